"""Length predictors: registry, oracle/noisy, the online ridge learning across calls, quality
measure."""

import itertools
import json
import math
import random
import time

import pytest

from infsamp.errors import SamplingError
from infsamp.sampling.length_predictor import (
    ConstantPredictor,
    NoisyOraclePredictor,
    OnlinePredictor,
    OraclePredictor,
    kendall_tau,
    prediction_quality,
)
from infsamp.sampling.predictors import make_predictor
from infsamp.sampling.types import Sample


def brute_tau_b(x, y):
    pairs = list(itertools.combinations(range(len(x)), 2))
    def sign(v):
        return (v > 0) - (v < 0)

    s = sum(sign(x[i] - x[j]) * sign(y[i] - y[j]) for i, j in pairs)
    ux = sum(abs(sign(x[i] - x[j])) for i, j in pairs)
    uy = sum(abs(sign(y[i] - y[j])) for i, j in pairs)
    return s / math.sqrt(ux * uy)


def test_kendall_tau_matches_brute_force_with_ties():
    rng = random.Random(1)
    x = [rng.randint(0, 5) for _ in range(700)]  # > one 512-row chunk
    y = [xi + rng.randint(-3, 3) for xi in x]
    assert kendall_tau(x, y) == pytest.approx(brute_tau_b(x, y))
    assert kendall_tau([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert kendall_tau([1, 1, 1], [1, 2, 3]) == 0.0


def test_prediction_quality():
    tau, mae = prediction_quality([10, 20, 30], [12, 18, 33])
    assert tau == pytest.approx(1.0) and mae == pytest.approx(7 / 3)
    with pytest.raises(ValueError):
        prediction_quality([1], [1, 2])


def test_registry():
    assert isinstance(make_predictor("none"), ConstantPredictor)
    assert isinstance(make_predictor("oracle"), OraclePredictor)
    assert isinstance(make_predictor("online"), OnlinePredictor)
    noisy = make_predictor("noisy:0.5")
    assert isinstance(noisy, NoisyOraclePredictor) and noisy.sigma == 0.5
    for bad in ("bert", "noisy", "noisy:x", "noisy:-1"):
        with pytest.raises(SamplingError):
            make_predictor(bad)


def spec(sample_id, group_id=0, key="", text="", prompt_tokens=10, max_new=1024):
    return Sample(sample_id, group_id, 0, prompt_tokens, max_new, key, text)


def test_oracle_and_noisy():
    oracle = OraclePredictor({0: 7})
    assert oracle.predict(spec(0)) == 7 and oracle.predict_remaining(spec(0), [1, 2]) == 5
    oracle.set_lengths(lambda s: 3 * s.sample_id)
    assert oracle.predict(spec(4)) == 12
    noisy = NoisyOraclePredictor(0.5, {0: 100}, seed=3)
    first = noisy.predict(spec(0))
    assert first == noisy.predict(spec(0)) != 100  # fixed per sample within a call
    assert NoisyOraclePredictor(0.0, {0: 100}).predict(spec(0)) == 100


def arithmetic_like_call(rng, prompts):
    """Length grows with the digits of the prompt, like the embedded task."""
    specs, lengths = [], []
    for group_id, digits in enumerate(prompts):
        text = "+".join(str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))
                        for _ in range(2)) + "=?"
        for _ in range(8):
            specs.append(spec(len(specs), group_id, f"k{digits}", text))
            lengths.append(max(1, round(12 * digits ** 2 * rng.lognormvariate(0, 0.15))))
    return specs, lengths


def test_online_learns_prompt_features_across_calls():
    rng = random.Random(0)
    predictor = OnlinePredictor()
    taus = []
    for _ in range(12):
        specs, lengths = arithmetic_like_call(rng, [rng.randint(1, 8) for _ in range(4)])
        taus.append(kendall_tau([predictor.predict(s) for s in specs], lengths))
        predictor.update(specs, lengths)
    assert taus[0] == 0.0  # nothing known yet: every prediction alike
    assert min(taus[-4:]) > 0.6


