"""GRPOStep: truncation and high-entropy masks, importance weights and the entropy metric, with
micro-batched gradients equal to whole-batch gradients for every loss type."""

import pytest
import torch

from infsamp.algorithm.grpo_step import GRPOStep
from infsamp.algorithm.logprobs import plan_sequence_batches, sequence_logprobs_and_entropy
from infsamp.algorithm.losses import LOSS_TYPES
from infsamp.algorithm.rollout import Rollout
from infsamp.config_algorithm import TrainingConfig

from test_logprobs import PAD, random_batch, tiny_model

PROMPTS, COMPLETIONS = random_batch([4, 4, 4, 7, 7, 7], [12, 2, 6, 9, 1, 4])
TRUNCATED = [True, False, False, True, False, False]


def make_rollout(**kw):
    advantages = torch.randn(len(COMPLETIONS), generator=torch.Generator().manual_seed(3))
    return Rollout(PROMPTS, COMPLETIONS, advantages, **kw)


def make_step(budget=10_000, **options):
    cfg = TrainingConfig(**options)
    cfg.validate()
    return GRPOStep(tiny_model(), cfg, pad_token_id=PAD, temperature=0.9, max_new_tokens=12,
                    micro_batch_tokens=budget)


def gradients(step, rollout):
    step.model.zero_grad()
    _, stats = step.accumulate_gradients(rollout, step.step_inputs(rollout))
    return {n: p.grad.clone() for n, p in step.model.named_parameters()}, stats


def assert_same(a, b):
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_masked_micro_batches_equal_the_whole_batch(loss_type):
    options = dict(loss_type=loss_type, top_entropy_quantile=0.3, mask_truncated_completions=True,
                   beta=0.0, num_iterations=2)
    rollout = make_rollout(truncated=TRUNCATED)
    full, _ = gradients(make_step(10_000, **options), rollout)
    split, _ = gradients(make_step(30, **options), rollout)
    assert_same(split, full)
    unmasked, _ = gradients(make_step(10_000, loss_type=loss_type), rollout)
    assert any(not torch.allclose(unmasked[n], full[n]) for n in full)  # the masks did something


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_evenly_cut_micro_batches_equal_the_whole_batch(loss_type):
    # padded (prompt, completion) widths (4,12) (4,2) (4,6) (7,9) (7,1) (7,4) under 40 tokens:
    # greedy packing [0 3] [5 2 4] [1] (fullest 3 x 13 = 39), the even cut [0 3] [5 2] [4 1] (38)
    assert plan_sequence_batches(PROMPTS, COMPLETIONS, 40) == [[0, 3], [5, 2], [4, 1]]
    options = dict(loss_type=loss_type, mask_truncated_completions=True, num_iterations=2)
    rollout = make_rollout(truncated=TRUNCATED)
    full, _ = gradients(make_step(10_000, **options), rollout)
    even, _ = gradients(make_step(40, **options), rollout)
    assert_same(even, full)


def test_truncated_completions_carry_no_loss():
    masked, _ = gradients(make_step(mask_truncated_completions=True),
                          make_rollout(truncated=TRUNCATED))
    kept = [i for i, cut in enumerate(TRUNCATED) if not cut]
    only_kept = Rollout([PROMPTS[i] for i in kept], [COMPLETIONS[i] for i in kept],
                        make_rollout().advantages[kept])
    expected, _ = gradients(make_step(), only_kept)  # dapo: token mean over the kept tokens
    assert_same(masked, expected)
    flag_ignored, _ = gradients(make_step(), make_rollout(truncated=TRUNCATED))  # option off
    plain, _ = gradients(make_step(), make_rollout())
    assert_same(flag_ignored, plain)


def test_importance_weights_multiply_the_loss():
    weights = [torch.full((len(c),), 2.0) for c in COMPLETIONS]
    doubled, _ = gradients(make_step(30), make_rollout(importance_weights=weights))
    plain, _ = gradients(make_step(30), make_rollout())
    assert_same(doubled, {n: 2 * g for n, g in plain.items()})


def test_entropy_metric_is_the_mean_token_entropy():
    step = make_step(30)
    _, stats = gradients(step, make_rollout())
    _, entropies = sequence_logprobs_and_entropy(step.model, PROMPTS, COMPLETIONS,
                                                 max_tokens=10_000, pad_token_id=PAD,
                                                 temperature=0.9)
    expected = torch.cat(entropies).mean().item()
    assert stats.metrics()["entropy"] == pytest.approx(expected, rel=1e-5)


def test_truncation_flags_must_match_the_completions():
    with pytest.raises(ValueError, match="Rollout.truncated"):
        make_step(mask_truncated_completions=True).step_inputs(make_rollout(truncated=[True]))


@pytest.mark.parametrize("options", [{}, {"beta": 0.04}, {"top_entropy_quantile": 0.5},
                                     {"num_iterations": 2, "loss_type": "grpo"}])
def test_a_rank_with_nothing_to_train_runs_one_zero_backward(options):
    """Dynamic sampling over ranks: every group a rank sampled may be dropped. Its empty rollout
    (the step's totals from the other ranks) still runs a backward, so DDP's reduction meets the
    other ranks', and adds exactly nothing."""
    step = make_step(**options)
    if options.get("beta"):
        step.ref_model = tiny_model()
    optimizer = torch.optim.SGD(step.model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    before = {n: p.detach().clone() for n, p in step.model.named_parameters()}
    backwards = []
    next(step.model.parameters()).register_hook(lambda grad: backwards.append(grad.abs().max()))
    empty = Rollout([], [], torch.zeros(0), truncated=[], totals=step.totals_of([5, 6], None))
    metrics = step.optimize(empty, optimizer, scheduler)
    assert metrics["loss"] == 0.0 and metrics["grad_norm"] == 0.0
    assert backwards == [0.0] * step.cfg.num_iterations  # one backward a pass, of zeros
    for name, value in step.model.named_parameters():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)
