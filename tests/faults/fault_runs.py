"""What the fault tests share (a module of its own: every test folder has a conftest, so none can
be imported by that name): the run's settings, the policies each case runs with, signal codes."""

from __future__ import annotations

import signal
from pathlib import Path

import fault_harness

HARNESS = Path(fault_harness.__file__)
NUM_STEPS = 6
POLICIES = {  # every policy, and length_aware with each predictor training can use
    "continuous": [], "full": ["--sampling.policy", "full"],
    "rounds": ["--sampling.policy", "rounds"],
    "length_aware-online": ["--sampling.policy", "length_aware", "--sampling.predictor", "online"],
    "length_aware-none": ["--sampling.policy", "length_aware", "--sampling.predictor", "none"],
    "length_aware-hidden": ["--sampling.policy", "length_aware", "--sampling.predictor", "hidden",
                            "--sampling.predictor_prefix_tokens", "2"],  # parks every step
    # probes of 3 tokens in about the budget of g = 4 whole samples beside two ~13-token prompts:
    # all 8 at once, and the ones that reach 3 tokens without room parked
    "probe-online": ["--sampling.policy", "probe", "--sampling.predictor", "online",
                     "--sampling.probe_tokens", "3", "--sampling.kv_budget", "80"],
}


def run_args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    """`infsamp train` on the tiny model: 6 steps, checkpoints every 2 (two kept), eval every 3."""
    settings = {
        "model.name_or_path": model_dir, "model.attn_implementation": "eager",
        "data.num_train_examples": 40, "data.num_eval_examples": 4, "eval.num_problems": 4,
        "eval.every_steps": 3, "eval.max_new_tokens": 8,
        "rewards.functions": f"format,{HARNESS}:length_reward", "sampling.num_generations": 4,
        "sampling.max_new_tokens": 12, "sampling.micro_group": 4, "sampling.kv_budget": 4096,
        "training.max_steps": NUM_STEPS, "training.prompts_per_step": 2,
        "training.learning_rate": 1e-2,
        "training.warmup_ratio": 0.0, "checkpointing.save_every": 2, "checkpointing.keep_last": 2,
        "logging.output_dir": out, "logging.progress_bar": False, "logging.plot": False,
    }
    flags = [item for key, value in settings.items() for item in (f"--{key}", str(value))]
    return ["train", *flags, *extra]


SIGKILLED = -signal.SIGKILL