def test_online_uses_finished_siblings_and_history():
    predictor = OnlinePredictor()
    assert predictor.predict(spec(0, max_new=100)) == pytest.approx(50)  # no data: half the limit
    predictor.observe_finished(spec(0, group_id=0, key="a"), 40)
    # a finished sibling
    assert predictor.predict(spec(1, group_id=0, key="a")) == pytest.approx(40)
    predictor.end_call()
    assert predictor.predict(spec(0, group_id=3, key="a")) == pytest.approx(40)  # an earlier epoch


def test_online_prefix_model_learns_token_signal():
    rng = random.Random(0)
    predictor = OnlinePredictor()
    for _ in range(300):  # token 7 in the prefix means a long completion
        long = rng.random() < 0.5
        prefix = [7 if long else 3] * 4
        predictor.predict_remaining(spec(0), prefix)
        predictor.observe_finished(spec(0), 400 if long else 40)
        predictor.end_call()
    assert predictor.predict_remaining(spec(0),
                                       [7] * 4) > 5 * predictor.predict_remaining(spec(0), [3] * 4)


def test_online_is_cheap():
    predictor, rng = OnlinePredictor(), random.Random(0)
    specs, lengths = arithmetic_like_call(rng, [3] * 64)
    start = time.process_time()  # CPU time: other jobs on the machine do not count against it
    for s, length in zip(specs, lengths):
        predictor.predict(s)
        predictor.predict_remaining(s, list(range(16)))
        predictor.observe_finished(s, length)
    per_sample = (time.process_time() - start) / len(specs)
    assert per_sample < 1e-3, f"{per_sample * 1e6:.0f} us per sample"


def test_prefix_memory_tells_short_answers_from_long_derivations():
    from infsamp.sampling.length_predictor import OnlinePredictor

    predictor = OnlinePredictor()
    short, long = [5, 6, 7, 8, 9, 5], [20, 21, 22, 23, 21, 20]  # two ways to start an answer
    for _call in range(3):
        specs = [Sample(i, 0, i, 10, 400, "p1", "12+34=?") for i in range(8)]
        for spec in specs:
            prefix = short if spec.index_in_group % 2 else long
            predictor.predict_remaining(spec, prefix)
        for spec in specs:
            predictor.observe_finished(spec, 30 if spec.index_in_group % 2 else 300)
        predictor.end_call()
    spec_short, spec_long = (Sample(i, 0, i, 10, 400, "p1", "12+34=?") for i in (1, 2))
    assert (predictor.predict_remaining(spec_short, short) + len(short)
            == pytest.approx(30, rel=0.01))
    assert predictor.predict_remaining(spec_long, long) + len(long) == pytest.approx(300, rel=0.01)


def test_prefix_memory_ignores_placeholder_prefixes():
    from collections import Counter

    from infsamp.sampling.length_predictor import PrefixMemory

    memory = PrefixMemory()
    memory.add("p", Counter([0] * 8), 3.0)
    memory.add("p", Counter([1, 2, 3]), 4.0)
    assert memory.predict("p", Counter([0] * 8)) is None
    assert memory.predict("p", Counter([1, 2, 3])) == 4.0
    assert memory.predict("p", Counter([7, 8, 9])) is None  # nothing similar remembered
    assert memory.predict("other", Counter([1, 2, 3])) is None


def test_online_counts_down_after_its_first_point_and_asks_memory_once_outlived():
    predictor = OnlinePredictor()
    for length in (30, 60):  # the prompt's memory: one 30-token and one 60-token sample
        sample = Sample(0, 0, 0, 10, 100, "p")
        predictor.predict_remaining(sample, [5, 6, 7, 8])
        predictor.observe_finished(sample, length)
    sample = Sample(1, 0, 1, 10, 100, "p")
    first = predictor.predict_remaining(sample, [5, 6, 7, 8])
    assert predictor.predict_remaining(sample, [5] * 8) == pytest.approx(first - 4)
    outlived = first + 4 + 10
    assert predictor.predict_remaining(sample, [5] * int(outlived)) == pytest.approx(
        60 - int(outlived))  # only the 60-token sample ran this far


