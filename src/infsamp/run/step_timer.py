"""Where a step's time goes: wall seconds per phase, logged as `time/<phase>`.

The trainer wraps its calls (`with timer.phase("sampling"): ...`); the GRPO step reports its own
phases (`time/logprobs`: old and reference passes, `time/train`: forwards and backwards,
`time/optimizer`) in its metrics. `infsamp bench step` prints the split.

Deliberately simple: wall time (perf_counter), no device synchronisation (on CUDA a phase may
absorb the previous phase's queued kernels).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

PHASES = ("sampling", "rewards", "logprobs", "train", "optimizer", "eval")


class StepTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """`time/<phase>` of every phase timed since the last call (then reset)."""
        out = {f"time/{name}": round(value, 4) for name, value in self.seconds.items()}
        self.seconds = {}
        return out
