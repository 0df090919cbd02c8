"""Optimizers (a small registry) and the learning-rate schedule.

`adamw` and `sgd` come from torch; `adamw8bit` from bitsandbytes, which needs a CUDA GPU: asking for
it elsewhere ends in one clear error. The schedule is transformers' `get_scheduler`.

Deliberately simple: one parameter group (no per-layer learning rates).
"""

from __future__ import annotations

from typing import Callable

import torch

from infsamp.config import TrainingConfig
from infsamp.errors import InfsampError


def _adamw(params, cfg: TrainingConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             weight_decay=cfg.weight_decay)


def _adamw8bit(params, cfg: TrainingConfig) -> torch.optim.Optimizer:
    if not torch.cuda.is_available():
        raise InfsampError("training.optimizer adamw8bit: bitsandbytes 8-bit AdamW needs a CUDA GPU "
                           "(use adamw on CPU)")
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise InfsampError("training.optimizer adamw8bit: bitsandbytes is not installed "
                           "(pip install 'infsamp[gpu]')") from None
    return bnb.optim.AdamW8bit(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                               weight_decay=cfg.weight_decay)


def _sgd(params, cfg: TrainingConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": _adamw, "adamw8bit": _adamw8bit, "sgd": _sgd}


def build_optimizer(model: torch.nn.Module, cfg: TrainingConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return OPTIMIZERS[cfg.optimizer](params, cfg)


# transformers schedules that need only warmup and total steps -> whether the rate depends on the
# total (a run extended past it would restart or end such a schedule: see `schedule_horizon`)
LR_SCHEDULERS: dict[str, bool] = {
    "linear": True, "cosine": True, "cosine_with_restarts": True, "polynomial": True,
    "constant": False, "constant_with_warmup": False, "inverse_sqrt": False}


def schedule_horizon(cfg: TrainingConfig) -> dict[str, int | str]:
    """What the learning-rate schedule is built from (a checkpoint records it; resumes reuse it)."""
    return {"lr_scheduler": cfg.lr_scheduler, "learning_rate": cfg.learning_rate,
            "warmup_ratio": cfg.warmup_ratio, "num_training_steps": cfg.max_steps,
            "num_warmup_steps": int(round(cfg.warmup_ratio * cfg.max_steps))}


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainingConfig,
                    horizon: dict[str, int | str] | None = None):
    """transformers' schedule over `horizon` (default: this config's max_steps and warmup)."""
    from transformers import get_scheduler  # here: config validation reads LR_SCHEDULERS early

    horizon = horizon or schedule_horizon(cfg)
    try:
        return get_scheduler(str(horizon["lr_scheduler"]), optimizer,
                             num_warmup_steps=int(horizon["num_warmup_steps"]),
                             num_training_steps=int(horizon["num_training_steps"]))
    except ValueError as err:
        raise InfsampError(f"training.lr_scheduler {cfg.lr_scheduler!r}: {str(err).splitlines()[0]}") from None
