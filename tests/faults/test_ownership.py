"""A run folder has one owner at a time, and a run never deletes what it did not write.

The run holds an exclusive lock on its folder for as long as it lives (`run/ownership.py`): a
second run, a resume, a requeued `auto` job or an export into it while it goes is one line naming
the holder, exit 2, every file as it was. Folders the user made under the names of checkpoints
still to come are renamed aside, never deleted.
"""

from __future__ import annotations

import shutil
import signal
import time

from fault_harness import rows
from fault_runs import run_args
from test_run_folder import last_line, snapshot


def test_a_live_run_owns_its_folder_and_keeps_what_it_did_not_write(runner, tiny_model_dir,
                                                                     tmp_path):
    out = tmp_path / "run"
    live = runner.start(run_args(tiny_model_dir, out), kill_at="pause@3")  # live, holding out
    live.wait_for("paused after step 3")
    before = snapshot(out)
    holder = f"in use by infsamp train (PID {live.pid}, on host "
    for extra in ([], ["--resume"], ["--checkpointing.resume", "auto"]):
        code, output = runner.run(run_args(tiny_model_dir, out, *extra))
        assert code == 2 and holder in last_line(output), output
        assert "Traceback" not in output and "(nothing was changed)" in last_line(output)
    for target in (out / "exported", out):
        code, output = runner.run(["export", str(out), "--out", str(target)])
        assert code == 2, output
        assert f"the run folder of a live run: infsamp train (PID {live.pid}" in last_line(output)
    assert snapshot(out) == before

    # the user's own folders, under the names of the checkpoints still to come (4 and 6)
    (out / "checkpoint-4").mkdir()
    (out / "checkpoint-4" / "notes.txt").write_text("mine")
    shutil.copytree(out / "checkpoint-2", out / "checkpoint-6")  # a copy: its manifest says 2
    copied = snapshot(out / "checkpoint-6")
    live.signal(signal.SIGUSR1)
    assert live.wait() == 0, live.output
    for step in (4, 6):
        assert (f"{out / f'checkpoint-{step}'} was not written by this run (no manifest of step "
                f"{step}): renamed to checkpoint-{step}.foreign (kept)") in live.output
    assert snapshot(out / "checkpoint-4.foreign") == {"notes.txt": b"mine"}
    assert snapshot(out / "checkpoint-6.foreign") == copied  # and pruning left it alone
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [
        "checkpoint-4", "checkpoint-4.foreign", "checkpoint-6", "checkpoint-6.foreign"]
    assert [row["step"] for row in rows(out / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]

    code, output = runner.run(run_args(tiny_model_dir, out, "--resume"))  # the lock went with it
    assert code == 0 and "nothing to do" in output, output


def test_two_runs_started_together_into_one_folder(runner, tiny_model_dir, tmp_path):
    """A new run and a requeued `auto` job at once: one trains, the other is refused."""
    out = tmp_path / "run"
    args = run_args(tiny_model_dir, out, "--training.max_steps", "2", "--eval.num_problems", "0")
    # each holds after step 1 until told (SIGUSR1), so the other meets a live run whatever the
    # machine's speed (on an idle machine the first finished before the second had started)
    children = [runner.start(args, kill_at="pause@1"),
                runner.start([*args, "--checkpointing.resume", "auto"], kill_at="pause@1")]
    deadline = time.monotonic() + 120
    while all(child.process.is_alive() for child in children):
        assert time.monotonic() < deadline, [child.output for child in children]
        time.sleep(0.05)
    loser = next(child for child in children if not child.process.is_alive())
    winner = next(child for child in children if child is not loser)
    winner.wait_for("paused after step 1")
    winner.signal(signal.SIGUSR1)
    codes = [winner.wait(), loser.wait()]
    assert codes == [0, 2], [child.output for child in children]
    assert f"in use by infsamp train (PID {winner.pid}, " in last_line(loser.output), loser.output
    assert [row["step"] for row in rows(out / "metrics.jsonl")] == [1, 2]


def test_a_run_whose_folder_is_replaced_writes_nothing_more_into_it(runner, tiny_model_dir,
                                                                   tmp_path):
    """The folder of a live run removed and a new run started into the same path: when the old
    run goes on, it stops with one line before its next write, and the new run's files (its
    metrics, its checkpoints, which the old run's pruning would delete) stay as they were."""
    out = tmp_path / "run"
    old = runner.start(run_args(tiny_model_dir, out), kill_at="pause@3")
    old.wait_for("paused after step 3")
    shutil.rmtree(out)
    code, output = runner.run(run_args(tiny_model_dir, out, "--training.max_steps", "2"))
    assert code == 0, output
    after_new = snapshot(out)
    old.signal(signal.SIGUSR1)
    assert old.wait() == 2, old.output
    assert (f"logging.output_dir {out}: removed or replaced while this run was going"
            in last_line(old.output)), old.output
    assert "Traceback" not in old.output
    assert snapshot(out) == after_new
    assert [row["step"] for row in rows(out / "metrics.jsonl")] == [1, 2]
