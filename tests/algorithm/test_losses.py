"""Objectives (token clip, gspo, cispo), k3 KL, token aggregation and entropy masks, against values
computed by hand or by a direct transcription of each formula."""

import math

import pytest
import torch

from infsamp.algorithm.losses import (
    LOSS_TYPES,
    BatchTotals,
    LossStats,
    clipped_surrogate,
    high_entropy_masks,
    kl_penalty,
    per_token_loss,
    quantile,
)
from infsamp.choices import clip_range

# ratios 1.5, 0.5, 1.0 per row; row 0 has A = +1, row 1 has A = -2; eps_low 0.2, eps_high 0.28
RATIOS = torch.tensor([[1.5, 0.5, 1.0], [1.5, 0.5, 1.0]])
ADVANTAGES = torch.tensor([1.0, -2.0])


def _surrogate():
    logps = RATIOS.log().requires_grad_()
    return logps, clipped_surrogate(logps, torch.zeros(2, 3), ADVANTAGES, 0.2, 0.28)


def test_clipped_surrogate_by_hand():
    _, result = _surrogate()
    # A>0: -min(r, clip(r)) = -1.28, -0.5, -1;  A<0: -min(-2r, -2clip(r)) = 3, 1.6, 2
    torch.testing.assert_close(result.loss, torch.tensor([[-1.28, -0.5, -1.0], [3.0, 1.6, 2.0]]))
    assert result.is_high_clipped.tolist() == [[True, False, False], [False, False, False]]
    assert result.is_low_clipped.tolist() == [[False, False, False], [False, True, False]]


def test_clipped_tokens_have_no_gradient():
    logps, result = _surrogate()
    result.loss.sum().backward()
    # d(-r A)/d logp = -r A where unclipped, 0 where the clipped branch is the min
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, -0.5, -1.0], [3.0, 0.0, 2.0]]))


def test_kl_penalty_k3_by_hand():
    logps, ref = torch.tensor([[math.log(0.5), -1.0]]), torch.tensor([[math.log(0.25), -1.0]])
    expected = 0.5 - math.log(0.5) - 1  # exp(d) - d - 1 with d = log(0.25 / 0.5)
    torch.testing.assert_close(kl_penalty(logps, ref), torch.tensor([[expected, 0.0]]))
    assert (kl_penalty(torch.randn(4, 5), torch.randn(4, 5)) >= 0).all()


def test_per_token_loss_adds_beta_kl_and_counts_masked_stats():
    logps = RATIOS.log()
    ref = logps - 1.0  # d = -1 everywhere: k3 = exp(-1) + 1 - 1
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, stats = per_token_loss(logps, torch.zeros(2, 3), ref, ADVANTAGES, epsilon_low=0.2,
                                 epsilon_high=0.28, beta=0.1, mask=mask)
    k3 = math.exp(-1)
    torch.testing.assert_close(loss,
                               torch.tensor([[-1.28, -0.5, -1.0], [3.0, 1.6, 2.0]]) + 0.1 * k3)
    assert stats.num_tokens == 5 and stats.high_clipped == 1 and stats.low_clipped == 1
    assert stats.kl == pytest.approx(5 * k3)
    metrics = stats.metrics()
    assert metrics["clip_ratio/region_mean"] == pytest.approx(2 / 5)
    assert metrics["kl"] == pytest.approx(k3)


def test_on_policy_ratio_is_one_with_policy_gradient():
    logps = torch.randn(2, 3).requires_grad_()
    loss, _ = per_token_loss(logps, None, None, ADVANTAGES, epsilon_low=0.2, epsilon_high=0.2,
                             beta=0.0)
    torch.testing.assert_close(loss, -ADVANTAGES.unsqueeze(1).expand(2, 3))
    loss.sum().backward()
    torch.testing.assert_close(logps.grad, -ADVANTAGES.unsqueeze(1).expand(2, 3))


def test_beta_without_reference_raises():
    with pytest.raises(ValueError, match="ref_logps"):
        per_token_loss(torch.zeros(1, 2), None, None, torch.ones(1), epsilon_low=0.2,
                       epsilon_high=0.2, beta=0.1)


def test_loss_stats_add_up():
    total = LossStats(2, 1.0, 1, 0, 0.5) + LossStats(3, 2.0, 0, 1, 1.0)
    assert total == LossStats(5, 3.0, 1, 1, 1.5)


# --- aggregation ----------------------------------------------------------------------------------

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
TOTALS = BatchTotals(num_sequences=2, num_tokens=3, max_new_tokens=4)


def test_registry_names():
    assert set(LOSS_TYPES) == {"grpo", "dr_grpo", "dapo", "bnpo", "gspo", "cispo"}


@pytest.mark.parametrize("name, expected", [
    ("grpo", (1.5 + 4.0) / 2),  # mean of per-sequence token means
    ("dr_grpo", 7.0 / (2 * 4)),  # token sum / (sequences * max completion length)
    ("dapo", 7.0 / 3),  # token sum / tokens
    ("bnpo", 7.0 / 3),
])
def test_aggregation_by_hand(name, expected):
    assert LOSS_TYPES[name].aggregate(LOSS, MASK, TOTALS).item() == pytest.approx(expected)


