"""What the console shows: infsamp's notices once each, and not the lines other libraries print
that are not ours (nor the user's) to fix.

`Notices.say(kind, line)` prints a notice (a setting infsamp adjusted, not an error) as one line on
stderr the first time its kind comes up, never as a Python warning with its source line: a
sampler lowering max_new_tokens each step says so once.

Each entry names the logger that emits a line and a pattern of that line; a `logging.Filter` on
that logger drops the matching records only, so every other warning of the same library still
shows. Logger filters survive vLLM's own `dictConfig` (which resets its child loggers' levels, not
their filters). Installed once per process by `import infsamp` (`quiet_library_noise`).

    torchao            its CUDA-only kernels (`_C_mxfp8...so`, `_C_cutlass...so`) that a CPU build
                       cannot load
    torch._pytree      the deprecation of `register_constant()` on enums, called by torchao
    vllm (in-process)  what our deliberate settings cause: eager mode, no inductor, the seed set,
                       no tokenizer in the engine (we pass token ids), dummy weights replaced by
                       ours (rotary and tied lm_head "failed to load"), set_num_threads after
                       binding; and its CPU build's packaging notes (no Triton CPU backend, no
                       tcmalloc/iomp preloaded: the README's vLLM lines say how)

Deliberately simple: exact loggers and patterns for the pinned versions (requirements-dev.txt);
C++ warnings printed by torch itself (vLLM's NUMA binding note) are not Python logging and stay.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings

LIBRARY_NOISE: dict[str, tuple[str, ...]] = {
    "torchao": (r"^Failed to load .*torchao/_C\w*\.\S*so",),
    "torch.utils._pytree": (r"is an Enum subclass and is now natively supported by torch",),
    "vllm.triton_utils.importing": (r"^Triton is installed, but doesn't include CPU backend",),
    "vllm.platforms.cpu": (r"^Triton is not installed\. triton-cpu is expected",),
    "vllm.engine.arg_utils": (r"^The global random seed is set to",),
    "vllm.config.vllm": (r"^Enforce eager set", r"^Inductor compilation was disabled",
                         r"^Model Runner V2 requires Triton"),
    "vllm.v1.worker.cpu_worker": (r"is not found in LD_PRELOAD",
                                  r"`torch\.set_num_threads` after the thread binding"),
    "vllm.model_executor.model_loader.reload.layerwise": (r": Failed to load weights$",),
    "vllm.renderers.base": (r"^Using None for EOS token id because tokenizer is not initialized",),
}
# Python warnings of the same kind: vLLM's triton dispatcher touches a deprecated torch alias
WARNING_NOISE = (r"`torch\.distributed\.reduce_op` is deprecated",)


class _DropNoise(logging.Filter):
    """Drops the records whose message matches one of `patterns`."""

    def __init__(self, patterns: tuple[str, ...]):
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.search(message) for p in self.patterns)


def quiet_library_noise() -> None:
    """Install the filters (once per process; calling again changes nothing)."""
    for name, patterns in LIBRARY_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise(patterns))
    for pattern in WARNING_NOISE:
        warnings.filterwarnings("ignore", message=pattern, category=FutureWarning)


class Notices:
    """One line per kind of notice, printed the first time only (one holder per run)."""

    def __init__(self):
        self.said: set[str] = set()

    def say(self, kind: str, line: str) -> None:
        if kind not in self.said:
            self.said.add(kind)
            print(line, file=sys.stderr, flush=True)
