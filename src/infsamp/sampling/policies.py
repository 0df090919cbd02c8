"""Admission policies: which pending sample a free slot takes next. Pure Python, no torch.

A policy only orders pending samples; `SlotScheduler` owns the slots and the KV books and asks
`pick(slot, can_allocate)` for each free slot until the policy answers None.

- `full`: every sample at once (one slot per sample, budget ignored): what TRL does today.
- `rounds`: g at a time, a round starts only when every slot is free (the paper's naive micro sampling
  groups). `length_sorted=True` fills rounds from the longest predicted sample, which minimises the sum
  of round maxima when only the count per round is capped.
- `continuous`: a freed slot takes the next pending sample in arrival order (same group, then the next).
- `length_aware`: global grouping of the call's samples onto the g slots by predicted length (FPTAS,
  LPT fallback, `grouping.py`); each slot runs its planned queue in refill order (`sjf` shortest
  predicted first, `ljf` longest first) and, once empty, takes from the queue with the most predicted
  work left. As soon as a sample ends more than 2% off its prediction (or an adaptive predictor has
  learnt something new), the plan is stale: from then on every free slot takes the next pending sample
  of the whole call in refill order (list scheduling; with `ljf` that is LPT on the remaining samples).
  With exact predictions the plan is followed to the end. `refill: auto` is `ljf` (measured: sjf is
  worse than plain arrival order whenever predictions are imperfect; see docs/scheduling.md).

Simplification: a policy never preempts; the scheduler's conservative reservation makes that safe.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

from infsamp.choices import REFILL_ORDERS
from infsamp.errors import SamplingError
from infsamp.sampling.grouping import DEFAULT_MAX_STATES, balance, lpt
from infsamp.sampling.length_predictor import ConstantPredictor, LengthPredictor
from infsamp.sampling.types import Sample

CanAllocate = Callable[[Sample], bool]

# options any policy accepts (so callers may pass the config uniformly); unknown names are an error
KNOWN_OPTIONS = {"refill", "epsilon", "prefix_tokens", "length_sorted", "max_states"}
DEFAULT_REFILL = "ljf"  # what `refill: auto` means; measured in docs/scheduling.md


class AdmissionPolicy:
    name = ""
    uses_budget = True
    prefix_tokens_wanted = 0

    def __init__(self, samples: Sequence[Sample], num_slots: int,
                 predictor: LengthPredictor | None, **options):
        unknown = set(options) - KNOWN_OPTIONS
        if unknown:
            raise SamplingError(f"policy {self.name}: unknown option {sorted(unknown)[0]!r}")
        self.samples = samples
        self.num_slots = num_slots
        self.predictor = predictor

    def begin_admit(self, all_free: bool) -> None:
        """Called once per `admit()`, before the picks."""

    def pick(self, slot: int, can_allocate: CanAllocate) -> Sample | None:
        raise NotImplementedError

    def on_started(self, slot: int, sample: Sample) -> None:
        pass

    def on_finished(self, sample: Sample, length: int) -> None:
        pass

    def on_prefix(self, sample: Sample, token_ids: Sequence[int]) -> float | None:
        """The sample's first tokens were seen; returns its re-predicted total length, if any."""
        return None


class ContinuousPolicy(AdmissionPolicy):
    name = "continuous"

    def __init__(self, samples, num_slots, predictor, **options):
        super().__init__(samples, num_slots, predictor, **options)
        self._pending = deque(samples)

    def pick(self, slot, can_allocate):
        if self._pending and can_allocate(self._pending[0]):
            return self._pending.popleft()
        return None


class FullPolicy(ContinuousPolicy):
    name = "full"
    uses_budget = False

    def __init__(self, samples, num_slots, predictor, **options):
        super().__init__(samples, max(1, len(samples)), predictor, **options)


class RoundsPolicy(ContinuousPolicy):
    name = "rounds"

    def __init__(self, samples, num_slots, predictor, length_sorted: bool = False, **options):
        super().__init__(samples, num_slots, predictor, **options)
        if length_sorted and predictor is None:
            raise SamplingError("policy rounds: length_sorted needs a length predictor")
        self.length_sorted = bool(length_sorted)
        self._round_open = False

    def begin_admit(self, all_free):
        self._round_open = all_free
        if all_free and self.length_sorted:  # re-sort with the latest predictions, longest first
            order = sorted(self._pending, key=lambda s: (-self.predictor.predict(s), s.sample_id))
            self._pending = deque(order)

    def pick(self, slot, can_allocate):
        sample = super().pick(slot, can_allocate) if self._round_open else None
        if sample is None:
            self._round_open = False  # a round never takes samples behind one that did not fit
        return sample


