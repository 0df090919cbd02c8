"""Scores for a step: every reward function on the batch, each value checked, a weighted sum.

Every value is checked: a function that raises (anything, `SystemExit` and `KeyboardInterrupt`
included), returns something other than a list of the right length, a non-number, NaN or inf stops
the step with a one-line `RewardError` naming the function and the row, instead of silently
corrupting the advantages. `None` means "not applicable to this row" and is skipped as TRL does
(nansum across functions). A call past `rewards.timeout_s` is stopped (`workers.py`), gives None
for all its rows (counted in `rewards/<name>/timeouts`) and the step goes on. The functions are
called by a runner (`workers.reward_runner`: in this process, or in worker processes with a
timeout) that the trainer keeps for the run; without one, a runner is made for the call.

Deliberately simple: one call per function per step; a failing batch is re-run row by row to name
the row.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from infsamp.errors import RewardError
from infsamp.rewards.builtin import RewardFunction, completion_text
from infsamp.rewards.calling import describe_error
from infsamp.rewards.workers import WorkerDied, reward_runner


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
            logged[f"rewards/{name}/std"] = (math.sqrt(squares / (len(scored) - 1))
                                             if len(scored) > 1 else 0.0)
        for name, count in self.timeouts.items():
            logged[f"rewards/{name}/timeouts"] = count
        return logged


def _prompt_preview(prompt: Any) -> str:
    text = prompt if isinstance(prompt, str) else completion_text(prompt[-1:])
    return repr(text[:60])


def _row_error(who: str, row: int, prompts: Sequence[Any], why: str) -> RewardError:
    """`who` is e.g. "reward function 'accuracy'"; the message names the row and the prompt's
    start."""
    preview = f" (prompt {_prompt_preview(prompts[row])})" if row < len(prompts) else ""
    return RewardError(f"{who}, row {row}{preview}: {why}")


def _find_failing_row(runner, name: str, func: RewardFunction, prompts: Sequence[Any],
                      completions: Sequence[Any], columns: dict[str, list],
                      extra: dict[str, Any]) -> int | None:
    """Re-run `func` row by row to locate the row that made the batched call raise."""
    for row in range(len(completions)):
        one_columns = {key: values[row:row + 1] if isinstance(values, (list, tuple))
                       and len(values) == len(completions) else values
                       for key, values in {**columns, **extra}.items()}
        kwargs = {"prompts": prompts[row:row + 1], "completions": completions[row:row + 1],
                  **one_columns}
        if runner.call(name, func, kwargs).error is not None:
            return row
    return None


FLOAT32_MAX = 3.4028234663852886e38  # rewards become float32 tensors


def _checked_value(value: Any, name: str, row: int, prompts: Sequence[Any]) -> float:
    if value is None:
        return math.nan
    if not isinstance(value, numbers.Real):
        why = f"returned {type(value).__name__} {value!r}, expected a number or None"
    elif not math.isfinite(value):
        why = f"returned {value!r}"
    elif abs(value) > FLOAT32_MAX:
        why = f"returned {value!r}, beyond float32 range (|reward| <= {FLOAT32_MAX:.3g})"
    else:
        return float(value)
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


def _failure(runner, name: str, func: RewardFunction, err: BaseException,
             prompts: Sequence[Any], completions: Sequence[Any], columns: dict[str, list],
             extra: dict[str, Any]) -> RewardError:
    why = describe_error(err)
    died = isinstance(err, WorkerDied)  # its process is gone: row by row would kill it again
    row = None if died else _find_failing_row(runner, name, func, prompts, completions, columns,
                                              extra)
    if row is None:
        return RewardError(f"reward function {name!r}: {why}")
    return _row_error(f"reward function {name!r}", row, prompts, why)


def _check_inputs(funcs: list, weights: Sequence[float] | None, completions: Sequence[Any],
                  columns: dict[str, list]) -> list[float]:
    weights = list(weights) if weights else [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise RewardError(f"rewards.weights: {len(weights)} weights for {len(funcs)} "
                          f"reward functions")
    for key, values in columns.items():
        if len(values) != len(completions):
            raise ValueError(f"column {key!r} has {len(values)} values for {len(completions)} "
                             f"completions")
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
                    timeout_s: float = 0.0, runner=None, **extra: Any) -> RewardResult:
    """Run every function (async ones concurrently), check its values, sum them with `weights`.

    `columns` holds one value per completion for each dataset column (already repeated G times);
    `extra` (e.g. completion_ids) is passed through to every function, each getting its own copy.
    None rows are skipped (TRL's nansum); a row that no function scored raises RewardError, unless
    a function timed out on it (`timeout_s` > 0: its rows are None and `timeouts` counts the
    call), when its total is NaN. `runner` (`workers.reward_runner(funcs, timeout_s)`, kept by the
    caller across steps) calls the functions; without it one is made for this call and closed.
    """
    own = runner is None
    runner = reward_runner(funcs, timeout_s) if own else runner
    try:
        return _compute(runner, funcs, weights, prompts, completions, columns, extra)
    finally:
        if own:
            runner.close()


def _compute(runner, funcs: list[tuple[str, RewardFunction]], weights: Sequence[float] | None,
             prompts: Sequence[Any], completions: Sequence[Any], columns: dict[str, list],
             extra: dict[str, Any]) -> RewardResult:
    weights = _check_inputs(funcs, weights, completions, columns)
    kwargs = {"prompts": list(prompts), "completions": list(completions), **columns, **extra}
    timeouts = {name: 0 for name, _ in funcs} if runner.timeout_s else {}
    result = RewardResult(total=[], timeouts=timeouts)
    outcomes = runner.call_all(funcs, kwargs).values()
    for (name, func), outcome in zip(funcs, outcomes):
        if outcome.timed_out:
            result.timeouts[name] += 1
            result.per_function[name] = [math.nan] * len(completions)
        elif outcome.error is not None:
            raise _failure(runner, name, func, outcome.error, prompts, completions, columns,
                           extra) from None
        else:
            result.per_function[name] = _checked_values(name, outcome.value, prompts, completions)
    result.total = [_weighted_total(row, weights, result, prompts)
                    for row in range(len(completions))]
    return result
