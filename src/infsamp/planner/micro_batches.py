"""Which sequences share a micro-batch: greedy packing under a padded-token budget.

Pure Python (no torch), a sizing decision like the rest of the planner: the GRPO step's log-probs
(`algorithm/logprobs.py`, prompts left-padded and completions right-padded) and the reward model's
scoring (`rewards/reward_model.py`, right-padded texts) both pack by these rules, so one budget
means the same thing in both.

Deliberately simple: longest first, each sequence joins the newest micro-batch if it still fits
(no bin-packing search); a sequence over the budget on its own still gets a micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def _pack(order: Sequence[int], padded_size: Callable[[list[int]], int],
          max_tokens: int) -> list[list[int]]:
    """Greedy packing of `order` into consecutive groups whose padded size stays <= max_tokens."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
    batches: list[list[int]] = []
    for index in order:
        if batches and padded_size(batches[-1] + [index]) <= max_tokens:
            batches[-1].append(index)
        else:
            batches.append([index])  # a sequence over budget on its own still gets a micro-batch
    return batches


def plan_micro_batches(seq_lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Sequence indices grouped so that count * longest length <= max_tokens; longest first."""
    order = sorted(range(len(seq_lengths)), key=lambda i: -seq_lengths[i])
    return _pack(order, lambda batch: len(batch) * max(seq_lengths[i] for i in batch), max_tokens)


def plan_prompt_completion_batches(prompt_lengths: Sequence[int],
                                   completion_lengths: Sequence[int],
                                   max_tokens: int) -> list[list[int]]:
    """As plan_micro_batches, for the left/right-padded layout: count * (max prompt + max
    completion)."""
    def padded_size(batch: list[int]) -> int:
        longest_prompt = max(prompt_lengths[i] for i in batch)
        return len(batch) * (longest_prompt + max(completion_lengths[i] for i in batch))

    totals = [p + c for p, c in zip(prompt_lengths, completion_lengths)]
    order = sorted(range(len(totals)), key=lambda i: (-totals[i], -completion_lengths[i]))
    return _pack(order, padded_size, max_tokens)
