"""Reward functions are isolated (issue 19, item 2): whatever a function raises (`sys.exit`,
`KeyboardInterrupt`, `SystemExit` in an async function, `sys.exit` at import) is one line naming
the function, the step and the row, the exit code is 2 and the step is not applied; each function
scores its own copy of the step; `rewards.timeout_s` really stops a call, sync or async, and the
step time stays flat over 20 steps with functions that always overrun.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import pytest

from infsamp.rewards.builtin import accuracy_reward
from infsamp.rewards.compute import compute_rewards
from infsamp.rewards.workers import RewardWorkers
from infsamp.run.checkpoint import list_checkpoints, verify_checkpoint
from infsamp.run.ownership import LOCK_NAME, claim_run_folder, live_holder

from fault_harness import length_reward, rows, vandal_reward
from fault_runs import SIGKILLED, run_args

LINUX_ONLY = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

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


def fails_in_evaluation(prompts, completions, **kwargs):  # training scores 8 rows a step
    if _late() and len(completions) != 8:
        raise ValueError("cannot judge")
    return length(prompts, completions)


def hangs_once(prompts, completions, **kwargs):  # at step 3, the first run only
    marker = os.path.join(os.path.dirname(RUN), "worker.pid")
    if _late() and not os.path.exists(marker):
        with open(marker + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(marker + ".tmp", marker)
        time.sleep(3600)
    return length(prompts, completions)
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


def test_a_reward_that_fails_in_evaluation_names_the_evaluation(runner, tiny_model_dir,
                                                                 tmp_path):
    out = tmp_path / "run"
    functions = f"format,{reward_file(tmp_path, out)}:fails_in_evaluation"
    code, output = runner.run(run_args(tiny_model_dir, out, "--rewards.functions", functions,
                                       "--training.max_steps", "4"))
    assert code == 2 and "Traceback" not in output, output
    assert output.strip().splitlines()[-1].startswith(
        "infsamp train: error: evaluation at step 3: reward function 'fails_in_evaluation', row 0 "
        "(prompt "), output
    assert output.strip().endswith("raised ValueError: cannot judge (the checkpoints are as they "
                                   "were)")
    assert [r["step"] for r in rows(out / "metrics.jsonl")] == [1, 2, 3]
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2"]


@pytest.mark.parametrize("exit_code", [3, 0])
def test_sys_exit_at_import_is_one_line(runner, tiny_model_dir, tmp_path, exit_code):
    path = tmp_path / "exits_at_import.py"
    path.write_text(f"import sys\nsys.exit({exit_code})\n"
                    "def f(completions, **kw):\n    return []\n")
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


def _open_files(pid: int) -> set[str]:
    folder = Path(f"/proc/{pid}/fd")
    return {os.readlink(fd) for fd in folder.iterdir() if fd.is_symlink()}


@LINUX_ONLY
def test_reward_processes_never_hold_the_run_folder_lock(tmp_path):
    """The trainer holds its folder's flock; a process forked without exec would hold it too, and
    keep the folder locked after a killed trainer. The loaders are fresh interpreters started
    without the trainer's descriptors, and the workers are forked from them."""
    lock = claim_run_folder(tmp_path / "run")
    lock_file = str((tmp_path / "run" / LOCK_NAME).resolve())
    assert lock_file in _open_files(os.getpid())  # what the probe below looks for
    funcs = [("length", length_reward)]
    workers = RewardWorkers(funcs, timeout_s=60)
    try:
        workers.call_all(funcs, {"prompts": ["p"], "completions": ["abc"]})
        worker = workers.workers["length"]
        for pid in (worker.loader.popen.pid, worker.pid):
            assert lock_file not in _open_files(pid), pid
    finally:
        workers.close()
        lock.release()


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] in "ZX"
    except (FileNotFoundError, IndexError):
        return True


@LINUX_ONLY
def test_a_killed_trainer_leaves_no_reward_process_and_no_lock(runner, tiny_model_dir,
                                                               tmp_path):
    """`kill -9` of a trainer whose reward worker is in the middle of a call: the worker dies
    with it, the folder is free at once, and a resume continues from the last checkpoint."""
    out = tmp_path / "run"
    args = short_run(tiny_model_dir, out, f"format,{reward_file(tmp_path, out)}:hangs_once",
                     "--rewards.timeout_s", "600")
    child = runner.start(args)
    marker = tmp_path / "worker.pid"
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert child.process.is_alive() and time.monotonic() < deadline, child.output
        time.sleep(0.05)
    worker_pid = int(marker.read_text())
    child.signal(signal.SIGKILL)
    assert child.wait() == SIGKILLED
    deadline = time.monotonic() + 5
    while not _gone(worker_pid):
        assert time.monotonic() < deadline, f"reward worker {worker_pid} outlived its trainer"
        time.sleep(0.05)
    assert live_holder(out) is None
    code, output = runner.run([*args, "--resume"])
    assert code == 0, output
    assert [r["step"] for r in rows(out / "metrics.jsonl")] == [1, 2, 3, 4]
