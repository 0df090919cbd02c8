"""The prompt forwarded once per group: a group's completions packed into one row behind one copy
of their prompt, each attending causally to the prompt and to itself only (`training.share_prompt`).

Layout of a shared micro-batch (rows right-padded to the micro-batch's longest row):

    [p p p p | a a a | b b | c c c c | pad]     segment  0 0 0 0 | 1 1 1 | 2 2 | 3 3 3 3 | -1
    position ids       0 1 2 3 | 4 5 6 | 4 5 | 4 5 6 7 | 0         (each completion restarts at P)

The 4D attention mask [r, 1, W, W] lets a query see a key when both are in the same segment and
the key is not later, or when the key is a prompt token (segment 0) not later than the query; a
padding position sees itself only (no empty softmax row). transformers passes a 4D mask to the
attention as it is (masking_utils `_preprocess_mask_arguments`): boolean for sdpa, additive
(0 / dtype min) for eager. So every completion token sees exactly the keys, positions and
rotary phases it sees in the unshared layout, and the prompt's activations get the sum of the
group's gradients through one forward instead of G. A completion token's log-prob is read from the
position before it: the first from the prompt's last position, the others from their own segment.

The per-completion views (`completion_ids`, `completion_mask` [b, T_c], `indices`, `rows`,
`gather`) are those of `logprobs.MicroBatch`, so the loss code cannot tell the layouts apart.

Deliberately simple: a group is the completions whose prompt token ids are equal; a group larger
than the token budget is cut into several rows (each with its own copy of the prompt); the mask is
materialised ([r, W, W] booleans), which flash-attention kernels cannot take (those run unshared).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from infsamp.algorithm.lm_head import unwrapped
from infsamp.algorithm.logprobs import (
    MicroBatch,
    lengths_mask,
    make_micro_batch,
    model_token_rows,
    pad_rows,
    plan_sequence_batches,
)
from infsamp.planner.micro_batches import plan_shared_prompt_batches

MASK_IMPLEMENTATIONS = ("sdpa", "eager")  # attention kernels that take a custom 4D mask


def supports_shared_prompt(model: torch.nn.Module) -> bool:
    """Whether the model's attention takes the block mask (sdpa or eager transformers model)."""
    config = getattr(unwrapped(model), "config", None)
    return getattr(config, "_attn_implementation", None) in MASK_IMPLEMENTATIONS


@dataclass
class SharedMicroBatch(MicroBatch):
    """`MicroBatch`'s per-completion views over the shared layout: `input_ids`, `position_ids`
    [r, W] and `attention_mask` [r, 1, W, W] (bool, True: may attend) are the rows'."""

    predictors: Tensor  # [n] flat positions in [r * W] whose output predicts each real token
    real_tokens: int = 0  # tokens of the rows that are not padding

    @property
    def num_tokens(self) -> int:
        return self.real_tokens

    @property
    def logits_to_keep(self) -> int:
        return 0  # every position (transformers: slice(-0, None)): predictors lie anywhere

    def select(self, kept: Tensor) -> Tensor:
        """Every position's output [r, W, X] -> those predicting each real token [n, X]."""
        return kept.reshape(-1, kept.shape[-1])[self.predictors]

    def forward_inputs(self, model: torch.nn.Module) -> dict[str, Tensor]:
        mask = self.attention_mask
        config = getattr(unwrapped(model), "config", None)
        if getattr(config, "_attn_implementation", None) == "eager":  # eager adds the mask
            dtype = next(model.parameters()).dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(dtype).min)  # [r, 1, W, W]
        return {"input_ids": self.input_ids, "attention_mask": mask,
                "position_ids": self.position_ids}


def _row_layout(prompt: Sequence[int], completions: list[Sequence[int]]):
    """Token ids, segments and positions of one row; the predictor offset of each token."""
    ids, segments = list(prompt), [0] * len(prompt)
    positions = list(range(len(prompt)))
    predictors: list[list[int]] = []
    for k, completion in enumerate(completions, start=1):
        start = len(ids)
        predictors.append([len(prompt) - 1] + list(range(start, start + len(completion) - 1)))
        ids += list(completion)
        segments += [k] * len(completion)
        positions += list(range(len(prompt), len(prompt) + len(completion)))
    return ids, segments, positions, predictors


