"""Clipped surrogate, k3 KL and token aggregation, against values computed by hand."""

import math

import pytest
import torch

from infsamp.rl.losses import (LOSS_TYPES, BatchTotals, LossStats, clipped_surrogate, kl_penalty,
                               per_token_loss)

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
    loss, stats = per_token_loss(logps, torch.zeros(2, 3), ref, ADVANTAGES, epsilon_low=0.2, epsilon_high=0.28,
                                 beta=0.1, mask=mask)
    k3 = math.exp(-1)
    torch.testing.assert_close(loss, torch.tensor([[-1.28, -0.5, -1.0], [3.0, 1.6, 2.0]]) + 0.1 * k3)
    assert stats.num_tokens == 5 and stats.high_clipped == 1 and stats.low_clipped == 1
    assert stats.kl == pytest.approx(5 * k3)
    metrics = stats.metrics()
    assert metrics["clip_ratio/region_mean"] == pytest.approx(2 / 5)
    assert metrics["kl"] == pytest.approx(k3)


def test_on_policy_ratio_is_one_with_policy_gradient():
    logps = torch.randn(2, 3).requires_grad_()
    loss, _ = per_token_loss(logps, None, None, ADVANTAGES, epsilon_low=0.2, epsilon_high=0.2, beta=0.0)
    torch.testing.assert_close(loss, -ADVANTAGES.unsqueeze(1).expand(2, 3))
    loss.sum().backward()
    torch.testing.assert_close(logps.grad, -ADVANTAGES.unsqueeze(1).expand(2, 3))


def test_beta_without_reference_raises():
    with pytest.raises(ValueError, match="ref_logps"):
        per_token_loss(torch.zeros(1, 2), None, None, torch.ones(1), epsilon_low=0.2, epsilon_high=0.2, beta=0.1)


def test_loss_stats_add_up():
    total = LossStats(2, 1.0, 1, 0) + LossStats(3, 2.0, 0, 1)
    assert total == LossStats(5, 3.0, 1, 1)


# --- aggregation ----------------------------------------------------------------------------------

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
TOTALS = BatchTotals(num_sequences=2, num_tokens=3, max_completion_length=4)


def test_registry_names():
    assert set(LOSS_TYPES) == {"grpo", "dr_grpo", "dapo", "bnpo"}


@pytest.mark.parametrize("name, expected", [
    ("grpo", (1.5 + 4.0) / 2),  # mean of per-sequence token means
    ("dr_grpo", 7.0 / (2 * 4)),  # token sum / (sequences * max completion length)
    ("dapo", 7.0 / 3),  # token sum / tokens
    ("bnpo", 7.0 / 3),
])
def test_aggregation_by_hand(name, expected):
    assert LOSS_TYPES[name](LOSS, MASK, TOTALS).item() == pytest.approx(expected)


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
        torch.testing.assert_close(LOSS_TYPES[name](loss, mask, totals), value)


@pytest.mark.parametrize("name", sorted(LOSS_TYPES))
def test_sum_over_micro_batches_equals_full_batch(name):
    lengths = [5, 1, 3, 0, 4, 2]
    loss = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))  # [N, T]
    mask = (torch.arange(5).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()  # [N, T]
    totals = BatchTotals.from_lengths(lengths, max_completion_length=8)
    full = LOSS_TYPES[name](loss, mask, totals)
    split = [[0, 3], [1, 2, 5], [4]]
    parts = []
    for rows in split:
        width = max(1, max(lengths[i] for i in rows))  # each micro-batch padded to its own width
        parts.append(LOSS_TYPES[name](loss[rows, :width], mask[rows, :width], totals))
    torch.testing.assert_close(sum(parts), full)


def test_batch_totals_from_lengths():
    assert BatchTotals.from_lengths([3, 0, 2], 16) == BatchTotals(3, 5, 16)
