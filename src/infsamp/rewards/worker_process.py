"""What runs inside the processes of `workers.py`: the loader, which imports one reward function
and forks a worker for each request, and the worker, which answers one call per message.

Everything that crosses a process boundary is JSON (as the trainer's collectives: nothing is
ever unpickled): the function as a reference (`function_reference`: its module, a reward file's
path, its qualified name, a `functools.partial`'s arguments), the step's arguments, the values
returned (arrays and tensors as lists; NaN and inf as JSON's NaN and Infinity), an exception as
its one-line description. File descriptors of new workers pass over the loader's socket
(SCM_RIGHTS, `multiprocessing.reduction`).

Deliberately simple: a function is found again by name, as pickle would find it, so lambdas,
closures, callable objects and functions of the script being run (`__main__`) are refused in one
line; column values go as JSON (a tuple arrives as a list); the loader forks from its single
thread (a function whose import starts threads is forked all the same).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import os
import signal
import socket
import sys
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any, NoReturn

from infsamp.errors import RewardError, first_line
from infsamp.rewards.builtin import RewardFunction
from infsamp.rewards.calling import (
    Outcome,
    call_async,
    call_sync,
    describe_error,
    is_async_callable,
)
from infsamp.rewards.loading import FILE_MODULE_PREFIX, load_file_module
from infsamp.rewards.process_tree import (
    PR_SET_CHILD_SUBREAPER,
    PR_SET_PDEATHSIG,
    end_descendants,
    prctl,
)

# what a loader gets when the trainer dies (PR_SET_PDEATHSIG) or closes it: end every process
# below it, then exit (a real-time signal: no library's handler takes it over)
END_SIGNAL = signal.SIGRTMIN + 2 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2
UNSENDABLE = ("define it at the top level of a module or a .py file (a lambda, a closure, a "
              "callable object or a function of the script being run cannot be sent), or set "
              "rewards.timeout_s 0")


# ---------------------------------------------------------------- JSON over a connection


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays and scalars, torch tensors
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON")


def encode(message: Any) -> bytes:
    return json.dumps(message, default=_plain).encode()


def send(conn: Connection, message: Any) -> None:
    conn.send_bytes(encode(message))


def receive(conn: Connection) -> Any:
    return json.loads(conn.recv_bytes())


# ---------------------------------------------------------------- finding a function by name


def _resolve(module: str, qualname: str) -> Any:
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def function_reference(name: str, func: RewardFunction) -> dict[str, Any]:
    """How a loader finds `func` again (checked here: resolving it must give `func` itself)."""
    if isinstance(func, functools.partial):
        reference = function_reference(name, func.func)
        reference.update(args=list(func.args), keywords=dict(func.keywords))
        try:
            encode(reference)
        except (TypeError, ValueError) as err:
            raise RewardError(f"rewards.timeout_s: reward function {name!r}: its partial "
                              f"arguments are not JSON ({first_line(err)}); {UNSENDABLE}") from None
        return reference
    module, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", "")
    try:
        found = module not in (None, "__main__") and _resolve(module, qualname) is func
    except Exception:  # noqa: BLE001 - not importable, no such attribute
        found = False
    if not found:
        raise RewardError(f"rewards.timeout_s: reward function {name!r} cannot run in a worker "
                          f"process: {UNSENDABLE}")
    path = sys.modules[module].__file__ if module.startswith(FILE_MODULE_PREFIX) else None
    return {"module": module, "qualname": qualname, "file": path}


def resolve_reference(reference: dict[str, Any]) -> RewardFunction:
    if reference.get("file"):
        load_file_module(reference["file"], reference["module"])
    func = _resolve(reference["module"], reference["qualname"])
    if "args" in reference:
        func = functools.partial(func, *reference["args"], **reference["keywords"])
    return func


# ---------------------------------------------------------------- the loader and its workers


def load_and_fork(fd: int, parent_pid: int) -> None:
    """The loader: import the function, then fork a worker for each request until EOF; every
    process below it ends with its worker, and all of them when the loader ends."""
    _detach_loader(parent_pid)
    conn = Connection(fd)
    try:
        func = resolve_reference(receive(conn))
    except BaseException as err:  # noqa: BLE001 - user code at import
        send(conn, ["error", describe_error(err)])
        _end_everything()
    send(conn, ["loaded"])
    while True:
        try:
            message = receive(conn)
        except (EOFError, OSError):
            _end_everything()
        if message[0] == "fork":
            _fork_worker(conn, func)
        else:  # ["end", pid]: the worker (past its time, or it ended) and all below it
            code = end_descendants(group=message[1]).get(message[1], -signal.SIGKILL)
            send(conn, ["exit_code", code])


def _fork_worker(conn: Connection, func: RewardFunction) -> None:
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the worker
        conn.close()
        ours.close()
        try:
            _detach_worker(os.getppid())
            serve(Connection(theirs.detach()), func)
        finally:
            os._exit(0)
    theirs.close()
    send(conn, ["forked", pid])
    reduction.send_handle(conn, ours.fileno(), pid)
    ours.close()


def serve(conn: Connection, func: RewardFunction) -> None:
    """A worker's loop: one call per message until EOF."""
    loop = asyncio.new_event_loop() if is_async_callable(func) else None
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            return
        conn.send_bytes(_reply(_call(func, payload, loop)))


def _call(func: RewardFunction, payload: bytes, loop) -> Outcome:
    try:
        kwargs = json.loads(payload)
        if loop is None:
            return call_sync(func, kwargs)
        return loop.run_until_complete(call_async(func, kwargs))
    except BaseException as err:  # noqa: BLE001 - escaped the loop (a task the function started)
        return Outcome(error=err)


def _reply(outcome: Outcome) -> bytes:
    if outcome.error is not None:
        return encode(["error", describe_error(outcome.error)])
    try:
        return encode(["ok", outcome.value])
    except (TypeError, ValueError) as err:
        why = f"returned {type(outcome.value).__name__}, which cannot be sent back from its " \
              f"worker process ({first_line(err)})"
        return encode(["error", why])


def _ignore_stops(parent_pid: int, death_signal: int) -> None:
    """Stops are the trainer's to decide; `death_signal` when the parent dies."""
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_IGN)
    prctl(PR_SET_PDEATHSIG, death_signal)
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)


def _detach_loader(parent_pid: int) -> None:
    """A loader: the processes its workers leave behind are handed to it (a subreaper), and
    when the trainer dies or stops it (END_SIGNAL), it ends all of them before it exits."""
    signal.signal(END_SIGNAL, lambda number, frame: _end_everything())
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    _ignore_stops(parent_pid, END_SIGNAL)


def _detach_worker(parent_pid: int) -> None:
    """A worker: a process group of its own (killed whole), dies with its loader."""
    os.setpgid(0, 0)
    signal.signal(END_SIGNAL, signal.SIG_DFL)
    _ignore_stops(parent_pid, signal.SIGKILL)


def _end_everything() -> NoReturn:
    end_descendants()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)
