"""Reward functions: the TRL signature, two built-ins, loading by name, and checked weighted sums.

A reward function is what TRL users already write:
`f(prompts, completions, **dataset_columns) -> list[float | None]` (extra keywords such as
`completion_ids` may be passed, so accept `**kwargs`). Completions are strings, or, when the prompt
went through a chat template, lists of messages `[{"role": "assistant", "content": ...}]`.
`None` means "not applicable to this row" and is skipped like TRL does (nansum across functions).

A function may be `async def` (an HTTP scorer, a sandboxed code runner): the async functions of
a step run concurrently on an event loop in a worker thread while the plain ones run one after
another in the trainer's thread (`rewards.allow_async: false` refuses async functions instead).
A directory name loads a sequence-classification reward model (`infsamp.reward_model`).

Every value is checked: a function that raises, returns something other than a list of the right
length, a non-number, NaN or inf stops the step with a one-line `RewardError` naming the function and
the row, instead of silently corrupting the advantages. With `rewards.timeout_s`, a call that runs
longer gives None for all its rows (counted in `rewards/<name>/timeouts`) and the step goes on.

Deliberately simple: everything runs in this process; a timed-out plain function cannot be stopped,
so it keeps running in a daemon thread (an async one is cancelled); one call per function per step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
import importlib.util
import inspect
import math
import numbers
import threading
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

from infsamp.errors import RewardError
from infsamp.tasks.gsm8k import extract_xml_answer, has_xml_format

RewardFunction = Callable[..., list]

FORMAT_REWARD = 0.5
ACCURACY_REWARD = 2.0


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, or the contents of a list of chat messages."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content") or "") for message in completion)


def normalize_answer(text: str) -> str:
    """Canonical form for comparing answers: stripped; numbers without thousands commas or trailing zeros.

    '1,000' -> '1000', '5.0' -> '5', '-3.50' -> '-3.5'; anything that is not a number stays as stripped text.
    """
    text = text.strip()
    try:
        number = Decimal(text.replace(",", ""))
    except InvalidOperation:
        return text
    if not number.is_finite():
        return text
    return format(number.normalize(), "f") if number != 0 else "0"


def format_reward(completions: Sequence[Any], think_block: str = "forbid",
                  **kwargs: Any) -> list[float]:
    """0.5 when the completion is exactly <reasoning>\\n...\\n</reasoning>\\n<answer>\\n...\\n</answer>\\n.

    The seed's strict format reward, with two lenient deviations documented in `infsamp.tasks.gsm8k`:
    multi-line reasoning is allowed (DOTALL) and the final newline is optional. `think_block`
    (`rewards.format_think_block`): a leading <think>...</think> block is forbidden (the seed),
    allowed (skipped) or required.
    """
    return [FORMAT_REWARD if has_xml_format(completion_text(c), think_block) else 0.0
            for c in completions]


def accuracy_reward(completions: Sequence[Any], answer: Sequence[Any], **kwargs: Any) -> list[float]:
    """2.0 when the text inside <answer>...</answer> equals the reference `answer` column, else 0.0.

    Improvement over the seed's exact string comparison: both sides go through `normalize_answer`,
    so '1,000' matches '1000' and '5.0' matches '5'.
    """
    return [ACCURACY_REWARD if normalize_answer(extract_xml_answer(completion_text(c))) == normalize_answer(str(a))
            else 0.0 for c, a in zip(completions, answer)]


BUILTIN_REWARDS: dict[str, RewardFunction] = {"format": format_reward, "accuracy": accuracy_reward}


# ---------------------------------------------------------------- loading


def _load_from_file(path: str, spec: str) -> Any:
    if not Path(path).exists():
        raise RewardError(f"reward function {spec!r}: file {path} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"infsamp_user_rewards_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]
    try:
        module_spec.loader.exec_module(module)  # type: ignore[union-attr]
    except Exception as err:  # noqa: BLE001 - user code: report, don't crash with a traceback
        raise RewardError(f"reward function {spec!r}: importing {path} failed ({type(err).__name__}: {err})") from None
    return module


def _load_from_module(name: str, spec: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception as err:  # noqa: BLE001
        raise RewardError(f"reward function {spec!r}: cannot import module {name!r} "
                          f"({type(err).__name__}: {err})") from None


def load_reward_function(spec: str, **model_options: Any) -> tuple[str, RewardFunction]:
    """A built-in name, 'package.module:function', 'path/to/file.py:function' or a reward model
    directory -> (name, function). `model_options` (device, dtype, max_tokens) go to
    `load_reward_model`."""
    if spec in BUILTIN_REWARDS:
        return spec, BUILTIN_REWARDS[spec]
    from infsamp.reward_model import load_reward_model, looks_like_model_dir

    if looks_like_model_dir(spec):
        return Path(spec).resolve().name, load_reward_model(spec, **model_options)
    source, sep, attr = spec.rpartition(":")
    if not sep or not source or not attr:
        raise RewardError(f"reward function {spec!r}: unknown (built-in: "
                          f"{', '.join(BUILTIN_REWARDS)}; or give 'module:function', "
                          "'file.py:function' or a reward model directory)")
    is_file = source.endswith(".py")
    module = _load_from_file(source, spec) if is_file else _load_from_module(source, spec)
    func = getattr(module, attr, None)
    if not callable(func):
        raise RewardError(f"reward function {spec!r}: {source} has no function {attr!r}")
    return attr, func


def load_reward_functions(names: list[str],
                          format_think_block: str = "forbid",
                          **model_options: Any) -> list[tuple[str, RewardFunction]]:
    """Load each spec; repeated names get a suffix (accuracy, accuracy_2) so metrics stay distinct.
    The built-in format reward gets `format_think_block` (`rewards.format_think_block`)."""
    loaded: list[tuple[str, RewardFunction]] = []
    seen: set[str] = set()
    for spec in names:
        name, func = load_reward_function(spec, **model_options)
        if func is format_reward and format_think_block != "forbid":
            func = functools.partial(format_reward, think_block=format_think_block)
        unique, index = name, 2
        while unique in seen:
            unique, index = f"{name}_{index}", index + 1
        seen.add(unique)
        loaded.append((unique, func))
    return loaded


# ---------------------------------------------------------------- computing


@dataclass
class RewardResult:
    """Weighted total per completion and each function's raw values (None -> NaN)."""

    total: list[float]  # NaN for a row that only timed-out functions could have scored
    per_function: dict[str, list[float]] = field(default_factory=dict)
    timeouts: dict[str, int] = field(default_factory=dict)  # calls past rewards.timeout_s, if set

    def metrics(self) -> dict[str, float]:
        """TRL's names: rewards/{name}/mean and rewards/{name}/std over the rows the function scored
        (std with Bessel's correction, as TRL's `nanstd`; 0 for a single row; mean NaN for none)."""
        logged: dict[str, float] = {}
        for name, values in self.per_function.items():
            scored = [v for v in values if v is not None and not math.isnan(v)]
            mean = sum(scored) / len(scored) if scored else float("nan")
            squares = sum((v - mean) ** 2 for v in scored)
            logged[f"rewards/{name}/mean"] = mean
            logged[f"rewards/{name}/std"] = math.sqrt(squares / (len(scored) - 1)) if len(scored) > 1 else 0.0
        for name, count in self.timeouts.items():
            logged[f"rewards/{name}/timeouts"] = count
        return logged


