"""SIGKILL at any moment, then `--resume`: the same weights, optimizer state and log rows, exactly.

Each test kills a real child process (`kill -9`) at one moment (fault_harness.py lists them),
resumes it in a fresh child, and compares the final checkpoint and the JSONL rows with an
uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import random
import time

import pytest
import torch

from fault_harness import final_state, logs
from fault_runs import NUM_STEPS, POLICIES, SIGKILLED, run_args


def assert_same_run(run, expected) -> None:
    """Bit-identical final weights, optimizer and RNG tensors, training state and log rows."""
    got_model, got_tensors, got_json = final_state(run, NUM_STEPS)
    want_model, want_tensors, want_json = final_state(expected, NUM_STEPS)
    for got, want in ((got_model, want_model), (got_tensors, want_tensors)):
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key
    assert got_json == want_json
    assert logs(run) == logs(expected)
    assert not list(run.glob("*.tmp"))


def kill_then_resume(runner, model_dir, out, kill_at, *extra):
    code, output = runner.run(run_args(model_dir, out, *extra), kill_at=kill_at)
    assert code == SIGKILLED, output
    code, output = runner.run(run_args(model_dir, out, *extra, "--resume"))
    assert code == 0, output
    assert "Traceback" not in output
    return output


MOMENTS = ["sampling@3", "update@3", "metrics@4", "torn@5", "eval@3", "model@4", "state@4",
           "rename@4", "prune@6"]


@pytest.mark.parametrize("kill_at", MOMENTS)
def test_kill_at_any_moment_resumes_exactly(runner, reference, tiny_model_dir, tmp_path, kill_at):
    output = kill_then_resume(runner, tiny_model_dir, tmp_path / "run", kill_at)
    assert "resuming from" in output
    assert_same_run(tmp_path / "run", reference("continuous"))


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "continuous"])
def test_every_policy_and_predictor_resumes_exactly(runner, reference, tiny_model_dir, tmp_path,
                                                    policy):
    """The online predictor's state is in the checkpoint (it used to be an unpicklable lambda);
    so is the hidden predictor's probe, and runs that park samples resume exactly too."""
    kill_then_resume(runner, tiny_model_dir, tmp_path / "run", "state@4", *POLICIES[policy])
    assert_same_run(tmp_path / "run", reference(policy))
    if policy in ("length_aware-online", "length_aware-hidden", "probe-online"):
        rows = [json.loads(line) for line in (reference(policy) / "metrics.jsonl").open()]
        assert sum(row["sampling/num_preemptions"] for row in rows) > 0  # parks after k tokens
        if policy.startswith("probe"):  # wider than g = 4
            assert max(row["sampling/peak_rows"] for row in rows) > 4


def test_killed_twice_in_a_row(runner, reference, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    code, _ = runner.run(run_args(tiny_model_dir, out), kill_at="rename@2")
    assert code == SIGKILLED
    auto = run_args(tiny_model_dir, out, "--checkpointing.resume", "auto")
    code, output = runner.run(auto, kill_at="torn@3")
    assert code == SIGKILLED and "starting this run again from step 0" in output
    code, output = runner.run(run_args(tiny_model_dir, out, "--resume"), kill_at="model@4")
    assert code == SIGKILLED and "resuming from" in output
    code, output = runner.run(run_args(tiny_model_dir, out, "--resume"))
    assert code == 0, output
    assert_same_run(out, reference("continuous"))


def test_kill_at_a_random_moment(runner, reference, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    child = runner.start(run_args(tiny_model_dir, out))
    child.wait_for("step 1/")
    time.sleep(random.Random().uniform(0.0, 0.6))
    with contextlib.suppress(ProcessLookupError):  # an unloaded machine may finish first
        child.signal(9)
    child.wait()  # before the first checkpoint there is nothing to resume: `auto` starts again
    code, output = runner.run(run_args(tiny_model_dir, out, "--checkpointing.resume", "auto"))
    assert code == 0, output
    assert_same_run(out, reference("continuous"))


def test_resume_of_a_finished_run_changes_nothing(runner, reference, tiny_model_dir, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(reference("continuous"), out)
    before = {p.name: p.read_bytes() for p in out.glob("*.jsonl")}
    code, output = runner.run(run_args(tiny_model_dir, out, "--resume"))
    assert code == 0 and "finished at step 6" in output, output
    assert {p.name: p.read_bytes() for p in out.glob("*.jsonl")} == before  # no eval, no rows
