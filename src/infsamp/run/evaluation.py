"""Held-out evaluation: decode each problem once (greedy by default) and score its accuracy.

Takes the prompts as token ids, the same ids the sampler gets for the same example
(`infsamp.tasks.prompts.encode_prompt`), and stops on the same tokens (`stop_token_ids`). Runs
transformers `generate` in batches left-padded with the pad token (never re-tokenising text); each
completion is cut at its first stop token. A problem counts as solved when the built-in accuracy
reward (`infsamp.rewards.accuracy_reward`) scores it, so training and evaluation agree on what
"correct" means. Reported as a fraction in [0, 1].

Deliberately simple: one completion per problem (pass@1), no self-consistency.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infsamp.rewards.builtin import accuracy_reward


def left_padded(prompt_ids: Sequence[Sequence[int]],
                pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both [B, T], prompts right-aligned."""
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)  # [B, T]
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids):] = torch.tensor(list(ids), dtype=torch.long)
        mask[row, width - len(ids):] = 1
    return input_ids, mask


def until_stop(ids: Sequence[int], stop_token_ids: Sequence[int]) -> list[int]:
    """The completion before its first stop token (the whole of it when none occurs)."""
    stops = set(stop_token_ids)
    return next((list(ids[:i]) for i, token in enumerate(ids) if token in stops), list(ids))


@torch.no_grad()
def generate_completions(model, prompt_ids: Sequence[Sequence[int]], *, pad_token_id: int,
                         stop_token_ids: Sequence[int], max_new_tokens: int,
                         temperature: float = 0.0, batch_size: int = 64) -> list[list[int]]:
    """Each prompt's completion ids, cut before its first stop token."""
    device = next(model.parameters()).device
    completions: list[list[int]] = []
    for start in range(0, len(prompt_ids), batch_size):
        input_ids, mask = left_padded(prompt_ids[start: start + batch_size], pad_token_id)
        out = model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                             temperature=temperature if temperature > 0 else None, top_p=None, top_k=None,
                             pad_token_id=pad_token_id, eos_token_id=list(stop_token_ids) or None)
        new_tokens = out[:, input_ids.shape[1]:].tolist()  # [b, T_new]
        completions.extend(until_stop(row, stop_token_ids) for row in new_tokens)
    return completions


def evaluate_accuracy(model, tokenizer, prompt_ids: Sequence[Sequence[int]],
                      answers: Sequence[str], *, stop_token_ids: Sequence[int],
                      max_new_tokens: int = 256, temperature: float = 0.0) -> float:
    """Fraction of prompts whose completion the accuracy reward scores as correct (NaN for none)."""
    if not prompt_ids:
        return float("nan")
    was_training = model.training
    model.eval()
    try:
        completions = generate_completions(model, prompt_ids, pad_token_id=tokenizer.pad_token_id,
                                           stop_token_ids=stop_token_ids,
                                           max_new_tokens=max_new_tokens, temperature=temperature)
    finally:
        model.train(was_training)
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    scores = accuracy_reward(texts, answer=list(answers))
    return sum(score > 0 for score in scores) / len(prompt_ids)
