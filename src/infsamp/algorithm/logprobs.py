"""Memory-bounded per-token log-probs of completions, in micro-batches sized by a token budget.

Layout of a micro-batch: prompts LEFT-padded to the micro-batch's longest prompt, completions
RIGHT-padded to its longest completion, so every completion occupies the last `T_c` positions:

    [pad pad p p p | c c c pad]   attention_mask 0 0 1 1 1 | 1 1 1 0
                                  (position_ids from the mask's cumsum)

Which sequences share a micro-batch is the planner's packing rule (`planner/micro_batches.py`,
the same one the reward model scores by). The forward asks the model for only `T_c + 1` positions
(`logits_to_keep`) and drops the last one; the LM head then runs per chunk on the final hidden
states of the real completion tokens (`algorithm/lm_head.py`: no `[tokens, vocabulary]` logits in
the forward or the backward), with fp32 log-softmax and, when asked, each position's token entropy
(no grad) from the same chunks (`micro_batch_logprobs_and_entropy`: TRL's `entropy` metric and
high-entropy token mask). Logits are divided by the sampling temperature first, as TRL does.

Training loop these pieces are made for (one micro-batch of activations alive at a time):

    totals = BatchTotals.from_lengths([len(c) for c in completions], max_new_tokens)
    for mb in build_micro_batches(prompts, completions, max_tokens=budget, pad_token_id=pad):
        logps = micro_batch_logprobs(model, mb, temperature)              # [b, T_c], with grad
        loss, stats = per_token_loss(logps, mb.gather(old), mb.gather(ref), mb.rows(advantages),
                                     loss_type=loss_type, mask=mb.completion_mask, ...)
        LOSS_TYPES[loss_type].aggregate(loss, mb.completion_mask, totals).backward()  # sums .grad

Multi-turn completions (tool calls): a completion's tokens include context the model did not
sample (a tool's answer). `model_masks` (per sequence, 1 on the model's own tokens) keep those
out of `completion_mask`: they are read by the forward (attention sees them) but the LM head never
runs on their positions, so they get no log-prob, no loss, no entropy, no KL and no count in any
normaliser.

Simplifications: sequences are never packed end to end (padding only); a model without a hookable
output head gets its full logits, log-softmaxed in row chunks (correct, but no memory saving).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from infsamp.algorithm.lm_head import (
    HeadCall,
    HeadSpec,
    head_hook,
    head_log_probs,
    logit_transform,
    logits_log_softmax,
    unwrapped,
)
from infsamp.planner.micro_batches import plan_prompt_completion_batches

# --- tensors of one micro-batch -------------------------------------------------------------------


@dataclass
class MicroBatch:
    indices: list[int]  # positions of these sequences in the step's batch
    input_ids: Tensor  # [b, T_p + T_c]
    attention_mask: Tensor  # [b, T_p + T_c]
    position_ids: Tensor  # [b, T_p + T_c]
    completion_ids: Tensor  # [b, T_c]
    completion_mask: Tensor  # [b, T_c] float, 1 on real completion tokens the model sampled

    @property
    def logits_to_keep(self) -> int:
        """The last T_c + 1 positions: every completion token's predictor (and one more)."""
        return self.completion_ids.shape[1] + 1

    @property
    def num_tokens(self) -> int:
        """Real (not padding) tokens the forward reads."""
        return int(self.attention_mask.sum())

    def forward_inputs(self, model: torch.nn.Module) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                "position_ids": self.position_ids}

    def select(self, kept: Tensor) -> Tensor:
        """The kept positions' outputs [b, >= T_c + 1, X] -> those predicting each real
        completion token [n, X]."""
        keep = self.logits_to_keep
        states = kept[:, -keep:-1].reshape(-1, kept.shape[-1])  # [b * T_c, X]
        return states[self.completion_mask.reshape(-1).nonzero().squeeze(-1)]

    def rows(self, values: Tensor) -> Tensor:
        """Pick this micro-batch's rows from a per-sequence tensor of the whole step ([N, ...] ->
        [b, ...])."""
        return values[torch.as_tensor(self.indices, device=values.device)]

    def gather(self, per_sequence: Sequence[Tensor] | None) -> Tensor | None:
        """Right-pad this micro-batch's entries of a per-sequence list (e.g. old log-probs) to [b,
        T_c]."""
        if per_sequence is None:
            return None
        return right_padded(per_sequence, self.indices, self.completion_mask)  # [b, T_c]


def right_padded(per_sequence: Sequence[Tensor], indices: Sequence[int], like: Tensor) -> Tensor:
    """Entries `indices` of a per-sequence list, right-padded with 0 to `like` [b, T_c] (fp32)."""
    out = torch.zeros(like.shape, dtype=torch.float32, device=like.device)  # [b, T_c]
    for row, index in enumerate(indices):
        values = torch.as_tensor(per_sequence[index])
        out[row, : values.shape[0]] = values.to(out.device, torch.float32)
    return out


