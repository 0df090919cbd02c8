"""The `length_aware` admission policy: a global plan of the call's samples onto the g slots by
predicted length, list scheduling once the plan is stale, and parking after the first tokens.
Pure Python, no torch.

The plan: global grouping by predicted length (FPTAS, LPT fallback, `grouping.py`); each slot runs
its planned queue in refill order (`sjf` shortest predicted first, `ljf` longest first) and, once
empty, takes from the queue with the most predicted work left. As soon as a sample ends more than
2% off its prediction (or an adaptive predictor has learnt something new), the plan is stale: from
then on every free slot takes the next pending sample of the whole call in refill order (list
scheduling; with `ljf` that is LPT on the remaining samples). With exact predictions the plan is
followed to the end. `refill: auto` is `ljf` (measured: sjf is worse than plain arrival order
whenever predictions are imperfect; see docs/scheduling.md).

Decisions after the first tokens (`preempt`, on with a token-conditioned predictor and `ljf`):
every k generated tokens a running sample's remaining length is re-predicted; at its first point
(k tokens) a sample whose predicted remaining work is less than 1/`park_ratio` of what the best
waiting sample is expected to take (a pending sample's predicted length, a parked one's predicted
remainder) is parked, and that sample takes the slot. So samples are probed k tokens at a time,
the likely long ones keep their slots and the short ones wait for the end, where they fill the
gaps (longest remaining predicted first). Later points only re-rank the waiting samples.

Simplification: the policy parks only at a sample's first prediction point, and never for a
sample that could not start in the freed slot; the scheduler's conservative reservation keeps
that safe.
"""

from __future__ import annotations

import heapq

from infsamp.choices import REFILL_ORDERS
from infsamp.errors import SamplingError
from infsamp.sampling.grouping import DEFAULT_MAX_STATES, balance
from infsamp.sampling.length_predictor import ConstantPredictor
from infsamp.sampling.policies.base import AdmissionPolicy, CanAllocate
from infsamp.sampling.types import Sample

DEFAULT_REFILL = "ljf"  # what `refill: auto` means; measured in docs/scheduling.md
PARK_RATIO = 1.0  # park a sample predicted to need less than the best waiting one (measured)


