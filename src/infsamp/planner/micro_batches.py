"""Which sequences share a micro-batch: as few micro-batches as greedy packing needs under a
padded-token budget, with the sequences spread evenly across them.

Pure Python (no torch), a sizing decision like the rest of the planner: the GRPO step's log-probs
and gradients (`algorithm/logprobs.py`, prompts left-padded and completions right-padded; every
rank's training micro-batches and the TRL plug-in's log-probs go through it) and the reward
model's scoring (`rewards/reward_model.py`, right-padded texts) both pack by these rules, so one
budget means the same thing everywhere.

Sequences are sorted longest first and cut into consecutive runs (so each micro-batch pads to
lengths close to its own). Greedy packing (each sequence joins the newest micro-batch if it still
fits under the budget) fixes the number of micro-batches; then the cut points are chosen so the
fullest micro-batch is as small as any cut of that sorted order into that many runs allows (a
binary search for the smallest bound under which greedy packing needs no more micro-batches). So
the fullest micro-batch, which sets the training step's peak memory, sits near the mean instead of
at the budget, with the same number of forwards.

Deliberately simple: no reordering search beyond the sorted order; a sequence over the budget on
its own still gets a micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

Widths = tuple[int, ...]  # a sequence's padded dimensions: (length,) or (prompt, completion)


def _greedy(order: Sequence[int], widths: Sequence[Widths], max_tokens: int) -> list[list[int]]:
    """Consecutive groups of `order` whose padded size stays <= max_tokens."""
    batches: list[list[int]] = []
    batch_widths: Widths = ()
    for index in order:
        grown = tuple(map(max, batch_widths, widths[index])) if batches else widths[index]
        if batches and (len(batches[-1]) + 1) * sum(grown) <= max_tokens:  # padded tokens
            batches[-1].append(index)
            batch_widths = grown
        else:
            batches.append([index])  # a sequence over budget on its own still gets a micro-batch
            batch_widths = widths[index]
    return batches


def pack_micro_batches(widths: Sequence[Widths], max_tokens: int) -> list[list[int]]:
    """Sequence indices grouped into micro-batches of padded size <= max_tokens: greedy packing's
    count, the sequences spread evenly over them (module docstring); longest first in each."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
    if not widths:
        return []
    order = sorted(range(len(widths)), key=lambda i: (-sum(widths[i]), -widths[i][-1]))
    num_batches = len(_greedy(order, widths, max_tokens))
    low, high = 1, max_tokens  # the smallest bound under which greedy needs no more micro-batches
    while low < high:
        middle = (low + high) // 2
        if len(_greedy(order, widths, middle)) <= num_batches:
            high = middle
        else:
            low = middle + 1
    return _greedy(order, widths, low)


def plan_micro_batches(seq_lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Sequence indices grouped so that count * longest length <= max_tokens."""
    return pack_micro_batches([(n,) for n in seq_lengths], max_tokens)


def plan_prompt_completion_batches(prompt_lengths: Sequence[int],
                                   completion_lengths: Sequence[int],
                                   max_tokens: int) -> list[list[int]]:
    """As plan_micro_batches, for the left/right-padded layout: count * (max prompt + max
    completion)."""
    return pack_micro_batches(list(zip(prompt_lengths, completion_lengths)), max_tokens)


def shared_prompt_rows(prompt_length: int, completion_lengths: Sequence[int],
                       max_tokens: int) -> list[list[int]]:
    """One group's completions (indices into `completion_lengths`) cut into rows of one prompt
    plus as many completions, longest first, as fit under `max_tokens` (at least one each)."""
    rows: list[list[int]] = []
    size = 0
    for j in sorted(range(len(completion_lengths)), key=lambda j: -completion_lengths[j]):
        if rows and size + completion_lengths[j] <= max_tokens:
            rows[-1].append(j)
            size += completion_lengths[j]
        else:
            rows.append([j])
            size = prompt_length + completion_lengths[j]
    return rows


def plan_shared_prompt_batches(prompt_lengths: Sequence[int],
                               completion_lengths: Sequence[Sequence[int]],
                               max_tokens: int) -> list[list[tuple[int, list[int]]]]:
    """The shared-prompt layout (`algorithm/shared_prompt.py`): each group (one prompt, its
    completions) becomes rows of prompt + completions, P + sum of R tokens each, and the rows are
    packed as sequences of that length are (count * longest row <= max_tokens). Returns, per
    micro-batch, its rows as (group index, completion indices within the group)."""
    rows = [(g, row) for g, (prompt, lengths) in enumerate(zip(prompt_lengths, completion_lengths))
            for row in shared_prompt_rows(prompt, lengths, max_tokens)]
    widths = [(prompt_lengths[g] + sum(completion_lengths[g][j] for j in row),) for g, row in rows]
    return [[rows[k] for k in batch] for batch in pack_micro_batches(widths, max_tokens)]