def test_single_batch_matches_trl_formulas():
    loss, mask = torch.randn(5, 7), (torch.rand(5, 7) > 0.3).float()
    totals = BatchTotals(5, int(mask.sum()), 7)
    trl = {
        "grpo": ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean(),
        "dr_grpo": (loss * mask).sum() / (loss.size(0) * 7),
        "dapo": (loss * mask).sum() / mask.sum(),
        "bnpo": (loss * mask).sum() / mask.sum().clamp(min=1.0),
    }
    for name, value in trl.items():
        torch.testing.assert_close(LOSS_TYPES[name].aggregate(loss, mask, totals), value)


@pytest.mark.parametrize("name", sorted(LOSS_TYPES))
def test_sum_over_micro_batches_equals_full_batch(name):
    lengths = [5, 1, 3, 0, 4, 2]
    loss = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))  # [N, T]
    mask = (torch.arange(5).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()  # [N, T]
    totals = BatchTotals.from_lengths(lengths, max_new_tokens=8)
    full = LOSS_TYPES[name].aggregate(loss, mask, totals)
    split = [[0, 3], [1, 2, 5], [4]]
    parts = []
    for rows in split:
        width = max(1, max(lengths[i] for i in rows))  # each micro-batch padded to its own width
        parts.append(LOSS_TYPES[name].aggregate(loss[rows, :width], mask[rows, :width], totals))
    torch.testing.assert_close(sum(parts), full)


def test_batch_totals_from_lengths():
    assert BatchTotals.from_lengths([3, 0, 2], 16) == BatchTotals(3, 5, 16)


# --- gspo and cispo against direct transcriptions of their formulas -----------------------------


def random_step(seed=0, rows=5, width=7, noise=0.05):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).float()  # [N, T]
    old = -torch.rand(rows, width, generator=g) * 3  # [N, T]
    logps = (old + noise * torch.randn(rows, width, generator=g)).requires_grad_()  # [N, T]
    advantages = torch.randn(rows, generator=g)  # [N]
    totals = BatchTotals.from_lengths(lengths.tolist(), max_new_tokens=width)
    return logps, old, advantages, mask, totals


def registry_loss(name, logps, old, advantages, mask, totals, epsilon_low, epsilon_high):
    loss, _ = per_token_loss(logps, old, None, advantages, epsilon_low=epsilon_low,
                             epsilon_high=epsilon_high, beta=0.0, mask=mask, loss_type=name)
    return LOSS_TYPES[name].aggregate(loss, mask, totals)


def gspo_by_formula(logps, old, advantages, mask, epsilon_low, epsilon_high):
    """J = -1/N sum_i min(s_i A_i, clip(s_i, 1 - el, 1 + eh) A_i), s_i = exp(mean_t logp - old)."""
    terms = []
    for i in range(logps.shape[0]):
        tokens = mask[i].bool()
        s = torch.exp((logps[i][tokens] - old[i][tokens]).mean())
        clipped = s.clamp(1 - epsilon_low, 1 + epsilon_high)
        terms.append(-torch.min(s * advantages[i], clipped * advantages[i]))
    return torch.stack(terms).mean()


def cispo_by_formula(logps, old, advantages, mask, epsilon_high):
    """J = -sum_{i,t} sg(min(r_it, eh)) A_i logp_it / sum m, r_it = exp(logp_it - old_it)."""
    total, count = 0.0, 0
    for i in range(logps.shape[0]):
        for t in range(logps.shape[1]):
            if mask[i, t]:
                weight = min(math.exp(float(logps[i, t].detach() - old[i, t])), epsilon_high)
                total = total - weight * advantages[i] * logps[i, t]
                count += 1
    return total / count


def value_and_grad(fn, logps):
    value = fn()
    (grad,) = torch.autograd.grad(value, logps)
    return value.detach(), grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_value_and_gradient_equal_the_formula(seed):
    logps, old, adv, mask, totals = random_step(seed)
    eps = (0.02, 0.03)  # with noise 0.05 some sequences are clipped, some not
    ours = value_and_grad(lambda: registry_loss("gspo", logps, old, adv, mask, totals, *eps),
                          logps)
    direct = value_and_grad(lambda: gspo_by_formula(logps, old, adv, mask, *eps), logps)
    torch.testing.assert_close(ours[0], direct[0])
    torch.testing.assert_close(ours[1], direct[1])


def test_gspo_clips_whole_sequences():
    logps, old, adv, mask, totals = random_step(3, noise=0.5)
    surrogate = LOSS_TYPES["gspo"].objective(logps, old, adv, 3e-4, 4e-4, mask=mask)
    clipped = surrogate.is_low_clipped | surrogate.is_high_clipped  # [N, T]
    assert clipped.any() and (clipped.all(dim=1) | ~clipped.any(dim=1)).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cispo_value_and_gradient_equal_the_formula(seed):
    logps, old, adv, mask, totals = random_step(seed, noise=0.3)
    cap = 1.1  # some ratios above it, some below
    ours = value_and_grad(lambda: registry_loss("cispo", logps, old, adv, mask, totals, 0.2, cap),
                          logps)
    direct = value_and_grad(lambda: cispo_by_formula(logps, old, adv, mask, cap), logps)
    torch.testing.assert_close(ours[0], direct[0])
    torch.testing.assert_close(ours[1], direct[1])
    ratio = torch.exp(logps.detach() - old)
    assert ((ratio > cap) & mask.bool()).any()
    assert (ours[1][mask.bool()] != 0).all()  # clipped tokens keep their gradient


