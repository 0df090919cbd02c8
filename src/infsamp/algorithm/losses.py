"""The GRPO loss family as small pure functions: per-token objectives, k3 KL, token aggregation.

A loss type (`LOSS_TYPES`) is a pair of pure functions (default clip ranges: `choices.py`):
- an objective `(logps, old_logps, advantages, epsilon_low, epsilon_high, mask) -> Surrogate`,
  the per-token loss [B, T] (token-level PPO clip, GSPO's sequence-level clip, or CISPO's
  clipped weight);
- an aggregator `(loss [b, T], mask [b, T], totals) -> scalar`, where `totals` (BatchTotals)
  describes the WHOLE optimizer step's batch. Every aggregator is linear in the per-token loss
  with constants taken from `totals`, and every objective depends only on its own sequence's
  tokens, so summing over any split of the batch into micro-batches gives exactly the full-batch
  value: gradient accumulation over token-budget micro-batches reproduces the full-batch
  gradient, whatever the split.

`per_token_loss` composes them as TRL does: objective, times an optional per-token 0/1
`token_mask` (the high-entropy tokens), times optional per-token `importance_weights` (e.g. the
capped correction exp(old_logp - engine_logp) for a sampling engine whose log-probs differ),
plus beta * KL:
    loss = objective * token_mask * importance_weights + beta * k3,
    k3 = exp(ref - logp) - (ref - logp) - 1

Differences from TRL, deliberately:
- TRL's grpo, bnpo and dr_grpo normalise each per-device micro-batch and divide by the number
  of accumulation steps, so their value depends on how the batch was split. Here the split is an
  implementation detail of the memory budget, so the normalisers are those of the full step
  batch. For grpo and dr_grpo this equals TRL whenever TRL's micro-batches are equal-sized.
- bnpo is kept as its own registry entry ("token mean over the batch", the batch being the
  optimizer step's). In one process with one micro-batch it equals TRL's bnpo; with several
  micro-batches TRL's bnpo is the mean of micro-batch token means, ours the token mean of the
  step (= dapo here).
- gspo is one loss type (TRL: `importance_sampling_level="sequence"` with `loss_type="grpo"`,
  the GSPO paper's setting), with the paper's clip range 3e-4 / 4e-4 as its default. Its clip
  fractions count the tokens of clipped sequences (TRL counts sequences).
- cispo's default cap is 5.0, the value TRL's docs recommend (ScaleRL); TRL itself falls back to
  epsilon (0.2) when epsilon_high is unset, which would scale every weight down to 0.2.
- Not here: delta clipping, sapo / luspo / vespo, an entropy bonus.
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
    num_tokens: int  # completion tokens that carry loss in the step (sum of the loss mask)
    max_new_tokens: int  # sampling.max_new_tokens, the |o| of Dr. GRPO

    @classmethod
    def from_lengths(cls, completion_lengths: Sequence[int], max_new_tokens: int) -> BatchTotals:
        return cls(len(completion_lengths), int(sum(completion_lengths)), max_new_tokens)


# --- per-token objectives ------------------------------------------------------------------------


class Surrogate(NamedTuple):
    loss: Tensor  # [B, T] per-token loss
    is_low_clipped: Tensor  # [B, T] bool: ratio < 1 - eps_low with A < 0 (TRL clip_ratio/low_*)
    is_high_clipped: Tensor  # [B, T] bool: ratio > 1 + eps_high with A > 0 (TRL clip_ratio/high_*)


def _ppo_clip(ratio: Tensor, advantages: Tensor, epsilon_low: float,
              epsilon_high: float) -> Surrogate:
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) for ratios [B, T] or [B, 1]."""
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    adv = advantages.unsqueeze(1)  # [B, 1]
    loss = -torch.min(ratio * adv, clipped * adv)
    with torch.no_grad():
        is_low = (ratio < 1 - epsilon_low) & (adv < 0)
        is_high = (ratio > 1 + epsilon_high) & (adv > 0)
    return Surrogate(loss, is_low, is_high)


def clipped_surrogate(logps: Tensor, old_logps: Tensor, advantages: Tensor,
                      epsilon_low: float, epsilon_high: float,
                      mask: Tensor | None = None) -> Surrogate:
    """Token-level PPO/GRPO clip (DeepSeekMath GRPO; TRL `importance_sampling_level="token"`).

        r_t = exp(logp_t - old_logp_t),
        loss_t = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)

    Advantages are per sequence [B]; `mask` is unused (each token is its own ratio).
    """
    return _ppo_clip(torch.exp(logps - old_logps), advantages, epsilon_low, epsilon_high)


