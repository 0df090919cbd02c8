"""Checkpoint folder names: which folders of a run folder are checkpoints, which are complete, and
the rank watcher's line naming the newest complete one (read without the run layer)."""

from pathlib import Path

from infsamp.checkpoint_folders import MANIFEST, candidates, checkpoint_dirs, list_checkpoints
from infsamp.distributed.rank_watch import RankWatch


def make_run_folder(out: Path) -> None:
    for step, complete in [(9, True), (10, True), (12, False)]:
        final, _ = checkpoint_dirs(out, step)
        final.mkdir(parents=True)
        if complete:
            (final / MANIFEST).write_text("{}")
    checkpoint_dirs(out, 13)[1].mkdir()  # checkpoint-13.tmp: being written
    (out / "checkpoint-11.foreign").mkdir()
    (out / "checkpoint-14").write_text("a file, not a folder")


def test_steps_order_numerically_and_only_manifests_are_complete(tmp_path):
    make_run_folder(tmp_path)
    assert [p.name for p in candidates(tmp_path)] == ["checkpoint-12", "checkpoint-10",
                                                      "checkpoint-9"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-9", "checkpoint-10"]
    assert list_checkpoints(tmp_path / "missing") == []


def test_the_watcher_names_the_newest_complete_checkpoint(tmp_path):
    watch = RankWatch.__new__(RankWatch)  # no store: describe reads only the run folder
    watch.rank, watch.output_dir = 0, tmp_path
    assert watch.describe(1, "exit code 9").endswith("no checkpoint was written yet")
    make_run_folder(tmp_path)
    line = watch.describe(1, "exit code 9")
    assert line.startswith("rank 1 failed (exit code 9); rank 0 stopped too: ")
    assert f"the newest complete checkpoint is {tmp_path / 'checkpoint-10'};" in line
