"""Reward functions are isolated (issue 19, item 2): whatever a function raises (`sys.exit`,
`KeyboardInterrupt`, `SystemExit` in an async function, `sys.exit` at import) is one line naming
the function, the step and the row, the exit code is 2 and the step is not applied; each function
scores its own copy of the step; `rewards.timeout_s` really stops a call, sync or async, and the
step time stays flat over 20 steps with functions that always overrun.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from conftest import run_args
from fault_harness import rows, vandal_reward

from infsamp.rewards.builtin import accuracy_reward
from infsamp.rewards.compute import compute_rewards
from infsamp.run.checkpoint import list_checkpoints, verify_checkpoint

REWARDS = '''
import asyncio, os, sys, time

RUN = {run!r}


def _late():  # from step 3 on: checkpoint-2 is on disk
    return os.path.isdir(os.path.join(RUN, "checkpoint-2"))


def length(prompts, completions, **kwargs):
    return [len(c) / 10 for c in completions]


def exits(prompts, completions, **kwargs):
    if _late():
        sys.exit(0)
    return length(prompts, completions)


def interrupts(prompts, completions, **kwargs):
    if _late():
        raise KeyboardInterrupt
    return length(prompts, completions)


async def async_exits(prompts, completions, **kwargs):
    if _late():
        sys.exit(0)
    return length(prompts, completions)


def busy(prompts, completions, **kwargs):
    while True:
        pass


async def blocks_its_loop(prompts, completions, **kwargs):
    time.sleep(3600)
'''


def reward_file(folder: Path, run: Path) -> Path:
    path = folder / "case_rewards.py"
    path.write_text(REWARDS.format(run=str(run)))
    return path


def short_run(model_dir: Path, out: Path, functions: str, *extra: str) -> list[str]:
    return run_args(model_dir, out, "--rewards.functions", functions, "--training.max_steps", "4",
                    "--eval.num_problems", "0", *extra)


@pytest.mark.parametrize("function, extra, raised", [
    ("exits", [], "raised SystemExit: 0"),
    ("interrupts", [], "raised KeyboardInterrupt"),
    ("async_exits", [], "raised SystemExit: 0"),
    ("interrupts", ["--rewards.timeout_s", "60"], "raised KeyboardInterrupt"),  # in a worker
])
def test_whatever_a_reward_raises_is_one_line_and_the_step_is_not_applied(
        runner, tiny_model_dir, tmp_path, function, extra, raised):
    out = tmp_path / "run"
    functions = f"format,{reward_file(tmp_path, out)}:{function}"
    code, output = runner.run(short_run(tiny_model_dir, out, functions, *extra))
    errors = [line for line in output.splitlines() if line.startswith("infsamp train")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in output, output
    assert errors[0].startswith(f"infsamp train: error: step 3: reward function {function!r}, "
                                "row 0 (prompt "), errors[0]
    assert f"{raised}; the step was not applied" in errors[0]
    assert [r["step"] for r in rows(out / "metrics.jsonl")] == [1, 2]
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2"]
    verify_checkpoint(out / "checkpoint-2")


@pytest.mark.parametrize("exit_code", [3, 0])
def test_sys_exit_at_import_is_one_line(runner, tiny_model_dir, tmp_path, exit_code):
    path = tmp_path / "exits_at_import.py"
    path.write_text(f"import sys\nsys.exit({exit_code})\ndef f(completions, **kw):\n    return []\n")
    code, output = runner.run(short_run(tiny_model_dir, tmp_path / "run", f"{path}:f"))
    assert code == 2 and "Traceback" not in output, output
    assert output.strip().splitlines()[-1] == (
        f"infsamp train: error: rewards.functions: reward function '{path}:f': importing {path} "
        f"failed (SystemExit: {exit_code})")


@pytest.mark.parametrize("timeout_s", [0.0, 60.0])  # in this process, in worker processes
def test_each_function_scores_its_own_copy(timeout_s):
    prompts, completions, answers = ["p"] * 3, ["<answer>\n5\n</answer>", "x", "y"], ["5", "7", "9"]
    funcs = [("vandal", vandal_reward), ("accuracy", accuracy_reward), ("again", vandal_reward)]
    result = compute_rewards(funcs, None, prompts, completions, {"answer": answers},
                             timeout_s=timeout_s)
    assert result.per_function["accuracy"] == [2.0, 0.0, 0.0]  # the originals, not 72 everywhere
    assert completions == ["<answer>\n5\n</answer>", "x", "y"] and answers == ["5", "7", "9"]
    assert prompts == ["p"] * 3


def test_timeouts_stop_the_call_and_step_time_stays_flat(runner, tiny_model_dir, tmp_path):
    """A sync function that busy-loops and an async one that blocks its event loop, both past
    `rewards.timeout_s` at every one of 20 steps: each call is stopped (its process killed), the
    run ends, and the last steps take no longer than the first ones."""
    out = tmp_path / "run"
    path = reward_file(tmp_path, out)
    argv = run_args(tiny_model_dir, out, "--rewards.functions",
                    f"{path}:length,{path}:busy,{path}:blocks_its_loop",
                    "--rewards.timeout_s", "0.1", "--training.max_steps", "20",
                    "--training.prompts_per_step", "1", "--sampling.max_new_tokens", "4",
                    "--eval.num_problems", "0", "--checkpointing.save_every", "0")
    child = runner.start(argv)
    code = child.wait(timeout=150)
    assert code == 0, child.output
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").open()]  # timings kept
    assert [m["rewards/busy/timeouts"] for m in metrics] == [1] * 20
    assert [m["rewards/blocks_its_loop/timeouts"] for m in metrics] == [1] * 20
    times = [m["step_time"] for m in metrics]
    early, late = statistics.median(times[1:6]), statistics.median(times[-5:])
    assert late < 1.5 * early + 0.1, times  # threads left spinning would slow every later step
