"""Where a run's checkpoints are and which of them are complete: names only.

A checkpoint is the folder `checkpoint-N` of the run folder (written as `checkpoint-N.tmp` and
renamed when done); it is complete once its manifest, the last file written, is there. What is
inside and how it is verified is `run/checkpoint.py`'s. This module sits below every room
(pathlib and re, no torch) so that whoever only needs to find checkpoints, as the rank watcher
naming the newest one when a peer fails (`distributed/rank_watch.py`), reads the same rule
without importing the run layer that writes them.

`checkpoint_around(path)` names the checkpoint a path is (or is inside), so a run folder chosen
there is refused with the run to resume instead (a checkpoint is not a run folder).

Deliberately simple: the folder name is the step; nothing here opens a file. A run folder is
recognised by the files every run writes first (`RUN_MARKERS`).
"""

from __future__ import annotations

import re
from pathlib import Path

MANIFEST = "manifest.json"
_CKPT = re.compile(r"^checkpoint-(\d+)$")
_ANY_CKPT = re.compile(r"^checkpoint-\d+(\.[\w-]+)?$")  # .tmp, .damaged[-k], .foreign
LOCK_NAME = ".infsamp.lock"  # the run's lock (run/ownership.py)
RUN_MARKERS = ("config.yaml", "metrics.jsonl", LOCK_NAME)


def checkpoint_dirs(output_dir: Path, step: int) -> tuple[Path, Path]:
    """(checkpoint-N, checkpoint-N.tmp): where step N's checkpoint ends up and is written first."""
    final = output_dir / f"checkpoint-{step}"
    return final, final.with_name(final.name + ".tmp")


def checkpoint_step(path: Path) -> int | None:
    match = _CKPT.match(path.name)
    return int(match.group(1)) if match and path.is_dir() else None


def candidates(output_dir: Path) -> list[Path]:
    """Every checkpoint-N folder (complete or damaged), newest first."""
    if not output_dir.is_dir():
        return []
    found = [(step, p) for p in output_dir.iterdir() if (step := checkpoint_step(p)) is not None]
    return [p for _, p in sorted(found, reverse=True)]


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Checkpoints with a manifest (written completely), oldest first."""
    return [p for p in reversed(candidates(output_dir)) if (p / MANIFEST).is_file()]


def checkpoint_around(path: Path) -> Path | None:
    """The nearest folder at or above `path` named as a checkpoint (checkpoint-N, .tmp, .damaged,
    .foreign) that holds a manifest or sits in a run folder (even one not written yet)."""
    for folder in [path.absolute(), *path.absolute().parents]:
        if _ANY_CKPT.match(folder.name) and (
                (folder / MANIFEST).is_file() or is_run_folder(folder.parent)):
            return folder
    return None


def is_run_folder(folder: Path) -> bool:
    return any((folder / name).exists() for name in RUN_MARKERS)
