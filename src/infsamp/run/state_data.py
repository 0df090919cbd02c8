"""Training state as data only: nested Python values <-> a JSON tree plus a flat dict of tensors.

A checkpoint holds the optimizer and scheduler state, the RNG states and the trainer's counters.
They are written as JSON (structure, numbers, strings) and one safetensors file (every tensor), so
loading a checkpoint never unpickles anything: a crafted file can at worst fail to parse.

    to_data({"optimizer": opt.state_dict()}) -> (tree, {"state/optimizer/state/0/exp_avg": t, ...})
    from_data(tree, tensors) -> the same value (tuples, int dict keys and numpy arrays restored)

Encoding: a tensor becomes {"__tensor__": key}; a tuple {"__tuple__": [...]}; a dict whose keys are
not all plain strings {"__items__": [[key, value], ...]}; a numpy array {"__ndarray__": list,
"dtype": name}; torchao's quantized optimizer states (8-bit AdamW) {"__subclass__": class name,
"inner": its plain tensors, "attributes": [...]}, rebuilt by the class's own `__tensor_unflatten__`
(only the classes in `QUANTIZED_STATES`). Anything that is not data (a function, any other object)
is refused at save time.

`bad_run_size(state)` checks the sizes a resume takes from the state as they are (the data
position and epoch, the sampler's g and the training micro-batch): a hand-edited one is named.

Deliberately simple: tensors are moved to the CPU to be written; no sharding.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from infsamp.options import MAX_INTEGER

MARKERS = ("__tensor__", "__tuple__", "__items__", "__ndarray__", "__subclass__", "__dtype__")
QUANTIZED_STATES = ("torchao.optim.subclass_8bit.OptimState8bit",
                    "torchao.optim.subclass_4bit.OptimState4bit",
                    "torchao.optim.subclass_fp8.OptimStateFp8")


def to_data(value: Any, path: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON-able tree, tensors by key) for nested dicts, lists, tuples, scalars and tensors."""
    tensors: dict[str, torch.Tensor] = {}
    return _encode(value, path or "state", tensors), tensors


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor) and type(value) is not torch.Tensor \
            and hasattr(value, "__tensor_flatten__"):
        return _encode_quantized(value, path, tensors)
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Tensor):
        if path in tensors:
            raise ValueError(f"{path}: two tensors under one key")
        tensors[path] = value.detach().to("cpu").contiguous()
        return {"__tensor__": path}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and k not in MARKERS for k in value):
            return {k: _encode(v, f"{path}/{k}", tensors) for k, v in value.items()}
        return {"__items__": [[_encode(k, f"{path}/key", tensors),
                               _encode(v, f"{path}/{k}", tensors)] for k, v in value.items()]}
    raise TypeError(f"{path}: {type(value).__name__} is not data "
                    "(checkpoints hold tensors, numbers and strings)")


def _encode_quantized(value: torch.Tensor, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """A quantized optimizer state as its plain inner tensors and its (data) attributes."""
    name = f"{type(value).__module__}.{type(value).__qualname__}"
    if name not in QUANTIZED_STATES:
        raise TypeError(f"{path}: {name} is not data (checkpoints hold tensors, numbers and "
                        "strings)")
    names, attributes = value.__tensor_flatten__()
    inner = {n: _encode(getattr(value, n), f"{path}/{n}", tensors) for n in names}
    return {"__subclass__": name, "inner": inner,
            "attributes": _encode(list(attributes), f"{path}/attributes", tensors)}


def _decode_quantized(tree: dict[str, Any], tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    import importlib

    name = tree["__subclass__"]
    if name not in QUANTIZED_STATES:
        raise ValueError(f"{name}: not a tensor class a checkpoint may rebuild")
    module, _, cls_name = name.rpartition(".")
    cls = getattr(importlib.import_module(module), cls_name)
    inner = {k: from_data(v, tensors) for k, v in tree["inner"].items()}
    return cls.__tensor_unflatten__(inner, from_data(tree["attributes"], tensors), None, None)


def from_data(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `to_data`; a tensor key missing from `tensors` raises KeyError."""
    if isinstance(tree, list):
        return [from_data(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if "__tensor__" in tree:
        return tensors[tree["__tensor__"]]
    if "__subclass__" in tree:
        return _decode_quantized(tree, tensors)
    if "__dtype__" in tree:
        return getattr(torch, tree["__dtype__"])
    if "__tuple__" in tree:
        return tuple(from_data(v, tensors) for v in tree["__tuple__"])
    if "__items__" in tree:
        return {_hashable(from_data(k, tensors)): from_data(v, tensors)
                for k, v in tree["__items__"]}
    if "__ndarray__" in tree:
        return np.asarray(tree["__ndarray__"], dtype=np.dtype(tree["dtype"]))
    return {k: from_data(v, tensors) for k, v in tree.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU, and CUDA where present) global random states."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(tuple(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def bad_run_size(state: dict[str, Any]) -> str | None:
    """'data.position -3 is not an integer in [0, 40]' for the first size a resume would take
    that its run could not have written; None when every one is in range. The position is at
    most the rows the run trained on (its identity's `num_train`, when recorded); g at most the
    KV budget (each sample holds at least one token of it)."""
    data, counters = state.get("data") or {}, state.get("counters") or {}
    sizes = counters.get("sizes") or {}
    num_train = ((state.get("run") or {}).get("data") or {}).get("num_train", MAX_INTEGER)
    budget = sizes.get("kv_budget_tokens")
    max_g = budget if _is_integer(budget) and budget > 0 else MAX_INTEGER
    ranges = {"data.position": (data.get("position"), 0, num_train),
              "data.epoch": (data.get("epoch"), 0, MAX_INTEGER),
              "counters.micro_group": (counters.get("micro_group"), 0, MAX_INTEGER),
              "counters.sizes.micro_group": (sizes.get("micro_group"), 0, max_g),
              "counters.sizes.train_micro_batch_tokens": (sizes.get("train_micro_batch_tokens"),
                                                          1, MAX_INTEGER)}
    for where, (value, low, high) in ranges.items():
        if not (_is_integer(value) and low <= value <= high):
            return f"{where} {value!r} is not an integer in [{low}, {high}]"
    return None


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
