"""Where a step's time goes: wall seconds per phase, logged as `time/<phase>`.

The training step wraps its calls (`with timer.phase("sampling"): ...`); the GRPO step times its
own phases with one too (`time/logprobs`: old and reference passes, `time/train`: forwards and
backwards, `time/optimizer`) and reports them in its metrics. In the lowest layer, so both rooms
use the one timer. `infsamp bench step` prints the split.

Deliberately simple: wall time (perf_counter), no device synchronisation (on CUDA a phase may
absorb the previous phase's queued kernels).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

PHASES = ("sampling", "rewards", "logprobs", "train", "optimizer", "eval")


class StepTimer:
    def __init__(self, *always: str) -> None:
        self.always = always  # phases reported (0.0) even when they did not run
        self.seconds: dict[str, float] = dict.fromkeys(always, 0.0)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        """Count `seconds` to phase `name` (a phase whose end is not one block)."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def metrics(self) -> dict[str, float]:
        """`time/<phase>` of every phase timed since the last call (then reset)."""
        out = {f"time/{name}": round(value, 4) for name, value in self.seconds.items()}
        self.seconds = dict.fromkeys(self.always, 0.0)
        return out
