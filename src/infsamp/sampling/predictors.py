"""The registry of length predictors (`sampling.predictor`, `--predictor`). No torch.

`make_predictor(name)`: `none` (a constant: no information), `oracle` (the true lengths, for
measurement only), `noisy:SIGMA` (the true length times a log-normal error of that sigma),
`online` (prompt features and the first generated tokens, learned inside the run;
`length_predictor.py`) and `hidden` (a probe on the policy's own hidden states;
`hidden_predictor.py`).
"""

from __future__ import annotations

from collections.abc import Callable

from infsamp.errors import SamplingError
from infsamp.sampling.hidden_predictor import HiddenPredictor
from infsamp.sampling.length_predictor import (
    ConstantPredictor,
    LengthPredictor,
    NoisyOraclePredictor,
    OnlinePredictor,
    OraclePredictor,
)

PREDICTORS: dict[str, Callable[[str | None], LengthPredictor]] = {
    "none": lambda arg: ConstantPredictor(),
    "oracle": lambda arg: OraclePredictor(),
    "online": lambda arg: OnlinePredictor(),
    "hidden": lambda arg: HiddenPredictor(),
    "noisy": lambda arg: NoisyOraclePredictor(_parse_sigma(arg)),
}


def make_predictor(name: str) -> LengthPredictor:
    """`none`, `oracle`, `online`, `hidden` or `noisy:SIGMA` (oracle/noisy need `set_lengths`
    before each call)."""
    base, _, arg = name.partition(":")
    if base not in PREDICTORS:
        raise SamplingError(f"unknown length predictor {name!r}; choose none, oracle, online, "
                            "hidden or noisy:SIGMA")
    return PREDICTORS[base](arg or None)


def _parse_sigma(arg: str | None) -> float:
    try:
        sigma = float(arg)
    except (TypeError, ValueError):
        raise SamplingError(f"noisy predictor needs a sigma, as noisy:0.5; got {arg!r}") from None
    if not sigma >= 0:
        raise SamplingError(f"noisy predictor sigma must be >= 0, got {sigma}")
    return sigma
