"""`hidden`: a length predictor on the policy's own hidden states. No torch (numpy only).

At each prediction point (every k generated tokens) the engine has handed the sample the last
layer's hidden state at its latest token (`Sample.hidden_state`, a vector it computed anyway); a
ridge probe maps it, with the `online` predictor's prompt-level features and the log of the tokens
so far, to the log of the remaining length, trained online from the run's finished samples (every
point a sample passed is one example), exponentially forgotten as the policy changes.

It predicts what `online` predicts before a sample starts, whenever no hidden state is there (the
vLLM engine hands none out, or the probe has seen too few examples yet), at a first point whose
start the prompt's prefix memory knows, and past a tool's answer that the turn memory knows (the
state at hand predates the answer). The measurements and the papers behind it: docs/scheduling.md,
"Length predictors".

Simplifications: the hidden state of the current token only (no pooling over the tokens so far);
a linear probe on a fixed scaling (each vector to unit RMS), refit every 32 examples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from infsamp.sampling.length_predictor import LengthPredictor, OnlinePredictor, _Ridge
from infsamp.sampling.types import Sample


class HiddenPredictor(LengthPredictor):
    name = "hidden"
    uses_prefix = True
    uses_hidden = True  # asks the engine for Sample.hidden_state
    adaptive = True

    def __init__(self):
        self._tokens = OnlinePredictor()  # the prior, and the fallback without states
        self._probe: _Ridge | None = None  # sized by the first hidden state
        self._points: dict[int, list[tuple[np.ndarray, int]]] = {}  # sample -> (features, tokens)

    def predict(self, spec: Sample) -> float:
        return self._tokens.predict(spec)

    def predict_remaining(self, spec: Sample, prefix_token_ids: Sequence[int]) -> float:
        fallback = self._tokens.predict_remaining(spec, prefix_token_ids)
        num_tokens = len(prefix_token_ids)
        if spec.hidden_state is None or self._tokens.after_answer(spec, num_tokens) is not None:
            return fallback  # past a tool's answer: the turn memory (the state predates it)
        x = self._features(spec, spec.hidden_state, num_tokens)
        first_point = spec.sample_id not in self._points
        self._points.setdefault(spec.sample_id, []).append((x, num_tokens))
        if first_point and self._tokens.remembered(spec):
            return fallback  # the prompt's own memory of similar starts beats a global probe
        log_remaining = self._probe.predict(x)
        if log_remaining is None:
            return fallback
        most = max(1, spec.max_new_tokens - num_tokens)
        return float(min(most, max(1.0, math.exp(min(log_remaining, 30.0)))))

    def observe_finished(self, spec: Sample, length: int) -> None:
        self._tokens.observe_finished(spec, length)
        for x, num_tokens in self._points.pop(spec.sample_id, ()):
            if length > num_tokens:
                self._probe.add(x, math.log(length - num_tokens))

    def end_call(self) -> None:
        self._tokens.end_call()
        self._points.clear()
        if self._probe is not None:
            self._probe.fit()

    def state_dict(self) -> dict:
        return {"tokens": self._tokens.state_dict(),
                "probe": None if self._probe is None else self._probe.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._tokens.load_state_dict(state["tokens"])
        self._points.clear()
        self._probe = None
        if state["probe"] is not None:
            self._probe = _Ridge(len(state["probe"]["b"]))
            self._probe.load_state_dict(state["probe"])

    def _features(self, spec: Sample, hidden, num_tokens: int) -> np.ndarray:
        state = np.asarray(hidden, dtype=float).ravel()
        state = state / (math.sqrt(float(state @ state) / max(1, state.size)) + 1e-9)
        x = np.concatenate([self._tokens.prompt_features(spec), [math.log1p(num_tokens)], state])
        if self._probe is None:
            self._probe = _Ridge(x.size)
        if x.size != self._probe.b.size:
            raise ValueError(f"hidden predictor: a hidden state of {state.size} values, the probe "
                             f"was built for {self._probe.b.size - x.size + state.size}")
        return x
