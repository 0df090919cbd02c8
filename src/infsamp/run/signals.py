"""SIGTERM and SIGINT during training: finish the step, save, stop; a second signal stops at once.

Schedulers send SIGTERM some seconds before they kill a job, and Ctrl-C sends SIGINT. Inside
`StopSignals` the first of either only records the request and says so; the training loop checks
`requested` between steps, saves a checkpoint (`checkpointing.save_on_signal`) and raises
`RunStopped` (exit code 128 + the signal number). A second signal raises `StopNow` where the
program is: the step in flight is abandoned and nothing more is saved (a checkpoint being written
is removed, earlier ones stay).

Deliberately simple: only the main thread can install handlers; elsewhere signals keep their
defaults.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopNow(KeyboardInterrupt):
    """The second signal: stop without finishing the step."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class StopSignals:
    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def _handle(self, number: int, _frame: Any) -> None:
        name = signal.Signals(number).name
        if self.received is not None:
            raise StopNow(f"{name} again: stopped at once, the step in flight is lost "
                          "(nothing more saved)", 128 + number)
        self.received = number
        print(f"\n{name} received: finishing this step, then stopping "
              "(send it again to stop at once)", file=sys.stderr, flush=True)
