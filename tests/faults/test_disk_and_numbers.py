"""A full disk while saving, and NaN/inf in the numbers: one line, nothing bad applied or kept."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from infsamp.run.checkpoint import list_checkpoints, load_checkpoint

from fault_harness import final_state
from fault_runs import HARNESS, run_args
from test_kill_resume import assert_same_run


def last_line(output: str) -> str:
    return output.strip().splitlines()[-1]


def assert_disk_full_handled(out: Path, output: str, code: int, name: str, intact: str) -> None:
    assert code == 2 and "Traceback" not in output, output
    line = last_line(output)
    assert line.startswith(f"infsamp train: error: cannot write {name} in {out}: "
                           "No space left on device")
    assert line.endswith(f"(removed the partial {name}.tmp; {intact} is intact)")
    assert not list(out.glob("*.tmp"))
    assert load_checkpoint(out / intact).step == int(intact.split("-")[1])


def test_disk_full_while_saving_injected(runner, reference, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    code, output = runner.run(run_args(tiny_model_dir, out), kill_at="enospc@4")
    assert_disk_full_handled(out, output, code, "checkpoint-4", "checkpoint-2")
    code, output = runner.run(run_args(tiny_model_dir, out, "--resume"))
    assert code == 0, output
    assert_same_run(out, reference("continuous"))


@pytest.fixture
def small_disk(tmp_path, reference):
    """A tmpfs with room for the logs and 2.5 checkpoints (skipped where mounting fails)."""
    files = (reference("continuous") / "checkpoint-6").rglob("*")
    ckpt = sum(p.stat().st_size + 4096 for p in files)
    logs = sum(p.stat().st_size for p in reference("continuous").glob("*.*"))
    mount = tmp_path / "disk"
    mount.mkdir()
    size = int(2.5 * ckpt + logs + 64 * 1024) // 4096 * 4096
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip("cannot mount a small filesystem here (the injected test covers ENOSPC)")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_disk_full_while_saving_on_a_small_filesystem(runner, tiny_model_dir, small_disk):
    out = small_disk / "run"
    code, output = runner.run(run_args(tiny_model_dir, out, "--checkpointing.keep_last", "3"))
    assert_disk_full_handled(out, output, code, "checkpoint-6", "checkpoint-4")


def test_huge_learning_rate_stops_before_a_non_finite_update(runner, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    code, output = runner.run(run_args(tiny_model_dir, out, "--training.learning_rate", "1e30"))
    assert code == 2 and "Traceback" not in output, output
    line = last_line(output)
    assert re.fullmatch(r"infsamp train: error: step \d+: (loss|gradient norm) is (nan|inf);.*"
                        r"|infsamp train: error: step \d+: .* holds NaN or inf; the checkpoint "
                        r"is not written.*", line)
    for checkpoint in list_checkpoints(out):
        load_checkpoint(checkpoint)  # verifies: every saved tensor is finite


def test_non_finite_reward_stops_or_skips(runner, tiny_model_dir, tmp_path):
    huge = ["--rewards.functions", f"{HARNESS}:huge_reward"]
    code, output = runner.run(run_args(tiny_model_dir, tmp_path / "stop", *huge))
    assert code == 2
    assert last_line(output) == ("infsamp train: error: step 1: reward is inf; stopped before "
                                 "applying it (checkpoints untouched; training.nonfinite skip "
                                 "skips such updates instead)")
    assert not list((tmp_path / "stop").glob("checkpoint-*"))
    skip = run_args(tiny_model_dir, tmp_path / "skip", *huge, "--training.nonfinite", "skip")
    code, output = runner.run(skip)
    assert code == 0, output
    lines = (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["train/skipped_updates"] for r in rows] == [1, 2, 3, 4, 5, 6]
    weights, _, _ = final_state(tmp_path / "skip", 6)
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    assert all((weights[k] == initial[k]).all() for k in initial)


@pytest.mark.parametrize("flag, value", [("--training.learning_rate", "inf"),
                                         ("--rewards.weights", "nan,1"),
                                         ("--training.adam_beta1", "nan")])
def test_non_finite_settings_are_refused(runner, tiny_model_dir, tmp_path, flag, value):
    code, output = runner.run(run_args(tiny_model_dir, tmp_path / "run", flag, value))
    assert code == 2
    expected = f"infsamp train: error: {flag[2:]}: must be a finite number"
    assert last_line(output).startswith(expected)
