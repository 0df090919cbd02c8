"""Length predictors for the length-aware scheduler, and their quality measure. No torch.

Interface (`LengthPredictor`): `predict(spec)` expected total length; `predict_remaining(spec,
prefix)` remaining length after the generated tokens so far (every k of them);
`observe_finished(spec, length)` a sample of the current call ended (its siblings can use it);
`end_call()` the call (training step) is over, learn from it. `SlotScheduler` makes these calls
itself; the engine only hands the predictor in.

Predictors (registered in `predictors.py`, `make_predictor`): `none` (a constant), `oracle` (the
true lengths, for measurement only), `noisy:SIGMA` (the true length times a log-normal error) and
`online`: a ridge regression on log length over cheap prompt features, learned inside the run from
its own completions (exponentially forgotten, so it follows the policy), and, token-conditioned, a
second ridge that adds a hashed bag of the first k generated token ids, overruled by a per-prompt
memory of finished samples' first k tokens (`PrefixMemory`); its features and rules are told in
docs/scheduling.md, "Length predictors". `hidden` (`hidden_predictor.py`) adds a probe on the
policy's own hidden states.

Multi-turn episodes (tool calls): a length is the model's tokens, the decode work (a tool's
answer is prefilled context, `Sample.context_spans`, and never counted); `online` also keeps a
`TurnMemory` (`turn_memory.py`) of the model tokens episodes decoded from each turn on, per prompt
and for the run, and predicts a sample resumed after a tool's answer from it (what the prompt's
episodes decoded from that turn on, less what this turn has decoded), before its own countdown.

Simplification: features are fixed and hand-picked; after the first prediction point the online
predictor only counts down its prediction (or, once outlived, asks the prompt's memory).
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from infsamp.sampling.prefix_memory import PrefixMemory
from infsamp.sampling.turn_memory import TurnMemory, model_turn_lengths
from infsamp.sampling.types import Sample

NUMBER = re.compile(r"\d+")


class LengthPredictor:
    name = ""
    uses_prefix = False  # wants predict_remaining every k generated tokens (k, 2k, ...)
    uses_hidden = False  # wants the engine's last hidden state on each sample (Sample.hidden_state)
    adaptive = False     # predictions of pending samples change as samples finish

    def predict(self, spec: Sample) -> float:
        raise NotImplementedError

    def predict_remaining(self, spec: Sample, prefix_token_ids: Sequence[int]) -> float:
        return max(1.0, self.predict(spec) - len(prefix_token_ids))

    def observe_finished(self, spec: Sample, length: int) -> None:
        pass

    def end_call(self) -> None:
        pass

    def update(self, specs: Sequence[Sample], lengths: Sequence[int]) -> None:
        """Learn from a whole finished call at once (when the scheduler did not see it)."""
        for spec, length in zip(specs, lengths):
            self.observe_finished(spec, length)
        self.end_call()

    def state_dict(self) -> dict:
        """What it learned, as plain dicts, lists and numbers (a checkpoint stores it as JSON)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class ConstantPredictor(LengthPredictor):
    """`none`: every sample looks alike (half its max_new_tokens)."""
    name = "none"

    def predict(self, spec):
        return spec.max_new_tokens / 2


class OraclePredictor(LengthPredictor):
    """`oracle`: the true length, from a sample_id -> length mapping or a spec -> length
    function."""
    name = "oracle"

    def __init__(self, lengths: Mapping[int, int] | Callable[[Sample], int] | None = None):
        self.set_lengths(lengths or {})

    def set_lengths(self, lengths: Mapping[int, int] | Callable[[Sample], int]) -> None:
        """The true lengths of the next call's samples."""
        self._length_of = lengths if callable(lengths) else (lambda spec: lengths[spec.sample_id])

    def predict(self, spec):
        return float(self._length_of(spec))


