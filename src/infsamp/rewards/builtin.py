"""The built-in reward functions (TRL's signature) and the text of a completion.

`f(prompts, completions, **dataset_columns) -> list[float | None]`: completions are strings, or,
when the prompt went through a chat template, lists of messages `[{"role": "assistant", "content":
...}]`.

    format         0.5 for the XML format of the GSM8K recipe
    accuracy       2.0 when the <answer> equals the reference (normalised numbers)
    math_verify    1.0 when math-verify finds the completion's answer equal to the reference
                   (\\boxed{}, fractions, LaTeX; TRL's and open-r1's accuracy reward)
    reasoning_gym  the reasoning-gym task's own `score_answer` (in [0, 1]) of the answer that
                   `rewards.answer_extraction` reads out of the completion

`ACCURACY_LIKE` names those that score correctness (evaluation's default, `eval.reward`).

Deliberately simple: math-verify and reasoning-gym are imported on first call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

from infsamp.errors import RewardError
from infsamp.tasks.answers import ANSWER_EXTRACTORS
from infsamp.tasks.gsm8k import extract_xml_answer, has_xml_format
from infsamp.tasks.reasoning_gym import score

RewardFunction = Callable[..., list]

FORMAT_REWARD = 0.5
ACCURACY_REWARD = 2.0


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, or the contents of a list of chat messages."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content") or "") for message in completion)


def normalize_answer(text: str) -> str:
    """Canonical form for comparing answers: stripped; numbers without thousands commas or trailing
    zeros.

    '1,000' -> '1000', '5.0' -> '5', '-3.50' -> '-3.5'; anything that is not a number stays as
    stripped text.
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
    """0.5 when the completion is exactly
    <reasoning>\\n...\\n</reasoning>\\n<answer>\\n...\\n</answer>\\n.

    The seed's strict format reward, with two lenient deviations documented in
    `infsamp.tasks.gsm8k`: multi-line reasoning is allowed (DOTALL) and the final newline is
    optional. `think_block` (`rewards.format_think_block`): a leading <think>...</think> block is
    forbidden (the seed), allowed (skipped) or required.
    """
    return [FORMAT_REWARD if has_xml_format(completion_text(c), think_block) else 0.0
            for c in completions]


def accuracy_reward(completions: Sequence[Any], answer: Sequence[Any],
                    **kwargs: Any) -> list[float]:
    """2.0 when the text inside <answer>...</answer> equals the reference `answer` column, else 0.0.

    Improvement over the seed's exact string comparison: both sides go through `normalize_answer`,
    so '1,000' matches '1000' and '5.0' matches '5'.
    """
    return [ACCURACY_REWARD
            if normalize_answer(extract_xml_answer(completion_text(c))) == normalize_answer(str(a))
            else 0.0 for c, a in zip(completions, answer)]


MATH_VERIFY_INSTALL = "pip install math-verify==0.9.0, or pip install 'infsamp[real]'"


LOG_LINE_CHARS = 200
MATH_VERIFY_LOGGERS = ("math_verify.parser", "math_verify.grader")


class _ShortLines(logging.Filter):
    """math-verify logs the whole completion on a parsing timeout ("Timeout during parsing:
    <text>": 10 MB of run log for a 10 MB completion): one line of LOG_LINE_CHARS at most."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if len(text) > LOG_LINE_CHARS or "\n" in text:
            record.msg, record.args = text.splitlines()[0][:LOG_LINE_CHARS] + " ...", None
        return True


def _shorten_math_verify_logs() -> None:
    for name in MATH_VERIFY_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ShortLines) for f in logger.filters):
            logger.addFilter(_ShortLines())


def math_verify_reward(completions: Sequence[Any], answer: Sequence[Any],
                       **kwargs: Any) -> list[float | None]:
    """1.0 when math-verify's `verify` finds the completion's answer equal to the reference, else
    0.0; None (the row is skipped) when the reference itself does not parse. As TRL's
    `accuracy_reward`: the reference parsed with math-verify's defaults, the completion as LaTeX
    with \\boxed{} tried first and units normalised. Beyond TRL: a reference of bare LaTeX
    ('\\frac{1}{3}', as MATH-style answer columns hold) is read as math, and a completion without
    LaTeX as a plain expression ('so the answer is 42'), as GSM8K-style completions are written.
    Timeouts (signal.alarm) only in the main thread, as TRL."""
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError:
        raise RewardError(f"reward function 'math_verify' needs math-verify "
                          f"({MATH_VERIFY_INSTALL})") from None
    _shorten_math_verify_logs()
    main = threading.current_thread() is threading.main_thread()
    parse_timeout, verify_timeout = (10, 5) if main else (None, None)
    if not main:  # its 'timeout is disabled' warnings: we disabled them on purpose
        for name in MATH_VERIFY_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
    latex = LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                  boxed_match_priority=0, try_extract_without_anchor=False)
    rewards: list[float | None] = []
    for completion, reference in zip(completions, answer):
        gold = parse(str(reference), parsing_timeout=parse_timeout)
        if not gold and "\\" in str(reference):  # bare LaTeX: '\\frac{1}{3}'
            gold = parse(f"${reference}$", parsing_timeout=parse_timeout)
        if not gold:
            rewards.append(None)
            continue
        text = completion_text(completion)
        found = parse(text, extraction_config=[latex], extraction_mode="first_match",
                      parsing_timeout=parse_timeout) or \
            parse(text, extraction_config=[ExprExtractionConfig()], extraction_mode="first_match",
                  parsing_timeout=parse_timeout)
        rewards.append(float(verify(gold, found, timeout_seconds=verify_timeout)))
    return rewards


def reasoning_gym_reward(completions: Sequence[Any], answer: Sequence[Any],
                         question: Sequence[str] = (), metadata: Sequence[Any] = (),
                         task: Sequence[str] = (), answer_extraction: str = "answer_tag",
                         **kwargs: Any) -> list[float]:
    """The reasoning-gym task's `score_answer` (in [0, 1]; reasoning-gym gives partial credit
    on some tasks) of the answer `answer_extraction` reads (`infsamp.tasks.answers`), with the
    row's own entry; needs rows of a `reasoning_gym:NAME` dataset."""
    if not task:
        raise RewardError("reward function 'reasoning_gym' scores rows of a reasoning_gym:NAME "
                          "dataset (data.dataset); these rows have no 'task' column")
    extract = ANSWER_EXTRACTORS[answer_extraction]
    return [score(extract(completion_text(c)), t, q, str(a), m)
            for c, a, q, m, t in zip(completions, answer, question, metadata, task)]


BUILTIN_REWARDS: dict[str, RewardFunction] = {
    "format": format_reward, "accuracy": accuracy_reward, "math_verify": math_verify_reward,
    "reasoning_gym": reasoning_gym_reward}
ACCURACY_LIKE = ("accuracy", "math_verify", "reasoning_gym")
