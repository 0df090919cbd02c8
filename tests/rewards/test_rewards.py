"""Built-in rewards, loading by spec, and the checks of compute_rewards (one-line errors naming
function + row)."""

import asyncio
import functools
import math
import os
import threading
import time

import numpy as np
import pytest

from infsamp.errors import RewardError
from infsamp.rewards.builtin import (
    BUILTIN_REWARDS,
    accuracy_reward,
    completion_text,
    format_reward,
    normalize_answer,
)
from infsamp.rewards.calling import check_async_allowed, is_async_callable
from infsamp.rewards.compute import compute_rewards
from infsamp.rewards.loading import load_reward_functions

import timed_rewards

GOOD = "<reasoning>\n3 + 4 = 7\n</reasoning>\n<answer>\n7\n</answer>\n"
MULTILINE = "<reasoning>\nfirst 3 + 4 = 7\nthen 7 * 2 = 14\n</reasoning>\n<answer>\n14\n</answer>"


def chat(text):
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize("text, expected", [
    (GOOD, 0.5),
    (GOOD.rstrip("\n"), 0.5),                      # final newline optional (deviation, documented)
    (MULTILINE, 0.5),                               # multi-line reasoning (DOTALL, documented)
    ("<reasoning>\nx\n</reasoning>\n<answer>\n7\n</answer>\nextra", 0.0),
    ("<reasoning>x</reasoning><answer>7</answer>", 0.0),  # tags must sit on their own lines
    ("The answer is 7", 0.0),
    ("prefix " + GOOD, 0.0),
])
def test_format_reward_strict_pattern(text, expected):
    assert format_reward([text]) == [expected]
    assert format_reward([chat(text)]) == [expected]


def test_accuracy_reward_compares_answer_tag_with_reference():
    completions = [GOOD, GOOD, "<answer> 1,275 </answer>", "<answer>\n5.0\n</answer>", "7",
                   "no tags 7"]
    answers = ["7", "8", "1275", "5", "7", "7"]
    assert accuracy_reward(completions, answer=answers) == [2.0, 0.0, 2.0, 2.0, 2.0, 0.0]
    assert accuracy_reward([chat(c) for c in completions],
                           answer=answers) == [2.0, 0.0, 2.0, 2.0, 2.0, 0.0]


