"""The benchmarks' memory meters, in one place: the process's resident set from /proc, and peaks.

- `resident_bytes`, `peak_resident_bytes`, `reset_peak`: this Linux process's VmRSS, VmHWM, and
  VmHWM := VmRSS from now on.
- `PeakMeter(device)` (`memory.py`, the GPU suite): peak bytes above the memory in use when it is
  built, CPU resident set or CUDA `max_memory_allocated`; `reset()` restarts the peak.
- `PeakRss` / `CudaPeak` (`make_meter(device)`; `vs_trl.py`, `vs_trl_real.py`, the GPU suite's
  part 3): `start()` takes the baseline (after a warm-up step) and resets the peak, `peak_bytes()`
  is the run-wide peak above that baseline, and `phase(fn)` wraps a function so that each call's
  own peak above the memory in use at its start lands in `phase_peaks` (calls before `start()`,
  the warm-up, are not measured).

Deliberately simple: Linux only on the CPU (VmHWM is reset through /proc/self/clear_refs), one
CUDA device.
"""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path


def status_kib(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM, ...)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def resident_bytes() -> int:
    return status_kib("VmRSS") * 1024


def peak_resident_bytes() -> int:
    return status_kib("VmHWM") * 1024


def reset_peak() -> None:
    """VmHWM := VmRSS from now on."""
    Path("/proc/self/clear_refs").write_text("5")


class PeakRss:
    """Peak resident-set growth (bytes) above the resident set at `start()`."""

    def __init__(self):
        self.baseline: int | None = None
        self.earlier_peak = 0  # the peak before a phase measurement reset it
        self.phase_peaks: list[int] = []

    def start(self) -> None:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.baseline = self.in_use()
        self.earlier_peak = 0
        self.reset_peak()

    def peak_bytes(self) -> int:
        return max(self.earlier_peak, self.peak_since_reset()) - (self.baseline or 0)

    def phase(self, fn):
        """`fn` wrapped: once started, each call's peak growth goes to `phase_peaks`."""
        def measured(*args, **kwargs):
            if self.baseline is None:  # the warm-up step
                return fn(*args, **kwargs)
            self.earlier_peak = max(self.earlier_peak, self.peak_since_reset())
            before = self.in_use()
            self.reset_peak()
            result = fn(*args, **kwargs)
            self.phase_peaks.append(self.peak_since_reset() - before)
            return result
        return measured

    # the memory counters; CudaPeak overrides these three
    def in_use(self) -> int:
        return resident_bytes()

    def peak_since_reset(self) -> int:
        return peak_resident_bytes()

    def reset_peak(self) -> None:
        reset_peak()


class CudaPeak(PeakRss):
    """The same on CUDA: `memory_allocated` / `max_memory_allocated` of the current device."""

    def start(self) -> None:
        import torch

        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.baseline = self.in_use()
        self.earlier_peak = 0
        self.reset_peak()

    def in_use(self) -> int:
        import torch

        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    def peak_since_reset(self) -> int:
        import torch

        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    def reset_peak(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats()


def make_meter(device: str) -> PeakRss:
    return CudaPeak() if device == "cuda" else PeakRss()


class PeakMeter:
    """Peak bytes above the memory in use at construction, on the device's counters."""

    def __init__(self, device: str):
        self.device = device
        self.counters = make_meter(device)
        self.baseline = self.counters.in_use()
        self.reset()

    def reset(self) -> None:
        self.counters.reset_peak()

    def peak(self) -> int:
        return self.counters.peak_since_reset() - self.baseline
