"""What a GRPO step trains on: the sampled batch (`Rollout`, as the sampler and the rewards hand
it over) and the inputs fixed for all of a step's iterations (`StepInputs`, `grpo_step.py` builds
them). Deliberately plain containers: no method but the count of model tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from infsamp.algorithm.losses import BatchTotals


@dataclass
class Rollout:
    prompt_ids: list[list[int]]  # one per completion (the group's prompt repeated)
    completion_ids: list[list[int]]
    advantages: Tensor  # [N]
    truncated: list[bool] | None = None  # per completion: cut at the length limit; None: none
    # per completion, one weight per token [L_i] multiplying its policy loss, e.g. the capped
    # importance-sampling correction exp(old_logp - engine_logp) of a sampling engine; None: all 1
    importance_weights: list[Tensor] | None = None
    engine_logprobs: list[Tensor] | None = None  # per completion [T_i]: the sampling engine's
    totals: BatchTotals | None = None  # the whole step's (one rank's share); None: its own
    # per completion [L_i], 1 on the tokens the model sampled, 0 on context it did not (a tool's
    # answer in a multi-turn episode): no log-prob, loss, entropy, KL or count there; None: all 1
    model_masks: list[Tensor] | None = None


class StepInputs(NamedTuple):
    """What every iteration of one step shares; per-sequence lists are gathered per micro-batch."""

    carries_loss: Tensor  # [N] 1.0 where the sequence contributes loss, 0.0 where masked
    totals: BatchTotals
    old: list[Tensor] | None = None  # old log-probs [L_i] (num_iterations > 1)
    ref: list[Tensor] | None = None  # reference log-probs [L_i] (beta > 0)
    token_masks: list[Tensor] | None = None  # high-entropy token masks [L_i] (quantile < 1)


def model_lengths(rollout: Rollout) -> list[int]:
    """Each completion's tokens that the model sampled (all of them without model masks)."""
    if rollout.model_masks is None:
        return [len(c) for c in rollout.completion_ids]
    return [int(torch.as_tensor(m).sum()) for m in rollout.model_masks]

