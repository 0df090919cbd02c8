"""The GRPO loss as small pure functions: clipped surrogate, k3 KL penalty, token aggregation.

Per-token terms follow TRL's GRPOTrainer (token-level importance sampling):
    ratio = exp(logp - old_logp)
    loss  = -min(ratio * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A) + beta * k3
    k3    = exp(ref - logp) - (ref - logp) - 1
Token aggregation is a registry, `LOSS_TYPES`, of functions `agg(loss [b, T], mask [b, T], totals)` where
`totals` (BatchTotals) describes the WHOLE optimizer step's batch. Every aggregator is linear in the
per-token loss with constants taken from `totals`, so summing `agg` over any split of the batch into
micro-batches gives exactly `agg` over the full batch: gradient accumulation over token-budget micro-batches
reproduces the full-batch gradient, whatever the split.

Differences from TRL, deliberately:
- TRL's grpo, bnpo and dr_grpo normalise each per-device micro-batch and divide by the number of
  accumulation steps, so their value depends on how the batch was split. Here the split is an
  implementation detail of the memory budget, so the normalisers are those of the full step batch.
  For grpo and dr_grpo this equals TRL whenever TRL's micro-batches are equal-sized.
- bnpo is kept as its own registry entry with its own definition ("token mean over the batch", the batch
  being the optimizer step's). In one process with one micro-batch it equals TRL's bnpo; with several
  micro-batches TRL's bnpo is the mean of micro-batch token means, ours is the token mean of the step.
  Numerically it therefore coincides with dapo (TRL's dapo normalises by the generation batch's token
  count, `num_items_in_batch`, which is the step's token count when one generation feeds one step).
- Only token-level importance sampling and the four loss types above; no sequence-level ratios, delta
  clipping, cispo/sapo/vespo or vLLM importance-sampling correction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
from torch import Tensor


class BatchTotals(NamedTuple):
    """Sizes of the whole optimizer-step batch (not of a micro-batch)."""

    num_sequences: int  # completions in the step
    num_tokens: int  # completion tokens in the step (sum of the mask)
    max_completion_length: int  # sampling.max_new_tokens, the |o| of Dr. GRPO

    @classmethod
    def from_lengths(cls, completion_lengths: Sequence[int], max_completion_length: int) -> "BatchTotals":
        return cls(len(completion_lengths), int(sum(completion_lengths)), max_completion_length)


# --- per-token terms ----------------------------------------------------------------------------


class Surrogate(NamedTuple):
    loss: Tensor  # [B, T] per-token clipped surrogate loss
    is_low_clipped: Tensor  # [B, T] bool: ratio < 1 - eps_low with A < 0 (TRL clip_ratio/low_*)
    is_high_clipped: Tensor  # [B, T] bool: ratio > 1 + eps_high with A > 0 (TRL clip_ratio/high_*)


def clipped_surrogate(logps: Tensor, old_logps: Tensor, advantages: Tensor,
                      epsilon_low: float, epsilon_high: float) -> Surrogate:
    """PPO/GRPO clipped objective per token, negated to a loss; advantages are per sequence [B]."""
    ratio = torch.exp(logps - old_logps)  # [B, T]
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)  # [B, T]
    adv = advantages.unsqueeze(1)  # [B, 1]
    loss = -torch.min(ratio * adv, clipped * adv)  # [B, T]
    with torch.no_grad():
        is_low = (ratio < 1 - epsilon_low) & (adv < 0)  # [B, T]
        is_high = (ratio > 1 + epsilon_high) & (adv > 0)  # [B, T]
    return Surrogate(loss, is_low, is_high)


def kl_penalty(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """k3 estimator of KL(policy || reference) per token, >= 0 (Schulman; as TRL)."""
    delta = ref_logps - logps  # [B, T]
    return torch.exp(delta) - delta - 1  # [B, T]


@dataclass
class LossStats:
    """Masked token SUMS, so that micro-batch stats add up; `.metrics()` gives TRL's means."""

    num_tokens: float = 0.0
    kl: float = 0.0
    low_clipped: float = 0.0
    high_clipped: float = 0.0

    def __add__(self, other: "LossStats") -> "LossStats":
        return LossStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def metrics(self) -> dict[str, float]:
        n = max(self.num_tokens, 1.0)
        return {
            "kl": self.kl / n,
            "clip_ratio/low_mean": self.low_clipped / n,
            "clip_ratio/high_mean": self.high_clipped / n,
            "clip_ratio/region_mean": (self.low_clipped + self.high_clipped) / n,
        }


