"""Damaged checkpoints fall back to the newest one that verifies; crafted pickles never run."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fault_runs import run_args
from test_kill_resume import assert_same_run

SRC = Path(__file__).resolve().parents[2] / "src"


def rehash(checkpoint: Path, name: str) -> None:
    """Update the manifest for a file changed on purpose (so the deeper check is what fires)."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    data = (checkpoint / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def nan_weight(checkpoint: Path) -> None:
    path = checkpoint / "model" / "model.safetensors"
    tensors = load_file(str(path))
    key = sorted(tensors)[0]
    tensors[key].view(-1)[0] = float("nan")
    save_file(tensors, str(path), metadata={"format": "pt"})
    rehash(checkpoint, "model/model.safetensors")


def bad_json(checkpoint: Path) -> None:
    (checkpoint / "training_state.json").write_text('{"step": 6, "optimizer": ')
    rehash(checkpoint, "training_state.json")


def edit_state(change):
    """Edit training_state.json by hand, hashes updated (issue 32: each resumed silently)."""
    def edit(checkpoint: Path) -> None:
        path = checkpoint / "training_state.json"
        tree = json.loads(path.read_text())
        change(tree)
        path.write_text(json.dumps(tree))
        rehash(checkpoint, "training_state.json")
    return edit


def edit_manifest(change):
    def edit(checkpoint: Path) -> None:
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        change(manifest)
        (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    return edit


def _nan_learning_rate(tree: dict) -> None:
    tree["optimizer"]["param_groups"][0]["lr"] = float("nan")


STATE = "training_state.safetensors"
DAMAGE = {  # how checkpoint-6 is damaged -> words the skip line must contain
    "truncated weights": (lambda c: truncate(c / "model" / "model.safetensors"), "truncated"),
    "deleted state": (lambda c: (c / STATE).unlink(), f"{STATE} is missing"),
    "deleted manifest": (lambda c: (c / "manifest.json").unlink(), "no manifest.json"),
    "altered byte": (lambda c: flip_byte(c / STATE), "differs from its sha256"),
    "invalid state json": (bad_json, "training_state.json cannot be read"),
    "NaN weight": (nan_weight, "NaN or inf"),
    # edited by hand, hashes updated (issue 32): a NaN learning rate trained NaN weights a step
    # later; a step 'two' was a traceback; the rest resumed as if nothing had happened
    "NaN learning rate": (edit_state(_nan_learning_rate),
                          "optimizer.param_groups[0].lr is not a finite number"),
    "inf in the scheduler": (edit_state(lambda t: t["scheduler"].update(_last_lr=[float("inf")])),
                             "scheduler._last_lr[0] is not a finite number"),
    "step 'two' in the state": (edit_state(lambda t: t.update(step="two")),
                                "training_state.json is at step 'two', its manifest at step 6"),
    # the data position and the run's sizes, edited by hand (hashes updated): each resumed
    "data position beyond the dataset": (edit_state(lambda t: t["data"].update(position=10**6)),
                                         "data.position 1000000 is not an integer in [0, 40]"),
    "negative data position": (edit_state(lambda t: t["data"].update(position=-3)),
                               "data.position -3 is not an integer in [0, 40]"),
    "non-integer data position": (edit_state(lambda t: t["data"].update(position=2.5)),
                                  "data.position 2.5 is not an integer in [0, 40]"),
    "negative micro group": (edit_state(lambda t: t["counters"]["sizes"].update(micro_group=-1)),
                             "counters.sizes.micro_group -1 is not an integer in [0, 4096]"),
    "huge micro group": (edit_state(lambda t: t["counters"]["sizes"].update(micro_group=10**9)),
                         "counters.sizes.micro_group 1000000000 is not an integer in [0, 4096]"),
    "non-integer micro group": (edit_state(lambda t: t["counters"]["sizes"].update(
        micro_group=2.5)), "counters.sizes.micro_group 2.5 is not an integer in [0, 4096]"),
    "zero training micro-batch": (edit_state(lambda t: t["counters"]["sizes"].update(
        train_micro_batch_tokens=0)), "counters.sizes.train_micro_batch_tokens 0 is not an "
        "integer in [1, 4294967295]"),
    "negative training micro-batch": (edit_state(lambda t: t["counters"]["sizes"].update(
        train_micro_batch_tokens=-64)), "train_micro_batch_tokens -64 is not an integer"),
    "huge training micro-batch": (edit_state(lambda t: t["counters"]["sizes"].update(
        train_micro_batch_tokens=2**40)), "train_micro_batch_tokens 1099511627776 is not an"),
    "manifest of another step": (edit_manifest(lambda m: m.update(step=4)),
                                 "its manifest is step 4's (copied or renamed"),
    "manifest of another format": (edit_manifest(lambda m: m.update(format=9)),
                                   "manifest.json is not a valid manifest"),
    "a file taken out of the manifest": (edit_manifest(lambda m: m["files"].pop(
        "model/config.json")), "holds model/config.json, which its manifest does not list"),
}


def skip_line(output: str, name: str) -> str:
    return next(line for line in output.splitlines() if line.startswith(f"skipping {name}: "))


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_newest_checkpoint_falls_back(runner, reference, tiny_model_dir, tmp_path, damage):
    out = tmp_path / "run"
    shutil.copytree(reference("continuous"), out)  # checkpoint-4 and checkpoint-6
    harm, words = DAMAGE[damage]
    harm(out / "checkpoint-6")
    code, output = runner.run(run_args(tiny_model_dir, out, "--resume"))
    assert code == 0, output
    assert words in skip_line(output, "checkpoint-6")
    assert "resuming from" in output and "(step 4)" in output
    assert (out / "checkpoint-6.damaged").is_dir()  # kept for inspection, never deleted
    assert_same_run(out, reference("continuous"))


def test_no_checkpoint_verifies_is_one_line_and_exit_2(runner, reference, tiny_model_dir,
                                                      tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference("continuous"), out)
    truncate(out / "checkpoint-6" / STATE)
    (out / "checkpoint-4" / "model" / "model.safetensors").unlink()
    code, output = runner.run(run_args(tiny_model_dir, out, "--resume"))
    assert code == 2
    assert output.splitlines()[-1].startswith("infsamp train: error: nothing to resume from:")
    assert "--checkpointing.resume auto" in output and "Traceback" not in output


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def old_format(checkpoint: Path, evil: bytes) -> None:
    """What infsamp wrote before: training_state.pt (torch.save: a pickle), and a pickled .bin."""
    (checkpoint / "model").mkdir(parents=True)
    (checkpoint / "training_state.pt").write_bytes(evil)
    (checkpoint / "model" / "pytorch_model.bin").write_bytes(evil)


def behind_valid_hash(name: str):
    def craft(checkpoint: Path, evil: bytes) -> None:
        shutil.copytree(checkpoint.parent / "checkpoint-6", checkpoint)
        (checkpoint / name).write_bytes(evil)
        rehash(checkpoint, name)
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        manifest["step"] = 9  # its own step's (a copy of another step's is refused as such)
        (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    return craft


CRAFTED = {"old format": (old_format, "is a pickle and is not loaded"),
           "state tensors": (behind_valid_hash(STATE), "not a readable safetensors"),
           "state json": (behind_valid_hash("training_state.json"), "cannot be read"),
           "weights": (behind_valid_hash("model/model.safetensors"), "not a readable safetensors")}


@pytest.mark.parametrize("crafted", CRAFTED)
def test_a_crafted_pickle_is_never_executed(runner, reference, tiny_model_dir, tmp_path, crafted):
    live = tmp_path / "payload-is-live"
    torch.load(_saved(Payload(live), tmp_path / "live.pt"), weights_only=False)
    assert live.exists()  # the payload runs a shell command when unpickled (the old loader did)...
    marker, out = tmp_path / "executed", tmp_path / "run"
    shutil.copytree(reference("continuous"), out)
    craft, words = CRAFTED[crafted]
    craft(out / "checkpoint-9", _saved(Payload(marker), tmp_path / "evil.pt").read_bytes())
    code, output = runner.run(run_args(tiny_model_dir, out, "--resume"))
    assert code == 0, output
    assert words in skip_line(output, "checkpoint-9")
    assert "resuming from" in output
    assert not marker.exists()  # ...and resuming past the crafted checkpoint never ran it


def _saved(obj, path: Path) -> Path:
    torch.save(obj, path)
    return path


def test_no_code_path_can_unpickle():
    """The second proof: nothing under src/ calls torch.load or the pickle module."""
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"torch\.load\(|import pickle|from pickle|pickle\.load", text), path
