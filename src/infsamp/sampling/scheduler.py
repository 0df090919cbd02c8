"""The slot loop's brain: which sample starts in which decode slot, and when. Pure Python, no torch.

The real engine and the simulator both run exactly this loop, so they agree by construction:

    while not sched.done:
        for slot, spec in sched.admit(): engine.start(slot, spec)
        finished = engine.decode_step(sched.active())   # one forward pass over all active slots
        sched.step(finished)                             # [(sample_id, length), ...]

Conventions. A sample of length L (generated tokens incl. EOS) is active for exactly L decode steps.
KV is counted in tokens: a group holds its `prompt_tokens` from the start of its first sample until its
last sample finishes (the prompt is prefilled once per group, never per sample); a sample holds j tokens
after its j-th decode step. Admission is conservative: a sample starts only if the held prompts plus
`max_new_tokens` for every active sample (itself included) fit `max_kv_tokens`, so the budget is never
exceeded and nothing is ever preempted. Which pending sample goes next is the admission policy's job
(`policies.py`); this class only keeps the books.

Simplifications: one call = one training step (every sample of the call finishes before `done`); slots
are identical; the reservation is the worst case (`max_new_tokens`), not the predicted length.
"""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Sequence

from infsamp.errors import SamplingError
from infsamp.sampling.grouping import lower_bound, pigeonhole_bound
from infsamp.sampling.policies import make_policy

if TYPE_CHECKING:
    from infsamp.sampling.length_predictor import LengthPredictor


@dataclass(frozen=True)
class SampleSpec:
    sample_id: int        # 0..N-1 within one sampler call, group-major (group 0's samples first, in order)
    group_id: int         # which prompt of the call (0..B-1)
    index_in_group: int
    prompt_tokens: int    # the group's prompt length; its KV is shared, held once while the group is open
    max_new_tokens: int
    prompt_key: str = ""  # stable identity of the prompt across steps/epochs (for the predictor's history)
    prompt_text: str = "" # for cheap prompt features


@dataclass
class SchedulerStats:
    decode_steps: int = 0
    lower_bound: int = 0          # max(ceil(sum L / num_slots), max L) for this call
    opt_lower_bound: int = 0      # pigeonhole_bound: tighter, still <= the best possible schedule
    peak_kv_tokens: int = 0
    num_samples: int = 0
    generated_tokens: int = 0
    num_rounds: int = 0           # admissions that started from an empty engine (rounds policy: its rounds)
    num_preemptions: int = 0      # always 0: admission is conservative
    num_slots: int = 0
    kendall_tau: float | None = None  # last prediction used (token-conditioned once seen) vs real lengths
    mae: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def make_group_specs(prompt_tokens: Sequence[int], group_size: int, max_new_tokens: int,
                     prompt_keys: Sequence[str] | None = None,
                     prompt_texts: Sequence[str] | None = None) -> list[SampleSpec]:
    """Group-major specs for B prompts x G samples (the layout every sampler call uses)."""
    specs = []
    for group_id, num_prompt in enumerate(prompt_tokens):
        key = prompt_keys[group_id] if prompt_keys else ""
        text = prompt_texts[group_id] if prompt_texts else ""
        for index in range(group_size):
            specs.append(SampleSpec(len(specs), group_id, index, int(num_prompt), max_new_tokens, key, text))
    return specs


