"""The GSM8K recipe of the second seed (willccbb's GRPO demo, as in TRL's examples): its XML answer
format.

One place for the format shared by the recipe and the built-in rewards (`infsamp.rewards` imports
from here): the system prompt, the strict format pattern, and the two answer extractors
(`extract_hash_answer` for GSM8K references, `extract_xml_answer` for completions), and how a
leading `<think>...</think>` block (Qwen3 with thinking on) is treated: `THINK_BLOCK_RULES`, chosen
by `rewards.format_think_block`.

Deliberate deviations from the original, both more lenient for the correct format only:
- `XML_FORMAT_PATTERN` is matched with DOTALL, so the reasoning (and answer) may span several lines;
  the original `re.match` without flags only accepted one-line reasoning.
- the final newline after `</answer>` is optional; the original required it, but generation usually
  stops at the end-of-sequence token right after `</answer>`.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from infsamp.choices import THINK_BLOCK_RULES

SYSTEM_PROMPT = """Respond in the following format:
<reasoning>
...
</reasoning>
<answer>
...
</answer>
"""

XML_FORMAT_PATTERN = re.compile(r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n?$",
                                re.DOTALL)
THINK_BLOCK = re.compile(r"^\s*<think>.*?</think>\s*", re.DOTALL)


def extract_hash_answer(text: str) -> str | None:
    """GSM8K reference '...#### 42' -> '42'; None when there is no '####'."""
    if "####" not in text:
        return None
    return text.split("####")[1].strip()


def read_hash_answer(text: str) -> str | None:
    """A GSM8K reference's final answer when it is a number, as the accuracy reward compares
    numbers ('#### 1,000' -> '1,000'); None when there is no '####' or what follows is not a
    number ('#### seventy-two')."""
    answer = extract_hash_answer(text)
    try:
        number = Decimal((answer or "").replace(",", ""))
    except InvalidOperation:
        return None
    return answer if number.is_finite() else None


def extract_xml_answer(text: str) -> str:
    """Text inside the last <answer>...</answer>, stripped (the seed's helper).

    Like the original, a completion without the tags is returned whole (stripped), so a bare '42'
    still counts as the answer 42.
    """
    answer = text.split("<answer>")[-1]
    answer = answer.split("</answer>")[0]
    return answer.strip()


def has_xml_format(text: str, think_block: str = "forbid") -> bool:
    """True when `text` is exactly <reasoning>...</reasoning><answer>...</answer> (one tag per
    line), after a leading <think>...</think> block that `think_block` allows or requires."""
    if think_block not in THINK_BLOCK_RULES:
        raise ValueError(f"think_block must be one of {', '.join(THINK_BLOCK_RULES)}, "
                         f"got {think_block!r}")
    think = THINK_BLOCK.match(text) if think_block != "forbid" else None
    if think_block == "require" and think is None:
        return False
    return XML_FORMAT_PATTERN.match(text[think.end():] if think else text) is not None
