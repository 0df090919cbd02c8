"""What the trainer does once before a run: check what the config needs of this machine, load the
reward functions first, warn about settings that are valid but almost certainly not meant, choose
the CPU thread count, seed every RNG.

Deliberately simple: plain functions of the config; nothing here holds state.
"""

from __future__ import annotations

import random
import sys

import numpy as np
import torch

from infsamp.algorithm.grpo_step import DEFAULT_MICRO_BATCH_TOKENS
from infsamp.config import Config
from infsamp.errors import RewardError
from infsamp.models.device import check_device
from infsamp.models.loading import check_lora_targets, resolve_device, resolve_dtype
from infsamp.models.precision import resolve_precision
from infsamp.planner.precisions import PrecisionMode
from infsamp.rewards.loading import load_reward_functions
from infsamp.run.trackers import check_trackers_installed


def check_environment(cfg: Config, device: torch.device) -> PrecisionMode:
    """What the config asks of this machine, before anything loads: the CUDA device, the trackers'
    clients, the LoRA targets among the model's layers; and the precision mode, resolved here once
    for the run (`auto` -> the device's default, then its own checks)."""
    check_device(cfg.model)
    check_trackers_installed(cfg.logging.report_to)
    check_lora_targets(cfg.model)
    return resolve_precision(cfg, device)


def load_rewards(cfg: Config):
    """The reward functions (reward models on the run's device), before anything else loads."""
    device = resolve_device(cfg.model.device)
    try:
        funcs = load_reward_functions(
            cfg.rewards.functions, cfg.rewards.format_think_block, cfg.rewards.answer_extraction,
            device=device,
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