class SlotScheduler:
    def __init__(self, samples: Sequence[SampleSpec], policy: str, num_slots: int,
                 max_kv_tokens: int | None = None, predictor: "LengthPredictor | None" = None,
                 **policy_options):
        self._samples = list(samples)
        _check_samples(self._samples, num_slots)
        self.predictor = predictor
        self._policy = make_policy(policy, self._samples, num_slots, predictor, **policy_options)
        self._policy.bind(self.age)
        self.num_slots = self._policy.num_slots
        self.max_kv_tokens = max_kv_tokens if self._policy.uses_budget else None
        self._max_new_any = max((s.max_new_tokens for s in self._samples), default=0)
        self._check_budget()
        self.prefix_tokens_wanted = self._policy.prefix_tokens_wanted
        self._free_slots = list(range(self.num_slots))  # a heap: lowest free slot first
        self._active: dict[int, SampleSpec] = {}
        self._slot_of: dict[int, int] = {}
        self._start_step: dict[int, int] = {}
        self._group_open = [0] * (max((s.group_id for s in self._samples), default=-1) + 1)
        self._group_unfinished = list(self._group_open)
        for spec in self._samples:
            self._group_unfinished[spec.group_id] += 1
        self._held_prompt_tokens = 0
        self._reserved_tokens = 0      # sum of max_new_tokens over active samples
        self._active_tokens = 0        # sum of tokens generated so far by active samples
        self._num_finished = 0
        self._lengths: dict[int, int] = {}
        self._predicted: dict[int, float] = {}
        self._stats = SchedulerStats(num_samples=len(self._samples), num_slots=self.num_slots)

    # ---- the loop -------------------------------------------------------------------------------
    def admit(self) -> list[tuple[int, SampleSpec]]:
        """(slot, sample) pairs to start now, before the next decode step."""
        all_free = not self._active
        self._policy.begin_admit(all_free)
        started = []
        while self._free_slots:
            spec = self._policy.pick(self._free_slots[0], self.can_allocate)
            if spec is None:
                break
            slot = heapq.heappop(self._free_slots)
            self._allocate(slot, spec)
            started.append((slot, spec))
        if all_free and started:
            self._stats.num_rounds += 1
        if not self._active and not self.done:
            raise RuntimeError(f"scheduler stalled: policy {self._policy.name!r} admitted nothing "
                               f"with {len(self._samples) - self._num_finished} samples left")
        return started

    def step(self, finished: Sequence[tuple[int, int]]) -> None:
        """After each decode step: (sample_id, length) of the samples that ended in it."""
        if not self._active:
            raise RuntimeError("step() called with no active sample; call admit() first")
        self._stats.decode_steps += 1
        self._active_tokens += len(self._active)
        kv_tokens = self._held_prompt_tokens + self._active_tokens
        self._stats.peak_kv_tokens = max(self._stats.peak_kv_tokens, kv_tokens)
        for sample_id, length in finished:
            self._release(sample_id, int(length))
        if self.done:
            self._finish_call()

    def observe_prefix(self, sample_id: int, token_ids: Sequence[int]) -> None:
        """The engine reports a sample's first `prefix_tokens_wanted` generated tokens (once)."""
        if sample_id not in self._slot_of:
            raise ValueError(f"observe_prefix: sample {sample_id} is not active")
        total = self._policy.on_prefix(self._samples[sample_id], token_ids)
        if total is not None:  # quality is measured on the prediction the plan last used
            self._predicted[sample_id] = float(total)

    def active(self) -> dict[int, SampleSpec]:
        """slot -> running sample."""
        return dict(self._active)

    @property
    def done(self) -> bool:
        return self._num_finished == len(self._samples)

    def stats(self) -> SchedulerStats:
        return self._stats

    def age(self, sample_id: int) -> int:
        """Decode steps a running sample has taken so far (= tokens it has generated)."""
        return self._stats.decode_steps - self._start_step[sample_id]

    # ---- KV books -------------------------------------------------------------------------------
    def can_allocate(self, spec: SampleSpec) -> bool:
        """Whether starting `spec` now keeps the worst-case KV within the budget."""
        if self.max_kv_tokens is None:
            return True
        opens_group = not self._group_open[spec.group_id]
        held = self._held_prompt_tokens + (spec.prompt_tokens if opens_group else 0)
        if held + self._reserved_tokens + spec.max_new_tokens > self.max_kv_tokens:
            return False
        # never open a group whose prompt would leave too little room to run any one sample alone
        return not opens_group or held + self._max_new_any <= self.max_kv_tokens

    def _allocate(self, slot: int, spec: SampleSpec) -> None:
        if not self._group_open[spec.group_id]:
            self._group_open[spec.group_id] = 1
            self._held_prompt_tokens += spec.prompt_tokens
        self._active[slot] = spec
        self._slot_of[spec.sample_id] = slot
        self._start_step[spec.sample_id] = self._stats.decode_steps
        self._reserved_tokens += spec.max_new_tokens
        if self.predictor is not None:
            self._predicted[spec.sample_id] = float(self.predictor.predict(spec))
        self._policy.on_started(slot, spec)

    def _release(self, sample_id: int, length: int) -> None:
        slot = self._slot_of.pop(sample_id, None)
        if slot is None:
            raise ValueError(f"step: sample {sample_id} finished but is not active")
        spec = self._active.pop(slot)
        age = self._stats.decode_steps - self._start_step.pop(sample_id)
        if length != age or length > spec.max_new_tokens:
            raise ValueError(f"step: sample {sample_id} reported length {length} after {age} decode "
                             f"steps (max_new_tokens {spec.max_new_tokens})")
        heapq.heappush(self._free_slots, slot)
        self._active_tokens -= length
        self._reserved_tokens -= spec.max_new_tokens
        self._group_unfinished[spec.group_id] -= 1
        if self._group_unfinished[spec.group_id] == 0:
            self._held_prompt_tokens -= spec.prompt_tokens
        self._lengths[sample_id] = length
        self._num_finished += 1
        if self.predictor is not None:
            self.predictor.observe_finished(spec, length)
        self._policy.on_finished(spec, length)

    def _finish_call(self) -> None:
        lengths = [self._lengths[s.sample_id] for s in self._samples]
        self._stats.generated_tokens = sum(lengths)
        self._stats.lower_bound = lower_bound(lengths, self.num_slots)
        self._stats.opt_lower_bound = pigeonhole_bound(lengths, self.num_slots)
        if self.predictor is not None:
            from infsamp.sampling.length_predictor import prediction_quality

            predicted = [self._predicted[s.sample_id] for s in self._samples]
            self._stats.kendall_tau, self._stats.mae = prediction_quality(predicted, lengths)
            self.predictor.end_call()

    def _check_budget(self) -> None:
        if self.max_kv_tokens is None:
            return
        largest = max(self._samples, key=lambda spec: spec.prompt_tokens, default=None)
        if largest is not None and largest.prompt_tokens + self._max_new_any > self.max_kv_tokens:
            raise SamplingError(
                f"kv budget {self.max_kv_tokens} tokens is too small for group {largest.group_id}: "
                f"prompt {largest.prompt_tokens} + max_new_tokens {self._max_new_any}")


def _check_samples(samples: list[SampleSpec], num_slots: int) -> None:
    if num_slots < 1:
        raise SamplingError(f"num_slots must be >= 1, got {num_slots}")
    for position, spec in enumerate(samples):
        if spec.sample_id != position:
            raise ValueError(f"samples must be numbered 0..N-1 in order; got id {spec.sample_id} at {position}")
        if spec.max_new_tokens < 1 or spec.prompt_tokens < 0:
            raise SamplingError(f"sample {position}: max_new_tokens must be >= 1 and prompt_tokens >= 0")
