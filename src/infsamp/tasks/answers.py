"""Reading the answer out of a completion: the extractors `rewards.answer_extraction` names.

    answer_tag   the text inside the last <answer>...</answer> (reasoning-gym's own `extract_answer`
                 convention, and its system prompts'); None without the tags
    boxed        the contents of the last \\boxed{...} (nested braces kept); None without one
    last_number  the last number: '-12', '3.5', '1,000' -> '1000'; None without one
    last_line    the last non-empty line, stripped
    whole        the whole completion, stripped

Pair the extractor with what the prompt asks for (`data.answer_instruction`, README: "Answer
formats"); None is scored as no answer.

Deliberately simple: regular expressions, no parsing of the maths (`math_verify` does that).
"""

from __future__ import annotations

import re
from collections.abc import Callable

_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
_BOXED = "\\boxed{"


def answer_tag(text: str) -> str | None:
    matches = _ANSWER_TAG.findall(text)
    return matches[-1].strip() if matches else None


def boxed(text: str) -> str | None:
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(_BOXED)
    for position in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[begin:position].strip()
    return None  # unbalanced: cut off before its closing brace


def last_number(text: str) -> str | None:
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def last_line(text: str) -> str | None:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def whole(text: str) -> str | None:
    return text.strip() or None


ANSWER_EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "answer_tag": answer_tag, "boxed": boxed, "last_number": last_number,
    "last_line": last_line, "whole": whole,
}