def test_on_policy_gspo_is_the_sequence_mean_policy_gradient():
    logps, _, adv, mask, totals = random_step(4)
    value, grad = value_and_grad(
        lambda: registry_loss("gspo", logps, None, adv, mask, totals, 3e-4, 4e-4), logps)
    lengths = mask.sum(-1, keepdim=True)  # [N, 1]
    torch.testing.assert_close(value, -adv.mean())
    torch.testing.assert_close(grad, -adv.unsqueeze(1) * mask / lengths / len(adv))
    _, grpo_grad = value_and_grad(
        lambda: registry_loss("grpo", logps, None, adv, mask, totals, 0.2, 0.2), logps)
    torch.testing.assert_close(grad, grpo_grad)


def test_on_policy_cispo_is_reinforce():
    logps, _, adv, mask, totals = random_step(5)
    value, grad = value_and_grad(
        lambda: registry_loss("cispo", logps, None, adv, mask, totals, 0.2, 5.0), logps)
    expected = -(adv.unsqueeze(1) * logps.detach() * mask).sum() / mask.sum()
    torch.testing.assert_close(value, expected)
    torch.testing.assert_close(grad, -adv.unsqueeze(1) * mask / mask.sum())
    _, dapo_grad = value_and_grad(
        lambda: registry_loss("dapo", logps, None, adv, mask, totals, 0.2, 0.2), logps)
    torch.testing.assert_close(grad, dapo_grad)  # on-policy, cispo and dapo step alike


@pytest.mark.parametrize("name", sorted(LOSS_TYPES))
def test_token_mask_and_importance_weights_scale_the_policy_term_only(name):
    logps, old, adv, mask, _ = random_step(6)
    ref = old - 0.1
    weights = torch.rand(logps.shape, generator=torch.Generator().manual_seed(1)) * 2  # [N, T]
    token_mask = (torch.rand(logps.shape, generator=torch.Generator().manual_seed(2)) > 0.5)
    common = dict(epsilon_low=0.2, epsilon_high=0.28, beta=0.1, mask=mask, loss_type=name)
    plain, _ = per_token_loss(logps, old, ref, adv, **common)
    weighted, _ = per_token_loss(logps, old, ref, adv, importance_weights=weights,
                                 token_mask=token_mask.float(), **common)
    kl = 0.1 * kl_penalty(logps, ref)
    torch.testing.assert_close(weighted - kl, (plain - kl) * weights * token_mask)


def test_default_clip_ranges_per_loss_type():
    assert clip_range("dapo", 0.0, 0.0) == (0.2, 0.2)
    assert clip_range("dapo", 0.1, 0.0) == (0.1, 0.1)
    assert clip_range("grpo", 0.2, 0.28) == (0.2, 0.28)
    assert clip_range("gspo", 0.0, 0.0) == (3e-4, 4e-4)
    assert clip_range("gspo", 1e-3, 2e-3) == (1e-3, 2e-3)
    assert clip_range("cispo", 0.0, 0.0) == (0.2, 5.0)


def test_entropy_is_summed_over_the_mask():
    logps, _, adv, mask, _ = random_step(7)
    entropy = torch.rand(logps.shape)
    _, stats = per_token_loss(logps, None, None, adv, epsilon_low=0.2, epsilon_high=0.2, beta=0.0,
                              mask=mask, entropy=entropy)
    assert stats.metrics()["entropy"] == pytest.approx(float((entropy * mask).sum() / mask.sum()))


# --- high-entropy token masks ---------------------------------------------------------------


@pytest.mark.parametrize("q", [0.0, 0.2, 0.5, 0.83, 1.0])
def test_quantile_matches_torch(q):
    values = torch.randn(101, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(quantile(values, q), torch.quantile(values, q))


def test_high_entropy_masks_threshold_over_the_step_and_skip_masked_sequences():
    entropies = [torch.tensor([0.1, 0.9, 0.5]), torch.tensor([0.7]), torch.tensor([5.0, 6.0])]
    masks = high_entropy_masks(entropies, [True, True, False], top_quantile=0.5)
    # pool 0.1 0.5 0.7 0.9 (the masked sequence's 5 and 6 are left out): median 0.6
    assert [m.tolist() for m in masks] == [[0.0, 1.0, 0.0], [1.0], [0.0, 0.0]]
    everything = high_entropy_masks(entropies, [True, True, True], top_quantile=1.0)
    assert all(bool(m.all()) for m in everything)
    nothing = high_entropy_masks(entropies, [False] * 3, 0.2)
    assert [m.tolist() for m in nothing] == [[0.0] * 3, [0.0], [0.0] * 2]
