"""The names the config accepts for each choice, and the few defaults that come with a name.

The registries themselves (loss types, reward scalers, optimizers, schedules, precision modes,
sampling policies, predictors, refill orders, engines, strategies, trackers) live with the code
that implements them, above the config. Each is built over the names declared here, and
`tests/test_choices.py` checks that every registry holds exactly its names: so `config.py` checks
a choice without importing torch or anything above it, and a new entry is added in two places
that a test keeps in step.

Deliberately simple: plain tuples and dicts, no plug-in discovery.
"""

from __future__ import annotations

# algorithm/losses.py LOSS_TYPES; the default clip range (epsilon, epsilon_high) of each loss,
# used where `training.epsilon` / `epsilon_high` are 0 (None: the same as epsilon)
LOSS_CLIP_RANGES: dict[str, tuple[float, float | None]] = {
    "grpo": (0.2, None), "dr_grpo": (0.2, None), "dapo": (0.2, None), "bnpo": (0.2, None),
    "gspo": (3e-4, 4e-4),  # sequence-level ratios sit close to 1 (Qwen's GSPO)
    "cispo": (0.2, 5.0),  # cispo caps the importance weight itself (MiniMax-M1)
}
LOSS_TYPES = tuple(LOSS_CLIP_RANGES)

REWARD_SCALERS = ("group", "batch", "none")  # algorithm/advantages.py
OPTIMIZERS = ("adamw", "adamw8bit", "sgd")  # algorithm/optim.py and planner/estimate.py

# transformers schedules that need only warmup and total steps -> whether the rate depends on the
# total (a run extended past it would restart or end such a schedule: see optim.schedule_horizon)
LR_SCHEDULERS: dict[str, bool] = {
    "linear": True, "cosine": True, "cosine_with_restarts": True, "polynomial": True,
    "constant": False, "constant_with_warmup": False, "inverse_sqrt": False}

PRECISIONS = ("fp32", "mixed", "bf16", "bf16_lossy")  # planner/precisions.py
PRECISION_CHOICES = ("auto", *PRECISIONS)

POLICIES = ("full", "rounds", "continuous", "length_aware", "probe")  # sampling/policies/
WIDE_POLICIES = ("probe",)  # may run more samples than g at once (each reserving less)
PROBE_TOKENS = 12  # the probe policy's k: the smallest that took the oracle's whole gain (measured)
PREDICTORS = ("none", "oracle", "online", "hidden", "noisy")  # sampling/predictors.py
# oracle and noisy know the true lengths: bench and simulate only
TRAINING_PREDICTORS = ("online", "hidden", "none")
REFILL_ORDERS = ("sjf", "ljf")  # sampling/policies/; `auto` means the measured best
ENGINES = ("slots", "vllm")  # sampling/engines/base.py
STRATEGIES = ("single", "ddp", "fsdp")  # distributed/strategies.py and planner/parallel.py
TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")  # run/trackers.py
# tasks/answers.py
ANSWER_EXTRACTIONS = ("answer_tag", "boxed", "last_number", "last_line", "whole")
# tasks/gsm8k.py: a completion must not / may / must open with a <think> block
THINK_BLOCK_RULES = ("forbid", "allow", "require")


def clip_range(loss_type: str, epsilon: float, epsilon_high: float) -> tuple[float, float]:
    """(epsilon_low, epsilon_high) with 0 meaning the loss type's default."""
    default_low, default_high = LOSS_CLIP_RANGES[loss_type]
    low = epsilon or default_low
    return low, epsilon_high or default_high or low


def tracker_problem(names: list[str]) -> str | None:
    """Why `logging.report_to` names no usable set of trackers (unknown, 'none' with others)."""
    for name in names:
        if name != "none" and name not in TRACKERS:
            return f"unknown tracker {name!r} (choose from {', '.join(TRACKERS)}, none)"
    if "none" in names and len(set(names)) > 1:
        return "'none' cannot be combined with a tracker"
    return None