class LengthAwarePolicy(AdmissionPolicy):
    name = "length_aware"
    uses_predictor = True

    def __init__(self, samples, micro_group, predictor, refill: str = "auto", epsilon: float = 0.1,
                 prefix_tokens: int = 8, preempt: bool = True, park_ratio: float = PARK_RATIO,
                 **options):
        super().__init__(samples, micro_group, predictor, **options)
        if predictor is None:
            self.predictor = ConstantPredictor()
        self.refill = DEFAULT_REFILL if refill == "auto" else refill
        if self.refill not in REFILL_ORDERS:
            raise SamplingError(f"policy length_aware: refill must be auto, "
                                f"sjf or ljf, got {refill!r}")
        self.epsilon = epsilon
        self.prefix_tokens_wanted = prefix_tokens if self.predictor.uses_prefix else 0
        self.preempt = bool(preempt) and self.prefix_tokens_wanted > 0 and self.refill == "ljf"
        self.park_ratio = park_ratio
        self._running: dict[int, int] = {}          # slot -> sample_id
        self._pending = {s.sample_id for s in samples}
        self._parked: set[int] = set()
        self._at_point: set[int] = set()  # running samples re-predicted since the last admission
        self._events_since_plan = 0
        self.tolerance = 0.02  # a sample ending this far off its prediction puts the call off plan
        self._off_plan = False
        self._queues = self._plan(DEFAULT_MAX_STATES)
        self._first_weight = dict(self._weight)

    def pick(self, slot, can_allocate):
        if (self.predictor.adaptive and self._events_since_plan >= self.micro_group
                and self._pending):
            self._queues = self._plan(0)
        if self._off_plan:  # list scheduling: the waiting sample first in refill order, any slot
            return self._take_best(can_allocate)
        sample = self._take(self._queues[slot], can_allocate)
        if sample is None:
            for victim in self._by_remaining_work():
                sample = self._take(self._queues[victim], can_allocate)
                if sample is not None:
                    break
        return sample

    def on_started(self, slot, sample):
        self._running[slot] = sample.sample_id
        self._parked.discard(sample.sample_id)

    def on_finished(self, sample, length):
        self._drop_running(sample.sample_id)
        self._at_point.discard(sample.sample_id)
        self._events_since_plan += 1
        planned = (self._total.get(sample.sample_id)
                   or self._weight.get(sample.sample_id, length))
        if abs(length - planned) > self.tolerance * planned:
            self._off_plan = True

    def on_tokens(self, sample):
        if sample.num_tokens == self.prefix_tokens_wanted:
            self._events_since_plan += 1
        self._at_point.add(sample.sample_id)
        return super().on_tokens(sample)

    def to_park(self, running, num_free, can_allocate):
        """Samples at their first point whose predicted remaining work, times `park_ratio`, is
        below the best waiting sample's; each is matched with a waiting sample that can start in
        its slot (the first `num_free` waiting samples go to the slots already free)."""
        fresh, self._at_point = self._at_point, set()
        if not self.preempt or not fresh:
            return []
        candidates = sorted((s for s in running.values() if s.sample_id in fresh
                             and s.num_tokens == self.prefix_tokens_wanted),
                            key=lambda s: self._priority(s.sample_id))
        if not candidates:  # most steps: no sample at its first point (sorting G waiting costs)
            return []
        waiting = sorted([*self._pending, *self._parked], key=self._priority,
                         reverse=True)[num_free:]
        parks = []
        for sample in candidates:
            mine = self._priority(sample.sample_id)
            if not waiting or self._priority(waiting[0]) < self.park_ratio * mine:
                break
            choice = next((i for i in waiting if can_allocate(self.samples[i], sample)), None)
            if choice is None:
                break
            waiting.remove(choice)
            parks.append(sample)
        return parks

    def on_waiting(self, sample):
        self._drop_running(sample.sample_id)

    def on_parked(self, sample):
        self._drop_running(sample.sample_id)
        self._parked.add(sample.sample_id)
        self._off_plan = True  # the plan assumed samples keep their slots

    def hold(self, held):
        self._pending -= held

    def release(self, samples):
        """Released samples join the pending ones; the plan is stale (list scheduling)."""
        for sample in samples:  # a re-plan weighed only the pending samples of its time
            weight = max(1.0, float(self.predictor.predict(sample)))
            self._weight.setdefault(sample.sample_id, weight)
            self._first_weight.setdefault(sample.sample_id, weight)
        self._pending |= {s.sample_id for s in samples}
        self._order = sorted(self._pending, key=self._refill_key)
        self._off_plan = True

    # ---- planning -------------------------------------------------------------------------------
    def _plan(self, max_states: int) -> list[list[int]]:
        pending = sorted(self._pending)
        weights = [max(1.0, float(self.predictor.predict(self.samples[i]))) for i in pending]
        loads = [self._remaining(self._running[s]) if s in self._running else 0.0
                 for s in range(self.micro_group)]
        slots = balance(weights, self.micro_group, self.epsilon, loads, max_states).slots
        self._weight = dict(zip(pending, weights))
        self._events_since_plan = 0
        self._order = sorted(pending, key=self._refill_key)
        return [sorted((pending[j] for j in jobs), key=self._refill_key) for jobs in slots]

    def _refill_key(self, sample_id: int) -> tuple[float, int]:
        weight = self._weight[sample_id]
        return (-weight if self.refill == "ljf" else weight, sample_id)

    def _remaining(self, sample_id: int) -> float:
        sample = self.samples[sample_id]
        total = self._total.get(sample_id) or float(self.predictor.predict(sample))
        return max(1.0, total - sample.num_tokens)

    def _priority(self, sample_id: int) -> float:
        """Predicted work left: a pending sample's planned length (never below its prediction at
        the call's start: siblings that finish early are the short ones, so a re-plan's
        prediction for the rest of a group is biased low), else its predicted remainder."""
        if sample_id in self._pending:
            return max(self._weight[sample_id], self._first_weight[sample_id])
        return self._remaining(sample_id)

    def _drop_running(self, sample_id: int) -> None:
        self._running = {s: i for s, i in self._running.items() if i != sample_id}

    def _take_best(self, can_allocate: CanAllocate) -> Sample | None:
        """List scheduling: the next pending sample in refill order, or a parked one predicted to
        take longer (ljf; with sjf, shorter), whichever fits first."""
        sign = 1 if self.refill == "ljf" else -1  # ljf: longest first, ties by id; sjf: reversed
        parked = [(-sign * self._priority(i), sign * i, i) for i in self._parked]
        heapq.heapify(parked)  # popped in order as far as needed: no sort of every parked sample
        position = 0
        while position < len(self._order) or parked:
            head = self._order[position] if position < len(self._order) else None
            if head is not None and head not in self._pending:
                del self._order[position]
                continue
            take_parked = parked and (head is None or self._before(parked[0][2], head))
            sample_id = parked[0][2] if take_parked else head
            if can_allocate(self.samples[sample_id]):
                if take_parked:
                    self._parked.discard(sample_id)
                else:
                    del self._order[position]
                    self._pending.discard(sample_id)
                return self.samples[sample_id]
            if take_parked:
                heapq.heappop(parked)
            else:
                position += 1
        return None

    def _before(self, parked_id: int, pending_id: int) -> bool:
        longer = self._priority(parked_id) > self._priority(pending_id)
        return longer if self.refill == "ljf" else not longer

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
        return sorted((s for s in range(self.micro_group) if self._queues[s]),
                      key=lambda s: -work(s))

