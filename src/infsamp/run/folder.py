"""The run folder, before anything loads: a new run, or the verified checkpoint to resume.

    checkpointing.resume ''      a new run: the folder must be missing or empty (a run never
                                 writes over files it did not write)
    checkpointing.resume latest  the newest checkpoint in the folder that verifies; none: an error
    checkpointing.resume auto    the same, or a new run when there is none (a requeued job)
    checkpointing.resume PATH    that checkpoint (into its own run folder, or into an empty one)

Resuming skips newer checkpoints that do not verify with one line each (they are renamed
`checkpoint-N.damaged`, never deleted), removes the run's own unfinished `checkpoint-N.tmp`
folders, rewinds the run's JSONL logs to the checkpoint's step, and checks that the checkpoint fits
this run: the same base model, full weights or LoRA of the same rank and targets, the same
learning-rate schedule (a run keeps the schedule it started with; see `check_schedule`), the
same precision mode (its optimizer states differ).

Deliberately simple: "the same model" means the same configured name or path, not a weights hash.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from infsamp.config import Config
from infsamp.errors import CheckpointError, RunFolderError
from infsamp.run import checkpoint as ckpt
from infsamp.algorithm.optim import schedule_horizon
from infsamp.choices import LR_SCHEDULERS
from infsamp.run.logs import RUN_LOGS, rewind


def prepare_run_folder(cfg: Config, check=None) -> ckpt.Checkpoint | None:
    """Create or check `logging.output_dir`; returns the verified checkpoint to resume, or None.
    `check(checkpoint)` may refuse it before anything in the folder changes (the launch's)."""
    out = Path(cfg.logging.output_dir)
    resume = cfg.checkpointing.resume
    if not resume:
        _require_empty(out, "pass --resume to continue that run, or choose another "
                            "logging.output_dir")
        out.mkdir(parents=True, exist_ok=True)
        return None
    found = _explicit(Path(resume), out) if resume not in ("latest", "auto") else _newest(out)
    if found is None:
        return _nothing_to_resume(out, resume)
    run_identity_matches(cfg, found)
    if check is not None:
        check(found)
    _rewind_logs(out, found.step)
    return found


def _require_empty(out: Path, advice: str) -> None:
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise RunFolderError(f"logging.output_dir {out}: already holds files ({shown}); {advice}")


def _explicit(path: Path, out: Path) -> ckpt.Checkpoint:
    found = ckpt.load_checkpoint(path)
    if path.resolve().parent != out.resolve():
        _require_empty(out, f"a run resumed from {path} starts a new run folder: choose an "
                            "empty one")
        out.mkdir(parents=True, exist_ok=True)
    print(f"resuming from {path} (step {found.step})")
    return found


def _newest(out: Path) -> ckpt.Checkpoint | None:
    skipped: list[Path] = []

    def skip(path: Path, reason: str) -> None:
        skipped.append(path)
        print(f"skipping {path.name}: {reason}", file=sys.stderr)

    found = ckpt.find_resume_point(out, skip)
    if found is not None:
        for path in skipped:
            kept = ckpt.set_aside(path)
            print(f"  {path.name} renamed to {kept.name} (kept, not loaded)", file=sys.stderr)
        _remove_unfinished(out)
        print(f"resuming from {found.path} (step {found.step})")
    return found


def _remove_unfinished(out: Path) -> None:
    for tmp in out.glob("checkpoint-*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)  # this run's own writes that a crash cut short


def _nothing_to_resume(out: Path, resume: str) -> None:
    if resume == "auto" and not any(out.glob("*")):
        out.mkdir(parents=True, exist_ok=True)
        print(f"no checkpoint in {out}: starting a new run (checkpointing.resume auto)")
        return None
    if resume == "auto" and (out / "config.yaml").is_file() and not ckpt.candidates(out):
        _remove_unfinished(out)
        _rewind_logs(out, -1)
        print(f"no checkpoint in {out}: starting this run again from step 0 "
              "(checkpointing.resume auto; the rows its earlier attempt logged are replaced)")
        return None
    state = "does not exist" if not out.exists() else "holds no checkpoint that verifies"
    raise RunFolderError(f"nothing to resume from: {out} {state}; to start a new run there use "
                         "--checkpointing.resume auto (or no --resume for an empty folder)")


def _rewind_logs(out: Path, step: int) -> None:
    for name in RUN_LOGS:
        dropped = rewind(out / name, step)
        if dropped:
            print(f"{name}: dropped {dropped} row(s) logged after step {max(step, 0)} "
                  "(logged again now)")


def run_identity(cfg: Config) -> dict[str, object]:
    """What a checkpoint must share with the run that resumes it."""
    from infsamp.models.device import resolve_device
    from infsamp.planner.precisions import resolve_precision_name

    model = cfg.model
    precision = resolve_precision_name(cfg.training.precision, resolve_device(model.device).type)
    return {"model": model.name_or_path, "weights": "lora" if model.lora_rank > 0 else "full",
            "lora_rank": model.lora_rank, "lora_target_modules": list(model.lora_target_modules),
            "precision": precision}


def run_identity_matches(cfg: Config, found: ckpt.Checkpoint) -> None:
    """One line when the checkpoint cannot continue this configuration."""
    saved, wanted, name = found.state.get("run", {}), run_identity(cfg), found.path.name
    if saved.get("model") != wanted["model"]:
        raise CheckpointError(f"{name} was trained from model {saved.get('model')!r}; this run "
                              f"names model.name_or_path {wanted['model']!r} (resume with the "
                              "same model)")
    if (saved.get("weights"), saved.get("lora_rank")) != (wanted["weights"], wanted["lora_rank"]):
        raise CheckpointError(f"{name} holds {_describe(saved)}; this run asks for "
                              f"{_describe(wanted)} (resume with --model.lora_rank "
                              f"{saved.get('lora_rank')}, or start a new run)")
    targets = saved.get("lora_target_modules")
    if wanted["weights"] == "lora" and targets != wanted["lora_target_modules"]:
        raise CheckpointError(f"{name} adapts {targets}; this run asks for "
                              f"model.lora_target_modules {wanted['lora_target_modules']}")
    precision = saved.get("precision", wanted["precision"])
    if precision != wanted["precision"]:  # the optimizer states differ between modes
        raise CheckpointError(f"{name} was saved with training.precision {precision}, this run "
                              f"is {wanted['precision']}; resume with --training.precision "
                              f"{precision}")
    check_schedule(cfg, found)


def _describe(identity: dict[str, object]) -> str:
    if identity.get("weights") == "lora":
        return f"LoRA adapters of rank {identity.get('lora_rank')}"
    return "full weights (model.lora_rank 0)"


def check_schedule(cfg: Config, found: ckpt.Checkpoint) -> None:
    """The schedule belongs to the run: a resume rebuilds it from the checkpoint's horizon. Past
    that horizon a constant (or inverse-sqrt) schedule simply continues; a decaying one would start
    over (transformers' cosine rises again) or stay at 0, so extending it is refused."""
    saved, name, max_steps = found.state["schedule"], found.path.name, cfg.training.max_steps
    now = schedule_horizon(cfg.training)
    for key in ("lr_scheduler", "learning_rate", "warmup_ratio"):
        if saved[key] != now[key]:
            raise CheckpointError(f"{name} was trained with training.{key} {saved[key]}; this run "
                                  f"asks for {now[key]} (a run keeps its learning-rate schedule; "
                                  "start a new run to change it)")
    if found.step > max_steps:
        raise CheckpointError(f"{name} is at step {found.step}, past training.max_steps "
                              f"{max_steps}")
    if max_steps <= saved["num_training_steps"]:
        return
    if LR_SCHEDULERS[saved["lr_scheduler"]]:
        raise CheckpointError(
            f"training.max_steps {max_steps}: this run's {saved['lr_scheduler']} schedule was "
            f"built for {saved['num_training_steps']} steps and cannot be extended (it would "
            "restart); "
            f"start a new run from {found.path / ckpt.MODEL_DIR}, or use a constant schedule")
    print(f"extending the run from {saved['num_training_steps']} to {max_steps} steps: the "
          f"{saved['lr_scheduler']} schedule continues as started")
