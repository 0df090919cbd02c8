"""What the sampler returns (completions, statistics) and the pure-Python budget arithmetic.

`Completion`, `SamplerStats` and `SampleResult` are plain dataclasses the trainer, the CLI and the
benchmark read. The budget helpers (`kv_bytes_per_token`, `micro_group_for_budget`) hold no torch code so
the planner and the simulator can size g exactly as the engine does.

Deliberately simple: the budget model is the slot engine's (every slot reserves room for a whole
completion; each group's prompt KV is held once), not a paged allocator's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

FinishReason = Literal["eos", "length"]


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    length: int  # generated tokens, EOS included
    finish_reason: FinishReason
    group_id: int
    index_in_group: int


@dataclass
class SamplerStats:
    decode_steps: int = 0  # decode forward passes
    lower_bound: int = 0  # per call max(ceil(sum L / g), max L): no g-slot schedule does better
    opt_lower_bound: int = 0  # per call pigeonhole bound: tighter for lumpy lengths, still <= the optimum
    prefill_tokens: int = 0  # prompt tokens run through the model (once per group)
    peak_kv_tokens: int = 0  # token capacity of the KV tensors at their peak (slots + shared prompts)
    peak_kv_bytes: int = 0  # bytes of those tensors
    num_preemptions: int = 0
    recomputed_tokens: int = 0
    generated_tokens: int = 0
    wall_time_s: float = 0.0
    tokens_per_second: float = 0.0
    num_slots: int = 0  # g
    kv_budget_tokens: int = 0
    policy: str = ""
    extra: dict[str, float] = field(default_factory=dict)

    def to_metrics(self, prefix: str = "sampling/") -> dict[str, float]:
        """Flat numeric metrics for the trainer's step log: {'sampling/decode_steps': ..., ...}."""
        values = {k: v for k, v in asdict(self).items() if k not in ("policy", "extra")}
        values.update(self.extra)
        return {f"{prefix}{k}": float(v) for k, v in values.items()}


@dataclass
class SampleResult:
    groups: list[list[Completion]]  # groups[i][j]: completion j of prompt i
    stats: SamplerStats

    @property
    def completions(self) -> list[Completion]:
        return [c for group in self.groups for c in group]


# ---------------------------------------------------------------- budget arithmetic (pure Python)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes one token occupies in the KV cache: keys and values of every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def kv_tokens_needed(num_slots: int, slot_tokens: int, max_prompt_tokens: int, num_prompts: int) -> int:
    """Worst-case KV tokens held with `num_slots` slots: every slot full, and one shared prompt per group
    that can be alive at once (at most one per slot, at most one per prompt)."""
    return num_slots * slot_tokens + max_prompt_tokens * min(num_prompts, num_slots)


def micro_group_for_budget(budget_tokens: int, slot_tokens: int, max_prompt_tokens: int, num_prompts: int,
                           num_samples: int) -> int:
    """Largest g <= num_samples whose worst case fits the budget (0 if not even one slot fits)."""
    best = 0
    low, high = 1, num_samples
    while low <= high:  # kv_tokens_needed grows with g: binary search
        mid = (low + high) // 2
        if kv_tokens_needed(mid, slot_tokens, max_prompt_tokens, num_prompts) <= budget_tokens:
            best, low = mid, mid + 1
        else:
            high = mid - 1
    return best

