"""The run-folder lock in one process and across two (run/ownership.py); the end-to-end cases are
in tests/faults/test_ownership.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infsamp.errors import RunFolderError
from infsamp.options import ConfigError
from infsamp.run.ownership import LOCK_NAME, check_still_held, claim_run_folder, live_holder

SRC = Path(__file__).resolve().parents[2] / "src"
CLAIM = ("import sys; from pathlib import Path; from infsamp.run.ownership import "
         "claim_run_folder\ntry:\n    claim_run_folder(Path(sys.argv[1]))\nexcept Exception as e:"
         "\n    print(e); sys.exit(2)")


def claim_in_another_process(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLAIM, str(folder)], capture_output=True,
                          check=False, text=True, env={**os.environ, "PYTHONPATH": str(SRC)},
                          timeout=60)


def test_one_holder_at_a_time_named_and_released(tmp_path):
    folder = tmp_path / "run"
    lock = claim_run_folder(folder)
    record = json.loads((folder / LOCK_NAME).read_text())
    assert record["pid"] == os.getpid() and live_holder(folder) == record
    with pytest.raises(RunFolderError, match="in use by this process"):
        claim_run_folder(folder)
    other = claim_in_another_process(folder)
    assert other.returncode == 2
    assert other.stdout.strip() == (
        f"logging.output_dir {folder}: in use by infsamp train (PID {os.getpid()}, on host "
        f"{record['host']}, started {record['started']}); wait for it to end, or choose another "
        "logging.output_dir (nothing was changed)")
    assert json.loads((folder / LOCK_NAME).read_text()) == record  # the refusal wrote nothing
    lock.release()
    assert live_holder(folder) is None
    assert claim_in_another_process(folder).returncode == 0  # and the OS let it go at its exit
    assert live_holder(folder) is None


def test_a_refused_claim_leaves_the_folder_as_it_found_it(tmp_path):
    folder = tmp_path / "a" / "run"
    claim_run_folder(folder).release(undo=True)
    assert not folder.exists()  # the lock file and the folder it created are gone
    folder.mkdir()
    (folder / LOCK_NAME).write_text("an earlier run's record")
    claim_run_folder(folder).release(undo=True)
    assert (folder / LOCK_NAME).read_text() == "an earlier run's record"


def test_a_trainer_that_fails_to_start_lets_its_folder_go(tiny_config, tmp_path):
    """A failure after the claim (here: too few prompts, found once the data is read) undoes it,
    so the same process can start the run again at once."""
    from infsamp.run.trainer import GRPOTrainer

    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="more than the 40 training prompts"):
        GRPOTrainer(tiny_config(**{"logging.output_dir": str(out),
                                   "training.prompts_per_step": 41}))
    assert not out.exists()
    trainer = GRPOTrainer(tiny_config(**{"logging.output_dir": str(out), "eval.num_problems": 0,
                                         "training.max_steps": 1}))
    assert live_holder(out) is not None
    trainer.train()
    assert live_holder(out) is None


def test_a_folder_removed_or_made_again_is_no_longer_held(tmp_path):
    folder = tmp_path / "run"
    check_still_held(folder)  # not held by this process: nothing to check
    lock = claim_run_folder(folder)
    check_still_held(folder)
    (folder / "metrics.jsonl").write_text("")
    (folder / "metrics.jsonl").unlink()  # the run's own files come and go: still held
    check_still_held(folder)
    (folder / LOCK_NAME).rename(tmp_path / "aside")
    with pytest.raises(RunFolderError, match="removed or replaced while this run was going"):
        check_still_held(folder)
    (folder / LOCK_NAME).write_text("{}")  # another lock file under the same name
    with pytest.raises(RunFolderError, match=f"logging.output_dir {folder}: removed"):
        check_still_held(folder)
    (tmp_path / "aside").replace(folder / LOCK_NAME)  # the one it locked, back
    check_still_held(folder)
    lock.release()
