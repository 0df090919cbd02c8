"""Sequences of advantage 0 are not forwarded in the training pass where they carry exactly no
gradient (same gradient as forwarding them), and are forwarded whenever a condition fails."""

import pytest
import torch

from infsamp.algorithm.rollout import Rollout

from test_shared_prompt import COMPLETIONS, PROMPTS, make_step


def rollout():
    advantages = torch.randn(len(COMPLETIONS), generator=torch.Generator().manual_seed(3))
    advantages[4:8] = 0.0  # one group without reward spread
    advantages[0] = 0.0
    return Rollout(PROMPTS, COMPLETIONS, advantages)


def gradients(step, batch):
    step.model.zero_grad()
    loss, _ = step.accumulate_gradients(batch, step.step_inputs(batch))
    return loss, {n: p.grad.clone() for n, p in step.model.named_parameters()}


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "gspo", "cispo"])
def test_skipping_is_exact(loss_type):
    batch = rollout()
    skipping = make_step(True, 40, loss_type=loss_type)
    assert len(skipping.carrying_gradient(batch)) == len(COMPLETIONS) - 5
    loss, grads = gradients(skipping, batch)
    assert skipping.skipped_sequences == 5
    forwarding = make_step(True, 40, loss_type=loss_type)
    forwarding.skips_zero_advantages = lambda: False
    loss_all, grads_all = gradients(forwarding, batch)
    assert forwarding.skipped_sequences == 0
    assert skipping.forwarded_tokens < forwarding.forwarded_tokens
    assert loss == pytest.approx(loss_all, rel=1e-5, abs=1e-7)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_all[name], rtol=1e-5, atol=1e-7)


def test_all_skipped_still_gives_zero_gradients():
    batch = Rollout(PROMPTS, COMPLETIONS, torch.zeros(len(COMPLETIONS)))
    step = make_step(True, 40)
    gradients(step, batch)
    assert step.skipped_sequences == len(COMPLETIONS)
    assert all(p.grad is not None and not p.grad.any() for p in step.model.parameters())


@pytest.mark.parametrize("condition", [dict(beta=0.1), dict(top_entropy_quantile=0.5),
                                       dict(num_iterations=2)])
def test_nothing_skipped_when_a_condition_fails(condition):
    step = make_step(True, 40, **condition)
    assert step.carrying_gradient(rollout()) == list(range(len(COMPLETIONS)))
