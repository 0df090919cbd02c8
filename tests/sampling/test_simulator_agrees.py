"""Issue 4 item 4: replaying a real sampling run's lengths through the simulator gives the decode steps
the real engine reported, for every policy (a random tiny Llama, sampled lengths, a KV budget)."""

import pytest
import torch

from infsamp.config import SamplingConfig
from infsamp.models.tiny import build_model, build_tokenizer
from infsamp.sampling.length_predictor import OraclePredictor
from infsamp.sampling.sampler import GroupSampler
from infsamp.sampling.types import make_samples
from infsamp.sampling.simulator import run_call

EOS = build_tokenizer().eos_token_id

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14]]
GROUP_SIZE, MAX_NEW = 6, 12


@pytest.fixture(scope="module")
def model():
    """The embedded model's architecture with random weights."""
    return build_model(build_tokenizer(), seed=0).eval()


class EosBoost:
    def __init__(self, specs):
        pass

    def __call__(self, sample_ids, num_generated, scores):
        scores = scores.clone()
        scores[:, EOS] += 3.5  # lengths spread over 1..12
        return scores


def sample(model, policy, kv_budget, predictor=None):
    cfg = SamplingConfig(policy=policy, micro_group=3, kv_budget=kv_budget, max_new_tokens=MAX_NEW,
                         temperature=1.0, predictor="none")
    generator = torch.Generator().manual_seed(7)
    return GroupSampler(model, None, cfg, predictor).sample(PROMPTS, GROUP_SIZE, generator=generator,
                                                           logits_processor_factory=EosBoost)


REFERENCE = {}


def reference_lengths(model, kv_budget):
    if kv_budget not in REFERENCE:
        result = sample(model, "continuous", kv_budget)
        REFERENCE[kv_budget] = [c.length for group in result.groups for c in group]
    return REFERENCE[kv_budget]


@pytest.mark.parametrize("kv_budget", ["40"])  # g=2 by budget; a larger one adds time, not coverage
@pytest.mark.parametrize("policy, predictor", [("full", None), ("rounds", None), ("continuous", None),
                                               ("length_aware", None), ("length_aware", "oracle")])
def test_replay_matches_the_real_engine(model, policy, predictor, kv_budget):
    torch.set_num_threads(1)
    lengths = reference_lengths(model, kv_budget)
    assert len(set(lengths)) > 2  # lengths vary, so the schedule matters
    oracle = OraclePredictor(dict(enumerate(lengths))) if predictor == "oracle" else None
    real = sample(model, policy, kv_budget, oracle)
    assert [c.length for group in real.groups for c in group] == lengths  # schedule-independent sampling
    samples = make_samples([len(p) for p in PROMPTS], GROUP_SIZE, MAX_NEW)
    replay_predictor = OraclePredictor() if predictor == "oracle" else None
    replay = run_call(samples, lengths, policy, real.stats.micro_group, real.stats.kv_budget_tokens,
                      replay_predictor)
    assert real.stats.micro_group == (len(lengths) if policy == "full" else 2)
    assert replay.decode_steps == real.stats.decode_steps
    assert replay.lower_bound == real.stats.lower_bound
    assert replay.peak_kv_tokens_used == real.stats.peak_kv_tokens_used
