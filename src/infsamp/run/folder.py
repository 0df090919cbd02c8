"""The run folder, before anything loads: a new run, or the verified checkpoint to resume.

    checkpointing.resume ''      a new run: the folder must be missing or empty (a run never
                                 writes over files it did not write)
    checkpointing.resume latest  the newest checkpoint in the folder that verifies; none: an error
    checkpointing.resume auto    the same, or a new run when there is none (a requeued job)
    checkpointing.resume PATH    that checkpoint (into its own run folder, or into an empty one)

First the folder is claimed (`ownership.py`: an exclusive lock, held until the run ends), so
another run, resume or export cannot use it meanwhile. Resuming skips newer checkpoints that do
not verify with one line each (they are renamed `checkpoint-N.damaged`, never deleted), checks
that the checkpoint continues this run (`identity.py`: the settings that define it, its schedule;
a `config.yaml` edited by hand is named), and only then removes the run's own unfinished
`checkpoint-N.tmp` folders. A refused resume leaves every file as it was. The run's JSONL logs are
rewound to the checkpoint's step later (`rewind_run_logs`), once the data is known to be the
checkpoint's.

Deliberately simple: "the same model" means the same configured name or path, not a weights hash.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from infsamp.checkpoint_folders import checkpoint_around, is_run_folder
from infsamp.config import Config
from infsamp.config_io import config_edits
from infsamp.errors import RunFolderError
from infsamp.run import checkpoint as ckpt
from infsamp.run.identity import check_resume
from infsamp.run.logs import RUN_LOGS, rewind
from infsamp.run.ownership import LOCK_NAME, claim_run_folder


def prepare_run_folder(cfg: Config, check=None) -> ckpt.Checkpoint | None:
    """Claim and check `logging.output_dir`; returns the verified checkpoint to resume, or None.
    `check(checkpoint)` may refuse it before anything in the folder changes (the launch's).
    The claim is held until the run ends (`ownership.release_run_folder`); a refusal undoes it."""
    out = Path(cfg.logging.output_dir)
    resume = cfg.checkpointing.resume
    _refuse_a_checkpoint(out)
    if resume == "latest" and not out.exists():
        return _nothing_to_resume(out, resume)
    lock = claim_run_folder(out)
    try:
        return _prepare(cfg, out, check)
    except BaseException:
        lock.release(undo=True)
        raise


def _prepare(cfg: Config, out: Path, check) -> ckpt.Checkpoint | None:
    resume = cfg.checkpointing.resume
    if not resume:
        _require_empty(out, "pass --resume to continue that run, or choose another "
                            "logging.output_dir")
        return None
    skipped: list[Path] = []
    found = _explicit(Path(resume), out) if resume not in ("latest", "auto") else \
        _newest(out, skipped)
    if found is None:
        return _nothing_to_resume(out, resume)
    check_resume(cfg, found)
    _check_config_file(out, cfg)
    if check is not None:
        check(found)
    for path in skipped:
        kept = ckpt.set_aside(path)
        print(f"  {path.name} renamed to {kept.name} (kept, not loaded)", file=sys.stderr)
    _remove_unfinished(out)
    print(f"resuming from {found.path} (step {found.step})")
    return found


def _refuse_a_checkpoint(out: Path) -> None:
    """A checkpoint (or a folder inside one) is not a run folder: name the run to resume."""
    found = checkpoint_around(out)
    if found is None:
        return
    where = "" if found == out.absolute() else f"inside {found.name}, "
    run = found.parent
    todo = (f"to continue that run: --logging.output_dir {run} --resume" if is_run_folder(run)
            else f"to start from it: --checkpointing.resume {found} with a new logging.output_dir")
    raise RunFolderError(f"logging.output_dir {out}: {where}a checkpoint of the run {run}, not a "
                         f"run folder; {todo} (nothing was changed)")


def _files_in(out: Path) -> list[str]:
    """What the folder holds besides its lock file."""
    return sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME) if out.is_dir() else []


def _require_empty(out: Path, advice: str) -> None:
    held = _files_in(out)
    if held:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise RunFolderError(f"logging.output_dir {out}: already holds files ({shown}); {advice}")


def _explicit(path: Path, out: Path) -> ckpt.Checkpoint:
    found = ckpt.load_checkpoint(path)
    if path.resolve().parent != out.resolve():
        _require_empty(out, f"a run resumed from {path} starts a new run folder: choose an "
                            "empty one")
    return found


def _newest(out: Path, skipped: list[Path]) -> ckpt.Checkpoint | None:
    """The newest checkpoint that verifies; the newer ones that do not go to `skipped`."""
    def skip(path: Path, reason: str) -> None:
        skipped.append(path)
        print(f"skipping {path.name}: {reason}", file=sys.stderr)

    return ckpt.find_resume_point(out, skip)


def _check_config_file(out: Path, cfg: Config) -> None:
    """A config.yaml edited by hand is not read on resume and would be overwritten: say so."""
    path = out / "config.yaml"
    edits = config_edits(path, cfg) if path.is_file() else None
    if edits:
        shown = ", ".join(f"{key} {value!r} in the file, {now!r} in this run"
                          for key, value, now in edits[:4]) + (", ..." if len(edits) > 4 else "")
        raise RunFolderError(f"{path} was edited by hand ({shown}); a resume does not read it "
                             f"and would overwrite it: resume with `infsamp train {path} "
                             "--resume` to use it, or undo the edit")


def _remove_unfinished(out: Path) -> None:
    for tmp in out.glob("checkpoint-*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)  # this run's own writes that a crash cut short


def _nothing_to_resume(out: Path, resume: str) -> None:
    if resume == "auto" and not _files_in(out):
        print(f"no checkpoint in {out}: starting a new run (checkpointing.resume auto)")
        return None
    if resume == "auto" and (out / "config.yaml").is_file() and not ckpt.candidates(out):
        _remove_unfinished(out)
        rewind_run_logs(out, -1)
        print(f"no checkpoint in {out}: starting this run again from step 0 "
              "(checkpointing.resume auto; the rows its earlier attempt logged are replaced)")
        return None
    state = "does not exist" if not out.exists() else "holds no checkpoint that verifies"
    raise RunFolderError(f"nothing to resume from: {out} {state}; to start a new run there use "
                         "--checkpointing.resume auto (or no --resume for an empty folder)")


def rewind_run_logs(out: Path, step: int) -> None:
    """Drop the rows logged after `step` (they are logged again) and torn last lines."""
    for name in RUN_LOGS:
        dropped = rewind(out / name, step)
        if dropped:
            print(f"{name}: dropped {dropped} row(s) logged after step {max(step, 0)} "
                  "(logged again now)")
