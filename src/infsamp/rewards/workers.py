"""Reward functions in worker processes, for `rewards.timeout_s`: a call past its time is stopped.

`reward_runner(funcs, timeout_s)` is what calls a run's reward functions: `InProcess`
(`calling.py`, TRL's way) without a timeout, `RewardWorkers` with one. There, each function has
a worker process of its own, kept for the run, so a function's own state (a cache, an HTTP
client, a model it loaded) lives on across steps. A step's calls go to every worker at once and
run concurrently (an async function on its worker's event loop). A call that has not answered
`timeout_s` after it was sent is stopped: its worker is killed (SIGKILL) and replaced at once.

Replacing must be cheap, or a function that always overruns would add its start-up to every
step. So each function has a loader process (a fresh interpreter, `python -c`: none of the
trainer's threads, CUDA context or open files, so never the run folder's lock of
`run/ownership.py`; and, unlike multiprocessing's `spawn`, it never re-runs the user's script)
that imports the function once and then only forks workers (as multiprocessing's forkserver
does): a replacement is a fork of an interpreter that has the function loaded already,
milliseconds whatever the function imports. A function that always overruns costs `timeout_s`
per step and never more (`tests/faults`). The processes' side, and what crosses between them
(JSON only), is `worker_process.py`. Workers and loaders ignore SIGINT, SIGTERM and SIGHUP (the
trainer decides how a run stops) and die with their parent (Linux `PR_SET_PDEATHSIG`).

A killed call takes its whole process tree with it, and a loader that ends (closed by the
trainer, or its trainer died) ends everything below it first (`process_tree.py`). A loader runs
in a process group of its own, so a `kill -9` of the trainer's group leaves it the time to do so.

Deliberately simple: one loader and one worker per function, even for cheap built-ins (a
reward-model folder, our own code over a model on the run's device, stays in the trainer's
process, without a timeout); the loader's start-up does not count against `timeout_s` (up to
START_TIMEOUT_S); a worker that died between calls is replaced without a word.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

from infsamp.errors import RewardError, first_line
from infsamp.rewards.builtin import RewardFunction
from infsamp.rewards.calling import CallError, InProcess, Outcome
from infsamp.rewards.worker_process import END_SIGNAL, encode, function_reference, receive, send

START_TIMEOUT_S = 120.0  # a loader's start: its interpreter and the function's imports
STOP_TIMEOUT_S = 5.0  # a loader's end: killing and reaping every process below it
# the longest single wait: poll(2) takes milliseconds as a C int (2,147,483.647 s); a call's
# longer timeout waits again until it is due
MAX_WAIT_S = 24 * 3600.0


def reward_runner(funcs: list[tuple[str, RewardFunction]], timeout_s: float):
    """What calls these functions each step: in this process, or in workers with a timeout."""
    return RewardWorkers(funcs, timeout_s) if timeout_s else InProcess()


def runs_in_process(func: RewardFunction) -> bool:
    """A reward model (`reward_model.RewardModel`) scores on the run's device, in this process."""
    return bool(getattr(func, "runs_in_process", False))


class RewardWorkers:
    """One worker process per function (reward models aside); `call_all` sends a step's calls to
    all of them and collects what comes back within `timeout_s`."""

    def __init__(self, funcs: list[tuple[str, RewardFunction]], timeout_s: float):
        self.timeout_s = timeout_s
        self.local = InProcess()
        self.workers = {name: FunctionWorker(name, function_reference(name, func))
                        for name, func in funcs if not runs_in_process(func)}

    def call(self, name: str, func: RewardFunction, kwargs: dict[str, Any]) -> Outcome:
        return self.call_all([(name, func)], kwargs)[name]

    def call_all(self, funcs: list[tuple[str, RewardFunction]],
                 kwargs: dict[str, Any]) -> dict[str, Outcome]:
        """Outcomes in `funcs` order; a reward model scores here while the workers run."""
        remote = [self.workers[name] for name, _ in funcs if name in self.workers]
        for worker in remote:
            worker.wait_ready()
        payload = _encoded_arguments(kwargs) if remote else b""  # once for all
        for worker in remote:
            worker.send(payload)
        local = self.local.call_all([(n, f) for n, f in funcs if n not in self.workers], kwargs)
        outcomes = {**local, **self._collect(remote)}
        return {name: outcomes[name] for name, _ in funcs}

    def _collect(self, remote: list[FunctionWorker]) -> dict[str, Outcome]:
        outcomes: dict[str, Outcome] = {}
        waiting = {worker.conn: worker for worker in remote}
        while waiting:
            deadline = min(worker.sent_at for worker in waiting.values()) + self.timeout_s
            wait_s = min(MAX_WAIT_S, max(0.0, deadline - time.monotonic()))
            ready = multiprocessing.connection.wait(list(waiting), wait_s)
            for conn in ready:
                worker = waiting.pop(conn)
                outcomes[worker.name] = worker.receive()
            if not ready:  # the earliest call is past its time (all were sent together)
                for conn, worker in list(waiting.items()):
                    if worker.sent_at + self.timeout_s <= time.monotonic():
                        del waiting[conn]
                        worker.replace()
                        outcomes[worker.name] = Outcome(timed_out=True)
        return outcomes

    def close(self) -> None:
        for worker in self.workers.values():
            worker.stop()


