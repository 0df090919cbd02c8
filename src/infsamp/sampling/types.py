"""The sampler's plain data: the per-sample state, the one statistics type, the result. Pure
Python (no torch), imported by every other module of `sampling/`.

`Sample` is the one per-sample state type (as nano-vllm's `Sequence`): what a sample is (its
group, prompt length, limit) and where it stands (status, slot, generated tokens, the engine's
log-probs). The scheduler moves it through pending -> running -> finished, and may park a running
sample (running -> parked -> running: its tokens are kept, its KV kept or recomputed); an engine
only appends tokens (and, when asked, the hidden state of the latest one). In a multi-turn
episode (`turns.py`) a sample whose turn ended in a tool call waits (running -> waiting -> parked
-> running) and gets the tool's answer as context tokens (`context_spans`: not the model's, so
they carry no loss; `max_new_tokens` counts them). A call with a gate (`SampleGate`: dynamic
sampling's decisions inside the call) declares samples it may not need: they are held
(held -> pending) until the gate releases them, or cancelled, never run. `SamplerStats` is the
one statistics type: the scheduler, the engine and the sampler each fill their own fields;
`COMBINED` says how each one adds up over calls (`merge`: the simulator, the benchmarks) and over
ranks.

The budget arithmetic that turns a KV budget into concurrency lives with the planner
(`planner/kv_budget.py`, below sampling in the layers).

Deliberately simple: the reservation is the worst case (`max_new_tokens` per running sample).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Protocol

# "tool_call": a turn that ended in a tool call (the sample waits for it, then resumes); a
# finished episode ends by "eos" or "length" only
FinishReason = Literal["eos", "length", "tool_call"]
# "held": declared but not admissible until a gate releases it; "cancelled": will never run
SampleStatus = Literal["pending", "held", "running", "parked", "waiting", "finished",
                       "cancelled"]


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
    # multi-turn episodes (`turns.py`): [start, end) of `token_ids` that are context, not the
    # model's (a tool's answer as the chat template renders it; one per tool turn, maybe
    # empty), and the tool turns so far
    context_spans: list[tuple[int, int]] = field(default_factory=list)
    num_turns: int = 0
    tool_latencies_s: list[float] = field(default_factory=list)  # per tool turn: call to answer

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_context_tokens(self) -> int:
        return sum(end - start for start, end in self.context_spans)

    def append_context(self, token_ids: list[int]) -> None:
        """Tokens the model did not sample (a tool's answer) after its tokens so far; the
        engine's log-prob of each is 0.0 (a placeholder: they carry no loss). Every answer is a
        span, an empty one too: one span per tool turn (its turn ends there; traces keep it)."""
        start = self.num_tokens
        self.token_ids.extend(token_ids)
        if self.logprobs is not None:
            self.logprobs.extend([0.0] * len(token_ids))
        self.context_spans.append((start, self.num_tokens))


def model_token_mask(length: int, context_spans: list[tuple[int, int]]) -> list[bool]:
    """Per token of a completion: True where the model sampled it, False on context spans."""
    mask = [True] * length
    for start, end in context_spans:
        mask[start:end] = [False] * (end - start)
    return mask


def make_samples(prompt_tokens: list[int], group_size: int | Sequence[int], max_new_tokens: int,
                 prompt_keys: list[str] | None = None, prompt_texts: list[str] | None = None,
                 first_index: Sequence[int] | None = None) -> list[Sample]:
    """Group-major samples for B prompts x G samples (the layout every sampler call uses);
    `group_size` one G or one per prompt, `first_index` (per prompt) the index in its group of
    a prompt's first sample here (a later chunk of a group: dynamic sampling)."""
    sizes = [group_size] * len(prompt_tokens) if isinstance(group_size, int) else group_size
    samples = []
    for group_id, (num_prompt, size) in enumerate(zip(prompt_tokens, sizes)):
        key = prompt_keys[group_id] if prompt_keys else ""
        text = prompt_texts[group_id] if prompt_texts else ""
        start = first_index[group_id] if first_index else 0
        for index in range(start, start + size):
            samples.append(Sample(len(samples), group_id, index, int(num_prompt), max_new_tokens,
                                  key, text))
    return samples


@dataclass
class Completion:
    """One finished sample as the sampler returns it. The step's statistics on a rank also hold
    the other ranks' completions: those carry their length and finish reason only (no tokens)."""

    token_ids: list[int]
    text: str
    length: int  # generated tokens, EOS included
    finish_reason: FinishReason
    group_id: int
    index_in_group: int
    logprobs: list[float] | None = None  # the engine's log-prob of each token (vLLM), else None
    context_spans: list[tuple[int, int]] = field(default_factory=list)  # tool answers' tokens
    num_turns: int = 0  # tool turns of the episode (its model turns: num_turns + 1)
    num_context_tokens: int = 0  # tokens in context_spans (other ranks' completions: the count)
    tool_latencies_s: list[float] = field(default_factory=list)  # per tool turn, seconds

    @property
    def num_model_tokens(self) -> int:
        """The tokens the model sampled (what carries loss)."""
        return self.length - self.num_context_tokens

    def model_mask(self) -> list[bool]:
        return model_token_mask(len(self.token_ids), self.context_spans)


# How each statistic combines, the one table: over calls one after another (`SamplerStats.merge`:
# the simulator, the benchmarks) and over ranks sampling the same step at once
# (`distributed/rank_step.py`); a statistic not named here (the predictor's quality, the overhead
# share) is averaged over ranks.
COMBINED: dict[str, tuple[str, str]] = {  # name: (over calls, over ranks), each sum or max
    "decode_steps": ("sum", "max"), "lower_bound": ("sum", "max"),
    "opt_lower_bound": ("sum", "max"), "num_samples": ("sum", "mean"),
    "generated_tokens": ("sum", "sum"), "num_rounds": ("sum", "mean"),
    "prefill_tokens": ("sum", "sum"), "num_preemptions": ("sum", "sum"),
    "recomputed_tokens": ("sum", "sum"), "model_time_s": ("sum", "max"),
    "schedule_time_s": ("sum", "max"), "wall_time_s": ("sum", "max"),
    "num_calls": ("sum", "mean"),
    "peak_kv_tokens_used": ("max", "max"), "peak_kv_tokens": ("max", "max"),
    "peak_kv_blocks": ("max", "mean"), "peak_kv_bytes": ("max", "max"),
    "micro_group": ("max", "max"), "kv_budget_tokens": ("max", "max"),
    "kv_block_size": ("max", "mean"), "tokens_per_second": ("", "sum"),
    "row_steps": ("sum", "sum"), "peak_rows": ("max", "max"),
    "context_tokens": ("sum", "sum"), "num_tool_turns": ("sum", "sum"),
    "engine_idle_s": ("sum", "max"),
}
COMBINE = {"sum": sum, "max": max, "mean": lambda values: sum(values) / len(values)}


@dataclass
class SamplerStats:
    """One sampler call (or, after `merge`, several). Keys are the same for every engine."""

    # the schedule (scheduler)
    decode_steps: int = 0  # loop iterations = engine forward steps
    lower_bound: int = 0  # per call max(ceil(sum L / g), max L): no g-slot schedule does better
    # per call pigeonhole bound: tighter for lumpy lengths, still <= the optimum
    opt_lower_bound: int = 0
    num_samples: int = 0
    generated_tokens: int = 0
    num_rounds: int = 0  # admissions that started from an empty engine (rounds policy: its rounds)
    micro_group: int = 0  # g: samples decoded at once
    peak_kv_tokens_used: int = 0  # occupied KV tokens at the peak (open prompts + tokens)
    row_steps: int = 0  # samples running, summed over decode steps (/ decode_steps: mean width)
    peak_rows: int = 0  # the most samples running in one decode step (its widest forward)
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
    # multi-turn episodes (the sampler's turn loop): tool answers' tokens appended, turns that
    # ended in a tool call, and time the loop waited on tool calls with nothing to decode
    context_tokens: int = 0
    num_tool_turns: int = 0
    engine_idle_s: float = 0.0
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
    def mean_rows(self) -> float:
        """Samples running in a decode step, on average (its width; g at most but for probes)."""
        return self.row_steps / max(1, self.decode_steps)

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
    def merge(cls, calls: list[SamplerStats]) -> SamplerStats:
        """Totals over calls: counters summed, peaks maxed, tau averaged over calls, MAE over
        samples."""
        first = calls[0] if calls else cls()
        total = cls(num_calls=0, policy=first.policy, engine=first.engine)
        for name, (over_calls, _) in COMBINED.items():
            if over_calls and calls:
                setattr(total, name, COMBINE[over_calls]([getattr(call, name) for call in calls]))
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


class SampleGate(Protocol):
    """Decisions taken while a sampler call runs (dynamic sampling, `run/dynamic_in_call.py`):
    which of the call's declared samples may start, and which will never run."""

    def begin(self, samples: Sequence[Sample]) -> set[int]:
        """The call's samples, before any starts (again on a retried call); returns the ids held
        back until released."""

    def after_step(self, finished: Sequence[Completion]) -> tuple[list[int], list[int], bool]:
        """The completions that ended in the latest decode step; returns the sample ids to
        release, those to cancel (held or not started; a running one runs on) and whether the
        call stops now (every sample not finished dropped). While nothing runs it must release
        something or stop."""
