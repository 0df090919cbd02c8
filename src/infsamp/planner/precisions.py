"""Precision modes (the registry of names): which dtype each tensor of a training run is kept in.

    mode        weights        grads  AdamW states  updates              matmuls  AdamW B/param
    fp32        fp32           fp32   fp32          exact                fp32     4 + 4 + 8 = 16
    mixed       fp32 (master)  fp32   fp32          exact                bf16 *   4 + 4 + 8 (+2)
    bf16        bf16           bf16   bf16          stochastic rounding  bf16     2 + 2 + 4 = 8
    bf16_lossy  bf16           bf16   bf16          round to nearest     bf16     2 + 2 + 4 = 8
    (* autocast, which adds 2 bytes of bf16 weight copies while a forward/backward runs)

With LoRA the adapters and their optimizer states are fp32 in every mode; the frozen base is fp32
in `fp32` mode and bf16 in the others (or NF4 with `model.load_in_4bit`). `auto` is fp32 on a CPU
and bf16 on a GPU: of the modes whose updates follow an fp32 run (docs/benchmarks/memory.md,
"Precision modes"), bf16 needs the fewest bytes. `bf16_lossy` is the negative control: most
updates round away.

Pure Python, shared by the planner (bytes) and `infsamp.models.precision` (dtypes, autocast,
checks). Deliberately simple: bf16 is the only 16-bit type (no fp16 and its loss scaling).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrecisionMode:
    name: str
    weights: str  # dtype of the trained weights in full fine-tuning (fp32 | bf16)
    lora_base: str  # dtype of the frozen base under LoRA
    compute: str  # dtype matmuls and activations run in
    autocast: bool  # fp32 weights computed in bf16 through torch.autocast
    keeps_updates: bool  # bf16 weights get updates that are not rounded away (stochastic rounding)
    summary: str
    warning: str = ""


PRECISIONS: dict[str, PrecisionMode] = {mode.name: mode for mode in (
    PrecisionMode("fp32", "fp32", "fp32", "fp32", autocast=False, keeps_updates=False,
                  summary="fp32 weights, gradients, optimizer states and compute"),
    PrecisionMode("mixed", "fp32", "bf16", "bf16", autocast=True, keeps_updates=False,
                  summary="fp32 master weights and optimizer states, bf16 autocast compute"),
    PrecisionMode("bf16", "bf16", "bf16", "bf16", autocast=False, keeps_updates=True,
                  summary="bf16 weights and states, stochastically rounded updates (torchao)"),
    PrecisionMode("bf16_lossy", "bf16", "bf16", "bf16", autocast=False, keeps_updates=False,
                  summary="bf16 weights, plain AdamW",
                  warning="training.precision bf16_lossy: plain AdamW on bf16 weights rounds most "
                          "updates away at GRPO learning rates; use bf16 or mixed"),
)}
DEFAULT_PRECISION = {"cuda": "bf16", "cpu": "fp32"}  # what `auto` means on each device


def resolve_precision_name(name: str, device_type: str) -> str:
    """'auto' -> the device's default; any other name is returned as is."""
    return DEFAULT_PRECISION.get(device_type, "fp32") if name == "auto" else name


def base_dtype(mode: PrecisionMode, lora: bool) -> str:
    """dtype of the model's own weights: trained (full fine-tuning) or the frozen base (LoRA)."""
    return mode.lora_base if lora else mode.weights
