"""Held-out evaluation: decode each problem once (greedy by default) and score its accuracy.

Uses transformers `generate` in left-padded batches; a problem counts as solved when the built-in
accuracy reward (`infsamp.rewards.accuracy_reward`) scores it, so training and evaluation agree on
what "correct" means. Reported as a fraction in [0, 1].

Deliberately simple: one completion per problem (pass@1), no self-consistency.
"""

from __future__ import annotations

import torch

from infsamp.rewards import accuracy_reward


@torch.no_grad()
def generate_texts(model, tokenizer, prompts: list[str], *, max_new_tokens: int, temperature: float = 0.0,
                   batch_size: int = 64) -> list[str]:
    texts: list[str] = []
    device = next(model.parameters()).device
    for start in range(0, len(prompts), batch_size):
        batch = tokenizer(prompts[start: start + batch_size], return_tensors="pt", padding=True).to(device)
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                             temperature=temperature if temperature > 0 else None, top_p=None, top_k=None,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        completions = out[:, batch["input_ids"].shape[1]:]  # [b, T_new]
        texts.extend(tokenizer.batch_decode(completions, skip_special_tokens=True))
    return texts


def evaluate_accuracy(model, tokenizer, problems: list[dict], *, max_new_tokens: int = 256,
                      temperature: float = 0.0) -> float:
    if not problems:
        return float("nan")
    was_training = model.training
    model.eval()
    texts = generate_texts(model, tokenizer, [p["prompt"] for p in problems], max_new_tokens=max_new_tokens,
                           temperature=temperature)
    model.train(was_training)
    scores = accuracy_reward(texts, answer=[p["answer"] for p in problems])
    return sum(score > 0 for score in scores) / len(problems)
