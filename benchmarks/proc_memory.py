"""Process memory of this Linux process from /proc: resident set now, its peak, and a peak reset.

Shared by the benchmark scripts (`memory.py`, `vs_trl.py`). Deliberately Linux-only: the CPU peak
(VmHWM) can be reset only through /proc/self/clear_refs.
"""

from __future__ import annotations

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
