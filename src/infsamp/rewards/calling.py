"""Calling reward functions in the trainer's process: sync ones in turn, async ones concurrently.

How TRL runs them (trl 1.16, `GRPOTrainer._calculate_rewards`): in the trainer's process, the plain
functions one after another, the async ones together (`asyncio.gather`) on an event loop in a
daemon thread; every function is handed the same lists; there is no timeout, and an exception
(`SystemExit` and `KeyboardInterrupt` included) propagates as it is. infsamp keeps that model
when `rewards.timeout_s` is 0, the default: no process to start, nothing encoded, the cheapest
path. On top of it:

- every exception a function raises, `BaseException` included (`sys.exit(0)`, `KeyboardInterrupt`,
  `SystemExit` inside an async function), becomes that call's `Outcome(error=...)`; `compute.py`
  turns it into one line naming the function and the row, and the step is not applied. A second
  stop signal (`run.signals.StopNow`) is not the function's doing and passes through.
- each function gets its own copy of the step's prompts, completions and columns (`own_copy`), so
  a function that edits them cannot change what the next one scores.

With `rewards.timeout_s` > 0 the functions run in worker processes instead (`workers.py`),
because only a process can be stopped: a thread that busy-loops past its timeout keeps spinning
(issue 19: step time 2.9 s -> 13.2 s over 6 steps), and an async function that blocks its event
loop (`time.sleep(3600)`) cannot even be cancelled.

Deliberately simple: one call per function per step; the async functions of a step share one
event loop in a thread made for that step (it also works when the caller is itself inside a
running loop, e.g. a notebook).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import inspect
import threading
from typing import Any, NamedTuple

from infsamp.errors import RewardError
from infsamp.rewards.builtin import RewardFunction


def is_async_callable(func: Any) -> bool:
    """True for `async def` functions, partials of them, and objects with an async __call__."""
    while isinstance(func, functools.partial):
        func = func.func
    # the __call__ method itself (is it async?), not whether func is callable
    call = getattr(func, "__call__", None)  # noqa: B004
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


class CallError(Exception):
    """A failure already described in words (e.g. by a worker process): `describe_error` quotes
    it as it is."""


def describe_error(err: BaseException) -> str:
    """'raised ZeroDivisionError: division by zero' (first line only), 'raised SystemExit: 0'."""
    if isinstance(err, CallError):
        return str(err)
    text = str(err).strip().splitlines()
    return f"raised {type(err).__name__}" + (f": {text[0]}" if text else "")


def is_stop_request(err: BaseException) -> bool:
    """The trainer's second stop signal (`run.signals.StopNow`, a KeyboardInterrupt carrying its
    exit code): it interrupts a reward call but is not the function's failure."""
    return isinstance(err, KeyboardInterrupt) and hasattr(err, "exit_code")


_SCALARS = frozenset({str, int, float, bool, type(None), bytes})  # immutable: shared as is


def own_copy(value: Any) -> Any:
    """A copy of a call's arguments that shares nothing mutable with the caller's: lists, dicts
    and tuples rebuilt, immutable scalars shared (fast for lists of text and token ids), anything
    else deep-copied."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is list:
        return [v if type(v) in _SCALARS else own_copy(v) for v in value]
    if kind is dict:
        return {k: v if type(v) in _SCALARS else own_copy(v) for k, v in value.items()}
    if kind is tuple:
        return tuple(own_copy(v) for v in value)
    return copy.deepcopy(value)


def call_sync(func: RewardFunction, kwargs: dict[str, Any]) -> Outcome:
    try:
        return Outcome(value=func(**kwargs))
    except BaseException as err:  # user code: sys.exit and Ctrl-C included
        if is_stop_request(err):
            raise
        return Outcome(error=err)


async def call_async(func: RewardFunction, kwargs: dict[str, Any]) -> Outcome:
    """Await one call; whatever it raises (SystemExit too) is its outcome, never the loop's."""
    try:
        return Outcome(value=await func(**kwargs))
    except BaseException as err:  # noqa: BLE001 - user code
        return Outcome(error=err)


def _run_async(calls: list[tuple[RewardFunction, dict[str, Any]]]) -> concurrent.futures.Future:
    """The calls concurrently on a new event loop in a daemon thread; the future holds their
    outcomes (or what escaped the loop itself, e.g. SystemExit from a task a function started)."""
    outcomes: concurrent.futures.Future = concurrent.futures.Future()

    async def gather() -> list[Outcome]:
        return list(await asyncio.gather(*(call_async(func, kw) for func, kw in calls)))

    def loop() -> None:
        try:
            outcomes.set_result(asyncio.run(gather()))
        except BaseException as err:  # noqa: BLE001 - reported through the future
            outcomes.set_exception(err)

    threading.Thread(target=loop, daemon=True, name="infsamp-async-rewards").start()
    return outcomes


def _async_outcomes(pending: concurrent.futures.Future, count: int) -> list[Outcome]:
    try:
        return pending.result()
    except BaseException as err:  # escaped the event loop: every async call failed
        if is_stop_request(err):
            raise
        return [Outcome(error=err)] * count


class InProcess:
    """Reward calls in this process (no timeout): sync ones in turn in this thread while the
    async ones run together on an event loop in another, each on its own copy of the inputs."""

    timeout_s = 0.0

    def call(self, name: str, func: RewardFunction, kwargs: dict[str, Any]) -> Outcome:
        return self.call_all([(name, func)], kwargs)[name]

    def call_all(self, funcs: list[tuple[str, RewardFunction]],
                 kwargs: dict[str, Any]) -> dict[str, Outcome]:
        """Outcomes in `funcs` order."""
        async_names = [name for name, func in funcs if is_async_callable(func)]
        calls = [(func, own_copy(kwargs)) for name, func in funcs if name in async_names]
        pending = _run_async(calls) if calls else None
        outcomes = {name: call_sync(func, own_copy(kwargs)) for name, func in funcs
                    if name not in async_names}
        if pending is not None:
            outcomes.update(zip(async_names, _async_outcomes(pending, len(calls))))
        return {name: outcomes[name] for name, _ in funcs}

    def close(self) -> None:
        """Nothing to free."""
