"""Which sequences share a micro-batch: greedy packing's count under a padded-token budget, the
sequences spread evenly over that many micro-batches."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infsamp.planner.micro_batches import plan_micro_batches, plan_prompt_completion_batches


def test_plan_by_hand():
    # longest first: 8, 5, 3, 2, 1; greedy under 10: [8] [5 3] [2 1] (largest 2 * 5 = 10);
    # the same 3 micro-batches cut evenly: [8] [5] [3 2 1] (largest 3 * 3 = 9)
    assert plan_micro_batches([5, 1, 3, 8, 2], 10) == [[3], [0], [2, 4, 1]]


def test_oversized_sequence_gets_its_own_micro_batch():
    assert plan_micro_batches([20, 2, 3], 10) == [[0], [2, 1]]
    assert plan_micro_batches([], 10) == []
    with pytest.raises(ValueError, match="max_tokens"):
        plan_micro_batches([1], 0)


def test_the_same_count_as_greedy_with_a_smaller_fullest():
    # 64 completions of 32 + 10..128 tokens under 1,280 (vs_trl's G = 64 shape): greedy packing
    # makes 1,280 1,160 1,161 1,243 1,196 1,050 padded tokens; the even cut 6 micro-batches too,
    # the fullest 1,261
    completions = [10 + (37 * i) % 119 for i in range(64)]
    plan = plan_prompt_completion_batches([32] * 64, completions, 1280)
    sizes = [len(b) * (32 + max(completions[i] for i in b)) for b in plan]
    assert len(plan) == 6 and max(sizes) == 1261


def _padded(batch, prompts, completions):
    return len(batch) * (max(prompts[i] for i in batch) + max(completions[i] for i in batch))


def _cuts(order):
    """Every cut of `order` into consecutive runs."""
    for mask in itertools.product([False, True], repeat=len(order) - 1):
        runs, run = [], [order[0]]
        for index, cut in zip(order[1:], mask):
            if cut:
                runs.append(run)
                run = []
            run.append(index)
        yield runs + [run]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 60)), min_size=1, max_size=8),
       st.integers(1, 200))
def test_fewest_micro_batches_then_the_smallest_fullest(lengths, budget):
    """Against every cut of the longest-first order: no cut within the budget has fewer
    micro-batches, and none with as many has a smaller fullest one."""
    prompts, completions = [p for p, _ in lengths], [c for _, c in lengths]
    plan = plan_prompt_completion_batches(prompts, completions, budget)
    assert sorted(i for batch in plan for i in batch) == list(range(len(lengths)))
    for batch in plan:
        assert _padded(batch, prompts, completions) <= budget or len(batch) == 1
    order = sorted(range(len(lengths)), key=lambda i: (-prompts[i] - completions[i],
                                                       -completions[i]))
    fits = [cut for cut in _cuts(order) if all(
        _padded(b, prompts, completions) <= budget or len(b) == 1 for b in cut)]
    fewest = min(len(cut) for cut in fits)
    assert len(plan) == fewest

    def fullest(cut):
        return max(_padded(b, prompts, completions) for b in cut)

    assert fullest(plan) == min(fullest(cut) for cut in fits if len(cut) == fewest)
