"""What the trainer does once before a run: check what the config needs of this machine, load the
reward functions first, warn about settings that are valid but almost certainly not meant, choose
the CPU thread count, seed every RNG, encode the prompts, and build the reference model and the
length predictor.

Deliberately simple: plain functions of the config; nothing here holds state.
"""

from __future__ import annotations

import random
import sys
from copy import deepcopy

import numpy as np
import torch

from infsamp.algorithm.grpo_step import DEFAULT_MICRO_BATCH_TOKENS
from infsamp.config import Config
from infsamp.errors import RewardError
from infsamp.models.device import check_device
from infsamp.models.loading import check_lora_targets, resolve_device, resolve_dtype
from infsamp.models.precision import resolve_precision
from infsamp.options import ConfigError
from infsamp.planner.precisions import PrecisionMode
from infsamp.rewards.loading import load_reward_functions
from infsamp.run.trackers import check_trackers_installed
from infsamp.sampling.predictors import make_predictor
from infsamp.tasks.loading import load_splits
from infsamp.tasks.prompts import EncodedSplit, encode_examples


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
        return load_reward_functions(
            cfg.rewards.functions, cfg.rewards.format_think_block, cfg.rewards.answer_extraction,
            device=device, dtype=resolve_dtype(cfg.model.dtype, device),
            max_tokens=cfg.training.train_micro_batch_tokens or DEFAULT_MICRO_BATCH_TOKENS,
            trust_remote_code=cfg.model.trust_remote_code)
    except RewardError as err:
        named = str(err).startswith("rewards.functions")
        raise (err if named else RewardError(f"rewards.functions: {err}")) from None


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


def load_prompts(cfg: Config, tokenizer,
                 tools: list[dict] | None = None) -> tuple[EncodedSplit, EncodedSplit]:
    """Training and held-out prompts as token ids (offering `tools`, JSON schemas), checked
    against the settings before the weights load; says in the run log which rows evaluate and
    how many prompts were skipped."""
    splits = load_splits(cfg.data, cfg.eval.num_problems)
    train = encode_examples(splits.train, tokenizer, cfg.data, "training prompts", tools)
    held_out = encode_examples(splits.eval, tokenizer, cfg.data, "evaluation prompts",
                               tools) if splits.eval else EncodedSplit([], 0)
    if cfg.training.prompts_per_step > len(train.prompts):
        wanted = cfg.training.prompts_per_step
        raise ConfigError(f"training.prompts_per_step: {wanted} is more than the "
                          f"{len(train.prompts)} training prompts; one step would repeat a "
                          "prompt")
    notes = [*splits.data_notes, splits.eval_note,
             train.note("training", cfg.data.max_prompt_length),
             held_out.note("evaluation", cfg.data.max_prompt_length)]
    print("\n".join(note for note in notes if note))
    return train, held_out


def length_predictor(cfg: Config):
    """The policy's length predictor (length_aware, probe), kept for the run so it learns across
    epochs."""
    from infsamp.sampling.policies import uses_predictor

    if not uses_predictor(cfg.sampling.policy):
        return None
    return make_predictor(cfg.sampling.predictor)  # online or none (Config.validate)


def reference_model(cfg: Config, model):
    """None with beta 0; with LoRA the base with adapters disabled; else a frozen copy."""
    if cfg.training.beta == 0 or cfg.model.lora_rank > 0:
        return None
    ref = deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref
