"""Faults of a torchrun launch (2 processes): one config for all ranks, the launcher's signals,
the launcher's death, and rank 0's hold on the run folder.

Each test is one launch (about 30 s on 2 cores, most of it the two processes' imports), so each
combines several cases: `tests/distributed/launching.py` starts it, `rank_child.py` runs the
`infsamp train` runs in it one after the other.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fault_harness import rows
from test_run_folder import last_line

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from launching import launch_command, settings, train_argv


def start(folder: Path, runs: list[dict], kill: str | None = None):
    """The launch in the background, its output (launcher and ranks) in folder/launch.log."""
    command, env = launch_command(folder, runs, kill=kill)
    log = folder / "launch.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    return process, log


def wait_for(log: Path, text: str, process, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)


def rank_files(folder: Path, suffix: str) -> list[str]:
    return [p.read_text() for p in sorted(folder.glob(f"runs-*.rank-*.{suffix}"))]


@pytest.mark.slow
def test_ranks_of_one_launch_run_one_config_and_sighup_to_the_launcher_saves(tiny_model_dir,
                                                                          tmp_path):
    """First run: rank 1 is given another learning rate and group size: one line naming both
    keys, every rank exits 2, before anything loads (its folder is never made). Second run, in
    the same processes: SIGHUP to the launcher (a closed terminal) reaches every rank, which
    finish the step, save once together and name the checkpoint."""
    mismatched = settings(tiny_model_dir, tmp_path / "mismatched")
    run = settings(tiny_model_dir, tmp_path / "run", **{"training.max_steps": 40,
                                                        "checkpointing.save_every": 0})
    other = train_argv(mismatched, "--training.learning_rate", "0.01",
                       "--sampling.num_generations", "4")
    process, log = start(tmp_path / "a", [
        {"argv": train_argv(mismatched), "argv_by_rank": {"1": other}, "expect": 2,
         "record": str(tmp_path / "rec-1")},
        {"argv": train_argv(run), "record": str(tmp_path / "rec-2")}])
    wait_for(log, "step 1/40", process)
    process.send_signal(signal.SIGHUP)
    process.wait(timeout=120)
    output = log.read_text()
    lines = [line for line in output.splitlines() if line.startswith("infsamp train:")]
    assert lines[0] == (
        "infsamp train: error: the 2 processes of this launch were given different settings "
        "(sampling.num_generations: rank 0 8, rank 1 4; training.learning_rate: rank 0 0.001, "
        "rank 1 0.01); give every process the same config file and flags"), output[-3000:]
    assert not (tmp_path / "mismatched").exists()
    stopped = [line for line in lines if "stopped by SIGHUP" in line]
    assert len(stopped) == 1 and len(lines) == 2, lines
    step = len(rows(tmp_path / "run" / "metrics.jsonl"))
    assert stopped[0] == (f"infsamp train: stopped by SIGHUP after step {step}: saved "
                          f"checkpoint-{step} in {tmp_path / 'run'} (continue with --resume)")
    assert (tmp_path / "run" / f"checkpoint-{step}" / "manifest.json").is_file()
    assert rank_files(tmp_path / "a", "codes") == ["2\n129\n", "2\n129\n"]


@pytest.mark.slow
def test_a_killed_launcher_stops_its_ranks_which_held_the_folder(runner, tiny_model_dir,
                                                               tmp_path):
    """While the launch runs (rank 0 paused after step 3), rank 0 holds the run folder: a new
    run and a resume are refused naming it. Then `kill -9` of the launcher: both ranks stop
    within seconds without writing, saying the launcher is gone (not blaming rank 0), and one
    process resumes the run from checkpoint-2 at once."""
    out = tmp_path / "run"
    values = settings(tiny_model_dir, out, **{"training.max_steps": 4,
                                              "checkpointing.save_every": 2})
    process, log = start(tmp_path / "a", [{"argv": train_argv(values),
                                           "record": str(tmp_path / "rec")}], kill="0:pause@3")
    wait_for(log, "paused after step 3", process)
    holder = json.loads((out / ".infsamp.lock").read_text())
    rank_pids = [int(pid) for pid in rank_files(tmp_path / "a", "pid")]
    assert holder["pid"] == rank_pids[0] and (holder["rank"], holder["world_size"]) == (0, 2)
    for extra in ([], ["--resume"]):
        code, output = runner.run(train_argv(values, *extra))
        assert code == 2, output
        assert f"in use by infsamp train (PID {rank_pids[0]}, rank 0 of 2, on host " in \
            last_line(output)

    process.kill()  # kill -9 of torchrun: its ranks live on in sessions of their own
    killed = time.monotonic()
    process.wait()
    while any(_alive(pid) for pid in rank_pids) and time.monotonic() - killed < 30:
        time.sleep(0.05)
    assert time.monotonic() - killed < 5, log.read_text()[-3000:]
    output = log.read_text()
    for rank in (0, 1):
        assert (f"infsamp train: error: the launcher (PID {process.pid}) is gone: killed, or it "
                f"crashed; rank {rank} stopped without saving: the newest complete checkpoint "
                f"is {out / 'checkpoint-2'}") in output, output[-3000:]
    assert "rank 0 failed" not in output
    assert [row["step"] for row in rows(out / "metrics.jsonl")] == [1, 2, 3]
    assert not (out / "checkpoint-4").exists()

    code, output = runner.run(train_argv(values, "--resume"))  # at once: the folder is free
    assert code == 0 and "resuming from" in output, output
    assert [row["step"] for row in rows(out / "metrics.jsonl")] == [1, 2, 3, 4]


def _alive(pid: int) -> bool:
    from infsamp.distributed.rank_watch import process_alive

    return process_alive(pid)
