"""The sampler's plain data: the per-sample state, the one statistics type, the result, and the
budget arithmetic. Pure Python (no torch), imported by every other module of `sampling/`.

`Sample` is the one per-sample state type (as nano-vllm's `Sequence`): what a sample is (its
group, prompt length, limit) and where it stands (status, slot, generated tokens, the engine's
log-probs). The scheduler moves it through pending -> running -> finished, and may park a running
sample (running -> parked -> running: its tokens are kept, its KV kept or recomputed); an
engine only appends tokens (and, when asked, the hidden state of the latest one).
`SamplerStats` is the one statistics type: the scheduler, the engine and the sampler each fill
their own fields, and `merge` sums calls (the simulator, the benchmarks).

Budget arithmetic (`shared_prompt_tokens`, `reserved_tokens`, `kv_tokens_needed`,
`concurrency_for_budget`) is the one place that turns a KV budget into concurrency, for the
sampler, the simulator, the planner and both benchmarks. An engine allocates KV in blocks of
`block_size` tokens: 1 for the slot engine (a group's prompt held once, each slot
`max_new_tokens`), vLLM's block size for its paged pool with prefix caching (a group's full prompt
blocks shared, the rest private).

Deliberately simple: the reservation is the worst case (`max_new_tokens` per running sample).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

VLLM_BLOCK_SIZE = {"cpu": 32, "cuda": 16}  # tokens per vLLM KV block (CPU kernels want 32s)
FinishReason = Literal["eos", "length"]
SampleStatus = Literal["pending", "running", "parked", "finished"]


@dataclass(eq=False)
class Sample:
    sample_id: int  # 0..N-1 within one sampler call, group-major (group 0's samples first)
    group_id: int  # which prompt of the call (0..B-1)
    index_in_group: int
    prompt_tokens: int  # the group's prompt length; its KV is shared, held once per open group
    max_new_tokens: int
    prompt_key: str = ""  # the prompt's identity across steps/epochs (the predictor's history)
    prompt_text: str = ""  # for cheap prompt features
    # where it stands: the scheduler sets status and slot, the engine appends tokens
    status: SampleStatus = "pending"
    slot: int = -1
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None  # the engine's log-prob of each token (None: not reported)
    finish_reason: FinishReason | None = None
    # the engine's last-layer hidden state at the latest token (a numpy vector), when the
    # predictor asks for it (`DecodeOptions.hidden_states`); else None
    hidden_state: Any = None
    parked_kv: bool = False  # parked with its KV kept by the engine (else recomputed on resume)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)



def make_samples(prompt_tokens: list[int], group_size: int, max_new_tokens: int,
                 prompt_keys: list[str] | None = None,
                 prompt_texts: list[str] | None = None) -> list[Sample]:
    """Group-major samples for B prompts x G samples (the layout every sampler call uses)."""
    samples = []
    for group_id, num_prompt in enumerate(prompt_tokens):
        key = prompt_keys[group_id] if prompt_keys else ""
        text = prompt_texts[group_id] if prompt_texts else ""
        for index in range(group_size):
            samples.append(Sample(len(samples), group_id, index, int(num_prompt), max_new_tokens,
                                  key, text))
    return samples


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    length: int  # generated tokens, EOS included
    finish_reason: FinishReason
    group_id: int
    index_in_group: int
    logprobs: list[float] | None = None  # the engine's log-prob of each token (vLLM), else None


_SUMMED = ("decode_steps", "lower_bound", "opt_lower_bound", "num_samples", "generated_tokens",
           "num_rounds", "prefill_tokens", "num_preemptions", "recomputed_tokens", "model_time_s",
           "schedule_time_s", "wall_time_s", "num_calls")
_PEAKS = ("peak_kv_tokens_used", "peak_kv_tokens", "peak_kv_blocks", "peak_kv_bytes", "num_slots",
          "kv_budget_tokens", "kv_block_size")


@dataclass
class SamplerStats:
    """One sampler call (or, after `merge`, several). Keys are the same for every engine."""

    # the schedule (scheduler)
    decode_steps: int = 0  # loop iterations = engine forward steps
    lower_bound: int = 0  # per call max(ceil(sum L / g), max L): no g-slot schedule does better
    opt_lower_bound: int = 0  # per call pigeonhole bound: tighter for lumpy lengths, still <= the optimum
    num_samples: int = 0
    generated_tokens: int = 0
    num_rounds: int = 0  # admissions that started from an empty engine (rounds policy: its rounds)
    num_slots: int = 0  # g
    peak_kv_tokens_used: int = 0  # occupied KV tokens at the peak (open prompts + tokens)
    predictor_kendall_tau: float | None = None  # prediction the plan last used vs real lengths
    predictor_mae: float | None = None
    # what the engine held and computed (engine)
    prefill_tokens: int = 0  # prompt tokens run through the model (shared prompts: once per group)
    peak_kv_tokens: int = 0  # KV capacity held at the peak: slot tensors, or blocks in use
    peak_kv_blocks: int = 0  # the same in the engine's allocation unit (slot engine: tokens)
    peak_kv_bytes: int = 0
    kv_block_size: int = 1
    num_preemptions: int = 0  # samples taken out of their slot unfinished (parked, or by vLLM)
    recomputed_tokens: int = 0  # generated tokens whose KV is computed again after that
    model_time_s: float = 0.0  # forward passes and token selection (the rest is overhead)
    # the call (sampler)
    schedule_time_s: float = 0.0  # in the scheduler, its policy and predictor (admit and step)
    wall_time_s: float = 0.0
    kv_budget_tokens: int = 0
    policy: str = ""
    engine: str = ""
    num_calls: int = 1

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / max(self.wall_time_s, 1e-9)

    @property
    def overhead_fraction(self) -> float:
        if not self.wall_time_s:
            return 0.0
        return max(0.0, 1.0 - self.model_time_s / self.wall_time_s)

    def to_metrics(self, prefix: str = "sampling/") -> dict[str, float]:
        """Flat numeric metrics for the trainer's step log: {'sampling/decode_steps': ..., ...}."""
        values = {f.name: getattr(self, f.name) for f in fields(self)
                  if f.name not in ("policy", "engine") and getattr(self, f.name) is not None}
        values.update(tokens_per_second=self.tokens_per_second,
                      overhead_fraction=self.overhead_fraction)
        return {f"{prefix}{k}": float(v) for k, v in values.items()}

    @classmethod
    def merge(cls, calls: list["SamplerStats"]) -> "SamplerStats":
        """Totals over calls: counters summed, peaks maxed, tau averaged over calls, MAE over
        samples."""
        first = calls[0] if calls else cls()
        total = cls(num_calls=0, policy=first.policy, engine=first.engine)
        for call in calls:
            for name in _SUMMED:
                setattr(total, name, getattr(total, name) + getattr(call, name))
            for name in _PEAKS:
                setattr(total, name, max(getattr(total, name), getattr(call, name)))
        rated = [c for c in calls if c.predictor_kendall_tau is not None]
        if rated:
            total.predictor_kendall_tau = sum(c.predictor_kendall_tau for c in rated) / len(rated)
            total.predictor_mae = (sum((c.predictor_mae or 0.0) * c.num_samples for c in rated)
                                   / max(1, sum(c.num_samples for c in rated)))
        return total


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


def kv_tokens_needed(num_slots: int, max_new_tokens: int, max_prompt_tokens: int, num_prompts: int,
                     block_size: int = 1) -> int:
    """Worst-case KV tokens held with `num_slots` samples running: each at its reservation, and one
    shared prompt per group that can be open at once (at most one per slot and one per prompt)."""
    lowest = max(0, max_prompt_tokens - block_size + 1)  # reservations repeat with P mod block
    reserve = max(reserved_tokens(p, max_new_tokens, block_size)
                  for p in range(lowest, max_prompt_tokens + 1))
    return (num_slots * reserve
            + shared_prompt_tokens(max_prompt_tokens, block_size) * min(num_prompts, num_slots))


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


def concurrency_for_budget(budget_tokens: int, max_new_tokens: int, max_prompt_tokens: int,
                           num_prompts: int, num_samples: int, block_size: int = 1) -> int:
    """g: the most samples (<= num_samples) whose worst case fits the budget; 0 if not even one."""
    return largest_fitting(num_samples, lambda g: kv_tokens_needed(
        g, max_new_tokens, max_prompt_tokens, num_prompts, block_size) <= budget_tokens)
