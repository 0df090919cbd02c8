"""Group-relative advantages for GRPO, TRL-compatible.

Rewards arrive flat, `[N]` with N = num_prompts * G and the G completions of a prompt adjacent (as
TRL lays them out). Each reward is centred on its group's mean and then divided by a scale chosen
from `REWARD_SCALERS`: the group's std ("group", TRL's default), the whole batch's std ("batch", as
in "Understanding R1-Zero-like training"), or nothing ("none", Dr. GRPO). Standard deviations are
the unbiased (Bessel-corrected) ones that TRL's `nanstd` computes, and `1e-4` is added before
dividing, as TRL does.

Deliberate choices:
- A group whose rewards all tie carries no signal: its advantages are set to exactly 0 (TRL gets ~0
  from `0 / (0 + 1e-4)`, up to the rounding of the mean). `zero_std_fraction` (TRL's metric
  `frac_reward_zero_std`) is the fraction of such groups for every scale; TRL's "batch" mode instead
  reports whether the batch std is 0.
- NaN rewards (every reward function returned None) are left out of means and stds and get advantage
  0.
- A std over fewer than two values is 0, not NaN, so G = 1 (evaluation) never produces NaN.
- Groups of unequal size (dynamic sampling: `compute_group_advantages`) are laid out padded with
  NaN to the largest, so every scale treats the padding as missing rewards: each group is centred
  on its own mean and scaled by its own std ("group"), and "batch" divides by the std of every
  reward of the step (each completion counts once, so a larger group weighs more in it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

STD_EPS = 1e-4  # added to the std before dividing, as TRL


class AdvantageResult(NamedTuple):
    advantages: Tensor  # [N]
    group_std: Tensor  # [N / G], unbiased std of each group's rewards
    zero_std_fraction: float  # fraction of groups whose rewards all tie (TRL: frac_reward_zero_std)
    reward_std: float  # unbiased std of all rewards in the batch (TRL: reward_std)


def nanstd(values: Tensor, dim: int | None = None) -> Tensor:
    """Unbiased std ignoring NaNs, like TRL's `nanstd`; 0 (not NaN) where fewer than two values
    remain."""
    count = (~torch.isnan(values)).sum(dim=dim)
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    squares = torch.nanmean((values - mean) ** 2, dim=dim)
    variance = squares * count / (count - 1).clamp(min=1)
    return torch.where(count > 1, variance.sqrt(), torch.zeros_like(variance))


# name -> divisor(grouped rewards [P, G], group std [P]) broadcastable to [P, G]
REWARD_SCALERS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "group": lambda grouped, group_std: group_std.unsqueeze(1) + STD_EPS,  # [P, 1]
    "batch": lambda grouped, group_std: nanstd(grouped.reshape(-1)) + STD_EPS,  # []
    "none": lambda grouped, group_std: torch.ones((), dtype=grouped.dtype, device=grouped.device),
}


def group_ties(grouped: Tensor) -> Tensor:
    """[P, G] -> [P] bool: True where every non-NaN reward of the group is equal (or none is
    left)."""
    high = torch.nan_to_num(grouped, nan=-torch.inf).amax(dim=1)  # [P]
    low = torch.nan_to_num(grouped, nan=torch.inf).amin(dim=1)  # [P]
    return ~(high > low)


def compute_advantages(rewards: Tensor, num_generations: int, scale: str) -> AdvantageResult:
    """Group-mean-centred rewards divided by the scale named `scale` (a key of REWARD_SCALERS)."""
    _check_scale(scale)
    if num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(f"num_generations: {num_generations} does not divide {rewards.numel()} "
                         f"rewards")
    return _grouped_advantages(rewards.float().reshape(-1, num_generations), scale)  # [P, G]


def compute_group_advantages(rewards: Tensor, group_sizes: Sequence[int],
                             scale: str) -> AdvantageResult:
    """`compute_advantages` for groups of any sizes: rewards [N] group-major, N = sum of sizes
    (each group padded with NaN to the largest, which no mean or std counts)."""
    _check_scale(scale)
    if min(group_sizes, default=0) < 1 or sum(group_sizes) != rewards.numel():
        raise ValueError(f"group sizes {list(group_sizes)} do not cover {rewards.numel()} rewards")
    sizes = torch.as_tensor(list(group_sizes))  # [P]
    real = torch.arange(int(sizes.max())).unsqueeze(0) < sizes.unsqueeze(1)  # [P, G_max]
    grouped = torch.full(real.shape, float("nan"))  # [P, G_max]
    grouped[real] = rewards.float()
    result = _grouped_advantages(grouped, scale)
    return result._replace(advantages=result.advantages[real.reshape(-1)])  # [N]


def _check_scale(scale: str) -> None:
    if scale not in REWARD_SCALERS:
        raise ValueError(f"scale_rewards: unknown {scale!r}; expected one of "
                         f"{sorted(REWARD_SCALERS)}")


def _grouped_advantages(grouped: Tensor, scale: str) -> AdvantageResult:
    """Advantages of rewards laid out [P, G] (NaN: missing)."""
    group_std = nanstd(grouped, dim=1)  # [P]
    centred = grouped - torch.nanmean(grouped, dim=1, keepdim=True)  # [P, G]
    advantages = centred / REWARD_SCALERS[scale](grouped, group_std)  # [P, G]
    tied = group_ties(grouped)  # [P]
    advantages = advantages.masked_fill(tied.unsqueeze(1), 0.0).nan_to_num(nan=0.0)  # [P, G]
    return AdvantageResult(
        advantages=advantages.reshape(-1),
        group_std=group_std,
        zero_std_fraction=tied.float().mean().item(),
        reward_std=nanstd(grouped.reshape(-1)).item(),
    )
