"""`model.device` as a torch device (and the check that this machine has it), its memory, the
dtypes a setting names, and the model under a peft wrapper: importable without transformers (the
engines use them).

Deliberately simple: one device per run; 'auto' is the first CUDA GPU when there is one.
"""

from __future__ import annotations

import os
import re

import torch

from infsamp.config import ModelConfig
from infsamp.options import ConfigError
from infsamp.planner.estimate import kv_bytes_per_token
from infsamp.planner.presets import shape_from_config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def check_device(cfg: ModelConfig) -> None:
    """A CUDA device (or a flash-attention kernel, which needs one) only where one is present."""
    kind, index = re.fullmatch(r"(auto|cpu|cuda)(?::(\d+))?", cfg.device).groups()
    attn = cfg.attn_implementation
    if kind != "cuda" and not attn.startswith("flash_attention"):
        return
    what = f"model.device {cfg.device!r}" if kind == "cuda" else \
        f"model.attn_implementation {attn!r}"
    if not torch.cuda.is_available():
        raise ConfigError(f"{what}: needs a CUDA GPU, and torch sees none (use cpu, sdpa or eager)")
    if int(index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"model.device: this machine has {torch.cuda.device_count()} CUDA "
                          f"device(s) (got {cfg.device!r})")


def model_kv_bytes_per_token(model) -> int:
    """KV bytes of one token for a transformers model (its shape, its parameters' dtype)."""
    model = base_model(model)
    dtype_bytes = next(model.parameters()).element_size()
    return kv_bytes_per_token(shape_from_config(model.config), dtype_bytes)


def is_4bit(model) -> bool:
    return bool(getattr(base_model(model), "is_loaded_in_4bit", False))


def base_model(model):
    """The transformers model itself: a peft model's base, or `model` when it has no adapters."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def memory_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the device's memory: the GPU's, or the machine's RAM on CPU. The
    one reader of free memory (the planner's sizes, vLLM's start-up check)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def resident_bytes() -> int | None:
    """This process's resident set now (Linux: /proc/self/statm); None where it cannot be read."""
    try:
        pages = int(open("/proc/self/statm").read().split()[1])  # noqa: SIM115
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def runtime_bytes(device: torch.device, model: torch.nn.Module,
                  cuda_context_bytes: int) -> int | None:
    """The runtime's resident memory outside the tensors, measured now: what the process holds
    on the device less the tensors it holds there. On the CPU the resident set (Python, torch,
    transformers, the tokenizer, the prompts) less the model's parameters and buffers; on CUDA
    what torch's allocator reserved less what it allocated, plus the CUDA context, which torch
    cannot see (`cuda_context_bytes`, the planner's assumption). None where it cannot be read
    (the planner then assumes its default)."""
    if device.type == "cuda":
        reserved = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return cuda_context_bytes + int(reserved)
    resident = resident_bytes()
    if resident is None:
        return None
    tensors = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
                  if t.device.type == "cpu")
    return max(0, resident - tensors)
