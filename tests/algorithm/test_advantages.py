"""Group-relative advantages checked against values computed by hand."""

import math

import pytest
import torch

from infsamp.algorithm.advantages import (
    REWARD_SCALERS,
    STD_EPS,
    compute_advantages,
    compute_group_advantages,
    nanstd,
)

NAN = float("nan")
# two groups of G=3: [1, 2, 3] (mean 2, unbiased std 1) and [5, 5, 5] (a tie)
REWARDS = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
# deviations from 3.5: -2.5 -1.5 -0.5 1.5 1.5 1.5 -> squares sum 15.5
BATCH_STD = math.sqrt(15.5 / 5)


def test_registry_names():
    assert set(REWARD_SCALERS) == {"group", "batch", "none"}


def test_group_scaling_by_hand():
    result = compute_advantages(REWARDS, 3, "group")
    expected = torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0,
                             0.0]) / torch.tensor([1 + STD_EPS] * 3 + [1.0] * 3)
    torch.testing.assert_close(result.advantages, expected)
    torch.testing.assert_close(result.group_std, torch.tensor([1.0, 0.0]))
    assert result.zero_std_fraction == 0.5
    assert result.reward_std == pytest.approx(BATCH_STD)


def test_batch_scaling_by_hand():
    result = compute_advantages(REWARDS, 3, "batch")
    expected = torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]) / (BATCH_STD + STD_EPS)
    torch.testing.assert_close(result.advantages, expected)
    assert result.zero_std_fraction == 0.5


def test_no_scaling_by_hand():
    result = compute_advantages(torch.tensor([0.0, 4.0, 1.0, 1.0]), 2, "none")
    torch.testing.assert_close(result.advantages, torch.tensor([-2.0, 2.0, 0.0, 0.0]))


def test_matches_trl_formula_on_random_rewards():
    rewards = torch.randn(32, generator=torch.Generator().manual_seed(0))
    grouped = rewards.view(-1, 8)
    # unbiased std
    trl = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
    torch.testing.assert_close(compute_advantages(rewards, 8, "group").advantages, trl.view(-1))
    trl_batch = (grouped - grouped.mean(1, keepdim=True)) / (rewards.std() + 1e-4)
    torch.testing.assert_close(compute_advantages(rewards, 8, "batch").advantages,
                               trl_batch.view(-1))


@pytest.mark.parametrize("scale", sorted(REWARD_SCALERS))
def test_tied_groups_give_exact_zero(scale):
    # 0.1 * 3 does not round-trip through a float mean exactly; the advantage must still be exactly
    # 0
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.0, 1.0, 0.0])
    result = compute_advantages(rewards, 3, scale)
    assert torch.equal(result.advantages[:6], torch.zeros(6))
    assert result.zero_std_fraction == pytest.approx(2 / 3)
    assert not torch.isnan(result.advantages).any()


@pytest.mark.parametrize("scale", sorted(REWARD_SCALERS))
def test_all_tied_batch_and_group_of_one_never_nan(scale):
    for rewards, g in [(torch.ones(8), 4), (torch.tensor([1.0, 2.0, 3.0]), 1)]:
        result = compute_advantages(rewards, g, scale)
        assert torch.equal(result.advantages, torch.zeros_like(rewards))
        assert result.zero_std_fraction == 1.0
        assert not torch.isnan(result.group_std).any()


def test_nan_rewards_are_left_out_and_get_zero():
    rewards = torch.tensor([NAN, 1.0, 3.0, NAN, NAN, NAN])  # group 2 is unscorable
    result = compute_advantages(rewards, 3, "group")
    s = math.sqrt(2.0) + STD_EPS  # std of [1, 3]
    torch.testing.assert_close(result.advantages, torch.tensor([0.0, -1 / s, 1 / s, 0.0, 0.0, 0.0]))
    assert result.zero_std_fraction == 0.5


def test_nanstd_unbiased_and_safe():
    assert nanstd(torch.tensor([1.0, 3.0])).item() == pytest.approx(math.sqrt(2.0))
    assert nanstd(torch.tensor([7.0])).item() == 0.0
    torch.testing.assert_close(nanstd(torch.tensor([[1.0, NAN, 3.0], [NAN, NAN, 2.0]]), dim=1),
                               torch.tensor([math.sqrt(2.0), 0.0]))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="scale_rewards"):
        compute_advantages(REWARDS, 3, "median")
    with pytest.raises(ValueError, match="num_generations"):
        compute_advantages(REWARDS, 4, "group")


# ---- groups of unequal size (dynamic sampling)


def reference_group_advantages(rewards: torch.Tensor, sizes: list[int], scale: str):
    """The per-group loop: each group on its own (compute_advantages, G = its size); "batch"
    divides the centred rewards by the std of every reward of the step."""
    parts, start = [], 0
    for size in sizes:
        own = "none" if scale == "batch" else scale
        parts.append(compute_advantages(rewards[start:start + size], size, own).advantages)
        start += size
    whole = torch.cat(parts)
    return whole / (nanstd(rewards) + STD_EPS) if scale == "batch" else whole


@pytest.mark.parametrize("scale", sorted(REWARD_SCALERS))
def test_groups_of_any_size_match_the_per_group_loop(scale):
    generator = torch.Generator().manual_seed(3)
    sizes = [2, 8, 3, 16, 5, 8]
    rewards = torch.randint(0, 3, (sum(sizes),), generator=generator).float()
    rewards[4:7] = 1.0  # a tie inside the second group does not make it tied
    rewards[10:13] = 2.0  # the third group ties: exactly 0
    rewards[14] = NAN  # a reward no function gave
    result = compute_group_advantages(rewards, sizes, scale)
    torch.testing.assert_close(result.advantages,
                               reference_group_advantages(rewards, sizes, scale))
    assert torch.equal(result.advantages[10:13], torch.zeros(3)) and result.advantages[14] == 0
    ties = [bool(compute_advantages(rewards[a:a + n], n, scale).zero_std_fraction)
            for a, n in zip([0, 2, 10, 13, 29, 34], sizes)]
    assert result.zero_std_fraction == pytest.approx(sum(ties) / len(sizes))
    assert result.reward_std == pytest.approx(nanstd(rewards).item())


@pytest.mark.parametrize("scale", sorted(REWARD_SCALERS))
def test_equal_groups_agree_with_compute_advantages(scale):
    rewards = torch.randn(24, generator=torch.Generator().manual_seed(1))
    same = compute_group_advantages(rewards, [8, 8, 8], scale)
    assert torch.equal(same.advantages, compute_advantages(rewards, 8, scale).advantages)


def test_group_sizes_must_cover_the_rewards():
    with pytest.raises(ValueError, match="do not cover"):
        compute_group_advantages(torch.zeros(5), [2, 2], "group")