def per_token_loss(logps: Tensor, old_logps: Tensor | None, ref_logps: Tensor | None, advantages: Tensor,
                   *, epsilon_low: float, epsilon_high: float, beta: float,
                   mask: Tensor | None = None) -> tuple[Tensor, LossStats]:
    """Surrogate + beta * KL per token, and masked stat sums for logging.

    `old_logps=None` means on-policy (num_iterations == 1): the ratio is exp(logp - logp.detach()) = 1 with
    the policy gradient intact, as TRL. `ref_logps` is needed only when beta > 0.
    """
    old_logps = logps.detach() if old_logps is None else old_logps
    surrogate = clipped_surrogate(logps, old_logps, advantages, epsilon_low, epsilon_high)
    loss = surrogate.loss  # [B, T]
    kl = torch.zeros_like(logps) if ref_logps is None else kl_penalty(logps, ref_logps)  # [B, T]
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("per_token_loss: beta > 0 needs ref_logps")
        loss = loss + beta * kl  # [B, T]
    mask = torch.ones_like(logps) if mask is None else mask.to(logps.dtype)  # [B, T]
    sums = torch.stack([mask.sum(), (kl.detach() * mask).sum(), (surrogate.is_low_clipped * mask).sum(),
                        (surrogate.is_high_clipped * mask).sum()])  # [4], one device sync below
    stats = LossStats(*sums.tolist())
    return loss, stats


# --- token aggregation: sum over micro-batches == value on the full batch -----------------------


def _masked_sum(loss: Tensor, mask: Tensor) -> Tensor:
    return (loss * mask).sum()  # []


def aggregate_grpo(loss: Tensor, mask: Tensor, totals: BatchTotals) -> Tensor:
    """Mean over the step's sequences of each sequence's token mean (GRPO paper; TRL 'grpo')."""
    per_sequence = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # [b]
    return per_sequence.sum() / max(totals.num_sequences, 1)


def aggregate_dr_grpo(loss: Tensor, mask: Tensor, totals: BatchTotals) -> Tensor:
    """Token sum over (num_sequences * max_completion_length), a constant (Dr. GRPO; TRL 'dr_grpo')."""
    return _masked_sum(loss, mask) / max(totals.num_sequences * totals.max_completion_length, 1)


def aggregate_dapo(loss: Tensor, mask: Tensor, totals: BatchTotals) -> Tensor:
    """Token sum over the step's completion-token count (DAPO; TRL 'dapo', its default)."""
    return _masked_sum(loss, mask) / max(totals.num_tokens, 1)


def aggregate_bnpo(loss: Tensor, mask: Tensor, totals: BatchTotals) -> Tensor:
    """Batch-normalised token mean, the batch being the optimizer step's (see module docstring).

    TRL's bnpo divides by the local micro-batch's tokens and averages micro-batches; ours divides by the
    step's tokens, so it does not depend on how the token budget split the batch (and equals dapo here).
    """
    batch_tokens = max(totals.num_tokens, 1)
    return _masked_sum(loss, mask) / batch_tokens


Aggregator = Callable[[Tensor, Tensor, BatchTotals], Tensor]

LOSS_TYPES: dict[str, Aggregator] = {
    "grpo": aggregate_grpo,
    "dr_grpo": aggregate_dr_grpo,
    "dapo": aggregate_dapo,
    "bnpo": aggregate_bnpo,
}
