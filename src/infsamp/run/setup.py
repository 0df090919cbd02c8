"""What the trainer does once before a run: load the reward functions first, warn about settings
that are valid but almost certainly not meant, choose the CPU thread count, seed every RNG.

Deliberately simple: plain functions of the config; nothing here holds state.
"""

from __future__ import annotations

import random
import sys

import numpy as np
import torch

from infsamp.config import Config
from infsamp.errors import RewardError
from infsamp.models.loading import resolve_device, resolve_dtype
from infsamp.rewards.loading import load_reward_functions
from infsamp.algorithm.grpo_step import DEFAULT_MICRO_BATCH_TOKENS


def load_rewards(cfg: Config):
    """The reward functions (reward models on the run's device), before anything else loads."""
    device = resolve_device(cfg.model.device)
    try:
        funcs = load_reward_functions(
            cfg.rewards.functions, cfg.rewards.format_think_block, device=device,
            dtype=resolve_dtype(cfg.model.dtype, device),
            max_tokens=cfg.training.train_micro_batch_tokens or DEFAULT_MICRO_BATCH_TOKENS,
            trust_remote_code=cfg.model.trust_remote_code)
    except RewardError as err:
        named = str(err).startswith("rewards.functions")
        raise (err if named else RewardError(f"rewards.functions: {err}")) from None
    return funcs


def warn_about_settings(cfg: Config) -> None:
    """Settings that are valid but almost certainly not meant."""
    if cfg.sampling.temperature == 0:
        print("warning: sampling.temperature 0 decodes greedily: every completion of a group is "
              "the same, rewards have no spread and GRPO learns nothing", file=sys.stderr)




SMALL_MODEL_PARAMETERS = 50_000_000


def set_num_threads(num_threads: int, model, device: torch.device) -> None:
    """0 = auto: one thread for a small model on CPU (its ops are too small to split; measured
    faster)."""
    if num_threads == 0 and device.type == "cpu":
        small = sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMETERS
        num_threads = 1 if small else 0
    if num_threads:
        torch.set_num_threads(num_threads)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
