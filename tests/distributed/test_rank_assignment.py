"""Assigning a step's prompts to ranks: a partition, never predicted worse than round-robin."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infsamp.distributed.rank_assignment import assign, imbalance, makespan, rank_loads, round_robin
from infsamp.errors import InfsampError

COSTS = st.lists(st.floats(min_value=1, max_value=4096, allow_nan=False), min_size=1, max_size=64)


@settings(max_examples=400)
@given(costs=COSTS, num_ranks=st.integers(min_value=1, max_value=16))
def test_lpt_is_a_partition_never_worse_than_round_robin(costs, num_ranks):
    if len(costs) < num_ranks:
        with pytest.raises(InfsampError, match="fewer prompts than the"):
            assign(costs, num_ranks)
        return
    shares = assign(costs, num_ranks, "lpt")
    assert sorted(i for share in shares for i in share) == list(range(len(costs)))
    assert all(share == sorted(share) and share for share in shares)  # ascending, none empty
    assert makespan(shares, costs) <= makespan(round_robin(costs, num_ranks), costs)
    mean = sum(costs) / num_ranks
    assert makespan(shares, costs) <= 4 / 3 * mean + max(costs)  # LPT's list-scheduling bound


def test_lpt_balances_a_straggler_that_round_robin_makes():
    costs = [100, 10, 100, 10, 100, 10, 100, 10]  # round-robin puts every long group on rank 0
    assert rank_loads(round_robin(costs, 2), costs) == [400, 40]
    shares = assign(costs, 2, "lpt")
    assert rank_loads(shares, costs) == [220, 220]
    assert imbalance(rank_loads(shares, costs)) == 1.0
    assert imbalance([400, 40]) == pytest.approx(400 / 220)


def test_round_robin_kept_where_it_predicts_shorter():
    costs = [2, 3, 2, 3, 2]  # LPT: {3,2,2} {3,2} -> 7; round-robin {2,2,2} {3,3} -> 6
    assert assign(costs, 2, "lpt") == round_robin(costs, 2)
    assert makespan(assign(costs, 2), costs) == 6


def test_uneven_shares():
    assert [len(s) for s in assign([5.0] * 5, 2, "round_robin")] == [3, 2]
    assert sorted(len(s) for s in assign([5.0] * 5, 2, "lpt")) == [2, 3]
