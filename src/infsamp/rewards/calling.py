"""Calling reward functions: sync ones in turn, async ones concurrently, each under a timeout.

A function may be `async def` (an HTTP scorer, a sandboxed code runner): the async functions of
a step run concurrently on an event loop in a worker thread while the plain ones run one after
another in the trainer's thread. With `rewards.timeout_s`, a call that runs longer gives an
`Outcome(timed_out=True)`.

Deliberately simple: everything runs in this process; a timed-out plain function cannot be stopped,
so it keeps running in a daemon thread (an async one is cancelled); one call per function per step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import threading
from typing import Any, Callable, NamedTuple

from infsamp.errors import RewardError
from infsamp.rewards.builtin import RewardFunction



def is_async_callable(func: Any) -> bool:
    """True for `async def` functions, partials of them, and objects with an async __call__."""
    while isinstance(func, functools.partial):
        func = func.func
    call = getattr(func, "__call__", None)
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(call)


def check_async_allowed(funcs: list[tuple[str, RewardFunction]], allow_async: bool) -> None:
    """rewards.allow_async false refuses `async def` reward functions before any work is done."""
    for name, func in funcs:
        if not allow_async and is_async_callable(func):
            raise RewardError(f"rewards.allow_async: false, but reward function {name!r} is async "
                              "(allow it, or make it a plain function)")


class Outcome(NamedTuple):
    """One call's result: its value, the exception it raised, or that it ran past the timeout."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False


class _Worker(threading.Thread):
    """A daemon thread running `job`: a call past its timeout is left behind, not blocking exit."""

    def __init__(self, job: Callable[[], Any]):
        super().__init__(daemon=True)
        self.job, self.outcome = job, Outcome(timed_out=True)

    def run(self) -> None:
        try:
            self.outcome = Outcome(value=self.job())
        except BaseException as err:  # noqa: BLE001 - user code; reported by the caller
            self.outcome = Outcome(error=err)


def _run_in_thread(job: Callable[[], Any], timeout_s: float) -> Outcome:
    worker = _Worker(job)
    worker.start()
    worker.join(timeout_s or None)
    return Outcome(timed_out=True) if worker.is_alive() else worker.outcome


async def _await_with_timeout(func: RewardFunction, kwargs: dict[str, Any],
                              timeout_s: float) -> Outcome:
    """Await one async call; past `timeout_s` it is cancelled (a TimeoutError it raises itself is
    an error, not a timeout)."""
    try:
        task = asyncio.ensure_future(func(**kwargs))
    except Exception as err:  # noqa: BLE001 - e.g. a TypeError from the call's arguments
        return Outcome(error=err)
    done, _ = await asyncio.wait({task}, timeout=timeout_s or None)
    if not done:
        task.cancel()
        return Outcome(timed_out=True)
    if task.cancelled():
        return Outcome(error=asyncio.CancelledError("the call was cancelled"))
    return Outcome(error=task.exception()) if task.exception() else Outcome(value=task.result())


def _start_async(calls: list[tuple[RewardFunction, dict[str, Any]]],
                 timeout_s: float) -> concurrent.futures.Future:
    """Run the calls concurrently on a new event loop in a daemon thread; the future holds their
    outcomes as soon as each finished or timed out (a task that ignores its cancellation is left
    behind on that loop instead of holding up the step)."""
    outcomes: concurrent.futures.Future = concurrent.futures.Future()

    async def gather() -> None:
        tasks = [_await_with_timeout(func, kwargs, timeout_s) for func, kwargs in calls]
        outcomes.set_result(list(await asyncio.gather(*tasks)))

    def loop() -> None:
        try:
            asyncio.run(gather())
        except BaseException as err:  # noqa: BLE001 - reported through the future
            if not outcomes.done():
                outcomes.set_exception(err)

    threading.Thread(target=loop, daemon=True).start()
    return outcomes


def invoke(func: RewardFunction, kwargs: dict[str, Any], timeout_s: float = 0.0) -> Outcome:
    """Call one sync or async function alone (async: on its own event loop in a worker thread)."""
    if is_async_callable(func):
        return _start_async([(func, kwargs)], timeout_s).result()[0]
    if timeout_s:
        return _run_in_thread(lambda: func(**kwargs), timeout_s)
    try:
        return Outcome(value=func(**kwargs))
    except Exception as err:  # noqa: BLE001 - user code
        return Outcome(error=err)


def run_reward_functions(funcs: list[tuple[str, RewardFunction]], kwargs: dict[str, Any],
                         timeout_s: float = 0.0) -> dict[str, Outcome]:
    """Every function on the same batch: async ones concurrently on an event loop in a worker
    thread, while the sync ones run one after another in this thread. Outcomes in `funcs` order."""
    async_names = [name for name, func in funcs if is_async_callable(func)]
    pending = _start_async([(func, kwargs) for name, func in funcs if name in async_names],
                           timeout_s) if async_names else None
    outcomes = {name: invoke(func, kwargs, timeout_s) for name, func in funcs
                if name not in async_names}
    if pending is not None:
        outcomes.update(zip(async_names, pending.result()))
    return {name: outcomes[name] for name, _ in funcs}


# ---------------------------------------------------------------- checking