def pad_rows(rows: list[Sequence[int]], width: int, pad: int, left: bool) -> Tensor:
    out = torch.full((len(rows), width), pad, dtype=torch.long)  # [b, width]
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        out[i, span] = torch.as_tensor(list(row), dtype=torch.long)
    return out


def lengths_mask(lengths: list[int], width: int, left: bool) -> Tensor:
    positions = torch.arange(width).unsqueeze(0)  # [1, width]
    sizes = torch.as_tensor(lengths).unsqueeze(1)  # [b, 1]
    return (positions >= width - sizes) if left else (positions < sizes)  # [b, width] bool


def model_token_rows(completion_mask: Tensor, indices: Sequence[int],
                     model_masks: Sequence[Tensor] | None) -> Tensor:
    """`completion_mask` [b, T_c] (1 on real tokens) times each sequence's model mask (1 on the
    tokens the model sampled, 0 on tool answers); as it is without masks."""
    if model_masks is None:
        return completion_mask
    return completion_mask * right_padded(model_masks, indices, completion_mask)  # [b, T_c]


def make_micro_batch(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                     indices: list[int], pad_token_id: int,
                     device: torch.device | str = "cpu",
                     model_masks: Sequence[Tensor] | None = None) -> MicroBatch:
    """Left-pad the prompts and right-pad the completions of `indices` into one micro-batch
    (`model_masks`: see the module docstring)."""
    prompts = [prompt_ids[i] for i in indices]
    completions = [completion_ids[i] for i in indices]
    if any(len(p) == 0 for p in prompts):
        raise ValueError("make_micro_batch: an empty prompt has no token to predict the completion "
                         "from")
    width_p, width_c = max(map(len, prompts)), max(1, max(map(len, completions)))
    prompt_mask = lengths_mask([len(p) for p in prompts], width_p, left=True)  # [b, T_p]
    completion_mask = lengths_mask([len(c) for c in completions], width_c, left=False)  # [b, T_c]
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()  # [b, T_p + T_c]
    completion_tensor = pad_rows(completions, width_c, pad_token_id, left=False)  # [b, T_c]
    input_ids = torch.cat([pad_rows(prompts, width_p, pad_token_id, left=True), completion_tensor],
                          dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [b, T_p + T_c]
    own = model_token_rows(completion_mask.float(), indices, model_masks)  # [b, T_c]
    return MicroBatch(indices, input_ids.to(device), attention_mask.to(device),
                      position_ids.to(device), completion_tensor.to(device), own.to(device))


def plan_sequence_batches(prompt_ids: Sequence[Sequence[int]],
                          completion_ids: Sequence[Sequence[int]], max_tokens: int,
                          indices: Sequence[int] | None = None) -> list[list[int]]:
    """The sequence indices of each micro-batch covering `indices` (default: all) within the
    padded token budget."""
    chosen = list(range(len(completion_ids))) if indices is None else list(indices)
    plan = plan_prompt_completion_batches([len(prompt_ids[i]) for i in chosen],
                                          [len(completion_ids[i]) for i in chosen], max_tokens)
    return [[chosen[j] for j in batch] for batch in plan]


def build_micro_batches(prompt_ids: Sequence[Sequence[int]],
                        completion_ids: Sequence[Sequence[int]], *,
                        max_tokens: int, pad_token_id: int, device: torch.device | str = "cpu",
                        indices: Sequence[int] | None = None,
                        model_masks: Sequence[Tensor] | None = None):
    """Yield MicroBatch objects covering `indices` (default: all) within the padded token budget.

    A generator: each micro-batch's tensors are built only when the loop reaches it. Re-calling it
    with the indices of a failed micro-batch and a smaller budget splits just that part
    (out-of-memory retry).
    """
    for batch in plan_sequence_batches(prompt_ids, completion_ids, max_tokens, indices):
        yield make_micro_batch(prompt_ids, completion_ids, batch, pad_token_id, device, model_masks)


# --- log-probs ------------------------------------------------------------------------------------


def _forward(model: torch.nn.Module, mb: MicroBatch):
    """The model's forward on the micro-batch, asking for the positions it reads only."""
    inputs = {**mb.forward_inputs(model), "use_cache": False}
    try:
        return model(**inputs, logits_to_keep=mb.logits_to_keep)
    except TypeError:  # a model without logits_to_keep: every position, sliced afterwards
        return model(**inputs)


def completion_logprobs(model: torch.nn.Module, mb: MicroBatch,
                        temperature: float = 1.0, with_entropy: bool = False,
                        chunked: bool = True) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs [b, T_c] (fp32; grad follows torch's mode) of the micro-batch's
    completions and, when asked, each position's token entropy [b, T_c] (no grad).

    Either layout (`MicroBatch`, or `shared_prompt.SharedMicroBatch`: the prompt once per
    group). `chunked`: the LM head runs per chunk on the final hidden states of the real
    completion tokens (`algorithm/lm_head.py`); else (or for a model without a hookable head)
    the model's full logits, log-softmaxed in row chunks. Padded completion positions get 0
    either way.
    """
    rows = mb.completion_mask.reshape(-1).nonzero().squeeze(-1)  # [n] real completion tokens
    targets = mb.completion_ids.reshape(-1)[rows]  # [n]
    spec = HeadSpec(temperature, logit_transform(getattr(unwrapped(model), "config", None)),
                    with_entropy)

    def compute(head: torch.nn.Module, hidden: Tensor) -> tuple[Tensor, Tensor]:
        return head_log_probs(head, mb.select(hidden), targets, spec)  # [n] each

    call = HeadCall(compute)
    with head_hook(model, call) if chunked else contextlib.nullcontext():
        out = _forward(model, mb)
    if call.result is None:  # no head to hook: the model's full logits
        logits = HeadSpec(temperature).scale(mb.select(out.logits))  # [n, V]
        logps, entropy = logits_log_softmax(logits, targets, with_entropy=with_entropy)
    else:
        logps, entropy = call.result
        if torch.is_grad_enabled() and getattr(out, "logits", None) is not None:
            logps = logps + out.logits.sum()  # + 0 ([b, 0, V]): the backward passes the model's
            # output, so wrappers hooking it (FSDP2's pre-backward) see this backward as usual
    shape = mb.completion_ids.shape
    return _at(logps, rows, shape), _at(entropy, rows, shape) if with_entropy else None


def _at(values: Tensor, rows: Tensor, shape: torch.Size) -> Tensor:
    """Values of the real completion tokens [n] at their positions of [b, T_c]; 0 elsewhere."""
    out = values.new_zeros(shape.numel())  # [b * T_c]
    return out.index_copy(0, rows, values).view(shape)


def micro_batch_logprobs(model: torch.nn.Module, mb: MicroBatch, temperature: float = 1.0,
                         chunked: bool = True) -> Tensor:
    """Per-token log-probs [b, T_c] (fp32) of the micro-batch's completions; grad follows torch's
    mode.

    Padded completion positions hold no log-prob: multiply by `mb.completion_mask`.
    """
    return completion_logprobs(model, mb, temperature, chunked=chunked)[0]


def micro_batch_logprobs_and_entropy(model: torch.nn.Module, mb: MicroBatch,
                                     temperature: float = 1.0,
                                     chunked: bool = True) -> tuple[Tensor, Tensor]:
    """As micro_batch_logprobs, plus each completion position's token entropy [b, T_c], no grad."""
    return completion_logprobs(model, mb, temperature, True, chunked)  # type: ignore[return-value]


def sequence_logprobs(model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]],
                      completion_ids: Sequence[Sequence[int]], *, max_tokens: int,
                      pad_token_id: int, temperature: float = 1.0, chunked: bool = True,
                      build: Callable | None = None,
                      model_masks: Sequence[Tensor] | None = None) -> list[Tensor]:
    """Log-probs of every completion token, one 1-D fp32 tensor per sequence, in the input order;
    no grad (old / reference log-probs; training runs the loop in the module docstring).

    `build`: the layout's micro-batch builder (`shared_prompt.LAYOUTS`; default: unshared).
    `model_masks`: tool answers' tokens get 0 (no log-prob computed for them).
    """
    return _sequence_pass(model, prompt_ids, completion_ids, max_tokens, pad_token_id, temperature,
                          with_entropy=False, chunked=chunked, build=build,
                          model_masks=model_masks)[0]


