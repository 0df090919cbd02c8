"""Garbage completions through the built-in rewards (issue 32, not yet tried): math-verify logs
the whole completion when its parsing times out ("Timeout during parsing: <text>"), so a 10 MB
completion put 10 MB into the run log (tried by hand: 14 s, 10,035,072 bytes of stderr); its
log lines are now cut to one line. Binary text and deeply nested LaTeX score 0.0.
"""

from __future__ import annotations

import logging

import pytest

from infsamp.rewards.builtin import math_verify_reward

LONGEST = 204  # 200 characters and " ..."

pytest.importorskip("math_verify")


@pytest.mark.parametrize("logger", ["math_verify.parser", "math_verify.grader"])
def test_math_verify_logs_one_short_line_for_a_huge_completion(caplog, logger):
    math_verify_reward(["<answer>\n72\n</answer>"], ["72"])
    with caplog.at_level(logging.WARNING):
        logging.getLogger(logger).warning(f"Timeout during parsing: {'1+' * 500_000}\nmore")
    (record,) = [r for r in caplog.records if r.name == logger]
    assert len(record.getMessage()) <= LONGEST and "\n" not in record.getMessage()
    assert record.getMessage().startswith("Timeout during parsing: 1+1+")


@pytest.mark.parametrize("completion", [
    "\x00\xff\x01" * 1000 + "<answer>\n\x00\n</answer>",
    "$" + "\\frac{" * 2000 + "1" + "}{2}" * 2000 + "$",
])
def test_garbage_completions_score_zero(completion):
    assert math_verify_reward([completion], ["72"]) == [0.0]
