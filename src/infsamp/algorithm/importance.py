"""Truncated importance sampling for completions sampled by another engine (vLLM).

vLLM samples with its own kernels, so its log-prob of a sampled token differs slightly from the
trainer model's: the samples come from a distribution a little off the policy being trained. The
per-token correction is the importance weight `exp(old_logp - engine_logp)` (old: the trainer
model's log-prob at sampling time), capped so that one odd token cannot dominate the step (Yao et
al. 2025, "truncated importance sampling"). Modes follow TRL's `vllm_importance_sampling_mode`:

- `token_truncate`: per-token weights clipped at the cap;
- `token_mask`: per-token weights above the cap set to 0;
- `sequence_truncate` / `sequence_mask`: one weight per completion (exp of the summed difference);
- `off`: no correction (the mismatch is still measured).

When the two log-probs agree exactly every weight is exactly 1 and the loss is unchanged. Tokens
outside the completion mask weigh 1 (they are masked out of the loss anyway).

Deliberately simple: an upper cap only (TRL's optional lower bound is left out).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


def _truncate(ratio: Tensor, cap: float) -> Tensor:
    return ratio.clamp(max=cap)


def _mask(ratio: Tensor, cap: float) -> Tensor:
    return ratio.masked_fill(ratio > cap, 0.0)


Bound = Callable[[Tensor, float], Tensor]
IS_MODES: dict[str, tuple[bool, Bound] | None] = {  # name -> (one weight per sequence?, bound)
    "token_truncate": (False, _truncate),
    "token_mask": (False, _mask),
    "sequence_truncate": (True, _truncate),
    "sequence_mask": (True, _mask),
    "off": None,
}


def engine_importance_weights(old_logps: Tensor, engine_logps: Tensor, mask: Tensor, mode: str,
                              cap: float) -> Tensor:
    """Capped exp(old_logp - engine_logp): [b, T] per token, or [b, 1] per sequence; no grad."""
    rule = IS_MODES[mode]
    if rule is None:
        return torch.ones_like(old_logps)
    per_sequence, bound = rule
    diff = ((old_logps - engine_logps) * mask).detach()  # [b, T]
    if per_sequence:
        diff = diff.sum(dim=-1, keepdim=True)  # [b, 1]
    return bound(torch.exp(diff), cap)


@dataclass
class MismatchStats:
    """|trainer - engine| log-prob over a step's completion tokens, and the weights applied (sums
    and extremes, so that micro-batches add up)."""

    num_tokens: float = 0.0
    abs_diff_sum: float = 0.0
    abs_diff_max: float = 0.0
    weight_sum: float = 0.0
    weight_min: float = float("inf")
    weight_max: float = 0.0

    def add(self, old_logps: Tensor, engine_logps: Tensor, mask: Tensor, weights: Tensor) -> None:
        valid = mask.bool()  # [b, T]
        diff = (old_logps - engine_logps).abs()[valid]  # [n]
        per_token = weights.expand_as(old_logps)[valid]  # [n]
        if diff.numel():
            self.merge(MismatchStats(diff.numel(), float(diff.sum()), float(diff.max()),
                                     float(per_token.sum()), float(per_token.min()),
                                     float(per_token.max())))

    def merge(self, other: MismatchStats) -> None:
        """Add another micro-batch's figures (sums add, extremes combine)."""
        self.num_tokens += other.num_tokens
        self.abs_diff_sum += other.abs_diff_sum
        self.abs_diff_max = max(self.abs_diff_max, other.abs_diff_max)
        self.weight_sum += other.weight_sum
        self.weight_min = min(self.weight_min, other.weight_min)
        self.weight_max = max(self.weight_max, other.weight_max)

    def metrics(self) -> dict[str, float]:
        if not self.num_tokens:
            return {}
        return {"sampling/logprob_abs_diff_mean": self.abs_diff_sum / self.num_tokens,
                "sampling/logprob_abs_diff_max": self.abs_diff_max,
                "sampling/importance_weight_mean": self.weight_sum / self.num_tokens,
                "sampling/importance_weight_min": self.weight_min,
                "sampling/importance_weight_max": self.weight_max}
