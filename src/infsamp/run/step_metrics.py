"""The metrics of one step's rollout (rewards, lengths, the sampler's statistics) and the check
that none of what the update will use is NaN or inf.

Deliberately simple: pure functions of the step's values; the trainer adds its own counters.
"""

from __future__ import annotations

from typing import Any

import torch

from infsamp.errors import NonFiniteError, first_non_finite


def check_finite(sample_metrics: dict[str, Any], advantages: torch.Tensor) -> None:
    """The step's reward aggregates and advantages are finite, or NonFiniteError names one."""
    rewards = {key: sample_metrics[key] for key in ("reward", "reward_std")
               if isinstance(sample_metrics.get(key), float)}
    bad = first_non_finite(rewards)
    if bad is not None:
        raise NonFiniteError(f"{bad} is {rewards[bad]}")
    if first_non_finite({"advantages": advantages}) is not None:
        raise NonFiniteError("an advantage is not finite")


def rollout_metrics(rewards, adv, completions) -> dict[str, Any]:
    """Mean reward and its spread, completion lengths, truncation, per-function rewards, accuracy
    (`rewards`: a RewardResult, `adv`: the advantages' result, `completions`: the step's N)."""
    lengths = torch.tensor([c.length for c in completions], dtype=torch.float32)  # [N]
    total = torch.tensor(rewards.total, dtype=torch.float32)  # [N]
    truncated = sum(c.finish_reason == "length" for c in completions)
    metrics: dict[str, Any] = {
        "reward": total.nanmean().item(), "reward_std": adv.reward_std,
        "frac_reward_zero_std": adv.zero_std_fraction,
        "completions/mean_length": lengths.mean().item(),
        "completions/max_length": lengths.max().item(),
        "completions/min_length": lengths.min().item(),
        "completions/clipped_ratio": truncated / len(completions),
    }
    metrics.update(rewards.metrics())
    if "accuracy" in rewards.per_function:
        values = rewards.per_function["accuracy"]
        metrics["accuracy"] = sum(1 for v in values if v and v > 0) / len(values)
    return metrics
