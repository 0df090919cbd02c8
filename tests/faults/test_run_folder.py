"""A run never writes over files it did not write; resume says what it resumes, or why not."""

from __future__ import annotations

import shutil
from pathlib import Path

from fault_runs import run_args


def snapshot(folder: Path) -> dict[str, bytes]:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {str(p.relative_to(folder)): p.read_bytes() for p in files}


def last_line(output: str) -> str:
    return output.strip().splitlines()[-1]


def test_new_run_into_a_used_folder_is_refused_and_touches_nothing(runner, reference,
                                                                   tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference("continuous"), out)
    before = snapshot(out)
    code, output = runner.run(run_args(tiny_model_dir, out, "--training.max_steps", "2"))
    assert code == 2 and "Traceback" not in output
    assert last_line(output).startswith(f"infsamp train: error: logging.output_dir {out}: "
                                        "already holds files")
    assert "pass --resume" in last_line(output)
    assert snapshot(out) == before


def test_a_checkpoint_is_not_a_run_folder(runner, reference, tiny_model_dir, tmp_path):
    """A checkpoint, a folder inside one, or a checkpoint-N not written yet (issue 32: training
    went into them; the refusal suggested --resume of the checkpoint): one line naming the run."""
    run = tmp_path / "run"
    shutil.copytree(reference("continuous"), run)
    before = snapshot(run)
    advice = f"to continue that run: --logging.output_dir {run} --resume (nothing was changed)"
    for out, where in [(run / "checkpoint-6", ""), (run / "checkpoint-6" / "sub", "inside "
                       "checkpoint-6, "), (run / "checkpoint-6" / "model", "inside checkpoint-6, "),
                       (run / "checkpoint-9", "")]:
        for resume in ([], ["--resume"], ["--checkpointing.resume", "auto"]):
            code, output = runner.run(run_args(tiny_model_dir, out, "--training.max_steps", "2",
                                               *resume))
            assert code == 2 and "Traceback" not in output, output
            assert last_line(output) == (f"infsamp train: error: logging.output_dir {out}: "
                                         f"{where}a checkpoint of the run {run}, not a run "
                                         f"folder; {advice}")
    assert snapshot(run) == before and not (run / "checkpoint-9").exists()


def test_a_folder_of_other_files_is_refused(runner, tiny_model_dir, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    for resume in ([], ["--resume"], ["--checkpointing.resume", "auto"]):
        code, output = runner.run(run_args(tiny_model_dir, out, *resume))
        assert code == 2 and "Traceback" not in output, output
    assert snapshot(out) == {"notes.txt": b"my notes"}


def test_resume_with_nothing_to_resume_says_so(runner, tiny_model_dir, tmp_path):
    code, output = runner.run(run_args(tiny_model_dir, tmp_path / "none", "--resume"))
    assert code == 2
    assert "nothing to resume from" in last_line(output) and "does not exist" in last_line(output)
    code, output = runner.run(run_args(tiny_model_dir, tmp_path / "none",
                                       "--training.max_steps", "2",
                                       "--checkpointing.resume", "auto"))
    assert code == 0 and "starting a new run" in output, output


def test_resume_with_another_lora_rank_is_one_line(runner, tiny_model_dir, tmp_path):
    out = tmp_path / "lora"
    lora = ["--model.lora_rank", "4", "--training.max_steps", "2", "--eval.num_problems", "0"]
    code, output = runner.run(run_args(tiny_model_dir, out, *lora))
    assert code == 0, output
    code, output = runner.run(run_args(tiny_model_dir, out, *lora, "--model.lora_rank", "8",
                                       "--resume"))
    assert code == 2 and "Traceback" not in output
    assert "checkpoint-2 was trained with model.lora_rank 4 (this run: 8)" in last_line(output)
    code, output = runner.run(run_args(tiny_model_dir, out, *lora, "--model.lora_rank", "0",
                                       "--resume"))
    assert code == 2 and "model.lora_rank 4 (this run: 0)" in last_line(output)


def test_extending_a_finished_run(runner, reference, tiny_model_dir, tmp_path):
    """A constant schedule continues as started; a decaying one is refused, not restarted."""
    out = tmp_path / "run"
    shutil.copytree(reference("continuous"), out)
    code, output = runner.run(run_args(tiny_model_dir, out, "--training.max_steps", "8",
                                       "--resume"))
    assert code == 0, output
    assert ("extending the run from 6 to 8 steps: the constant_with_warmup schedule continues "
            "as started") in output
    cosine = tmp_path / "cosine"
    code, output = runner.run(run_args(tiny_model_dir, cosine, "--training.lr_scheduler", "cosine",
                                       "--training.max_steps", "2", "--eval.num_problems", "0"))
    assert code == 0, output
    code, output = runner.run(run_args(tiny_model_dir, cosine, "--training.lr_scheduler", "cosine",
                                       "--training.max_steps", "4", "--resume"))
    assert code == 2
    assert "cosine schedule was built for 2 steps and cannot be extended" in last_line(output)


def test_resume_with_another_learning_rate_is_one_line(runner, reference, tiny_model_dir,
                                                       tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference("continuous"), out)
    code, output = runner.run(run_args(tiny_model_dir, out, "--training.learning_rate", "0.5",
                                       "--training.max_steps", "8", "--resume"))
    assert code == 2
    assert "checkpoint-6 was trained with training.learning_rate 0.01 (this run: 0.5)" \
        in last_line(output)


def test_a_read_only_run_folder_is_one_line(tmp_path, capsys):
    """A run folder the user cannot write (read-only mount, another user's folder: faked, as the
    test may run as root, where permissions do not apply) is one line at the claim, exit 2."""
    import errno
    import os
    from unittest import mock

    from infsamp import cli

    folder = tmp_path / "read-only"
    folder.mkdir()
    real_open = os.open

    def deny(path, flags, *args, **kwargs):
        if str(path).startswith(str(folder)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    with mock.patch("os.open", deny):
        code = cli.main(["train", "--logging.output_dir", str(folder), "--training.max_steps", "1",
                         "--eval.num_problems", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"infsamp train: error: logging.output_dir {folder}: cannot create or lock "
                      "it: Permission denied")
    assert list(folder.iterdir()) == []


def test_a_budget_that_lowers_max_new_tokens_is_one_plain_line(tiny_model_dir, tmp_path, capsys):
    """Issue 32 item 11: the KV budget lowering max_new_tokens was a raw Python UserWarning (its
    source line included) every step; now one plain line, once per run, and the run goes on."""
    import warnings

    from infsamp import cli

    args = run_args(tiny_model_dir, tmp_path / "run", "--training.max_steps", "2",
                    "--eval.num_problems", "0", "--sampling.max_new_tokens", "256",
                    "--sampling.kv_budget", "120", "--checkpointing.save_every", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a Python warning would end the run here
        assert cli.main(args) == 0
    notices = [line for line in capsys.readouterr().err.splitlines() if "lowered from" in line]
    assert len(notices) == 1 and notices[0].startswith("sampling.kv_budget='120' (120 tokens) "
                                                       "holds at most ")
    assert notices[0].endswith("max_new_tokens lowered from 256 (said once)")