def block_mask(segments: Tensor) -> Tensor:
    """[r, 1, W, W] bool from segments [r, W] (0 prompt, k > 0 completion k, -1 padding)."""
    width = segments.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()  # [W, W] key <= query
    query, key = segments.unsqueeze(2), segments.unsqueeze(1)  # [r, W, 1], [r, 1, W]
    seen = causal & ((key == query) | (key == 0)) & (query >= 0)  # [r, W, W]
    padding = (query < 0) & torch.eye(width, dtype=torch.bool)  # [r, W, W]: itself only
    return (seen | padding).unsqueeze(1)


def make_shared_micro_batch(prompt_ids: Sequence[Sequence[int]],
                            completion_ids: Sequence[Sequence[int]], rows: list[list[int]],
                            pad_token_id: int, device: torch.device | str = "cpu",
                            model_masks: Sequence[Tensor] | None = None) -> SharedMicroBatch:
    """One micro-batch of `rows`, each a list of sequences sharing one prompt; `model_masks`
    (tool answers' tokens 0) leave those tokens out of `completion_mask` and of the predictors:
    the head never runs on them."""
    layouts = [_row_layout(prompt_ids[row[0]], [completion_ids[i] for i in row]) for row in rows]
    width = max(len(ids) for ids, *_ in layouts)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)  # [r, W]
    segments = torch.full((len(rows), width), -1, dtype=torch.long)  # [r, W]
    positions = torch.zeros((len(rows), width), dtype=torch.long)  # [r, W]
    predictors: list[int] = []
    for r, (ids, segs, pos, preds) in enumerate(layouts):
        input_ids[r, : len(ids)] = torch.as_tensor(ids)
        segments[r, : len(ids)] = torch.as_tensor(segs)
        positions[r, : len(ids)] = torch.as_tensor(pos)
        predictors += [r * width + p for completion in preds for p in completion]
    indices = [i for row in rows for i in row]
    completions = [completion_ids[i] for i in indices]
    width_c = max(1, max(map(len, completions)))
    completion_tensor = pad_rows(completions, width_c, pad_token_id, left=False)  # [b, T_c]
    real = lengths_mask([len(c) for c in completions], width_c, left=False).float()  # [b, T_c]
    completion_mask = model_token_rows(real, indices, model_masks)  # [b, T_c]
    own = completion_mask[real.bool()].bool()  # [n] per real token in predictor order
    kept = torch.as_tensor(predictors, dtype=torch.long)[own]  # [n_model]
    return SharedMicroBatch(indices, input_ids.to(device), block_mask(segments).to(device),
                            positions.to(device), completion_tensor.to(device),
                            completion_mask.to(device), kept.to(device),
                            sum(len(ids) for ids, *_ in layouts))


def plan_shared_batches(prompt_ids: Sequence[Sequence[int]],
                        completion_ids: Sequence[Sequence[int]], max_tokens: int,
                        indices: Sequence[int] | None = None) -> list[list[list[int]]]:
    """The rows (lists of sequence indices sharing a prompt) of each micro-batch covering
    `indices` (default: all) within the token budget, counted the shared way."""
    chosen = list(range(len(completion_ids))) if indices is None else list(indices)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in chosen:
        groups.setdefault(tuple(prompt_ids[i]), []).append(i)
    members = list(groups.values())
    plan = plan_shared_prompt_batches([len(prompt_ids[g[0]]) for g in members],
                                      [[len(completion_ids[i]) for i in g] for g in members],
                                      max_tokens)
    return [[[members[g][j] for j in row] for g, row in batch] for batch in plan]


class Layout(NamedTuple):
    """How a step's sequences become micro-batches: `plan(prompts, completions, max_tokens,
    indices)` -> per micro-batch what `make(prompts, completions, that, pad, device)` builds."""

    plan: Callable
    make: Callable

    def build(self, prompt_ids, completion_ids, *, max_tokens: int, pad_token_id: int,
              device: torch.device | str = "cpu", indices: Sequence[int] | None = None,
              model_masks: Sequence[Tensor] | None = None):
        """Yield the micro-batches covering `indices` (default: all), each built when reached."""
        for batch in self.plan(prompt_ids, completion_ids, max_tokens, indices):
            yield self.make(prompt_ids, completion_ids, batch, pad_token_id, device, model_masks)


LAYOUTS = {False: Layout(plan_sequence_batches, make_micro_batch),
           True: Layout(plan_shared_batches, make_shared_micro_batch)}  # by share_prompt
