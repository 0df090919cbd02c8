"""training.share_prompt: the prompt forwarded once per group gives the unshared log-probs,
losses and gradients (fp32, relative 1e-5) for every loss type, LoRA and full, chunked head on
and off, num_iterations 2, gradient checkpointing; to bf16 rounding with bf16 weights and under
the `mixed` autocast; and forwards fewer tokens. Two processes (DDP, FSDP2) train in the shared
layout by default: tests/distributed/ compare them with one process."""

import pytest
import torch

from infsamp.algorithm.grpo_step import GRPOStep
from infsamp.algorithm.losses import LOSS_TYPES
from infsamp.algorithm.rollout import Rollout
from infsamp.algorithm.shared_prompt import LAYOUTS, plan_shared_batches
from infsamp.config_algorithm import TrainingConfig

from test_logprobs import PAD, random_batch, tiny_model

GROUPS, G = 3, 4
_P, _C = random_batch([5, 7, 3], [9, 2, 6, 4, 1, 8, 3, 5, 7, 2, 4, 6])
PROMPTS = [_P[k // G] for k in range(GROUPS * G)]  # each group's prompt repeated
COMPLETIONS = _C


def make_step(share: bool, budget: int, lora: bool = False, **options):
    cfg = TrainingConfig(share_prompt=share, **options)
    cfg.validate()
    torch.manual_seed(0)
    model = tiny_model()
    if lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                 init_lora_weights=False))
    return GRPOStep(model, cfg, pad_token_id=PAD, temperature=0.9, max_new_tokens=12,
                    micro_batch_tokens=budget)


def run(step):
    advantages = torch.randn(len(COMPLETIONS), generator=torch.Generator().manual_seed(3))
    rollout = Rollout(PROMPTS, COMPLETIONS, advantages)
    step.model.zero_grad()
    inputs = step.step_inputs(rollout)
    loss, _ = step.accumulate_gradients(rollout, inputs)
    grads = {n: p.grad.clone() for n, p in step.model.named_parameters() if p.grad is not None}
    return loss, grads, inputs


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
@pytest.mark.parametrize("lora,chunked", [(False, True), (True, True), (False, False)])
def test_shared_equals_unshared(loss_type, lora, chunked):
    options = dict(loss_type=loss_type, num_iterations=2, chunked_lm_head=chunked)
    shared = make_step(True, 40, lora, **options)
    assert shared.layout is LAYOUTS[True]
    loss_s, grads_s, inputs_s = run(shared)
    loss_u, grads_u, inputs_u = run(make_step(False, 40, lora, **options))
    assert loss_s == pytest.approx(loss_u, rel=1e-5)
    assert grads_s.keys() == grads_u.keys() and grads_s
    for name in grads_u:
        torch.testing.assert_close(grads_s[name], grads_u[name], rtol=1e-5, atol=1e-6, msg=name)
    for old_s, old_u in zip(inputs_s.old, inputs_u.old):
        torch.testing.assert_close(old_s, old_u, rtol=1e-5, atol=1e-6)


def test_shared_forwards_each_prompt_once_per_group():
    shared, unshared = make_step(True, 10_000), make_step(False, 10_000)
    run(shared), run(unshared)
    completion_tokens = sum(map(len, COMPLETIONS))
    assert shared.forwarded_tokens == completion_tokens + sum(len(p) for p in _P)
    assert unshared.forwarded_tokens == completion_tokens + sum(map(len, PROMPTS))


def test_rows_share_one_prompt_within_the_budget():
    for batch in plan_shared_batches(PROMPTS, COMPLETIONS, 20):
        for row in batch:
            assert len({tuple(PROMPTS[i]) for i in row}) == 1
            size = len(PROMPTS[row[0]]) + sum(len(COMPLETIONS[i]) for i in row)
            assert len(row) == 1 or size <= 20


def test_shared_equals_unshared_with_gradient_checkpointing():
    """Checkpointed layers recompute the forward with the same block mask: the same gradients."""
    def checkpointed(share: bool):
        step = make_step(share, 40)
        step.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})  # as models/loading.py
        step.model.train()
        return run(step)

    (loss_s, grads_s, _), (loss_u, grads_u, _) = checkpointed(True), checkpointed(False)
    assert loss_s == pytest.approx(loss_u, rel=1e-5) and grads_s.keys() == grads_u.keys()
    for name in grads_u:
        torch.testing.assert_close(grads_s[name], grads_u[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode", ["bf16", "mixed"])
def test_shared_matches_unshared_in_bf16_compute(mode):
    """bf16 weights, or fp32 weights under the run's bf16 autocast (`mixed`): the same sums in
    another order, so equal to bf16 rounding (the fp32 equality above is the exact statement)."""
    from infsamp.models.precision import compute_context
    from infsamp.planner.precisions import PRECISIONS

    def in_mode(share: bool):
        step = make_step(share, 40)
        if mode == "bf16":
            step.model.to(torch.bfloat16)
        with compute_context(PRECISIONS[mode], "cpu"):
            return run(step)

    (loss_s, grads_s, _), (loss_u, grads_u, _) = in_mode(True), in_mode(False)
    assert loss_s == pytest.approx(loss_u, rel=2e-2, abs=2e-3) and grads_s.keys() == grads_u.keys()
    for name in grads_u:
        g_s, g_u = grads_s[name].float(), grads_u[name].float()
        assert (g_s - g_u).norm() <= 0.03 * g_u.norm() + 1e-4, name  # measured <= 0.008
