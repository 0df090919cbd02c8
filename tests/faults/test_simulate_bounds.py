"""`infsamp simulate` states its bounds and shows progress (issue 32 item 9: `-G 1000000000
--groups 1` printed nothing for 30 s; `--micro-group 1e12` was a MemoryError traceback)."""

from __future__ import annotations

import contextlib
import io
import time

import pytest

from infsamp import cli
from infsamp.commands import simulate as simulate_command

SYNTHETIC = ["simulate", "--synthetic", "lognormal"]


def main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("flags, message", [
    (["-G", "1000000000", "--groups", "1", "--micro-group", "8"],
     "--groups 1 x --num-generations 1000000000 x --epochs 1 is 1,000,000,000 samples; a "
     "synthetic workload holds at most 1,000,000"),
    (["--groups", "1001", "-G", "1000", "--micro-group", "8"], "is 1,001,000 samples"),
    (["-G", "1000000000", "--groups", "1"], "give --micro-group or --kv-budget (or both)"),
    (["--micro-group", "1000000000000"],
     "--micro-group must be between 1 and 4294967295, got 1000000000000"),
    (["--micro-group", "8", "--kv-budget", "99999999999"], "--kv-budget must be between 1"),
    (["--micro-group", "8", "--epochs", "99999999999"], "--epochs must be between 1"),
    (["--micro-group", "8", "--seed", "99999999999"], "--seed must be between -4294967295"),
    (["--micro-group", "8", "--max-new-tokens", "0"], "--max-new-tokens must be between 1"),
    (["--micro-group", "8", "--prompts-per-step", "-1"], "--prompts-per-step must be between 1"),
    (["--micro-group", "8", "--probe-tokens", "99999999999"], "--probe-tokens must be between"),
    (["--micro-group", "8", "--warmup-steps", "-1"], "--warmup-steps must be between 0"),
    (["--micro-group", "8", "--warmup-steps", "20"], "--warmup-steps 20 leaves none of the "
                                                     "trace's 20 steps to measure"),
    (["--micro-group", "8", "--epsilon", "inf"], "--epsilon must be > 0 and finite, got inf"),
    (["--micro-group", "8", "--park-ratio", "nan"], "--park-ratio must be > 0, got nan"),
])
def test_out_of_bounds_is_one_line_at_once(flags, message):
    started = time.perf_counter()
    code, out, err = main(SYNTHETIC + flags)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert message in err and "Traceback" not in err
    assert time.perf_counter() - started < 2.0


def test_a_micro_group_far_above_the_samples_allocates_nothing_per_slot():
    """g = 100,000,000 for 640 samples (each slot was a list entry: 4 GB)."""
    code, out, _ = main(SYNTHETIC + ["--micro-group", "100000000", "--json"])
    assert code == 0 and '"micro_group": 100000000' in out


def test_a_long_replay_prints_progress(monkeypatch):
    monkeypatch.setattr(simulate_command, "PROGRESS_EVERY_S", 0.0)
    code, _, err = main(SYNTHETIC + ["--groups", "2", "-G", "4", "--micro-group", "4"])
    lines = err.strip().splitlines()
    assert code == 0 and lines, err
    assert all(line.startswith("simulate: ") and "tokens replayed" in line for line in lines)
    assert lines[-1].startswith("simulate: 100% (")
    code, _, err = main(SYNTHETIC + ["--groups", "2", "-G", "4", "--micro-group", "4", "--json"])
    assert "simulate: 100% (" in err  # stderr: stdout stays one JSON object


def test_a_short_replay_prints_no_progress():
    code, _, err = main(SYNTHETIC + ["--groups", "2", "-G", "4", "--micro-group", "4"])
    assert code == 0 and err == ""
