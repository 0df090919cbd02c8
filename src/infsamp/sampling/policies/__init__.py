"""Admission policies: which pending sample a free slot takes next, a registry by name.
Pure Python, no torch.

`base.py` holds the interface and the counting policies (`full`, `rounds`, `continuous`),
`length_aware.py` the planned policy with parking, `probe.py` the policy that starts more samples
than g as short probes. Deliberately simple: one flat registry, options passed through by name.
"""

from __future__ import annotations

from collections.abc import Sequence

from infsamp.errors import SamplingError
from infsamp.sampling.length_predictor import LengthPredictor
from infsamp.sampling.policies.base import (
    AdmissionPolicy,
    ContinuousPolicy,
    FullPolicy,
    RoundsPolicy,
)
from infsamp.sampling.policies.length_aware import LengthAwarePolicy
from infsamp.sampling.policies.probe import ProbePolicy
from infsamp.sampling.types import Sample

POLICIES: dict[str, type[AdmissionPolicy]] = {
    cls.name: cls for cls in (FullPolicy, RoundsPolicy, ContinuousPolicy, LengthAwarePolicy,
                              ProbePolicy)
}


def uses_predictor(policy: str) -> bool:
    """Whether `policy` takes the run's length predictor (`sampling.predictor`)."""
    return policy in POLICIES and POLICIES[policy].uses_predictor


def make_policy(name: str, samples: Sequence[Sample], micro_group: int,
                predictor: LengthPredictor | None, **options) -> AdmissionPolicy:
    if name not in POLICIES:
        raise SamplingError(f"unknown sampling policy {name!r}; choose one of "
                            f"{', '.join(POLICIES)}")
    return POLICIES[name](samples, micro_group, predictor, **options)