def sequence_clipped_surrogate(logps: Tensor, old_logps: Tensor, advantages: Tensor,
                               epsilon_low: float, epsilon_high: float,
                               mask: Tensor | None = None) -> Surrogate:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"; TRL
    `importance_sampling_level="sequence"`): one length-normalised ratio per sequence, clipped at
    the sequence level,

        s_i = exp( sum_t m_it (logp_it - old_logp_it) / sum_t m_it ),
        loss_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),

    broadcast to every token of the sequence ([B, T]) so that token masks and weights apply as
    usual.
    """
    mask = torch.ones_like(logps) if mask is None else mask.to(logps.dtype)  # [B, T]
    log_ratio = ((logps - old_logps) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # [B]
    ratio = torch.exp(log_ratio).unsqueeze(1)  # [B, 1]
    surrogate = _ppo_clip(ratio, advantages, epsilon_low, epsilon_high)  # [B, 1]
    return Surrogate(*(t.expand_as(logps) for t in surrogate))


def cispo_surrogate(logps: Tensor, old_logps: Tensor, advantages: Tensor,
                    epsilon_low: float, epsilon_high: float,
                    mask: Tensor | None = None) -> Surrogate:
    """CISPO (MiniMax-M1, 2025; TRL `loss_type="cispo"`): REINFORCE with a clipped, DETACHED
    weight,

        loss_t = -sg(min(r_t, eps_high)) * A * logp_t,   r_t = exp(logp_t - old_logp_t),

    so every token keeps a gradient (clipping bounds its size instead of zeroing it). `eps_high`
    is the cap of the ratio itself (TRL's definition; 5.0 by default here), `eps_low` is unused.
    """
    ratio = torch.exp(logps - old_logps)  # [B, T]
    adv = advantages.unsqueeze(1)  # [B, 1]
    loss = -torch.clamp(ratio, max=epsilon_high).detach() * adv * logps  # [B, T]
    is_high = ((ratio > epsilon_high) & (adv > 0)).detach()  # [B, T], TRL's cispo_clip_ratio
    return Surrogate(loss, torch.zeros_like(is_high), is_high)


def kl_penalty(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """k3 estimator of KL(policy || reference) per token, >= 0 (Schulman; as TRL)."""
    delta = ref_logps - logps  # [B, T]
    return torch.exp(delta) - delta - 1  # [B, T]


# --- token aggregation: sum over micro-batches == value on the full batch ------------------------


def aggregate_grpo(loss: Tensor, mask: Tensor, totals: BatchTotals) -> Tensor:
    """Mean over the step's sequences of each sequence's token mean (GRPO paper; TRL 'grpo')."""
    per_sequence = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # [b]
    return per_sequence.sum() / max(totals.num_sequences, 1)


def aggregate_dr_grpo(loss: Tensor, mask: Tensor, totals: BatchTotals) -> Tensor:
    """Token sum over (num_sequences * max_new_tokens), a constant (Dr. GRPO; TRL
    'dr_grpo')."""
    return (loss * mask).sum() / max(totals.num_sequences * totals.max_new_tokens, 1)


def aggregate_dapo(loss: Tensor, mask: Tensor, totals: BatchTotals) -> Tensor:
    """Token sum over the step's completion-token count (DAPO; TRL 'dapo', its default)."""
    return (loss * mask).sum() / max(totals.num_tokens, 1)


# --- the registry --------------------------------------------------------------------------------

Objective = Callable[..., Surrogate]
Aggregator = Callable[[Tensor, Tensor, BatchTotals], Tensor]


@dataclass(frozen=True)
class LossType:
    objective: Objective  # per-token loss
    aggregate: Aggregator  # tokens -> scalar, normalised by the step's totals


LOSS_TYPES: dict[str, LossType] = {  # when to use which: docs/usage.md
    "grpo": LossType(clipped_surrogate, aggregate_grpo),
    "dr_grpo": LossType(clipped_surrogate, aggregate_dr_grpo),
    "dapo": LossType(clipped_surrogate, aggregate_dapo),
    "bnpo": LossType(clipped_surrogate, aggregate_dapo),  # TRL's name; identical to dapo here
    "gspo": LossType(sequence_clipped_surrogate, aggregate_grpo),
    "cispo": LossType(cispo_surrogate, aggregate_dapo),
}


# --- masks ---------------------------------------------------------------------------------------


def quantile(values: Tensor, q: float) -> Tensor:
    """torch.quantile(values, q) (linear interpolation) without its 16M-element input limit."""
    ordered = values.flatten().float().sort().values  # [n]
    position = q * (ordered.numel() - 1)
    low, high = int(position), min(int(position) + 1, ordered.numel() - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)  # []


def high_entropy_masks(entropies: Sequence[Tensor], carries_loss: Sequence[bool],
                       top_quantile: float,
                       gather: Callable[[Tensor], Tensor] | None = None,
                       model_masks: Sequence[Tensor] | None = None) -> list[Tensor]:
    """Per sequence, 1.0 on tokens whose entropy is in the top `top_quantile` of the step's loss
    tokens.

    The threshold is the (1 - top_quantile) quantile over every token of the sequences that carry
    loss (TRL `top_entropy_quantile`; "Beyond the 80/20 Rule", Wang et al. 2025), so it does not
    depend on how the step is split into micro-batches. Sequences that carry no loss get an
    all-zero mask. `gather` turns this rank's pool into every rank's (several processes), so the
    threshold is the whole step's and the masks are those of one process. `model_masks` (1 on
    the tokens the model sampled) keep a tool's answer out of the pool.
    """
    own = [torch.ones_like(e, dtype=torch.bool) for e in entropies] if model_masks is None else \
        [torch.as_tensor(m).bool().to(e.device) for m, e in zip(model_masks, entropies)]
    pool = [e.float()[m] for e, m, keep in zip(entropies, own, carries_loss) if keep and e.numel()]
    pool = torch.cat(pool) if pool else torch.zeros(0)  # [n]
    if gather is not None:
        pool = gather(pool)
    if not pool.numel():
        return [torch.zeros_like(e, dtype=torch.float32) for e in entropies]
    threshold = quantile(pool, 1.0 - top_quantile)
    return [((e.float() >= threshold) & keep).float() for e, keep in zip(entropies, carries_loss)]


# --- per-token loss with logging stats -----------------------------------------------------------


@dataclass
class LossStats:
    """Masked token SUMS, so that micro-batch stats add up; `.metrics()` gives TRL's means."""

    num_tokens: float = 0.0
    kl: float = 0.0
    low_clipped: float = 0.0
    high_clipped: float = 0.0
    entropy: float = 0.0

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def metrics(self) -> dict[str, float]:
        n = max(self.num_tokens, 1.0)
        return {
            "kl": self.kl / n,
            "entropy": self.entropy / n,
            "clip_ratio/low_mean": self.low_clipped / n,
            "clip_ratio/high_mean": self.high_clipped / n,
            "clip_ratio/region_mean": (self.low_clipped + self.high_clipped) / n,
        }


def per_token_loss(logps: Tensor, old_logps: Tensor | None, ref_logps: Tensor | None,
                   advantages: Tensor, *, epsilon_low: float, epsilon_high: float, beta: float,
                   mask: Tensor | None = None, loss_type: str = "dapo",
                   token_mask: Tensor | None = None, importance_weights: Tensor | None = None,
                   entropy: Tensor | None = None) -> tuple[Tensor, LossStats]:
    """objective * token_mask * importance_weights + beta * KL per token [B, T], and stat sums.

    `old_logps=None` means on-policy (num_iterations == 1): the ratio is exp(logp - logp.detach())
    = 1 with the policy gradient intact, as TRL. `ref_logps` is needed only when beta > 0. `mask`
    [B, T] marks the tokens that carry loss (stats are summed over it); `token_mask` and
    `importance_weights` [B, T] scale the policy term only, like TRL's entropy mask and vLLM
    importance-sampling correction. `entropy` [B, T] (detached) is only summed into the stats.
    """
    old_logps = logps.detach() if old_logps is None else old_logps
    mask = torch.ones_like(logps) if mask is None else mask.to(logps.dtype)  # [B, T]
    objective = LOSS_TYPES[loss_type].objective
    surrogate = objective(logps, old_logps, advantages, epsilon_low, epsilon_high, mask=mask)
    loss = surrogate.loss  # [B, T]
    for weight in (token_mask, importance_weights):
        if weight is not None:
            loss = loss * weight.to(loss.dtype)  # [B, T]
    kl = torch.zeros_like(logps) if ref_logps is None else kl_penalty(logps, ref_logps)  # [B, T]
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("per_token_loss: beta > 0 needs ref_logps")
        loss = loss + beta * kl  # [B, T]
    entropy = torch.zeros_like(logps) if entropy is None else entropy.detach()  # [B, T]
    sums = torch.stack([mask.sum(), (kl.detach() * mask).sum(),
                        (surrogate.is_low_clipped * mask).sum(),
                        (surrogate.is_high_clipped * mask).sum(),
                        (entropy * mask).sum()])  # [5], one device sync below
    return loss, LossStats(*sums.tolist())
