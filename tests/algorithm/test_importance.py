"""Truncated importance sampling for vLLM-sampled completions: the modes by hand, and the GRPO
step's loss is unchanged without engine log-probs or when they agree exactly."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from infsamp.algorithm.grpo_step import GRPOStep
from infsamp.algorithm.importance import IS_MODES, MismatchStats, engine_importance_weights
from infsamp.algorithm.logprobs import sequence_logprobs
from infsamp.algorithm.rollout import Rollout
from infsamp.config_algorithm import TrainingConfig

OLD = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
ENGINE = torch.tensor([[0.0, -0.5, -2.0], [0.1, 0.0, -3.0]])  # old - engine: 0 .5 2 | -.1 0 3
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_token_modes_by_hand():
    truncated = engine_importance_weights(OLD, ENGINE, MASK, "token_truncate", cap=3.0)
    expected = torch.tensor([[1.0, math.exp(0.5), 3.0], [math.exp(-0.1), 1.0, 1.0]])
    torch.testing.assert_close(truncated, expected)
    masked = engine_importance_weights(OLD, ENGINE, MASK, "token_mask", cap=3.0)
    expected = torch.tensor([[1.0, math.exp(0.5), 0.0], [math.exp(-0.1), 1.0, 1.0]])
    torch.testing.assert_close(masked, expected)


def test_sequence_modes_by_hand():
    truncated = engine_importance_weights(OLD, ENGINE, MASK, "sequence_truncate", cap=3.0)
    expected = torch.tensor([[3.0], [math.exp(-0.1)]])  # e^2.5 capped; padding ignored
    torch.testing.assert_close(truncated, expected)
    masked = engine_importance_weights(OLD, ENGINE, MASK, "sequence_mask", cap=20.0)
    torch.testing.assert_close(masked, torch.tensor([[math.exp(2.5)], [math.exp(-0.1)]]))
    assert engine_importance_weights(OLD, ENGINE, MASK, "off", 3.0).eq(1.0).all()


def test_equal_log_probs_weigh_exactly_one():
    logps = torch.randn(3, 7)
    for mode in IS_MODES:
        weights = engine_importance_weights(logps, logps.clone(), torch.ones(3, 7), mode, 3.0)
        assert weights.eq(1.0).all(), mode


def test_mismatch_stats():
    stats = MismatchStats()
    weights = engine_importance_weights(OLD, ENGINE, MASK, "token_truncate", 3.0)
    stats.add(OLD, ENGINE, MASK, weights)
    metrics = stats.metrics()
    assert metrics["sampling/logprob_abs_diff_max"] == pytest.approx(2.0)  # the 3.0 is masked
    assert metrics["sampling/logprob_abs_diff_mean"] == pytest.approx((0.5 + 2.0 + 0.1) / 5)
    assert metrics["sampling/importance_weight_max"] == pytest.approx(3.0)
    assert MismatchStats().metrics() == {}


def _step_gradients(model, rollout, mode="token_truncate"):
    cfg = TrainingConfig(learning_rate=0.0, max_grad_norm=0.0, loss_type="dapo")
    step = GRPOStep(model, cfg, pad_token_id=0, temperature=0.7, max_new_tokens=8,
                    micro_batch_tokens=40, importance_sampling=mode)
    model.zero_grad()
    step.accumulate_gradients(rollout, step.step_inputs(rollout))
    return {n: p.grad.clone() for n, p in model.named_parameters()}, step


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=0)
    return LlamaForCausalLM(config)


def test_loss_unchanged_without_engine_logprobs_or_when_they_agree(model):
    prompts, completions = [[3, 4, 5], [6, 7]] * 2, [[8, 9, 10], [11, 12, 13, 14], [15], [16, 17]]
    advantages = torch.tensor([1.0, -0.5, 0.3, -0.8])
    plain = Rollout(prompts, completions, advantages)
    with torch.no_grad():
        exact = sequence_logprobs(model, prompts, completions, max_tokens=40, pad_token_id=0,
                                  temperature=0.7)
    agreeing = Rollout(prompts, completions, advantages,
                       engine_logprobs=[t.clone() for t in exact])
    off = Rollout(prompts, completions, advantages, engine_logprobs=[t - 0.5 for t in exact])
    base, _ = _step_gradients(model, plain)
    same, step = _step_gradients(model, agreeing)
    shifted, _ = _step_gradients(model, off)
    for name, grad in base.items():
        torch.testing.assert_close(same[name], grad, rtol=0, atol=1e-7, msg=name)
    assert step.mismatch.metrics()["sampling/logprob_abs_diff_max"] < 1e-5
    # engine log-probs 0.5 lower: every weight exp(0.5) -> the gradient scales by e^0.5 (< cap)
    for name, grad in base.items():
        torch.testing.assert_close(shifted[name], math.exp(0.5) * grad, rtol=1e-4, atol=1e-6,
                                   msg=name)


def test_an_out_of_memory_retry_measures_the_mismatch_once(model, monkeypatch):
    """A micro-batch whose backward runs out of memory is split and run again: its tokens count
    once in the mismatch statistics, as in a run without the retry."""
    prompts, completions = [[3, 4, 5], [6, 7]] * 2, [[8, 9, 10], [11, 12, 13, 14], [15], [16, 17]]
    rollout = Rollout(prompts, completions, torch.tensor([1.0, -0.5, 0.3, -0.8]),
                      engine_logprobs=[torch.full((len(c),), -0.5) for c in completions])
    _, clean = _step_gradients(model, rollout)
    original, calls = torch.Tensor.backward, {"n": 0}

    def fails_once(tensor, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", fails_once)
    _, retried = _step_gradients(model, rollout)
    assert retried.num_oom_retries == 1
    assert retried.mismatch.num_tokens == clean.mismatch.num_tokens == sum(map(len, completions))
    assert retried.mismatch.metrics() == pytest.approx(clean.mismatch.metrics())
