"""Atomic checkpoints: policy (or LoRA adapters), optimizer, scheduler, RNG states, step, data position.

A checkpoint is written into `checkpoint-N.tmp/` and renamed to `checkpoint-N/` only once every file
is on disk, so a crash mid-write leaves a `.tmp` folder that is never loaded. `trainer_state.json` is
written last inside it and is what marks a checkpoint as complete. Old step checkpoints beyond
`keep_last` are pruned.

Deliberately simple: one process, full optimizer state in one file (no sharding).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infsamp.errors import InfsampError

STATE_FILE = "trainer_state.json"
_CKPT = re.compile(r"^checkpoint-(\d+)$")


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with file.open("rb") as fh:
                os.fsync(fh.fileno())


def save_checkpoint(output_dir: Path, step: int, *, model, tokenizer, optimizer, scheduler,
                    extra: dict[str, Any], trainer_state: dict[str, Any], keep_last: int | None = None) -> Path:
    """Write checkpoint-`step` atomically; returns its path."""
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f"checkpoint-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / "model", safe_serialization=True)
    tokenizer.save_pretrained(tmp / "model")
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": rng_state(), **extra}, tmp / "training_state.pt")
    (tmp / STATE_FILE).write_text(json.dumps({"step": step, **trainer_state}, indent=1))
    _fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    if keep_last:
        prune(output_dir, keep_last)
    return final


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not output_dir.exists():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir()
             if (m := _CKPT.match(p.name)) and (p / STATE_FILE).exists()]
    return [p for _, p in sorted(found)]


def prune(output_dir: Path, keep_last: int) -> None:
    for old in list_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def resolve_resume(resume: str, output_dir: Path) -> Path | None:
    """'' -> None; 'latest' -> newest complete checkpoint in output_dir (None if there is none)."""
    if not resume:
        return None
    if resume == "latest":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / STATE_FILE).exists():
        raise InfsampError(f"checkpointing.resume {resume!r}: not a complete checkpoint (no {STATE_FILE})")
    return path


def load_training_state(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(trainer_state json, torch state: optimizer, scheduler, rng, extras)."""
    state = json.loads((path / STATE_FILE).read_text())
    blob = torch.load(path / "training_state.pt", weights_only=False)
    return state, blob