def hidden_samples(rng, num, dim=6):
    """Samples whose hidden state's first coordinate says how long they still run."""
    out = []
    for index in range(num):
        long = rng.random() < 0.5
        sample = Sample(index, 0, index, 10, 300, "p")
        state = [rng.gauss(0, 1) for _ in range(dim)]
        state[0] = 3.0 if long else -3.0
        out.append((sample, state, 200 if long else 20))
    return out


def test_hidden_probe_learns_remaining_length_from_the_hidden_state():
    rng = random.Random(0)
    predictor = make_predictor("hidden")
    assert predictor.uses_hidden and predictor.uses_prefix
    for _ in range(6):  # calls: one group of 16 each
        for sample, state, length in hidden_samples(rng, 16):
            sample.hidden_state = state
            predictor.predict_remaining(sample, [4] * 8)
            predictor.observe_finished(sample, length)
        predictor.end_call()
    long_state, short_state = [3.0] + [0.0] * 5, [-3.0] + [0.0] * 5
    probe = Sample(99, 0, 0, 10, 300, "p")
    probe.hidden_state = long_state
    long = predictor.predict_remaining(probe, [4] * 8)
    probe = Sample(98, 0, 1, 10, 300, "p")
    probe.hidden_state = short_state
    short = predictor.predict_remaining(probe, [4] * 8)
    assert long > 100 and short < 30
    restored = make_predictor("hidden")
    restored.load_state_dict(json.loads(json.dumps(predictor.state_dict())))  # JSON in a checkpoint
    probe = Sample(97, 0, 2, 10, 300, "p")
    probe.hidden_state = long_state
    assert restored.predict_remaining(probe, [4] * 8) == pytest.approx(long)


def test_hidden_without_a_hidden_state_predicts_as_online():
    """The vLLM engine hands out no hidden states: `hidden` then takes online's decisions."""
    rng = random.Random(1)
    hidden, online = make_predictor("hidden"), make_predictor("online")
    for sample, _, length in hidden_samples(rng, 40):
        assert hidden.predict(sample) == pytest.approx(online.predict(sample))
        assert hidden.predict_remaining(sample, [4, 5, 6]) == pytest.approx(
            online.predict_remaining(sample, [4, 5, 6]))
        hidden.observe_finished(sample, length)
        online.observe_finished(sample, length)


def test_hidden_defers_to_the_prefix_memory_at_a_known_start():
    """At a sample's first point `hidden` takes online's prediction when the prompt's prefix
    memory knows similar starts (here the first tokens tell 200 from 20 tokens and the hidden
    state is noise); a start the memory has not seen goes to the probe."""
    rng = random.Random(2)
    hidden, online = make_predictor("hidden"), make_predictor("online")
    starts = {200: [1, 2, 3, 4], 20: [5, 6, 7, 8]}
    for _ in range(4):
        for index in range(16):
            length = 200 if index % 2 else 20
            sample = Sample(index, 0, index, 10, 300, "p")
            sample.hidden_state = [rng.gauss(0, 1) for _ in range(6)]
            for predictor in (hidden, online):
                predictor.predict_remaining(sample, starts[length])
            for predictor in (hidden, online):
                predictor.observe_finished(sample, length)
        for predictor in (hidden, online):
            predictor.end_call()
    for sample_id, (length, start) in enumerate(starts.items()):
        probe = Sample(90 + sample_id, 0, sample_id, 10, 300, "p")
        probe.hidden_state = [rng.gauss(0, 1) for _ in range(6)]
        predicted = hidden.predict_remaining(probe, start)
        assert online.remembered(probe) is False  # the probe sample is new to the other one
        assert predicted == pytest.approx(online.predict_remaining(probe, start))
        assert hidden._tokens.remembered(probe)
        assert abs(math.log((predicted + len(start)) / length)) < 0.2
    unseen = Sample(99, 0, 9, 10, 300, "p")
    unseen.hidden_state = [0.0] * 6
    hidden.predict_remaining(unseen, [9, 10, 11, 12])
    assert not hidden._tokens.remembered(unseen)