class LengthAwarePolicy(AdmissionPolicy):
    name = "length_aware"

    def __init__(self, samples, num_slots, predictor, refill: str = "auto", epsilon: float = 0.1,
                 prefix_tokens: int = 16, max_states: int = DEFAULT_MAX_STATES, **options):
        super().__init__(samples, num_slots, predictor, **options)
        if predictor is None:
            self.predictor = ConstantPredictor()
        self.refill = DEFAULT_REFILL if refill == "auto" else refill
        if self.refill not in REFILL_ORDERS:
            raise SamplingError(f"policy length_aware: refill must be auto, sjf or ljf, got {refill!r}")
        self.epsilon, self.max_states = epsilon, max_states
        self.prefix_tokens_wanted = prefix_tokens if self.predictor.uses_prefix else 0
        self._running: dict[int, int] = {}          # slot -> sample_id
        self._prefix_total: dict[int, float] = {}   # sample_id -> re-predicted total length
        self._pending = {s.sample_id for s in samples}
        self._events_since_plan = 0
        self.tolerance = 0.02  # a sample ending this far off its prediction puts the call off plan
        self._off_plan = False
        self.plan_method = ""
        self._queues = self._plan(max_states)

    def pick(self, slot, can_allocate):
        if self.predictor.adaptive and self._events_since_plan >= self.num_slots and self._pending:
            self._queues = self._plan(0)
        if self._off_plan:  # list scheduling: the next pending sample in refill order, any slot
            return self._take(self._order, can_allocate)
        sample = self._take(self._queues[slot], can_allocate)
        if sample is None:
            for victim in self._by_remaining_work():
                sample = self._take(self._queues[victim], can_allocate)
                if sample is not None:
                    break
        return sample

    def on_started(self, slot, sample):
        self._running[slot] = sample.sample_id

    def on_finished(self, sample, length):
        self._running = {s: i for s, i in self._running.items() if i != sample.sample_id}
        self._events_since_plan += 1
        planned = (self._prefix_total.get(sample.sample_id)
                   or self._weight.get(sample.sample_id, length))
        if abs(length - planned) > self.tolerance * planned:
            self._off_plan = True

    def on_prefix(self, sample, token_ids):
        remaining = self.predictor.predict_remaining(sample, token_ids)
        self._prefix_total[sample.sample_id] = len(token_ids) + max(1.0, float(remaining))
        self._events_since_plan += 1
        return self._prefix_total[sample.sample_id]

    # ---- planning -------------------------------------------------------------------------------
    def _plan(self, max_states: int) -> list[list[int]]:
        pending = sorted(self._pending)
        weights = [max(1.0, float(self.predictor.predict(self.samples[i]))) for i in pending]
        loads = [self._remaining(self._running[s]) if s in self._running else 0.0
                 for s in range(self.num_slots)]
        if max_states > 0:
            grouping = balance(weights, self.num_slots, self.epsilon, loads, max_states)
            slots, self.plan_method = grouping.slots, grouping.method
        else:
            slots, self.plan_method = lpt(weights, self.num_slots, loads), "lpt"
        self._weight = dict(zip(pending, weights))
        self._events_since_plan = 0
        self._order = sorted(pending, key=self._refill_key)
        return [sorted((pending[j] for j in jobs), key=self._refill_key) for jobs in slots]

    def _refill_key(self, sample_id: int) -> tuple[float, int]:
        weight = self._weight[sample_id]
        return (-weight if self.refill == "ljf" else weight, sample_id)

    def _remaining(self, sample_id: int) -> float:
        sample = self.samples[sample_id]
        total = self._prefix_total.get(sample_id) or float(self.predictor.predict(sample))
        return max(1.0, total - sample.num_tokens)

    def _take(self, queue: list[int], can_allocate: CanAllocate) -> Sample | None:
        """The first sample of `queue` that is still pending and fits; stale entries are dropped."""
        position = 0
        while position < len(queue):
            sample_id = queue[position]
            if sample_id not in self._pending:
                del queue[position]
            elif can_allocate(self.samples[sample_id]):
                del queue[position]
                self._pending.discard(sample_id)
                return self.samples[sample_id]
            else:
                position += 1
        return None

    def _by_remaining_work(self) -> list[int]:
        def work(slot: int) -> float:
            running = self._remaining(self._running[slot]) if slot in self._running else 0.0
            return running + sum(self._weight[i] for i in self._queues[slot])
        return sorted((s for s in range(self.num_slots) if self._queues[s]), key=lambda s: -work(s))


POLICIES: dict[str, type[AdmissionPolicy]] = {
    cls.name: cls for cls in (FullPolicy, RoundsPolicy, ContinuousPolicy, LengthAwarePolicy)
}


def make_policy(name: str, samples: Sequence[Sample], num_slots: int,
                predictor: LengthPredictor | None, **options) -> AdmissionPolicy:
    if name not in POLICIES:
        raise SamplingError(f"unknown sampling policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name](samples, num_slots, predictor, **options)
