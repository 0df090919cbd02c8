"""The embedded task: multi-operand addition, solved column by column with carries.

Each problem is generated deterministically from a seed. The worked solution writes one line per
column (`95+07 c0: 5+7+0=12 -> 2`: the operands still to add, the carry in, the column sum and the
partial answer so far), so its length grows about quadratically with the number of digits.
Digit counts are drawn log-normally, which makes completion lengths heavy-tailed and
prompt-dependent, like real reasoning traces. Completions use the XML format of the GSM8K recipe
(`<reasoning>` ... `</reasoning>` `<answer>` ... `</answer>`), so the same format and accuracy
rewards score both.

Two ways to answer: the worked solution above, or a direct answer with no working
(`<reasoning>\nin my head\n</reasoning>` ...). The embedded model's SFT targets mix both
(`sft_completions`, `DIRECT_SHARE` direct), so a sampled group holds short guesses and long worked
solutions of the same problem, as real reasoning traces vary within a prompt; GRPO has to discover
from the reward alone that working it out pays.

Deliberately simple: addition only, non-negative integers, no natural-language wording.
"""

from __future__ import annotations

import math
import random
from typing import Any

MAX_DIGITS = 5
MEDIAN_DIGITS = 3.0
DIGITS_SIGMA = 0.6
SPLIT_OFFSETS = {"train": 0, "test": 1, "sft": 2}
DIRECT_SHARE = 0.5  # share of SFT targets that answer directly, without working
NUM_HELD_OUT_RESERVED = 2000  # the first 2000 test prompts never appear in train or sft


def _num_digits(rng: random.Random) -> int:
    return max(1, min(MAX_DIGITS, round(rng.lognormvariate(math.log(MEDIAN_DIGITS), DIGITS_SIGMA))))


def _random_number(rng: random.Random, num_digits: int) -> int:
    low = 0 if num_digits == 1 else 10 ** (num_digits - 1)
    return rng.randint(low, 10**num_digits - 1)


def make_operands(rng: random.Random) -> list[int]:
    """Two operands most of the time, three for one problem in four."""
    num_operands = 3 if rng.random() < 0.25 else 2
    return [_random_number(rng, _num_digits(rng)) for _ in range(num_operands)]


def format_prompt(operands: list[int]) -> str:
    return "+".join(str(x) for x in operands) + "=?\n"


def worked_solution(operands: list[int]) -> str:
    """Column-by-column reasoning in the XML answer format; the answer is the sum.

    Each line restates the operands still to add (zero-padded to one width, last digit dropped per
    line), so every step only reads its own line and the line above: `4821+0379 c0: 1+9+0=10 -> 0`.
    """
    width = max(len(str(x)) for x in operands)
    padded = [str(x).zfill(width) for x in operands]
    lines, partial, carry = [], "", 0
    for cut in range(width, 0, -1):
        remaining = [p[:cut] for p in padded]
        column = [int(p[-1]) for p in remaining]
        total = sum(column) + carry
        partial = str(total % 10) + partial
        terms = "+".join(str(v) for v in column + [carry])
        lines.append(f"{'+'.join(remaining)} c{carry}: {terms}={total} -> {partial}")
        carry = total // 10
    if carry:
        partial = str(carry) + partial
        lines.append(f"carry {carry} -> {partial}")
    answer = str(sum(operands))
    assert partial.lstrip("0") == answer.lstrip("0") or answer == "0"
    return ("<reasoning>\n" + "\n".join(lines) + "\n</reasoning>\n<answer>\n" + answer
            + "\n</answer>\n")


def direct_solution(operands: list[int]) -> str:
    """The answer with no working: short, and wrong more often than not once numbers have 3+
    digits."""
    return ("<reasoning>\nin my head\n</reasoning>\n<answer>\n" + str(sum(operands))
            + "\n</answer>\n")


def sft_completions(problems: list[dict[str, Any]], seed: int = 0,
                    direct_share: float = DIRECT_SHARE) -> list[str]:
    """The SFT target of each problem: the direct answer for `direct_share` of them, else the worked
    one."""
    rng = random.Random(seed)
    return [p["direct_solution"] if rng.random() < direct_share else p["solution"]
            for p in problems]


def make_problem(operands: list[int]) -> dict[str, Any]:
    return {
        "prompt": format_prompt(operands),
        "answer": str(sum(operands)),
        "solution": worked_solution(operands),
        "direct_solution": direct_solution(operands),
        "num_digits": max(len(str(x)) for x in operands),
        "num_operands": len(operands),
    }


def _draw(num: int, seed: int, split: str, exclude: set[str]) -> list[dict[str, Any]]:
    rng = random.Random(seed * 1000 + SPLIT_OFFSETS[split])
    problems: list[dict[str, Any]] = []
    max_tries = num * 50
    while len(problems) < num and max_tries:
        max_tries -= 1
        problem = make_problem(make_operands(rng))
        if problem["prompt"] not in exclude:
            problems.append(problem)
    return problems


def generate_problems(num: int, seed: int = 1234, split: str = "train") -> list[dict[str, Any]]:
    """`num` problems of `split` (train, test or sft); train/sft exclude the first 2000 test
    prompts."""
    if split not in SPLIT_OFFSETS:
        raise ValueError(f"unknown split {split!r} (known: {', '.join(SPLIT_OFFSETS)})")
    if split == "test":
        return _draw(num, seed, split, exclude=set())
    held_out = {p["prompt"] for p in _draw(NUM_HELD_OUT_RESERVED, seed, "test", exclude=set())}
    return _draw(num, seed, split, exclude=held_out)
