"""Peak-memory meters for the training benchmarks: the whole step's peak and one phase's own peak.

`PeakRss` (CPU: the process's resident set from /proc) and `CudaPeak` (CUDA: torch's allocator)
share one interface: `start()` takes the baseline (after a warm-up step) and resets the peak,
`peak_bytes()` is the run-wide peak above that baseline, and `phase(fn)` wraps a function so that
each call's own peak above the memory in use at its start lands in `phase_peaks` (calls before
`start()`, the warm-up, are not measured). Used by `vs_trl.py` and the GPU suite's part 3.

Deliberately simple: Linux only on the CPU (VmHWM is reset through /proc/self/clear_refs), one
CUDA device.
"""

from __future__ import annotations

import ctypes
import gc

from proc_memory import peak_resident_bytes, reset_peak, resident_bytes


class PeakRss:
    """Peak resident-set growth (bytes) above the resident set at `start()`."""

    def __init__(self):
        self.baseline: int | None = None
        self.earlier_peak = 0  # the peak before a phase measurement reset it
        self.phase_peaks: list[int] = []

    def start(self) -> None:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.baseline = self._in_use()
        self.earlier_peak = 0
        self._reset()

    def peak_bytes(self) -> int:
        return max(self.earlier_peak, self._peak()) - (self.baseline or 0)

    def phase(self, fn):
        """`fn` wrapped: once started, each call's peak growth goes to `phase_peaks`."""
        def measured(*args, **kwargs):
            if self.baseline is None:  # the warm-up step
                return fn(*args, **kwargs)
            self.earlier_peak = max(self.earlier_peak, self._peak())
            before = self._in_use()
            self._reset()
            result = fn(*args, **kwargs)
            self.phase_peaks.append(self._peak() - before)
            return result
        return measured

    # the memory counters; CudaPeak overrides these three
    def _in_use(self) -> int:
        return resident_bytes()

    def _peak(self) -> int:
        return peak_resident_bytes()

    def _reset(self) -> None:
        reset_peak()


class CudaPeak(PeakRss):
    """The same on CUDA: `memory_allocated` / `max_memory_allocated` of the current device."""

    def start(self) -> None:
        import torch

        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.baseline = self._in_use()
        self.earlier_peak = 0
        self._reset()

    def _in_use(self) -> int:
        import torch

        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    def _peak(self) -> int:
        import torch

        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    def _reset(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats()


def make_meter(device: str) -> PeakRss:
    return CudaPeak() if device == "cuda" else PeakRss()
