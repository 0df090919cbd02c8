"""`model.device` as a torch device, the dtypes a setting names, and the model under a peft
wrapper: importable without transformers (config validation and the engines use them).

Deliberately simple: one device per run; 'auto' is the first CUDA GPU when there is one.
"""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def base_model(model):
    """The transformers model itself: a peft model's base, or `model` when it has no adapters."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