class NoisyOraclePredictor(OraclePredictor):
    """`noisy:SIGMA`: the true length times exp(N(0, SIGMA)), fixed per sample and call."""
    name = "noisy"

    def __init__(self, sigma: float, lengths=None, seed: int = 0):
        super().__init__(lengths)
        self.sigma, self._rng = sigma, random.Random(seed)
        self._noise: dict[int, float] = {}

    def predict(self, spec):
        if spec.sample_id not in self._noise:
            self._noise[spec.sample_id] = math.exp(self._rng.gauss(0.0, self.sigma))
        return super().predict(spec) * self._noise[spec.sample_id]

    def end_call(self):
        self._noise.clear()


class _Ridge:
    """Ridge regression with exponential forgetting, refit lazily; silent until MIN_SEEN samples."""
    MIN_SEEN = 16
    DECAY = 0.999  # per sample added
    REFIT_EVERY = 32

    def __init__(self, num_features: int):
        self.a = np.eye(num_features)  # the ridge: l2 = 1
        self.b = np.zeros(num_features)
        self.weights: np.ndarray | None = None
        self.num_unfit, self.num_seen = 0, 0

    def add(self, x: np.ndarray, y: float) -> None:
        self.a *= self.DECAY
        self.b *= self.DECAY
        self.a += np.outer(x, x)
        self.b += y * x
        self.num_unfit += 1
        self.num_seen += 1
        if (self.num_unfit >= self.REFIT_EVERY
                or self.weights is None and self.num_seen >= self.MIN_SEEN):
            self.fit()

    def fit(self) -> None:
        if self.num_seen >= self.MIN_SEEN:
            self.weights = np.linalg.solve(self.a, self.b)
            self.num_unfit = 0

    def predict(self, x: np.ndarray) -> float | None:
        return None if self.weights is None else float(x @ self.weights)

    def state_dict(self) -> dict:
        return {"a": self.a.tolist(), "b": self.b.tolist(),
                "weights": None if self.weights is None else self.weights.tolist(),
                "num_unfit": self.num_unfit, "num_seen": self.num_seen}

    def load_state_dict(self, state: dict) -> None:
        self.a, self.b = np.array(state["a"], dtype=float), np.array(state["b"], dtype=float)
        weights = state["weights"]
        self.weights = None if weights is None else np.array(weights, dtype=float)
        self.num_unfit, self.num_seen = state["num_unfit"], state["num_seen"]