class WorkerDied(CallError):
    """The function's process ended during the call (os._exit, a crash, out of memory)."""


def _encoded_arguments(kwargs: dict[str, Any]) -> bytes:
    try:
        return encode(kwargs)
    except (TypeError, ValueError) as err:
        raise RewardError(f"rewards.timeout_s: the step's reward arguments cannot be sent to the "
                          f"worker processes ({first_line(err)}); set rewards.timeout_s "
                          "0") from None


class FunctionLoader:
    """The process that has imported one function and forks its workers."""

    def __init__(self, reference: dict[str, Any]):
        ours, theirs = socket.socketpair()
        code = f"from infsamp.rewards.worker_process import load_and_fork; " \
               f"load_and_fork({theirs.fileno()}, {os.getpid()})"
        self.popen = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),),
                                      stdin=subprocess.DEVNULL, env=_worker_environment(),
                                      process_group=0)
        theirs.close()
        self.conn, self.loaded = Connection(ours.detach()), False
        self.lock = threading.Lock()  # several workers of one loader (tools) ask from threads
        send(self.conn, reference)

    def wait_loaded(self, name: str) -> None:
        if self.loaded:
            return
        if not self.conn.poll(START_TIMEOUT_S):
            raise RewardError(f"reward function {name!r}: its worker process did not start "
                              f"within {START_TIMEOUT_S:.0f} s")
        message = self._ask(None)
        if message[0] != "loaded":
            raise RewardError(f"reward function {name!r}: its worker process cannot load it "
                              f"({message[1]})")
        self.loaded = True

    def fork(self) -> tuple[int, Connection]:
        """A new worker: its process id and the connection to it."""
        with self.lock:
            send(self.conn, ["fork"])
            _, pid = receive(self.conn)
            return pid, Connection(reduction.recv_handle(self.conn))

    def end(self, pid: int) -> int:
        """Kill worker `pid` (if it still runs) and every process below the loader: its exit
        code."""
        return self._ask(["end", pid])[1]

    def _ask(self, message) -> tuple:
        with self.lock:
            try:
                if message is not None:
                    send(self.conn, message)
                return receive(self.conn)
            except (EOFError, OSError):
                return ["died", f"exit code {self.popen.wait(5)}"]

    def stop(self) -> None:
        """End the loader and everything below it (it kills them, then exits)."""
        if self.popen.poll() is None:
            self.popen.send_signal(END_SIGNAL)
        try:
            self.popen.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.popen.kill()  # its workers die with it (PR_SET_PDEATHSIG), not what they started
            self.popen.wait(5)
        self.conn.close()


class FunctionWorker:
    """One function: its loader, and the worker that answers its calls (replaced after a
    timeout or a crash by a new fork of the loader)."""

    def __init__(self, name: str, reference: dict[str, Any]):
        self.name, self.reference = name, reference
        self.loader: FunctionLoader | None = None
        self.pid, self.conn, self.sent_at = 0, None, 0.0

    def wait_ready(self) -> None:
        if self.loader is None:
            self.loader = FunctionLoader(self.reference)
        try:
            self.loader.wait_loaded(self.name)
        except RewardError:
            self.stop()
            raise
        if self.conn is not None and self.conn.poll():  # ended between calls
            self.replace()
        if self.conn is None:
            self.pid, self.conn = self.loader.fork()

    def send(self, payload: bytes) -> None:
        self.conn.send_bytes(payload)
        self.sent_at = time.monotonic()

    def receive(self) -> Outcome:
        try:
            message = receive(self.conn)
        except (EOFError, OSError):
            code = self.replace()
            return Outcome(error=WorkerDied(f"its worker process ended (exit code {code})"))
        if message[0] == "ok":
            return Outcome(value=message[1])
        return Outcome(error=CallError(message[1]))

    def replace(self) -> int:
        """Kill the worker (past its timeout, or it ended) and all it started; the next call gets
        a new fork. Its exit code."""
        self.conn.close()
        code, self.pid, self.conn = self.loader.end(self.pid), 0, None
        return code

    def stop(self) -> None:
        if self.loader is not None:
            self.loader.stop()
        if self.conn is not None:
            self.conn.close()
        self.loader, self.pid, self.conn = None, 0, None


def _worker_environment() -> dict[str, str]:
    """This process's environment, with its import path (a script's folder, a test's rootdir)."""
    paths = [os.getcwd() if p == "" else p for p in sys.path]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
