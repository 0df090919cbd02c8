"""SIGTERM, SIGINT and SIGHUP during training: finish the step, save, stop; a second signal stops
at once.

Inside `StopSignals` the first of any only records the request and says so; the training loop checks
`received` between steps, saves a checkpoint (`checkpointing.save_on_signal`) and raises
`RunStopped` (exit code 128 + the signal number). A second signal raises `StopNow` where the
program is: the step in flight is abandoned and nothing more is saved. A SIGHUP is never a "second
signal" (a closed terminal can send it twice). Inside `StopSignals` stdout and stderr ignore write
errors (a closed terminal, a pipe whose reader went away), and after a SIGHUP they stay so: the
run still saves (docs/reliability.md, "Signals save").

Deliberately simple: only the main thread can install handlers; elsewhere signals keep their
defaults.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP")
                     if hasattr(signal, name))  # no SIGHUP on Windows


class StopNow(KeyboardInterrupt):
    """The second signal: stop without finishing the step."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class StopSignals:
    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._streams: tuple[Any, Any] = (sys.stdout, sys.stderr)

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        self._streams = (sys.stdout, sys.stderr)
        _survive_closed_terminal()
        return self

    def __exit__(self, *exc: Any) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}
        if self.received != getattr(signal, "SIGHUP", None):
            sys.stdout, sys.stderr = self._streams

    def _handle(self, number: int, _frame: Any) -> None:
        name = signal.Signals(number).name
        if self.received is not None and number != getattr(signal, "SIGHUP", None):
            raise StopNow(f"{name} again: stopped at once, the step in flight is lost "
                          "(nothing more saved)", 128 + number)
        if self.received is not None:
            return  # a closed terminal sends SIGHUP more than once (the shell, then the kernel)
        self.received = number
        print(f"\n{name} received: finishing this step, then stopping "
              "(send it again to stop at once)", file=sys.stderr, flush=True)


class _Unbroken:
    """A stream whose writes never raise: after SIGHUP the terminal may be gone, and a write to
    it fails (EIO); the run must still save and say so wherever it can."""

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (OSError, ValueError):
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _survive_closed_terminal() -> None:
    if not isinstance(sys.stdout, _Unbroken):
        sys.stdout = _Unbroken(sys.stdout)
    if not isinstance(sys.stderr, _Unbroken):
        sys.stderr = _Unbroken(sys.stderr)