@pytest.mark.parametrize("text, expected", [
    ("1,000", "1000"), ("5.0", "5"), ("-3.50", "-3.5"), (" 42 ", "42"), ("0.00", "0"),
    ("1e3", "1000"), ("abc", "abc"), ("nan", "nan"), ("", ""),
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_completion_text_joins_message_contents():
    assert completion_text([{"role": "assistant", "content": "a"},
                            {"role": "assistant", "content": None}]) == "a"


def test_load_builtin_module_and_file_functions(tmp_path):
    user_file = tmp_path / "my_rewards.py"
    user_file.write_text("def length_penalty(prompts, completions, **kw):\n    return [-len(c) for "
                         "c in completions]\n")
    loaded = load_reward_functions(["format", "accuracy", "infsamp.rewards.builtin:format_reward",
                                    f"{user_file}:length_penalty", "format"])
    assert [name for name, _ in loaded] == ["format", "accuracy", "format_reward", "length_penalty",
                                            "format_2"]
    assert loaded[0][1] is BUILTIN_REWARDS["format"]
    assert loaded[3][1](prompts=["p"], completions=["abc"]) == [-3]


@pytest.mark.parametrize("spec, fragment", [
    ("nope", "'nope': unknown"),
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("infsamp.rewards.builtin:missing", "has no function 'missing'"),
    ("/does/not/exist.py:f", "does not exist"),
])
def test_load_errors_are_one_line_naming_the_spec(spec, fragment):
    with pytest.raises(RewardError) as info:
        load_reward_functions([spec])
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_load_error_when_user_file_fails_to_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(RewardError, match=r"importing .*bad.py failed \(RuntimeError: boom\)"):
        load_reward_functions([f"{bad}:f"])


# ---------------------------------------------------------------- compute_rewards

PROMPTS = ["What is 3+4?", "What is 2+2?", "What is 1+1?"]
COLUMNS = {"answer": ["7", "4", "2"]}


def builtins():
    return load_reward_functions(["format", "accuracy"])


def test_weighted_total_and_per_function_metrics():
    completions = [GOOD, "<answer>4</answer>", "nothing"]
    result = compute_rewards(builtins(), [1.0, 0.5], PROMPTS, completions, COLUMNS)
    assert result.per_function == {"format": [0.5, 0.0, 0.0], "accuracy": [2.0, 2.0, 0.0]}
    assert result.total == [1.5, 1.0, 0.0]
    metrics = result.metrics()
    assert metrics["rewards/format/mean"] == pytest.approx(0.5 / 3)
    assert metrics["rewards/accuracy/mean"] == pytest.approx(4 / 3)
    # Bessel-corrected, as TRL
    assert metrics["rewards/accuracy/std"] == pytest.approx(math.sqrt(4 / 3))


def test_default_weights_are_one_and_extra_kwargs_reach_functions():
    seen = {}

    def spy(prompts, completions, answer, completion_ids, **kw):
        seen.update(answer=answer, ids=completion_ids)
        return np.array([1.0, 2.0, 3.0])  # arrays are accepted

    result = compute_rewards([("spy", spy)], None, PROMPTS, ["a", "b", "c"], COLUMNS,
                             completion_ids=[[1], [2], [3]])
    assert result.total == [1.0, 2.0, 3.0]
    assert seen == {"answer": ["7", "4", "2"], "ids": [[1], [2], [3]]}


def test_none_is_skipped_like_trl_nansum():
    def only_first(prompts, completions, **kw):
        return [1.0, None, None]

    def only_rest(prompts, completions, **kw):
        return [None, 2.0, 3.0]

    result = compute_rewards([("a", only_first), ("b", only_rest)], [1.0, 10.0], PROMPTS,
                             ["x", "y", "z"], COLUMNS)
    assert result.total == [1.0, 20.0, 30.0]
    assert math.isnan(result.per_function["a"][1])
    assert result.metrics()["rewards/a/mean"] == 1.0


def test_row_where_every_function_returns_none_is_an_error():
    def none_on_row_1(prompts, completions, **kw):
        return [1.0, None, 1.0]

    with pytest.raises(RewardError, match=r"reward functions f, row 1 \(prompt 'What is 2\+2\?'\)"):
        compute_rewards([("f", none_on_row_1)], None, PROMPTS, ["x", "y", "z"], COLUMNS)


def raises_on_row_2(prompts, completions, **kw):
    return [1.0 / (len(c) - 1) for c in completions]  # 'z' -> ZeroDivisionError


@pytest.mark.parametrize("func, fragment", [
    (raises_on_row_2,
     "reward function 'bad', row 2 (prompt 'What is 1+1?'): raised ZeroDivisionError"),
    (lambda prompts, completions, **kw: [1.0, float("nan"), 1.0],
     "'bad', row 1 (prompt 'What is 2+2?'): returned nan"),
    (lambda prompts, completions, **kw: [1.0, 1.0, float("inf")],
     "'bad', row 2 (prompt 'What is 1+1?'): returned inf"),
    (lambda prompts, completions, **kw: [1.0, "1", 1.0],
     "'bad', row 1 (prompt 'What is 2+2?'): returned str '1'"),
    (lambda prompts, completions, **kw: [1.0, 1.0], "'bad': returned 2 values for 3 completions"),
    (lambda prompts, completions, **kw: 1.0, "'bad': returned float, expected a list"),
    (lambda prompts, completions, **kw: {"a": 1}, "'bad': returned dict, expected a list"),
])
def test_bad_reward_functions_are_reported_with_name_and_row(func, fragment):
    with pytest.raises(RewardError) as info:
        compute_rewards([("ok", BUILTIN_REWARDS["format"]), ("bad", func)], None, PROMPTS,
                        ["xx", "yy", "z"], COLUMNS)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_batch_only_failure_names_function_without_row():
    def fails_on_batches(prompts, completions, **kw):
        if len(completions) > 1:
            raise RuntimeError("batch too big\nsecond line")
        return [0.0]

    with pytest.raises(RewardError,
                       match=r"^reward function 'f': raised RuntimeError: batch too big$"):
        compute_rewards([("f", fails_on_batches)], None, PROMPTS, ["a", "b", "c"], COLUMNS)


def test_conversational_prompt_preview_uses_last_message():
    prompts = [[{"role": "system", "content": "sys"}, {"role": "user", "content": "Q" * 100}]]
    with pytest.raises(RewardError) as info:
        compute_rewards([("f", lambda prompts, completions, **kw: [None])], None, prompts,
                        [chat("x")], {"answer": ["1"]})
    assert f"(prompt '{'Q' * 60}')" in str(info.value)


def test_weight_count_mismatch_is_an_error():
    with pytest.raises(RewardError, match="rewards.weights: 1 weights for 2 reward functions"):
        compute_rewards(builtins(), [1.0], PROMPTS, ["a", "b", "c"], COLUMNS)


def test_failing_row_is_found_when_extra_kwargs_are_not_per_row():
    def needs_state(prompts, completions, trainer_state, **kw):
        assert trainer_state == {"step": 3}
        return [1.0 / (len(c) - 1) for c in completions]

    with pytest.raises(RewardError,
                       match=r"'f', row 1 \(prompt 'What is 2\+2\?'\): raised ZeroDivisionError"):
        compute_rewards([("f", needs_state)], None, PROMPTS, ["aa", "b", "cc"], COLUMNS,
                        trainer_state={"step": 3})


THINK = "<think>\nLet me add.\n</think>\n\n"


@pytest.mark.parametrize("think_block, with_block, without_block", [
    ("forbid", 0.0, 0.5),   # the seed: the completion must open with <reasoning>
    ("allow", 0.5, 0.5),    # a leading think block is skipped
    ("require", 0.5, 0.0),  # Qwen3 with thinking on: the block must be there
])
def test_format_reward_think_block_option(think_block, with_block, without_block):
    scores = format_reward([THINK + GOOD, GOOD], think_block=think_block)
    assert scores == [with_block, without_block]
    assert format_reward([THINK + "prefix " + GOOD], think_block=think_block) == [0.0]
    (_, loaded), = load_reward_functions(["format"], format_think_block=think_block)
    assert loaded(completions=[chat(THINK + GOOD)], prompts=["p"]) == [with_block]


# ---------------------------------------------------------------- async functions and timeouts


def test_async_functions_run_concurrently_with_each_other_and_with_sync_ones():
    first, second, released = asyncio.Event(), asyncio.Event(), threading.Event()

    async def a(prompts, completions, **kw):  # finishes only if b runs at the same time
        first.set()
        await asyncio.wait_for(second.wait(), 10)
        released.set()
        return [1.0] * len(completions)

    async def b(prompts, completions, **kw):
        second.set()
        await asyncio.wait_for(first.wait(), 10)
        return [2.0] * len(completions)

    def plain(prompts, completions, **kw):  # runs in the trainer's thread while a and b run
        return [10.0 if released.wait(10) else 0.0] * len(completions)

    funcs = [("a", a), ("plain", plain), ("b", b)]
    result = compute_rewards(funcs, None, PROMPTS, ["x", "y", "z"], COLUMNS)
    assert list(result.per_function) == ["a", "plain", "b"]
    assert result.total == [13.0] * 3


def test_async_functions_work_inside_a_running_event_loop():
    async def scorer(prompts, completions, answer, **kw):
        await asyncio.sleep(0)
        return [float(a) for a in answer]

    async def main():  # e.g. a notebook: compute_rewards itself is called from a running loop
        return compute_rewards([("s", scorer)], None, PROMPTS, ["x", "y", "z"], COLUMNS)

    assert asyncio.run(main()).total == [7.0, 4.0, 2.0]


def test_async_callables_are_recognised_like_trl():
    async def scorer(prompts, completions, **kw):
        return [0.0] * len(completions)

    class Judge:
        async def __call__(self, prompts, completions, **kw):
            return [0.0] * len(completions)

    assert is_async_callable(scorer) and is_async_callable(functools.partial(scorer, x=1))
    assert is_async_callable(Judge()) and not is_async_callable(format_reward)


def test_timed_out_functions_give_none_and_are_counted():
    funcs = [("format", format_reward), ("slow_async", timed_rewards.slow_async),
             ("busy_loop", timed_rewards.busy_loop)]
    start = time.perf_counter()
    result = compute_rewards(funcs, None, PROMPTS, [GOOD, "x", "y"], COLUMNS, timeout_s=0.5)
    assert time.perf_counter() - start < 30
    assert result.total == [0.5, 0.0, 0.0]
    assert math.isnan(result.per_function["slow_async"][0])
    assert math.isnan(result.per_function["busy_loop"][2])
    metrics = result.metrics()
    assert metrics["rewards/slow_async/timeouts"] == 1
    assert metrics["rewards/busy_loop/timeouts"] == 1 and metrics["rewards/format/timeouts"] == 0
    assert math.isnan(metrics["rewards/busy_loop/mean"])


def test_a_timed_out_worker_is_killed_and_a_new_one_scores_the_next_step():
    from infsamp.rewards.workers import reward_runner

    funcs = [("slow", timed_rewards.slow_on_x), ("pid", timed_rewards.pid_reward),
             ("calls", timed_rewards.counts_calls)]
    runner = reward_runner(funcs, timeout_s=1.0)
    try:
        runner.workers["slow"].wait_ready()
        slow_pid = runner.workers["slow"].pid
        first = compute_rewards(funcs, None, PROMPTS, ["x", "y", "z"], COLUMNS, runner=runner)
        with pytest.raises(ProcessLookupError):
            os.kill(slow_pid, 0)  # killed (and reaped)
        start = time.perf_counter()
        second = compute_rewards(funcs, None, PROMPTS, ["a", "y", "z"], COLUMNS, runner=runner)
        assert time.perf_counter() - start < 0.9  # its replacement is a fork: no start-up
    finally:
        runner.close()
    assert first.timeouts["slow"] == 1 and second.timeouts["slow"] == 0
    assert second.per_function["slow"] == [2.0] * 3  # the new worker answers at once
    assert first.per_function["pid"][0] not in (os.getpid(), slow_pid)  # a process each
    assert first.per_function["pid"] == second.per_function["pid"]  # kept across steps
    assert (first.per_function["calls"][0], second.per_function["calls"][0]) == (1.0, 2.0)


def test_a_function_that_ends_its_worker_process_is_one_line():
    with pytest.raises(RewardError, match=r"^reward function 'hard': its worker process ended "
                                          r"\(exit code 7\)$"):
        compute_rewards([("hard", timed_rewards.exits_hard)], None, PROMPTS, ["a", "b", "c"],
                        COLUMNS, timeout_s=5)


def test_a_function_that_cannot_pickle_is_refused_with_a_timeout():
    with pytest.raises(RewardError, match=r"^rewards.timeout_s: reward function 'lam' cannot run "
                                          "in a worker process"):
        compute_rewards([("lam", lambda prompts, completions, **kw: [0.0] * 3)], None, PROMPTS,
                        ["a", "b", "c"], COLUMNS, timeout_s=5)


def test_rows_only_a_timed_out_function_could_score_have_no_total():
    result = compute_rewards([("hangs", timed_rewards.blocks_its_loop)], None, PROMPTS,
                             ["x", "y", "z"], COLUMNS, timeout_s=0.3)
    assert all(math.isnan(t) for t in result.total) and result.timeouts == {"hangs": 1}


async def async_raises_on_row_2(prompts, completions, **kw):
    return raises_on_row_2(prompts, completions)


async def raises_its_own_timeout(prompts, completions, **kw):
    raise TimeoutError("upstream API timed out")


@pytest.mark.parametrize("func, fragment", [
    (async_raises_on_row_2, "'bad', row 2 (prompt 'What is 1+1?'): raised ZeroDivisionError"),
    (raises_its_own_timeout, "'bad', row 0 (prompt 'What is 3+4?'): raised TimeoutError: up"),
])
def test_async_failures_name_function_and_row_even_with_a_timeout(func, fragment):
    with pytest.raises(RewardError) as info:
        compute_rewards([("bad", func)], None, PROMPTS, ["xx", "yy", "z"], COLUMNS, timeout_s=30)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_allow_async_false_refuses_async_functions():
    funcs = [("format", format_reward), ("judge", async_raises_on_row_2)]
    check_async_allowed(funcs, allow_async=True)
    with pytest.raises(RewardError,
                       match=r"^rewards.allow_async: false, but reward function 'judge' is async"):
        check_async_allowed(funcs, allow_async=False)


def test_a_function_that_ignores_its_cancellation_does_not_hold_up_the_step():
    start = time.perf_counter()
    result = compute_rewards([("format", format_reward), ("stubborn", timed_rewards.stubborn)],
                             None, PROMPTS, [GOOD, "x", "y"], COLUMNS, timeout_s=0.3)
    assert time.perf_counter() - start < 20 and result.timeouts == {"format": 0, "stubborn": 1}


def test_an_async_call_that_fails_before_awaiting_names_the_function():
    async def needs_column(prompts, completions, missing_column, **kw):
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match=r"^reward function 'judge'.*raised TypeError"):
        compute_rewards([("judge", needs_column)], None, PROMPTS, ["a", "b", "c"], COLUMNS)


@pytest.mark.parametrize("completion, reference, expected", [
    ("so \\boxed{\\frac{1}{3}}", "\\frac13", 1.0),  # bare LaTeX reference
    ("\\boxed{\\frac{1}{2}}", "$0.5$", 1.0),
    ("\\boxed{2}", "\\frac{1}{2}", 0.0),
    ("The answer is 42.", "42", 1.0),  # a GSM8K-style completion: a plain expression
    ("23 + 45 = 68", "68", 1.0),
    ("1,000 apples", "1000", 1.0),
    ("no idea", "3", 0.0),
    ("3", "no maths in this reference", None),  # skipped, as TRL
])
def test_math_verify_accepts_boxed_fractions_and_latex(completion, reference, expected):
    from infsamp.rewards.builtin import math_verify_reward

    chat = [{"role": "assistant", "content": completion}]
    assert math_verify_reward([completion, chat], answer=[reference, reference]) == [expected] * 2
