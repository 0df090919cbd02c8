"""The admission policy interface and the three policies that only count: `full`, `rounds`,
`continuous`. Pure Python, no torch; the package's `__init__` names them all.

A policy only orders pending samples; `SlotScheduler` owns the slots and the KV books and asks
`pick(slot, can_allocate)` for each free slot until the policy answers None.

- `full`: every sample at once (one slot per sample, budget ignored): what TRL does today.
- `rounds`: g at a time, a round starts only when every slot is free (the paper's naive micro
  sampling groups). `length_sorted=True` fills rounds from the longest predicted sample, which
  minimises the sum of round maxima when only the count per round is capped.
- `continuous`: a freed slot takes the next pending sample in arrival order (same group, then the
  next).

Deliberately simple: a policy sees samples and a `can_allocate` test, never the KV books.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence

from infsamp.errors import SamplingError
from infsamp.sampling.length_predictor import LengthPredictor
from infsamp.sampling.types import Sample

CanAllocate = Callable[[Sample], bool]

# options any policy accepts (so callers may pass the config uniformly); unknown names are an error
KNOWN_OPTIONS = {"refill", "epsilon", "prefix_tokens", "length_sorted", "preempt", "park_ratio",
                 "probe_tokens"}


class AdmissionPolicy:
    name = ""
    uses_budget = True
    prefix_tokens_wanted = 0
    # > 0: a new sample first reserves only this many tokens, so the budget (which it needs)
    # decides how many run at once: choices.WIDE_POLICIES names these policies
    probe_tokens = 0
    uses_predictor = False  # orders samples by a length predictor (`sampling.predictor`)
    keeps_parked_kv = True  # a parked sample's KV may be kept (when the engine and budget can)

    def __init__(self, samples: Sequence[Sample], micro_group: int,
                 predictor: LengthPredictor | None, **options):
        unknown = set(options) - KNOWN_OPTIONS
        if unknown:
            raise SamplingError(f"policy {self.name}: unknown option {min(unknown)!r}")
        self.samples = samples
        self.micro_group = micro_group
        self.predictor = predictor
        self._total: dict[int, float] = {}  # sample_id -> re-predicted total length (`on_tokens`)

    def begin_admit(self, all_free: bool) -> None:
        """Called once per `admit()`, before the picks."""

    def pick(self, slot: int, can_allocate: CanAllocate) -> Sample | None:
        raise NotImplementedError

    def on_started(self, slot: int, sample: Sample) -> None:
        pass

    def on_finished(self, sample: Sample, length: int) -> None:
        pass

    def on_tokens(self, sample: Sample) -> float:
        """A running sample reached a prediction point (k, 2k, ... tokens, on it; only asked of a
        policy with `prefix_tokens_wanted`); returns its re-predicted total length."""
        remaining = self.predictor.predict_remaining(sample, sample.token_ids)
        self._total[sample.sample_id] = sample.num_tokens + max(1.0, float(remaining))
        return self._total[sample.sample_id]

    def to_park(self, running: dict[int, Sample], num_free: int,
                can_allocate: Callable[..., bool]) -> list[Sample]:
        """Running samples to take out of their slots before this admission (none by default)."""
        return []

    def on_parked(self, sample: Sample) -> None:
        pass

    def hold(self, held: set[int]) -> None:
        """Samples not to start until `release`d (a gate's: dynamic sampling). Policies keep
        their waiting samples in `_pending` in arrival order; `length_aware` overrides both."""
        self._pending = deque(s for s in self._pending if s.sample_id not in held)

    def release(self, samples: Sequence[Sample]) -> None:
        """Held samples become pending, after those already waiting."""
        self._pending.extend(samples)

    def on_waiting(self, sample: Sample) -> None:
        """A running sample left its slot to wait on a tool call (the scheduler resumes it)."""

    def start_tokens(self, sample: Sample) -> int:
        """The new tokens a sample reserves when it first starts (a probe's k, else all)."""
        return sample.max_new_tokens

    def to_grow(self, running: Iterable[Sample],
                probing: Callable[[Sample], bool]) -> list[Sample]:
        """Running samples still on their first reservation (`probing`) that are due their whole
        one, in order; the scheduler grows each the budget holds and parks the rest."""
        return []


class ContinuousPolicy(AdmissionPolicy):
    name = "continuous"

    def __init__(self, samples, micro_group, predictor, **options):
        super().__init__(samples, micro_group, predictor, **options)
        self._pending = deque(samples)

    def pick(self, slot, can_allocate):
        if self._pending and can_allocate(self._pending[0]):
            return self._pending.popleft()
        return None


class FullPolicy(ContinuousPolicy):
    name = "full"
    uses_budget = False

    def __init__(self, samples, micro_group, predictor, **options):
        super().__init__(samples, max(1, len(samples)), predictor, **options)


class RoundsPolicy(ContinuousPolicy):
    name = "rounds"

    def __init__(self, samples, micro_group, predictor, length_sorted: bool = False, **options):
        super().__init__(samples, micro_group, predictor, **options)
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

