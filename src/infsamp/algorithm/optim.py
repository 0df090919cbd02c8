"""Optimizers (a small registry) chosen with the precision mode, and the learning-rate schedule.

Which implementation runs, by optimizer and by the dtype of the trainable parameters:

    optimizer   fp32 parameters (fp32, mixed, LoRA)   bf16 parameters (bf16 / bf16_lossy)
    adamw       torch AdamW                           torchao _AdamW, stochastic rounding
                                                      (bf16_lossy: torch AdamW, loses updates)
    adamw8bit   bitsandbytes on CUDA, else torchao    torchao AdamW8bit, stochastic rounding
    sgd         torch SGD                             torch-optimi SGD, Kahan-compensated

For `bf16` AdamW, torchao's stochastic rounding was chosen over torch-optimi's Kahan summation by
measurement (docs/benchmarks/memory.md, "Precision modes"): its applied update follows the fp32
run from the first steps (follow ratio 0.97 at 10 steps, 0.99 at 300; Kahan 0.07 and 0.95: its
bf16 buffer carries over late and rounds itself) and it keeps 4 bytes of state per parameter
instead of 6. It costs a torch.compile of its step per tensor shape (once) and 1.7x the
optimizer's CPU time on the embedded model. torchao has no SGD: bf16 SGD keeps its updates in
torch-optimi's Kahan buffer. The schedule is transformers' `get_scheduler`.

Deliberately simple: one parameter group (no per-layer learning rates).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from infsamp.config_algorithm import TrainingConfig
from infsamp.errors import InfsampError
from infsamp.planner.precisions import PRECISIONS, PrecisionMode

EPS = 1e-8  # torch's AdamW default, for every implementation: the modes compare like for like
LOW_PRECISION = (torch.bfloat16, torch.float16)


def _adam_settings(cfg: TrainingConfig) -> dict:
    return dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=EPS,
                weight_decay=cfg.weight_decay)


def _adamw(params, cfg: TrainingConfig, keep_updates: bool, device: torch.device):
    if keep_updates:
        from torchao.optim import _AdamW  # torchao's documented entry for bf16 stochastic rounding

        return _AdamW(params, **_adam_settings(cfg), bf16_stochastic_round=True)
    return torch.optim.AdamW(params, **_adam_settings(cfg))


def _adamw8bit(params, cfg: TrainingConfig, keep_updates: bool, device: torch.device):
    low = any(p.dtype in LOW_PRECISION for p in params)
    if device.type == "cuda" and not low:
        try:
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(params, **_adam_settings(cfg))
        except ImportError:
            pass  # torchao below
    try:
        from torchao.optim import AdamW8bit
    except ImportError:
        raise InfsampError("training.optimizer adamw8bit: needs torchao here "
                           "(pip install 'infsamp[lowprec]')") from None
    return AdamW8bit(params, **_adam_settings(cfg), bf16_stochastic_round=keep_updates)


def _sgd(params, cfg: TrainingConfig, keep_updates: bool, device: torch.device):
    if keep_updates:
        from optimi import SGD

        return SGD(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, kahan_sum=True)
    return torch.optim.SGD(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": _adamw, "adamw8bit": _adamw8bit, "sgd": _sgd}


def build_optimizer(model: torch.nn.Module, cfg: TrainingConfig,
                    precision: PrecisionMode | None = None) -> torch.optim.Optimizer:
    """The optimizer of the trainable parameters; one that keeps bf16 updates when the mode asks
    for it and the parameters are bf16 (LoRA adapters are fp32 and need nothing)."""
    precision = precision or PRECISIONS["fp32"]
    params = [p for p in model.parameters() if p.requires_grad]
    keep_updates = precision.keeps_updates and any(p.dtype in LOW_PRECISION for p in params)
    device = params[0].device if params else torch.device("cpu")
    return OPTIMIZERS[cfg.optimizer](params, cfg, keep_updates, device)


def schedule_horizon(cfg: TrainingConfig) -> dict[str, int | str]:
    """What the learning-rate schedule is built from (a checkpoint records it; resumes reuse it)."""
    return {"lr_scheduler": cfg.lr_scheduler, "learning_rate": cfg.learning_rate,
            "warmup_ratio": cfg.warmup_ratio, "num_training_steps": cfg.max_steps,
            "num_warmup_steps": int(round(cfg.warmup_ratio * cfg.max_steps))}


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainingConfig,
                    horizon: dict[str, int | str] | None = None):
    """transformers' schedule over `horizon` (default: this config's max_steps and warmup)."""
    from transformers import get_scheduler  # imported when a run builds its schedule

    horizon = horizon or schedule_horizon(cfg)
    try:
        return get_scheduler(str(horizon["lr_scheduler"]), optimizer,
                             num_warmup_steps=int(horizon["num_warmup_steps"]),
                             num_training_steps=int(horizon["num_training_steps"]))
    except ValueError as err:
        raise InfsampError(f"training.lr_scheduler {cfg.lr_scheduler!r}: "
                           f"{str(err).splitlines()[0]}") from None