class OnlinePredictor(LengthPredictor):
    """`online`: learned inside the run from its own completions (see the module docstring)."""
    name = "online"
    uses_prefix = True
    adaptive = True
    NUM_BUCKETS = 32

    def __init__(self):
        self._prompt_features: dict[str, list[float]] = {}
        # key -> [sum log L, n]
        self._history: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        # group -> same, this call
        self._siblings: dict[int, list[float]] = defaultdict(lambda: [0.0, 0])
        self._call_logs: list[tuple[str, float]] = []
        # sample -> (features, k, token counts)
        self._prefixes: dict[int, tuple[np.ndarray, int, Counter]] = {}
        self._totals: dict[int, float] = {}  # sample -> total predicted at its first point
        self._remembered: set[int] = set()  # samples whose first point the prefix memory knew
        self._memory = PrefixMemory()
        self._turns = TurnMemory()
        self._run_mean: float | None = None
        # (group, key) -> prediction; cleared on news
        self._cache: dict[tuple[int, str], float] = {}
        self._model = _Ridge(len(self.prompt_features(_probe_spec())))
        self._prefix_model = _Ridge(len(self._prefix_features(_probe_spec(), [])))

    def predict(self, spec):
        cache_key = (spec.group_id, spec.prompt_key)  # siblings look alike until a prefix is seen
        if cache_key not in self._cache:
            log_length = self._model.predict(self.prompt_features(spec))
            self._cache[cache_key] = self._from_log(log_length, spec)
        return self._cache[cache_key]

    def predict_remaining(self, spec, prefix_token_ids):
        """At the first prediction point: from the first k tokens (the prefix memory, else the
        prefix ridge). Later: that prediction's remainder, or, once the sample has outlived it,
        what its prompt's longer remembered samples ran past this point. Past a tool's answer:
        the turn memory's remainder for its turn, when an episode reached that turn."""
        num_tokens = len(prefix_token_ids)
        after_answer = self.after_answer(spec, num_tokens)
        if after_answer is not None:
            return after_answer
        first = self._prefixes.get(spec.sample_id)
        if first is not None and num_tokens > first[1]:  # a later point of the same sample
            total = self._totals[spec.sample_id]
            if total > num_tokens:
                return total - num_tokens
            return self._memory.remaining_after(_memory_key(spec), num_tokens)
        x, counts = self._prefix_features(spec, prefix_token_ids), Counter(prefix_token_ids)
        self._prefixes[spec.sample_id] = (x, num_tokens, counts)
        remembered = self._memory.predict(_memory_key(spec), counts)
        if remembered is not None:
            self._remembered.add(spec.sample_id)
        log_total = remembered if remembered is not None else self._prefix_model.predict(x)
        remaining = max(1.0, self._from_log(log_total, spec) - num_tokens)
        self._totals[spec.sample_id] = num_tokens + remaining
        return remaining

    def after_answer(self, spec, num_tokens: int) -> float | None:
        """A sample past k tool answers is at turn k: what episodes of its prompt (else of the
        run) decoded from turn k on, less this turn's tokens so far, within the room left."""
        if not spec.context_spans:
            return None
        in_turn = num_tokens - spec.context_spans[-1][1]
        remaining = self._turns.remaining(_memory_key(spec), len(spec.context_spans), in_turn)
        if remaining is None:
            return None
        return max(1.0, min(remaining, float(spec.max_new_tokens - num_tokens)))

    def remembered(self, spec) -> bool:
        """Whether this sample's first-point prediction came from its prompt's prefix memory
        (similar first tokens of the same prompt seen finishing), not from the ridge."""
        return spec.sample_id in self._remembered

    def observe_finished(self, spec, length):
        self._cache.clear()
        self._remembered.discard(spec.sample_id)
        turns = model_turn_lengths(length, spec.context_spans)  # the model's tokens per turn
        self._turns.add(_memory_key(spec), turns)
        log_length = math.log(max(1, sum(turns)))
        self._model.add(self.prompt_features(spec), log_length)
        x, num_prefix, counts = self._prefixes.pop(spec.sample_id, (None, 0, None))
        self._totals.pop(spec.sample_id, None)
        if x is not None and length > num_prefix:
            self._prefix_model.add(x, log_length)
            self._memory.add(_memory_key(spec), counts, log_length)
        sibling = self._siblings[spec.group_id]
        sibling[0] += log_length
        sibling[1] += 1
        self._call_logs.append((spec.prompt_key, log_length))
        self._run_mean = (log_length if self._run_mean is None
                          else 0.98 * self._run_mean + 0.02 * log_length)

    def state_dict(self) -> dict:
        """Between calls (what a checkpoint sees) the per-call parts are empty; kept anyway."""
        return {"history": {k: list(v) for k, v in self._history.items()},
                "siblings": [[g, list(v)] for g, v in self._siblings.items()],
                "call_logs": [list(item) for item in self._call_logs], "run_mean": self._run_mean,
                "model": self._model.state_dict(), "prefix_model": self._prefix_model.state_dict(),
                "memory": self._memory.state_dict(), "turns": self._turns.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._history.clear()
        self._history.update({k: list(v) for k, v in state["history"].items()})
        self._siblings.clear()
        self._siblings.update({int(g): list(v) for g, v in state["siblings"]})
        self._call_logs = [(key, log_length) for key, log_length in state["call_logs"]]
        self._run_mean = state["run_mean"]
        self._model.load_state_dict(state["model"])
        self._prefix_model.load_state_dict(state["prefix_model"])
        self._memory.load_state_dict(state["memory"])
        self._turns.load_state_dict(state.get("turns", {}))  # older checkpoints: none
        self._cache.clear()
        self._prefixes.clear()
        self._totals.clear()
        self._remembered.clear()

    def end_call(self):
        for key, log_length in self._call_logs:
            if key:
                self._history[key][0] += log_length
                self._history[key][1] += 1
        self._call_logs.clear()
        self._cache.clear()
        self._siblings.clear()
        self._prefixes.clear()
        self._totals.clear()
        self._remembered.clear()
        self._model.fit()
        self._prefix_model.fit()

    def _from_log(self, log_length: float | None, spec) -> float:
        if log_length is None:  # not fitted yet: siblings, history, run mean, then half the limit
            log_length = self._fallback_log(spec)
        return float(min(spec.max_new_tokens, max(1.0, math.exp(min(log_length, 30.0)))))

    def _fallback_log(self, spec) -> float:
        for total, count in (self._siblings.get(spec.group_id, (0.0, 0)),
                             self._history.get(spec.prompt_key, (0.0, 0))):
            if count:
                return total / count
        return self._run_mean if self._run_mean is not None else math.log(spec.max_new_tokens / 2)

    def prompt_features(self, spec) -> np.ndarray:
        """What is known of a sample before it starts (its prompt, history, siblings, the run)."""
        prompt = self._prompt_features.get(spec.prompt_text)
        if prompt is None:
            prompt = self._prompt_features[spec.prompt_text] = _text_features(spec.prompt_text)
        sib_total, sib_count = self._siblings.get(spec.group_id, (0.0, 0))
        hist_total, hist_count = self._history.get(spec.prompt_key, (0.0, 0))  # no "" key: end_call
        run = self._run_mean if self._run_mean is not None else 0.0
        return np.array([1.0, math.log1p(spec.prompt_tokens), *prompt, run,
                         float(sib_count > 0), sib_total / sib_count if sib_count else 0.0,
                         float(hist_count > 0), hist_total / hist_count if hist_count else 0.0])

    def _prefix_features(self, spec, token_ids: Sequence[int]) -> np.ndarray:
        """Base features plus a hashed bag of the first k token ids."""
        return np.concatenate([self.prompt_features(spec), self._bag(token_ids)])

    def _bag(self, token_ids: Sequence[int]) -> np.ndarray:
        bag = np.zeros(self.NUM_BUCKETS + 1)
        for token in token_ids:
            bag[(int(token) * 2654435761) % self.NUM_BUCKETS] += 1.0
        if len(token_ids):
            bag[:-1] /= len(token_ids)
        bag[-1] = len(token_ids) / 64
        return bag


def _memory_key(spec) -> str:
    """Samples of the same prompt share a memory: its key across epochs, else its text."""
    return spec.prompt_key or spec.prompt_text


def _text_features(text: str) -> list[float]:
    numbers = NUMBER.findall(text)
    longest = max((len(n) for n in numbers), default=0)
    return [math.log1p(len(text)), math.log1p(sum(len(n) for n in numbers)),
            math.log1p(len(numbers)), float(longest), float(longest) ** 2 / 10]


def _probe_spec():
    return Sample(0, 0, 0, 1, 1)


def kendall_tau(predicted: Sequence[float], real: Sequence[float]) -> float:
    """Kendall's tau-b (ties allowed); 0.0 when either side is constant. O(n^2) in numpy chunks."""
    x, y = np.asarray(predicted, dtype=float), np.asarray(real, dtype=float)
    concordance, untied_x, untied_y = 0.0, 0.0, 0.0
    for start in range(0, len(x), 512):
        dx = np.sign(x[start:start + 512, None] - x[None, :])  # [chunk, n]
        dy = np.sign(y[start:start + 512, None] - y[None, :])  # [chunk, n]
        concordance += float((dx * dy).sum())
        untied_x += float(np.abs(dx).sum())
        untied_y += float(np.abs(dy).sum())
    if untied_x == 0 or untied_y == 0:
        return 0.0
    return concordance / math.sqrt(untied_x * untied_y)


def prediction_quality(predicted: Sequence[float], real: Sequence[float]) -> tuple[float, float]:
    """(Kendall tau-b, mean absolute error) of predicted vs real lengths over one call's samples."""
    if len(predicted) != len(real):
        raise ValueError(f"prediction_quality: {len(predicted)} predictions for {len(real)} "
                         "lengths")
    if not real:
        return 0.0, 0.0
    mae = float(np.mean(np.abs(np.asarray(predicted, dtype=float) - np.asarray(real, dtype=float))))
    return kendall_tau(predicted, real), mae