def sequence_logprobs_and_entropy(model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]],
                                  completion_ids: Sequence[Sequence[int]], *, max_tokens: int,
                                  pad_token_id: int,
                                  temperature: float = 1.0, chunked: bool = True,
                                  build: Callable | None = None,
                                  model_masks: Sequence[Tensor] | None = None,
                                  ) -> tuple[list[Tensor], list[Tensor]]:
    """(log-probs, token entropies) of every completion, 1-D fp32 tensors per sequence; no grad."""
    return _sequence_pass(model, prompt_ids, completion_ids, max_tokens, pad_token_id, temperature,
                          with_entropy=True, chunked=chunked, build=build, model_masks=model_masks)


def _sequence_pass(model, prompt_ids, completion_ids, max_tokens: int, pad_token_id: int,
                   temperature: float, *, with_entropy: bool, chunked: bool,
                   build: Callable | None, model_masks: Sequence[Tensor] | None = None):
    """Per-sequence log-probs (and entropies) over token-budget micro-batches, in input order."""
    device = next(model.parameters()).device
    logps_out: list[Tensor] = [torch.empty(0)] * len(completion_ids)
    entropy_out: list[Tensor] = [torch.empty(0)] * len(completion_ids)
    with torch.no_grad():
        for mb in (build or build_micro_batches)(prompt_ids, completion_ids, max_tokens=max_tokens,
                                                 pad_token_id=pad_token_id, device=device,
                                                 model_masks=model_masks):
            logps, entropy = completion_logprobs(model, mb, temperature, with_entropy,
                                                 chunked)  # [b, T_c] each
            for row, index in enumerate(mb.indices):
                length = len(completion_ids[index])
                logps_out[index] = logps[row, :length]
                if entropy is not None:
                    entropy_out[index] = entropy[row, :length]
    return logps_out, entropy_out if with_entropy else None
