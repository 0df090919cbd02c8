"""Each rank's own shard of the weights and the optimizer state (FSDP), as files of a checkpoint.

    checkpoint-N/ranks/rank-R-of-W.json          the shard's tree (`state_data.py`'s data)
    checkpoint-N/ranks/rank-R-of-W.safetensors   its tensors

`local_shards` takes them from the model and optimizer, `write_shard` writes them (fsynced) into
the checkpoint's `.tmp` folder, `load_shards` puts them back on resume.

Deliberately simple: a shard is read back only by the same rank of the same number of ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from infsamp.run import checkpoint as ckpt
from infsamp.run.state_data import from_data, to_data

SHARDS_DIR = "ranks"


def shard_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}"


def local_shards(model: torch.nn.Module, optimizer) -> tuple[Any, dict[str, torch.Tensor]]:
    """This rank's shards of the parameters and the optimizer state, as (JSON tree, tensors)."""
    from torch.distributed.tensor import DTensor

    def local(value: Any) -> Any:
        if isinstance(value, DTensor):
            return value.to_local()
        if isinstance(value, dict):
            return {k: local(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(local(v) for v in value)
        return value

    weights = {name: p.to_local() for name, p in model.named_parameters()}
    return to_data({"weights": weights, "optimizer": local(optimizer.state_dict())}, "shard")


def load_shards(model: torch.nn.Module, optimizer, found: ckpt.Checkpoint, rank: int,
                world_size: int) -> None:
    """The inverse of `local_shards` from checkpoint-N/ranks/ (verified with the manifest)."""
    from torch.distributed.tensor import DTensor

    name = found.path / SHARDS_DIR / shard_name(rank, world_size)
    tensors = ckpt.read_tensors(name.with_suffix(".safetensors"))
    state = from_data(json.loads(name.with_suffix(".json").read_text()), tensors)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, shard in state["weights"].items():
            params[key].to_local().copy_(shard)
    order = [p for group in optimizer.param_groups for p in group["params"]]
    saved = state["optimizer"]
    for index, entry in saved["state"].items():
        param = order[int(index)]
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.shape == param.to_local().shape \
                    and key != "step":
                entry[key] = DTensor.from_local(value.to(param.device), param.device_mesh,
                                                param.placements, run_check=False,
                                                shape=param.shape, stride=param.stride())
    optimizer.load_state_dict(saved)


def write_shard(tmp: Path, shards, rank: int, world_size: int) -> str | None:
    """This rank's shard files in tmp/ranks/ (fsynced); None, or why they could not be written."""
    if shards is None:
        return None
    from safetensors.torch import save_file

    tree, tensors = shards
    base = tmp / SHARDS_DIR / shard_name(rank, world_size)
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(base.with_suffix(".safetensors")))
        base.with_suffix(".json").write_text(json.dumps(tree))
        for file in (base.with_suffix(".safetensors"), base.with_suffix(".json")):
            ckpt.fsync(file)
    except Exception as err:  # noqa: BLE001 - OSError or safetensors' own error
        why = getattr(err, "strerror", None) or err
        return f"rank {rank}: cannot write {base.name}: {why}"
    return None