def _prompt_preview(prompt: Any) -> str:
    text = prompt if isinstance(prompt, str) else completion_text(prompt[-1:])
    return repr(text[:60])


def _row_error(who: str, row: int, prompts: Sequence[Any], why: str) -> RewardError:
    """`who` is e.g. "reward function 'accuracy'"; the message names the row and the prompt's start."""
    preview = f" (prompt {_prompt_preview(prompts[row])})" if row < len(prompts) else ""
    return RewardError(f"{who}, row {row}{preview}: {why}")


def _is_per_row(values: Any, completions: Sequence[Any]) -> bool:
    return isinstance(values, (list, tuple)) and len(values) == len(completions)


# ---------------------------------------------------------------- calling: sync, async, timeouts


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


def _find_failing_row(func: RewardFunction, prompts: Sequence[Any], completions: Sequence[Any],
                      columns: dict[str, list], extra: dict[str, Any],
                      timeout_s: float = 0.0) -> int | None:
    """Re-run `func` row by row to locate the row that made the batched call raise."""
    for row in range(len(completions)):
        one_columns = {key: values[row:row + 1] if _is_per_row(values, completions) else values
                       for key, values in {**columns, **extra}.items()}
        kwargs = {"prompts": prompts[row:row + 1], "completions": completions[row:row + 1],
                  **one_columns}
        if invoke(func, kwargs, timeout_s).error is not None:
            return row
    return None


FLOAT32_MAX = 3.4028234663852886e38  # rewards become float32 tensors


