"""The budget arithmetic: KV tokens held by g samples, and the g a KV budget holds. Pure Python.

The one place that turns a KV budget into concurrency, for the planner (`estimate.py`, `sizes.py`)
and, through `sampling/types.py`, the sampler, the engines, the simulator and both benchmarks
(`shared_prompt_tokens`, `reserved_tokens`, `kv_tokens_needed`, `micro_group_within`;
`max_new_tokens_within`: the one check that a budget holds a sample). An engine allocates KV in
blocks of `block_size` tokens: 1 for the slot engine (a group's prompt held once, each slot
`max_new_tokens`), vLLM's block size for its paged pool with prefix caching (a group's full prompt
blocks shared, the rest private).

What an engine allocates for a run's sizes: vLLM its pool (`paged_pool_blocks`, one spare block
in it: `spare_block_tokens`, the one place that counts it); the slot engine its pool of running KV
(`slot_pool`) beside one prompt row per group open at once.

Deliberately simple: the reservation is the worst case (`max_new_tokens` per running sample).
"""

from __future__ import annotations

from infsamp.errors import SamplingError

VLLM_BLOCK_SIZE = {"cpu": 32, "cuda": 16}  # tokens per vLLM KV block (CPU kernels want 32s)


def kv_block_size(engine: str, device: str) -> int:
    """Tokens per KV allocation unit: 1 on the slot engine, vLLM's block on vLLM."""
    return VLLM_BLOCK_SIZE[device] if engine == "vllm" else 1


def shared_prompt_tokens(prompt_tokens: int, block_size: int = 1) -> int:
    """KV of a group's prompt held once for all its samples. Paged (block_size > 1): the full
    prompt blocks a prefix cache can share (never the block holding the last prompt token, which
    vLLM recomputes so that it has logits to sample from)."""
    if block_size == 1:
        return prompt_tokens
    return max(0, prompt_tokens - 1) // block_size * block_size


def reserved_tokens(prompt_tokens: int, max_new_tokens: int, block_size: int = 1) -> int:
    """KV a running sample may grow to on its own (beyond its group's shared prompt), in blocks."""
    if block_size == 1:
        return max_new_tokens
    blocks = -(-(prompt_tokens + max_new_tokens) // block_size)
    return blocks * block_size - shared_prompt_tokens(prompt_tokens, block_size)


def kv_tokens_needed(micro_group: int, max_new_tokens: int, max_prompt_tokens: int,
                     num_prompts: int, block_size: int = 1) -> int:
    """Worst-case KV tokens held with `micro_group` samples running: each at its reservation, and
    one shared prompt per group that can be open at once (at most one per slot and one per
    prompt)."""
    lowest = max(0, max_prompt_tokens - block_size + 1)  # reservations repeat with P mod block
    reserve = max(reserved_tokens(p, max_new_tokens, block_size)
                  for p in range(lowest, max_prompt_tokens + 1))
    return (micro_group * reserve
            + shared_prompt_tokens(max_prompt_tokens, block_size) * min(num_prompts, micro_group))


def largest_fitting(high: int, fits) -> int:
    """The largest n in 1..high with fits(n), for a monotone fits (true, then false); 0 if none."""
    best, low = 0, 1
    while low <= high:
        mid = (low + high) // 2
        if fits(mid):
            best, low = mid, mid + 1
        else:
            high = mid - 1
    return best


def spare_block_tokens(block_size: int = 1) -> int:
    """The one rule for vLLM's spare block: a paged pool (block_size > 1) keeps one block that no
    sample holds (vLLM's null block); the slot engine keeps none."""
    return block_size if block_size > 1 else 0


def usable_kv_tokens(budget_tokens: int, block_size: int = 1) -> int:
    """KV tokens samples may hold within a budget: its whole blocks but the spare one."""
    return max(0, budget_tokens // block_size * block_size - spare_block_tokens(block_size))


def auto_budget_tokens(micro_group: int, max_new_tokens: int, max_prompt_tokens: int,
                       num_prompts: int, block_size: int = 1) -> int:
    """`sampling.kv_budget: auto`: what g samples need at most, and the pool's spare block."""
    return kv_tokens_needed(micro_group, max_new_tokens, max_prompt_tokens, num_prompts,
                            block_size) + spare_block_tokens(block_size)


def paged_pool_blocks(budget_tokens: int, max_micro_group: int, max_new_tokens: int,
                      max_prompt_tokens: int, block_size: int) -> int:
    """Blocks of vLLM's pool: what `max_micro_group` samples need at most (each maybe of its own
    prompt) and the spare block, never more than the budget's whole blocks."""
    wanted = kv_tokens_needed(max_micro_group, max_new_tokens, max_prompt_tokens, max_micro_group,
                              block_size) + spare_block_tokens(block_size)
    return min(budget_tokens // block_size, -(-wanted // block_size))


def slot_pool(budget_tokens: int, micro_group: int, num_samples: int, held_prompt_tokens: int,
              max_reserve: int, probe_reserve: int = 0,
              max_micro_group: int = 0) -> tuple[int, int]:
    """(slots, running KV tokens) of a call: the scheduler's `num_slots` and `max_running_tokens`,
    the slot engine's pool. g slots of whole reservations (`max_reserve`); with probes (a new
    sample reserves `probe_reserve` > 0, every prompt of the call held: `held_prompt_tokens`) as
    many probes as the budget holds beside the prompts (at least g, at most one per sample and
    `max_micro_group`, 0: no cap) and, of their whole reservations, what that room holds."""
    whole = micro_group * max_reserve
    if not probe_reserve:
        return micro_group, whole
    room = budget_tokens - held_prompt_tokens
    slots = max(micro_group, min(num_samples, room // probe_reserve))
    slots = min(slots, max_micro_group or slots)
    return slots, max(whole, min(slots * max_reserve, room))


def max_new_tokens_within(budget_tokens: int, prompt_tokens: int, max_new_tokens: int,
                          block_size: int = 1) -> int:
    """The check that a budget holds one sample: the most new tokens (<= max_new_tokens) one
    sample of a `prompt_tokens` prompt can reserve beside its prompt; 0 if not even one."""
    return largest_fitting(max_new_tokens, lambda m: kv_tokens_needed(
        1, m, prompt_tokens, 1, block_size) <= budget_tokens)


def tokens_within_or_refuse(budget_tokens: int, prompt_tokens: int, max_new_tokens: int,
                            block_size: int, kv_budget: str) -> int:
    """`max_new_tokens_within`, refused in one line (SamplingError naming `sampling.kv_budget`)
    when the budget cannot hold the prompt plus one token: the sampler's rule and the trainer's
    check before the weights load."""
    fits = max_new_tokens_within(budget_tokens, prompt_tokens, max_new_tokens, block_size)
    if fits < 1:
        raise SamplingError(f"sampling.kv_budget={kv_budget!r} ({budget_tokens} tokens) cannot "
                            f"hold the longest prompt ({prompt_tokens} tokens) plus one token")
    return fits


def micro_group_within(budget_tokens: int, max_new_tokens: int, max_prompt_tokens: int,
                           num_prompts: int, num_samples: int, block_size: int = 1) -> int:
    """g: the most samples (<= num_samples) whose worst case fits the budget; 0 if not even one."""
    return largest_fitting(num_samples, lambda g: kv_tokens_needed(
        g, max_new_tokens, max_prompt_tokens, num_prompts, block_size) <= budget_tokens)
