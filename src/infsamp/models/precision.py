"""Precision modes in torch: dtypes, the one autocast context, and the checks made before loading.

The modes themselves (names, dtypes, bytes) are the registry in `infsamp.planner.precisions`; this
module adds what needs torch:

- `resolve_precision(cfg, device)`: 'auto' -> the device's default, then every check against this
  machine a bad setting needs, as one `ConfigError` line naming the option and the fix (the trainer
  calls it before the model loads; `Config.validate` has checked the name);
- `weights_dtype(mode, lora)`: the dtype the model is loaded in (`model.dtype` is derived from the
  precision: `auto`, or the same dtype spelled out; anything else is refused);
- `compute_context(mode, device)`: THE context manager for compute (bf16 autocast in `mixed`,
  nothing in the other modes), and `apply_compute(model, mode)`, which wraps the model's forward in
  it (as accelerate does) so every forward (training, log-prob passes, sampling, `generate` in
  evaluation) computes in bf16 while the master weights stay fp32. The autocast cache lives for one
  forward, so an optimizer step between two forwards is always seen.

Deliberately simple: bf16 only; the CPU bf16 check is functional (torch emulates bf16 on CPUs
without native bf16 instructions: correct, but slower than fp32).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import shutil
import sys
import types

import torch

from infsamp.config import Config
from infsamp.models.device import DTYPES, base_model, resolve_device
from infsamp.options import ConfigError
from infsamp.planner.precisions import PRECISIONS, PrecisionMode, base_dtype, resolve_precision_name

COMPUTE_DTYPE = torch.bfloat16


def weights_dtype(mode: PrecisionMode, lora: bool) -> torch.dtype:
    """dtype of the model's own weights: trained (full fine-tuning) or the frozen base (LoRA)."""
    return DTYPES[base_dtype(mode, lora)]


def compute_context(mode: PrecisionMode, device_type: str):
    """bf16 autocast for `mixed`; a no-op context in the other modes."""
    if mode.autocast:
        return torch.autocast(device_type, dtype=COMPUTE_DTYPE)
    return contextlib.nullcontext()


def apply_compute(model: torch.nn.Module, mode: PrecisionMode) -> torch.nn.Module:
    """Run the model's forward inside `compute_context` (the innermost transformers model, so
    peft's wrappers, `generate` and a deepcopy all go through it)."""
    if not mode.autocast:
        return model
    base = base_model(model)
    forward = type(base).forward

    @functools.wraps(forward)
    def forward_in_compute_dtype(self, *args, **kwargs):
        with compute_context(mode, self.device.type):
            return forward(self, *args, **kwargs)

    base.forward = types.MethodType(forward_in_compute_dtype, base)  # a deepcopy rebinds it
    return model


# --- checks --------------------------------------------------------------------------------------


@functools.cache
def cpu_computes_bf16() -> bool:
    """Whether this torch build runs bf16 matmuls and autocast on the CPU."""
    try:
        ones = torch.ones(4, 4, dtype=torch.bfloat16)
        with torch.autocast("cpu", dtype=COMPUTE_DTYPE):
            cast = torch.nn.functional.linear(torch.ones(2, 4), torch.ones(4, 4))
        return float((ones @ ones).sum()) == 64.0 and cast.dtype == COMPUTE_DTYPE
    except RuntimeError:
        return False


def cpu_has_native_bf16() -> bool:
    mkldnn = torch.backends.mkldnn.is_available()
    return mkldnn and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def resolve_precision(cfg: Config, device: torch.device | None = None) -> PrecisionMode:
    """The run's precision mode of a validated config, after every check (one ConfigError line
    each)."""
    device = device or resolve_device(cfg.model.device)
    mode = PRECISIONS[resolve_precision_name(cfg.training.precision, device.type)]
    lora = cfg.model.lora_rank > 0
    _check_model_dtype(cfg, mode, lora)
    _check_device(cfg, mode, lora, device)
    _check_libraries(cfg, mode, lora, device)
    if mode.warning:
        _say(mode.warning)
    return mode


def _check_model_dtype(cfg: Config, mode: PrecisionMode, lora: bool) -> None:
    wanted = base_dtype(mode, lora)
    if cfg.model.dtype not in ("auto", wanted):
        what = "the frozen LoRA base" if lora else "the trained weights"
        raise ConfigError(f"model.dtype {cfg.model.dtype}: training.precision {mode.name} keeps "
                          f"{what} in {wanted}; leave model.dtype auto (it follows "
                          "training.precision)")


def _check_device(cfg: Config, mode: PrecisionMode, lora: bool, device: torch.device) -> None:
    if cfg.model.load_in_4bit and device.type != "cuda":
        raise ConfigError("model.load_in_4bit: bitsandbytes NF4 needs a CUDA GPU; on a CPU train "
                          "LoRA without it (model.load_in_4bit false)")
    if cfg.model.load_in_4bit and cfg.sampling.engine == "vllm":
        raise ConfigError("sampling.engine vllm: vLLM cannot load a bitsandbytes 4-bit base; with "
                          "model.load_in_4bit use sampling.engine slots (auto picks it)")
    uses_bf16 = "bf16" in (mode.compute, base_dtype(mode, lora))
    if device.type == "cpu" and uses_bf16:
        if not cpu_computes_bf16():
            raise ConfigError(f"training.precision {mode.name}: this CPU / torch build cannot "
                              "compute in bf16; use training.precision fp32")
        if not cpu_has_native_bf16():
            _say(f"training.precision {mode.name}: this CPU has no native bf16 (AVX512-BF16 or "
                 "AMX); torch emulates it, slower than fp32")


def _check_libraries(cfg: Config, mode: PrecisionMode, lora: bool, device: torch.device) -> None:
    """The library each optimizer needs here (which one runs where: algorithm/optim.py)."""
    if cfg.model.load_in_4bit and not has_module("bitsandbytes"):
        raise ConfigError("model.load_in_4bit: needs bitsandbytes (pip install 'infsamp[gpu]')")
    keep_bf16 = mode.keeps_updates and mode.weights == "bf16" and not lora
    optimizer = cfg.training.optimizer
    if optimizer == "sgd" and keep_bf16 and not has_module("optimi"):
        raise ConfigError(f"training.precision {mode.name}: bf16 SGD keeps its updates with "
                          "torch-optimi (pip install 'infsamp[lowprec]'); or training.precision "
                          "mixed")
    bnb = device.type == "cuda" and (lora or mode.weights == "fp32") and has_module("bitsandbytes")
    if optimizer == "adamw" and keep_bf16:
        _check_torchao(f"training.precision {mode.name}", "training.precision mixed", device)
    if optimizer == "adamw8bit" and not bnb:
        _check_torchao("training.optimizer adamw8bit", "training.optimizer adamw", device)


def _check_torchao(option: str, other: str, device: torch.device) -> None:
    if not has_module("torchao"):
        raise ConfigError(f"{option}: needs torchao (pip install 'infsamp[lowprec]'); or {other}")
    if device.type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        raise ConfigError(f"{option}: torchao compiles its optimizer step and needs a C++ "
                          f"compiler on a CPU (install g++); or {other}")


def _say(line: str) -> None:
    """A setting that is valid but likely not meant: one plain line on stderr (as
    `run.setup.warn_about_settings`), not a Python warning with its source line."""
    print(f"warning: {line}", file=sys.stderr, flush=True)
