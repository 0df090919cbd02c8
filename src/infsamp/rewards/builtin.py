"""The built-in reward functions (TRL's signature) and the text of a completion.

`f(prompts, completions, **dataset_columns) -> list[float | None]`: completions are strings, or, when
the prompt went through a chat template, lists of messages `[{"role": "assistant", "content": ...}]`.

Deliberately simple: the XML format and the exact (normalised) answer of the GSM8K recipe.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Sequence

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
