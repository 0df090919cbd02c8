"""`model.device` as a torch device, importable without transformers (config validation uses it).

Deliberately simple: one device per run; 'auto' is the first CUDA GPU when there is one.
"""

from __future__ import annotations

import torch


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
