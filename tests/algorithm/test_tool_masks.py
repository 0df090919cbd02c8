"""Tool answers inside completions are context, not actions (`Rollout.model_masks`): no log-prob
is computed for them, and they stay out of the loss, the KL, the entropy (metric and
high-entropy threshold) and every loss type's normaliser, in both layouts (shared prompt too)."""

import pytest
import torch

from infsamp.algorithm.grpo_step import GRPOStep
from infsamp.algorithm.logprobs import (
    make_micro_batch,
    micro_batch_logprobs_and_entropy,
    sequence_logprobs,
)
from infsamp.algorithm.losses import (
    LOSS_TYPES,
    BatchTotals,
    high_entropy_masks,
    per_token_loss,
)
from infsamp.algorithm.rollout import Rollout
from infsamp.algorithm.shared_prompt import LAYOUTS
from infsamp.choices import clip_range
from infsamp.config_algorithm import TrainingConfig

from test_logprobs import PAD, random_batch, tiny_model

G = 3
_P, COMPLETIONS = random_batch([5, 4], [9, 6, 11, 7, 10, 8])
PROMPTS = [_P[k // G] for k in range(2 * G)]
SPANS = [[(2, 5)], [], [(1, 3), (6, 9)], [(3, 4)], [(4, 8)], [(0, 2)]]  # tool answers' tokens


def masks(spans=SPANS):
    out = []
    for completion, own in zip(COMPLETIONS, spans):
        mask = torch.ones(len(completion))
        for start, end in own:
            mask[start:end] = 0.0
        out.append(mask)
    return out


def rollout(with_masks=True):
    advantages = torch.randn(len(COMPLETIONS), generator=torch.Generator().manual_seed(5))
    return Rollout(PROMPTS, COMPLETIONS, advantages, model_masks=masks() if with_masks else None)


def make_step(share=False, **options):
    cfg = TrainingConfig(share_prompt=share, **options)
    cfg.validate()
    return GRPOStep(tiny_model(), cfg, pad_token_id=PAD, temperature=0.9,
                    max_new_tokens=12, micro_batch_tokens=10_000,
                    ref_model=tiny_model(seed=1) if cfg.beta else None)


def gradients(step, data):
    step.model.zero_grad()
    _, stats = step.accumulate_gradients(data, step.step_inputs(data))
    return {n: p.grad.clone() for n, p in step.model.named_parameters()}, stats


def reference(step, data):
    """The loss by hand: log-probs of every token (no masks), the model mask as the loss mask,
    the step's model-token count as the normaliser."""
    step.model.zero_grad()
    own = masks()
    mb = make_micro_batch(PROMPTS, COMPLETIONS, list(range(len(COMPLETIONS))), PAD)
    logps, entropy = micro_batch_logprobs_and_entropy(step.model, mb, step.temperature)
    ref = None
    if step.cfg.beta:
        ref = mb.gather(sequence_logprobs(step.ref_model, PROMPTS, COMPLETIONS, max_tokens=10_000,
                                          pad_token_id=PAD, temperature=step.temperature))
    loss_mask = mb.gather(own) * mb.completion_mask  # [b, T_c]
    totals = BatchTotals(len(COMPLETIONS), int(sum(m.sum() for m in own)), 12)
    low, high = clip_range(step.cfg.loss_type, step.cfg.epsilon, step.cfg.epsilon_high)
    per_token, stats = per_token_loss(logps, None, ref, data.advantages, epsilon_low=low,
                                      epsilon_high=high, beta=step.cfg.beta, mask=loss_mask,
                                      loss_type=step.cfg.loss_type, entropy=entropy)
    LOSS_TYPES[step.cfg.loss_type].aggregate(per_token, loss_mask, totals).backward()
    return {n: p.grad.clone() for n, p in step.model.named_parameters()}, stats


def assert_same(a, b):
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
@pytest.mark.parametrize("share", [False, True])
def test_tool_tokens_carry_no_loss_kl_or_count(loss_type, share):
    """Every loss type, KL on: the gradient and the statistics are those of the model's tokens
    alone (the normaliser counting them only), in either layout."""
    step = make_step(share, loss_type=loss_type, beta=0.1)
    data = rollout()
    got, stats = gradients(step, data)
    want, want_stats = reference(step, data)
    assert_same(got, want)
    for name in ("kl", "entropy", "clip_ratio/low_mean"):
        assert stats.metrics()[name] == pytest.approx(want_stats.metrics()[name], rel=1e-5)
    assert stats.num_tokens == sum(m.sum() for m in masks()) < sum(map(len, COMPLETIONS))
    unmasked, _ = gradients(step, rollout(with_masks=False))  # the test can fail
    assert any(not torch.allclose(unmasked[n], got[n]) for n in got)


def test_no_logprob_is_computed_for_tool_tokens():
    """The head runs on the model's tokens only: context positions get 0, the others the
    unmasked values, in both layouts."""
    model = tiny_model()
    plain = sequence_logprobs(model, PROMPTS, COMPLETIONS, max_tokens=10_000, pad_token_id=PAD)
    for share in (False, True):
        masked = sequence_logprobs(model, PROMPTS, COMPLETIONS, max_tokens=10_000,
                                   pad_token_id=PAD, build=LAYOUTS[share].build,
                                   model_masks=masks())
        for full, own, mask in zip(plain, masked, masks()):
            assert torch.all(own[mask == 0] == 0)
            torch.testing.assert_close(own[mask == 1], full[mask == 1], atol=1e-5, rtol=1e-5)
    mb = make_micro_batch(PROMPTS, COMPLETIONS, [0], PAD, model_masks=masks())
    assert mb.completion_mask[0].tolist() == masks()[0].tolist()
    assert mb.attention_mask.sum() == len(PROMPTS[0]) + len(COMPLETIONS[0])  # still read


def test_high_entropy_threshold_ignores_tool_tokens():
    """A tool answer's (huge) entropies do not move the threshold of the model's tokens."""
    entropies = [torch.tensor([0.1, 0.2, 9.0, 9.0, 0.3, 0.4])]
    own = [torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0])]
    with_tools = high_entropy_masks(entropies, [True], 0.5, model_masks=own)[0]
    alone = high_entropy_masks([torch.tensor([0.1, 0.2, 0.3, 0.4])], [True], 0.5)[0]
    assert with_tools[own[0] == 1].tolist() == alone.tolist() == [0.0, 0.0, 1.0, 1.0]
    assert high_entropy_masks(entropies, [True], 0.5)[0][:2].tolist() == [0.0, 0.0]


def test_step_totals_count_model_tokens():
    """dapo's normaliser (and bnpo's, cispo's) is the step's model tokens."""
    step = make_step()
    inputs = step.step_inputs(rollout())
    assert inputs.totals.num_tokens == int(sum(m.sum() for m in masks()))
