"""Checkpoints that hold data only, are written atomically and are verified before they are used.

    checkpoint-N/
      model/                      a standard `save_pretrained` folder: weights (or LoRA adapters)
                                  in safetensors, config, tokenizer (what `infsamp export` reads)
      training_state.safetensors  every other tensor: optimizer states, torch RNG states
      training_state.json         everything else: step, data position, schedule, counters, the
                                  optimizer's and scheduler's structure, python/numpy RNG states,
                                  the length predictor, what the run is (model, LoRA rank)
      manifest.json               bytes and sha256 of each file above; written last

Writing goes to `checkpoint-N.tmp/`, every file is fsynced, and the folder is renamed to
`checkpoint-N/` only when complete; a failure (a full disk) removes the `.tmp` folder and leaves
earlier checkpoints as they were. Loading checks the manifest (a truncated, deleted or altered file
is caught), reads tensors with safetensors and the rest as JSON (nothing is unpickled), and refuses
NaN or inf in any tensor.
`find_resume_point` walks back from the newest checkpoint to the newest one that verifies. A run
replaces or prunes only checkpoints it wrote (`is_own_checkpoint`: a manifest of the folder's own
step); a folder the user made under a checkpoint's name is renamed `checkpoint-N.foreign`.
The folders' names and which are complete (a manifest) are `checkpoint_folders.py`'s, read here
and by the rank watcher alike.

Deliberately simple: one process writes (with several ranks, the others add their shard files
through `write_extra` before the manifest); sha256 re-reads every file once at save and once at
load.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from infsamp.checkpoint_folders import (
    MANIFEST,
    candidates,
    checkpoint_dirs,
    checkpoint_step,
    list_checkpoints,
)
from infsamp.errors import CheckpointError, NonFiniteError, first_non_finite
from infsamp.files import fsync
from infsamp.run.state_data import bad_run_size, from_data, to_data

STATE_JSON = "training_state.json"
STATE_TENSORS = "training_state.safetensors"
MODEL_DIR = "model"
FORMAT = 2


@dataclass
class Checkpoint:
    path: Path
    step: int
    state: dict[str, Any]  # training_state.json with its tensors restored
    model_tensors: dict[str, torch.Tensor]  # the weights (or adapters) in model/


# ---------------------------------------------------------------- writing


def save_checkpoint(output_dir: Path, step: int, *, model, tokenizer, state: dict[str, Any],
                    keep_last: int | None = None, keep_step: int | None = None,
                    write_extra: Callable[[Path], None] | None = None) -> Path:
    """Write checkpoint-`step` atomically (see module docstring); returns its path. Then prune to
    the `keep_last` newest, and checkpoint-`keep_step` (the best evaluation's) whatever its age.
    `write_extra(tmp)` adds files before the manifest (other ranks' shards: rank_checkpoint.py)."""
    final, tmp = checkpoint_dirs(output_dir, step)
    tree, tensors = to_data({"format": FORMAT, "step": step, **state})
    _refuse_non_finite(step, dict(model.named_parameters()), tensors)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        _write_folder(tmp, model, tokenizer, tree, tensors, write_extra)
        _replace_folder(tmp, final)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError) or type(err).__name__ == "SafetensorError":
            raise CheckpointError(_write_failure(output_dir, final.name, err)) from None
        raise
    if keep_last:
        prune(output_dir, keep_last, keep_step)
    return final


def _write_folder(tmp: Path, model, tokenizer, tree: dict[str, Any],
                  tensors: dict[str, torch.Tensor], write_extra=None) -> None:
    from safetensors.torch import save_file

    tmp.mkdir(parents=True)
    if write_extra is not None:
        write_extra(tmp)
    model.save_pretrained(tmp / MODEL_DIR, safe_serialization=True)
    tokenizer.save_pretrained(tmp / MODEL_DIR)
    save_file(tensors, str(tmp / STATE_TENSORS))
    (tmp / STATE_JSON).write_text(json.dumps(tree))
    files = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(tmp.rglob("*")) if p.is_file()}
    manifest = {"format": FORMAT, "step": tree["step"], "files": files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    for path in [*tmp.rglob("*"), tmp]:
        fsync(path)


def _replace_folder(tmp: Path, final: Path) -> None:
    """Rename tmp -> final; an existing final (the same step saved again) is set aside first.
    A `checkpoint-N` this run did not write (no manifest of step N: a folder the user made) is
    renamed `checkpoint-N.foreign` instead, with one line: a run deletes only what it wrote."""
    old = final.with_name(final.name + ".old")
    if final.exists() and not is_own_checkpoint(final):
        kept = set_aside(final, ".foreign")
        print(f"{final} was not written by this run (no manifest of step "
              f"{final.name.rsplit('-', 1)[-1]}): renamed to {kept.name} (kept)", file=sys.stderr)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _refuse_non_finite(step: int, weights: dict[str, torch.Tensor],
                       tensors: dict[str, torch.Tensor]) -> None:
    bad = first_non_finite(weights) or first_non_finite(tensors)
    if bad is not None:
        raise NonFiniteError(f"step {step}: {bad} holds NaN or inf; the checkpoint is not written "
                             "(lower training.learning_rate or check the rewards)")


def _write_failure(output_dir: Path, name: str, err: BaseException) -> str:
    code = re.search(r"os error (\d+)", str(err))  # safetensors wraps the OS error in its own
    why = getattr(err, "strerror", None) or \
        (os.strerror(int(code.group(1))) if code else str(err).splitlines()[0])
    previous = list_checkpoints(output_dir)
    kept = f"{previous[-1].name} is intact" if previous else "no earlier checkpoint"
    return f"cannot write {name} in {output_dir}: {why} (removed the partial {name}.tmp; {kept})"


def _sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


# ---------------------------------------------------------------- finding and pruning


def is_own_checkpoint(path: Path) -> bool:
    """A checkpoint folder infsamp wrote: its manifest is readable and names its own step (a
    folder the user made or copied under another step's name is not)."""
    try:
        return _read_manifest(path)["step"] == checkpoint_step(path)
    except (CheckpointError, KeyError, TypeError):
        return False


def prune(output_dir: Path, keep_last: int, keep_step: int | None = None) -> None:
    """Remove the run's own complete checkpoints older than the `keep_last` newest, but
    checkpoint-`keep_step` (the best evaluation's, `checkpointing.keep_best`)."""
    own = [p for p in list_checkpoints(output_dir) if is_own_checkpoint(p)]
    for old in own[:-keep_last]:
        if checkpoint_step(old) != keep_step:
            shutil.rmtree(old, ignore_errors=True)


def find_resume_point(output_dir: Path, on_skip: Callable[[Path, str], None]) -> Checkpoint | None:
    """The newest checkpoint that verifies; `on_skip(path, reason)` for each newer one."""
    for path in candidates(output_dir):
        try:
            return load_checkpoint(path)
        except CheckpointError as err:
            on_skip(path, str(err))
    return None


def set_aside(path: Path, suffix: str = ".damaged") -> Path:
    """Rename a damaged checkpoint to checkpoint-N.damaged[-k]: kept to inspect, never loaded."""
    target, k = path.with_name(path.name + suffix), 1
    while target.exists():
        target, k = path.with_name(f"{path.name}{suffix}-{k}"), k + 1
    os.replace(path, target)
    return target


# ---------------------------------------------------------------- loading


def verify_checkpoint(path: Path) -> None:
    """Every file the manifest lists is there, whole and unaltered, and it lists every file; a
    checkpoint-N's manifest is step N's; CheckpointError says why not."""
    manifest = _read_manifest(path)
    named = checkpoint_step(path)
    if named is not None and manifest["step"] != named:
        raise CheckpointError(f"{path}: its manifest is step {manifest['step']}'s (copied or "
                              "renamed from another checkpoint)")
    for name, entry in manifest["files"].items():
        _verify_file(path, name, entry)
    unlisted = sorted(str(p.relative_to(path)) for p in path.rglob("*")
                      if p.is_file() and p.name != MANIFEST
                      and str(p.relative_to(path)) not in manifest["files"])
    if unlisted:
        raise CheckpointError(f"{path}: holds {unlisted[0]}, which its manifest does not list "
                              "(edited by hand, or added after saving)")


def newest_verified(output_dir: Path, on_skip: Callable[[Path, str], None]) -> Path | None:
    """The newest checkpoint folder that verifies (weights not read); `on_skip` for newer ones."""
    for path in candidates(output_dir):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as err:
            on_skip(path, str(err))
    return None


def load_checkpoint(path: Path) -> Checkpoint:
    """Verify and read a checkpoint; CheckpointError says why it cannot be used."""
    verify_checkpoint(path)
    tensors = read_tensors(path / STATE_TENSORS)
    try:
        tree = json.loads((path / STATE_JSON).read_text())
        state = from_data(tree, tensors)
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: {STATE_JSON} cannot be read ({err})") from None
    model_tensors: dict[str, torch.Tensor] = {}
    for file in sorted((path / MODEL_DIR).glob("*.safetensors")):
        model_tensors.update(read_tensors(file))
    if not model_tensors:
        raise CheckpointError(f"{path}: no weights in {MODEL_DIR}/")
    _check_state(path, state)
    return Checkpoint(path, state["step"], state, model_tensors)


def _check_state(path: Path, state: dict[str, Any]) -> None:
    """The state names the manifest's step, and the optimizer's and scheduler's numbers are
    finite (a NaN learning rate trains to NaN weights a step later)."""
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step != _read_manifest(path)["step"]:
        raise CheckpointError(f"{path}: {STATE_JSON} is at step {step!r}, its manifest at step "
                              f"{_read_manifest(path)['step']}")
    for part in ("optimizer", "scheduler"):
        where = _non_finite_number(state.get(part), part)
        if where is not None:
            raise CheckpointError(f"{path}: {STATE_JSON}: {where} is not a finite number")
    bad_size = bad_run_size(state)
    if bad_size is not None:
        raise CheckpointError(f"{path}: {STATE_JSON}: {bad_size} (edited by hand?)")


def _non_finite_number(value: Any, where: str) -> str | None:
    """Where in a nested state a float is NaN or inf (tensors are checked when read)."""
    if isinstance(value, float):
        return None if math.isfinite(value) else where
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        found = _non_finite_number(item, f"{where}.{key}" if isinstance(key, str)
                                   else f"{where}[{key}]")
        if found is not None:
            return found
    return None


def _read_manifest(path: Path) -> dict[str, Any]:
    if not (path / MANIFEST).is_file():
        old = " (written by an older infsamp: its training_state.pt is a pickle and is not " \
            "loaded)" if (path / "training_state.pt").exists() else ""
        raise CheckpointError(f"{path}: no {MANIFEST}, the checkpoint is incomplete{old}")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files, step = manifest["files"], manifest["step"]
        if not isinstance(files, dict) or STATE_JSON not in files or STATE_TENSORS not in files:
            raise ValueError("files missing")
        if manifest["format"] != FORMAT or not isinstance(step, int) or isinstance(step, bool):
            raise ValueError("another format")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: {MANIFEST} is not a valid manifest") from None
    return manifest


def _verify_file(path: Path, name: str, entry: dict[str, Any]) -> None:
    file = path / name
    if ".." in Path(name).parts or not file.is_file():
        raise CheckpointError(f"{path}: {name} is missing")
    size = file.stat().st_size
    if size != entry.get("bytes"):
        raise CheckpointError(f"{path}: {name} has {size} bytes, the manifest says "
                              f"{entry.get('bytes')} (truncated or replaced)")
    if _sha256(file) != entry.get("sha256"):
        raise CheckpointError(f"{path}: {name} differs from its sha256 in the manifest "
                              "(altered after saving)")


def read_tensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(file))
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error type
        why = str(err).splitlines()[0]
        raise CheckpointError(f"{file}: not a readable safetensors file ({why})") from None
    bad = first_non_finite(tensors)
    if bad is not None:
        raise CheckpointError(f"{file}: tensor {bad!r} holds NaN or inf")
    return tensors
