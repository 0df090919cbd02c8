"""No file a run writes is reached through a link it did not create (issue 32, item 1), a run
inside a live run's folder is refused (item 2), and a start whose KV budget holds no prompt is
refused before it writes anything (item 10).

A symbolic link planted where the run writes (its lock, its logs, `config.yaml`, a plot, the
`--out` of `infsamp sample`, a trace) is refused in one line or replaced by the run's own file;
the link's target is never written. A lock that is a folder or a FIFO is refused at once.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from infsamp.commands.output_files import check_output_files
from infsamp.config import Config
from infsamp.config_io import save_config
from infsamp.errors import RunFolderError
from infsamp.files import create_text, write_text
from infsamp.options import ConfigError
from infsamp.run.logs import append_jsonl
from infsamp.run.ownership import LOCK_NAME, claim_run_folder, release_run_folder

from fault_runs import run_args
from test_run_folder import last_line, snapshot

SECRET = "a file of the user's, outside the run\n"


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "elsewhere" / "precious.txt"
    path.parent.mkdir()
    path.write_text(SECRET)
    return path


def _plant(folder, name, target):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).symlink_to(target)


def test_a_lock_that_is_a_link_is_refused_and_its_target_untouched(tmp_path, victim):
    out = tmp_path / "run"
    _plant(out, LOCK_NAME, victim)
    with pytest.raises(RunFolderError, match="is a symbolic link"):
        claim_run_folder(out)
    assert victim.read_text() == SECRET


@pytest.mark.parametrize("kind", ["folder", "fifo", "dangling link"])
def test_a_lock_that_is_not_a_regular_file_is_refused_at_once(tmp_path, kind):
    out = tmp_path / "run"
    out.mkdir()
    lock = out / LOCK_NAME
    {"folder": lock.mkdir, "fifo": lambda: os.mkfifo(lock),
     "dangling link": lambda: lock.symlink_to(tmp_path / "nothing")}[kind]()
    start = time.monotonic()
    with pytest.raises(RunFolderError, match="not a regular file|symbolic link"):
        claim_run_folder(out)
    assert time.monotonic() - start < 2
    assert not (tmp_path / "nothing").exists()


def test_logs_never_append_through_a_link(tmp_path, victim):
    _plant(tmp_path / "run", "metrics.jsonl", victim)
    with pytest.raises(RunFolderError, match="symbolic link"):
        append_jsonl(tmp_path / "run" / "metrics.jsonl", {"step": 1})
    assert victim.read_text() == SECRET


@pytest.mark.parametrize("write", [
    lambda path: save_config(Config(), path),
    lambda path: write_text(path, "the run's own bytes"),
])
def test_a_file_replaced_atomically_replaces_the_link_not_its_target(tmp_path, victim, write):
    _plant(tmp_path / "run", "config.yaml", victim)
    path = tmp_path / "run" / "config.yaml"
    write(path)
    assert not path.is_symlink() and path.read_text() != SECRET
    assert victim.read_text() == SECRET
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.yaml"]  # no temporary left


def test_outputs_that_are_links_are_refused_before_any_work(tmp_path, victim):
    _plant(tmp_path, "out.jsonl", victim)
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match="is a symbolic link"):
            check_output_files({"--out": str(tmp_path / "out.jsonl")}, [], overwrite=overwrite)
    with pytest.raises(RunFolderError, match="symbolic link"):
        create_text(tmp_path / "out.jsonl")
    assert victim.read_text() == SECRET


def test_train_resume_through_a_planted_lock_link_is_one_line(runner, tiny_model_dir, tmp_path,
                                                               victim):
    out = tmp_path / "run"
    _plant(out, LOCK_NAME, victim)
    code, output = runner.run(run_args(tiny_model_dir, out, "--resume"))
    assert code == 2 and "is a symbolic link" in last_line(output), output
    assert "Traceback" not in output
    assert victim.read_text() == SECRET


def test_a_run_inside_a_live_runs_folder_is_refused(runner, tiny_model_dir, tmp_path):
    out = tmp_path / "live"
    live = runner.start(run_args(tiny_model_dir, out), kill_at="pause@1")
    try:
        live.wait_for("paused after step 1")
        before = snapshot(out)
        for inner in (out / "sub", out / "a" / "b"):
            code, output = runner.run(run_args(tiny_model_dir, inner))
            assert code == 2, output
            assert f"is inside {out}, the run folder of a live run" in last_line(output)
            assert f"PID {live.pid}" in last_line(output)
        assert snapshot(out) == before and not (out / "sub").exists()
    finally:
        live.signal(signal.SIGKILL)
        live.wait()


def test_a_claim_inside_a_folder_this_process_holds_is_refused(tmp_path):
    outer = tmp_path / "outer"
    claim_run_folder(outer)
    try:
        with pytest.raises(RunFolderError, match="inside"):
            claim_run_folder(outer / "inner")
        assert not (outer / "inner").exists()
    finally:
        release_run_folder(outer)


@pytest.mark.parametrize("settings", [
    ("--sampling.policy", "probe", "--sampling.kv_budget", "1"),
    ("--sampling.policy", "continuous", "--sampling.kv_budget", "10"),
])
def test_a_budget_that_holds_no_prompt_is_refused_before_anything_is_written(
        runner, tiny_model_dir, tmp_path, settings):
    """Issue 32, item 10: it was refused at step 1, after the step-0 evaluation had written its
    logs, so the next run into the folder was refused as a folder of other files."""
    new, existing = tmp_path / "new", tmp_path / "existing"
    existing.mkdir()  # made by the user, empty: it stays, empty
    for out in (new, existing):
        code, output = runner.run(run_args(tiny_model_dir, out, *settings))
        assert code == 2 and "cannot hold the longest prompt" in last_line(output), output
        assert "eval @" not in output
        assert not new.exists() and list(existing.iterdir()) == []


@pytest.mark.parametrize("policy, budget", [("probe", "1"), ("continuous", "10")])
def test_a_budget_that_holds_no_prompt_is_refused_before_the_weights_load(
        tiny_config, policy, budget, tmp_path):
    """Item 10's rule, "every size check that needs only the config and the model's shape runs
    before the weights load": the KV budget is checked against the longest prompt from the
    model's config, with the sampler's own rule and line, before any weight is read."""
    from unittest import mock

    from infsamp.errors import SamplingError
    from infsamp.run.trainer import GRPOTrainer

    cfg = tiny_config(**{"sampling.policy": policy, "sampling.kv_budget": budget,
                         "logging.output_dir": str(tmp_path / "run")})
    loaded = AssertionError("the weights loaded before the budget was checked")
    with mock.patch("infsamp.run.trainer.load_model_and_tokenizer", side_effect=loaded), \
            pytest.raises(SamplingError, match="cannot hold the longest prompt"):
        GRPOTrainer(cfg)
    assert not (tmp_path / "run").exists()
