"""Reward functions: the TRL signature, two built-ins, loading by name, and checked weighted sums.

A reward function is what TRL users already write:
`f(prompts, completions, **dataset_columns) -> list[float | None]` (extra keywords such as
`completion_ids` may be passed, so accept `**kwargs`). Completions are strings, or, when the prompt
went through a chat template, lists of messages `[{"role": "assistant", "content": ...}]`.
`None` means "not applicable to this row" and is skipped like TRL does (nansum across functions).

Every value is checked: a function that raises, returns something other than a list of the right
length, a non-number, NaN or inf stops the step with a one-line `RewardError` naming the function and
the row, instead of silently corrupting the advantages.

Deliberately simple: functions run one after another in this process (no async, no reward models).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import numbers
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Callable, Sequence

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


def load_reward_function(spec: str) -> tuple[str, RewardFunction]:
    """A built-in name, 'package.module:function' or 'path/to/file.py:function' -> (name, function)."""
    if spec in BUILTIN_REWARDS:
        return spec, BUILTIN_REWARDS[spec]
    source, sep, attr = spec.rpartition(":")
    if not sep or not source or not attr:
        raise RewardError(f"reward function {spec!r}: unknown (built-in: {', '.join(BUILTIN_REWARDS)}; "
                          "or give 'module:function' or 'file.py:function')")
    is_file = source.endswith(".py")
    module = _load_from_file(source, spec) if is_file else _load_from_module(source, spec)
    func = getattr(module, attr, None)
    if not callable(func):
        raise RewardError(f"reward function {spec!r}: {source} has no function {attr!r}")
    return attr, func


def load_reward_functions(names: list[str],
                          format_think_block: str = "forbid") -> list[tuple[str, RewardFunction]]:
    """Load each spec; repeated names get a suffix (accuracy, accuracy_2) so metrics stay distinct.
    The built-in format reward gets `format_think_block` (`rewards.format_think_block`)."""
    loaded: list[tuple[str, RewardFunction]] = []
    seen: set[str] = set()
    for spec in names:
        name, func = load_reward_function(spec)
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

    total: list[float]
    per_function: dict[str, list[float]] = field(default_factory=dict)

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


def _find_failing_row(func: RewardFunction, prompts: Sequence[Any], completions: Sequence[Any],
                      columns: dict[str, list], extra: dict[str, Any]) -> int | None:
    """Re-run `func` row by row to locate the row that made the batched call raise."""
    for row in range(len(completions)):
        one_columns = {key: values[row:row + 1] if _is_per_row(values, completions) else values
                       for key, values in {**columns, **extra}.items()}
        try:
            func(prompts=prompts[row:row + 1], completions=completions[row:row + 1], **one_columns)
        except Exception:  # noqa: BLE001
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


def call_reward_function(name: str, func: RewardFunction, prompts: Sequence[Any], completions: Sequence[Any],
                         columns: dict[str, list], extra: dict[str, Any] | None = None) -> list[float]:
    """Call one function on the batch and check its output; None becomes NaN."""
    extra = extra or {}
    try:
        values = func(prompts=list(prompts), completions=list(completions), **columns, **extra)
    except Exception as err:  # noqa: BLE001 - user code
        row = _find_failing_row(func, prompts, completions, columns, extra)
        why = f"raised {type(err).__name__}: {err}".splitlines()[0]
        if row is None:
            raise RewardError(f"reward function {name!r}: {why}") from None
        raise _row_error(f"reward function {name!r}", row, prompts, why) from None
    if hasattr(values, "tolist"):  # numpy array or torch tensor
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"reward function {name!r}: returned {type(values).__name__}, expected a list of floats")
    if len(values) != len(completions):
        raise RewardError(f"reward function {name!r}: returned {len(values)} values for "
                          f"{len(completions)} completions")
    return [_checked_value(v, name, row, prompts) for row, v in enumerate(values)]


def _check_inputs(funcs: list, weights: Sequence[float] | None, completions: Sequence[Any],
                  columns: dict[str, list]) -> list[float]:
    weights = list(weights) if weights else [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise RewardError(f"rewards.weights: {len(weights)} weights for {len(funcs)} reward functions")
    for key, values in columns.items():
        if len(values) != len(completions):
            raise ValueError(f"column {key!r} has {len(values)} values for {len(completions)} completions")
    return weights


def compute_rewards(funcs: list[tuple[str, RewardFunction]], weights: Sequence[float] | None,
                    prompts: Sequence[Any], completions: Sequence[Any], columns: dict[str, list],
                    **extra: Any) -> RewardResult:
    """Run every function, check its values, and sum them with `weights` (None rows skipped).

    `columns` holds one value per completion for each dataset column (already repeated G times);
    `extra` (e.g. completion_ids) is passed through to every function. A row that no function
    scored raises RewardError.
    """
    weights = _check_inputs(funcs, weights, completions, columns)
    per_function = {name: call_reward_function(name, func, prompts, completions, columns, extra)
                    for name, func in funcs}
    total = []
    for row in range(len(completions)):
        scored = [(w, values[row]) for w, values in zip(weights, per_function.values())
                  if not math.isnan(values[row])]
        if not scored:
            raise _row_error(f"reward functions {', '.join(per_function)}", row, prompts,
                             "every function returned None")
        row_total = sum(w * v for w, v in scored)
        if not abs(row_total) <= FLOAT32_MAX:
            raise _row_error(f"reward functions {', '.join(per_function)}", row, prompts,
                             f"weighted total {row_total!r} is beyond float32 range")
        total.append(row_total)
    return RewardResult(total=total, per_function=per_function)
