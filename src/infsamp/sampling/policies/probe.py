"""The `probe` admission policy: more samples than g at once, each new one a short probe.
Pure Python, no torch.

As many samples run as the budget holds (`kv_budget.slot_pool`), each new one a probe reserving
only `probe_tokens` (k) of KV (`start_tokens`). A probe that reaches k tokens is due its whole
reservation (`to_grow`): grown when the budget holds it, else parked (its KV dropped; the
scheduler's books decide which, `scheduler.py`, "Probes"); parked samples resume before new probes
start. Without a predictor both orders are arrival order; with one (re-predicted at k tokens) the
likely longest probes are grown first and the likely longest parked samples resume first (LJF).
Measured (docs/scheduling.md): the short samples, most of them, end inside their probe, and the
long ones are known after k tokens and run early.

Deliberately simple: a probe is parked whole (no partial reservations) and never keeps its KV.
"""

from __future__ import annotations

from infsamp.choices import PROBE_TOKENS
from infsamp.errors import SamplingError
from infsamp.sampling.policies.base import ContinuousPolicy
from infsamp.sampling.types import Sample


class ProbePolicy(ContinuousPolicy):
    name = "probe"
    uses_predictor = True  # optional: without one, arrival order
    keeps_parked_kv = False  # measured: kept probes crowd new ones out (docs/scheduling.md)

    def __init__(self, samples, micro_group, predictor, probe_tokens: int = PROBE_TOKENS,
                 **options):
        super().__init__(samples, micro_group, predictor, **options)
        if int(probe_tokens) < 1:
            raise SamplingError(f"policy probe: probe_tokens must be >= 1, got {probe_tokens}")
        self.probe_tokens = int(probe_tokens)
        uses_prefix = predictor is not None and predictor.uses_prefix
        self.prefix_tokens_wanted = self.probe_tokens if uses_prefix else 0
        self._parked: list[Sample] = []  # in the order they resume

    def pick(self, slot, can_allocate):
        """A parked sample first (it runs to its end), else the next new probe."""
        if self._parked and can_allocate(self._parked[0]):
            return self._parked.pop(0)
        return super().pick(slot, can_allocate)  # new probes in arrival order

    def start_tokens(self, sample):
        return min(self.probe_tokens, sample.max_new_tokens)

    def to_grow(self, running, probing):
        """Probes that reached k tokens (and did not end), the longest predicted first."""
        due = [s for s in running if probing(s) and s.num_tokens >= self.start_tokens(s)]
        return sorted(due, key=self._longest_first)

    def on_parked(self, sample):
        self._parked.append(sample)
        if self._total:
            self._parked.sort(key=self._longest_first)

    def _longest_first(self, sample: Sample) -> tuple[float, int]:
        """Longest predicted total first; without predictions, arrival order."""
        return (-self._total.get(sample.sample_id, 0.0), sample.sample_id)