def _checked_value(value: Any, name: str, row: int, prompts: Sequence[Any]) -> float:
    if value is None:
        return math.nan
    if isinstance(value, numbers.Real) and math.isfinite(value) and abs(value) <= FLOAT32_MAX:
        return float(value)
    if isinstance(value, numbers.Real) and math.isfinite(value):
        raise _row_error(f"reward function {name!r}", row, prompts,
                         f"returned {value!r}, beyond float32 range "
                         f"(|reward| <= {FLOAT32_MAX:.3g})")
    why = f"returned {value!r}" if isinstance(value, numbers.Real) else \
        f"returned {type(value).__name__} {value!r}, expected a number or None"
    raise _row_error(f"reward function {name!r}", row, prompts, why)


def _checked_values(name: str, values: Any, prompts: Sequence[Any],
                    completions: Sequence[Any]) -> list[float]:
    """A function's batch output as floats (None -> NaN), or a one-line RewardError naming the
    function and the row."""
    if hasattr(values, "tolist"):  # numpy array or torch tensor
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"reward function {name!r}: returned {type(values).__name__}, "
                          "expected a list of floats")
    if len(values) != len(completions):
        raise RewardError(f"reward function {name!r}: returned {len(values)} values for "
                          f"{len(completions)} completions")
    return [_checked_value(v, name, row, prompts) for row, v in enumerate(values)]


def _failure(name: str, func: RewardFunction, err: BaseException, prompts: Sequence[Any],
             completions: Sequence[Any], columns: dict[str, list], extra: dict[str, Any],
             timeout_s: float) -> RewardError:
    row = _find_failing_row(func, prompts, completions, columns, extra, timeout_s)
    why = f"raised {type(err).__name__}: {err}".splitlines()[0]
    if row is None:
        return RewardError(f"reward function {name!r}: {why}")
    return _row_error(f"reward function {name!r}", row, prompts, why)


def _check_inputs(funcs: list, weights: Sequence[float] | None, completions: Sequence[Any],
                  columns: dict[str, list]) -> list[float]:
    weights = list(weights) if weights else [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise RewardError(f"rewards.weights: {len(weights)} weights for {len(funcs)} reward functions")
    for key, values in columns.items():
        if len(values) != len(completions):
            raise ValueError(f"column {key!r} has {len(values)} values for {len(completions)} completions")
    return weights


def _weighted_total(row: int, weights: list[float], result: RewardResult,
                    prompts: Sequence[Any]) -> float:
    """Weighted sum of the row's scores; NaN when only timed-out functions could have scored it."""
    scored = [(w, values[row]) for w, values in zip(weights, result.per_function.values())
              if not math.isnan(values[row])]
    if scored:
        total = sum(w * v for w, v in scored)
        if not abs(total) <= FLOAT32_MAX:
            raise _row_error(f"reward functions {', '.join(result.per_function)}", row, prompts,
                             f"weighted total {total!r} is beyond float32 range")
        return total
    if any(result.timeouts.values()):
        return math.nan  # no signal for this row: its advantage becomes 0 and the step goes on
    raise _row_error(f"reward functions {', '.join(result.per_function)}", row, prompts,
                     "every function returned None")


def compute_rewards(funcs: list[tuple[str, RewardFunction]], weights: Sequence[float] | None,
                    prompts: Sequence[Any], completions: Sequence[Any], columns: dict[str, list],
                    timeout_s: float = 0.0, **extra: Any) -> RewardResult:
    """Run every function (async ones concurrently), check its values, sum them with `weights`.

    `columns` holds one value per completion for each dataset column (already repeated G times);
    `extra` (e.g. completion_ids) is passed through to every function. None rows are skipped (TRL's
    nansum); a row that no function scored raises RewardError, unless a function timed out on it
    (`timeout_s` > 0: its rows are None and `timeouts` counts the call), when its total is NaN.
    """
    weights = _check_inputs(funcs, weights, completions, columns)
    kwargs = {"prompts": list(prompts), "completions": list(completions), **columns, **extra}
    result = RewardResult(total=[], timeouts={name: 0 for name, _ in funcs} if timeout_s else {})
    outcomes = run_reward_functions(funcs, kwargs, timeout_s).values()
    for (name, func), outcome in zip(funcs, outcomes):
        if outcome.timed_out:
            result.timeouts[name] += 1
            result.per_function[name] = [math.nan] * len(completions)
        elif outcome.error is not None:
            raise _failure(name, func, outcome.error, prompts, completions, columns, extra,
                           timeout_s) from None
        else:
            result.per_function[name] = _checked_values(name, outcome.value, prompts, completions)
    result.total = [_weighted_total(row, weights, result, prompts)
                    for row in range(len(completions))]
    return result
