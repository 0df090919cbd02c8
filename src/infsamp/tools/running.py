"""Running tool calls without stopping the sampler: each call on a thread of its own (the
sampler polls `collect`), isolated as reward functions are (`rewards/workers.py`).

With `tools.timeout_s` > 0 a tool function runs in a worker process: a pool per function of up to
`tools.max_workers` workers (each forked from a loader process of its own, made when the calls
running at once first need it); a call past its time has its worker (and everything it started)
killed and replaced by a new fork. An environment's methods run in this process (the instance
lives here), on a thread joined with the timeout. With 0 every call runs in this process without
a limit (TRL's way).

Whatever goes wrong (`answer_of`; the list is in docs/usage.md) becomes the answer the model
reads, never the end of the run, rendered as TRL renders a tool's failure: `{"error": "..."}`.
Each answer carries its time.

Deliberately simple: a thread per call (cheap next to a decode step); an abandoned in-process
call keeps its thread until it returns.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from infsamp.errors import RewardError, ToolError
from infsamp.rewards.calling import Outcome, call_sync, describe_error, is_async_callable
from infsamp.rewards.worker_process import encode, function_reference
from infsamp.rewards.workers import FunctionLoader, FunctionWorker
from infsamp.tools.loading import Tool

MAX_ANSWER_BYTES = 1 << 20  # a tool's text answer, at most (a 10 MB result is a tool error)


@dataclass(frozen=True)
class Answer:
    content: str  # what the model reads
    failed: bool  # a tool error
    seconds: float
    timed_out: bool = False


def error_text(why: str) -> str:
    return json.dumps({"error": why})


def answer_of(outcome: Outcome, timeout_s: float, seconds: float) -> Answer:
    """The text the model reads for one call's outcome (see the module docstring)."""
    if outcome.timed_out:
        return Answer(error_text(f"the call took longer than {timeout_s:g} s"), True, seconds,
                      timed_out=True)
    if outcome.error is not None:
        return Answer(error_text(describe_error(outcome.error)), True, seconds)
    value = outcome.value
    if not isinstance(value, (str, int, float, bool)):
        why = f"returned {type(value).__name__}; a tool returns text or a number"
        return Answer(error_text(why), True, seconds)
    text = str(value)
    size = len(text.encode("utf-8", "replace"))
    if size > MAX_ANSWER_BYTES:
        why = f"returned {size} bytes of text (at most {MAX_ANSWER_BYTES})"
        return Answer(error_text(why), True, seconds)
    return Answer(text, False, seconds)


def call_here(func: Callable[..., Any], arguments: dict[str, Any]) -> Outcome:
    """One call in this thread (an async tool on an event loop of its own)."""
    if is_async_callable(func):
        return call_sync(lambda **kw: asyncio.run(func(**kw)), arguments)
    return call_sync(func, arguments)


def call_with_deadline(func: Callable[..., Any], arguments: dict[str, Any],
                       timeout_s: float) -> Outcome:
    """One call on a thread of its own, abandoned past `timeout_s` (0: waited for)."""
    if not timeout_s:
        return call_here(func, arguments)
    box: list[Outcome] = []
    thread = threading.Thread(target=lambda: box.append(call_here(func, arguments)),
                              daemon=True, name="infsamp-tool-call")
    thread.start()
    thread.join(timeout_s)
    return box[0] if box else Outcome(timed_out=True)


class WorkerPool:
    """Up to `size` worker processes of one function, each with a loader of its own (a loader
    that kills a worker past its time kills everything below it), made on demand."""

    def __init__(self, tool: Tool, size: int, spawner: ThreadPoolExecutor):
        try:
            reference = function_reference(tool.name, tool.func)
        except RewardError:
            raise ToolError(f"tools.timeout_s: tool {tool.name!r} cannot run in a worker "
                            "process: define it at the top level of a module or a .py file, or "
                            "set tools.timeout_s 0") from None
        self.name, self.reference, self.spawner = tool.name, reference, spawner
        self.idle: queue.LifoQueue[FunctionWorker] = queue.LifoQueue()
        self.slots = threading.Semaphore(size)
        self.workers: list[FunctionWorker] = []

    def call(self, arguments: dict[str, Any], timeout_s: float) -> Outcome:
        with self.slots:
            worker = self._take()
            try:
                worker.send(encode(arguments))
            except (TypeError, ValueError) as err:
                self.idle.put(worker)
                return Outcome(error=ToolError(f"its arguments are not JSON ({err})"))
            if worker.conn.poll(timeout_s):
                outcome = worker.receive()
            else:
                worker.replace()
                outcome = Outcome(timed_out=True)
            self.idle.put(worker)
            return outcome

    def _take(self) -> FunctionWorker:
        try:
            worker = self.idle.get_nowait()
        except queue.Empty:
            worker = FunctionWorker(f"tool {self.name}", self.reference)
            # a loader dies with the thread that started it (PR_SET_PDEATHSIG): the spawner's
            # thread lives as long as the runner, a call's thread does not
            worker.loader = self.spawner.submit(FunctionLoader, self.reference).result()
            self.workers.append(worker)
        worker.wait_ready()
        return worker

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.workers = []


class ToolRunner:
    """Calls submitted with a key, answers collected by key, in the order they come."""

    def __init__(self, functions: list[Tool], timeout_s: float, max_workers: int):
        self.timeout_s = timeout_s
        self.spawner = ThreadPoolExecutor(1, thread_name_prefix="infsamp-tool-loaders")
        self.pools = {t.name: WorkerPool(t, max_workers, self.spawner)
                      for t in functions} if timeout_s else {}
        self.results: queue.Queue[tuple[Any, Answer]] = queue.Queue()

    def submit(self, key: Any, name: str, func: Callable[..., Any],
               arguments: dict[str, Any]) -> None:
        """Run `func(**arguments)` (the pool of tool `name`, if it has one) on a new thread."""
        def run() -> None:
            start = time.perf_counter()
            try:
                pool = self.pools.get(name)
                outcome = (pool.call(arguments, self.timeout_s) if pool is not None
                           else call_with_deadline(func, arguments, self.timeout_s))
            except BaseException as err:  # noqa: BLE001 - a worker that cannot start, ...
                outcome = Outcome(error=err)
            self.results.put((key, answer_of(outcome, self.timeout_s, time.perf_counter() - start)))

        threading.Thread(target=run, daemon=True, name=f"infsamp-tool-{name}").start()

    def answer_now(self, key: Any, text: str) -> None:
        """A call that is not run (malformed, unknown tool): its error answer, at once."""
        self.results.put((key, Answer(error_text(text), True, 0.0)))

    def collect(self, timeout_s: float) -> list[tuple[Any, Answer]]:
        """The answers that came (waiting up to `timeout_s` for a first one)."""
        found = []
        try:
            found.append(self.results.get(timeout=timeout_s) if timeout_s else
                         self.results.get_nowait())
            while True:
                found.append(self.results.get_nowait())
        except queue.Empty:
            return found

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.spawner.shutdown(wait=False)
