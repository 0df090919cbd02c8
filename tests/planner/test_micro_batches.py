"""Which sequences share a micro-batch: greedy packing under a padded-token budget."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infsamp.planner.micro_batches import plan_micro_batches, plan_prompt_completion_batches


def test_plan_by_hand():
    # longest first: 3 (8) alone; 0 (5) + 2 (3) -> 2 * 5 = 10; 4 (2) + 1 (1) -> 2 * 2 = 4
    assert plan_micro_batches([5, 1, 3, 8, 2], 10) == [[3], [0, 2], [4, 1]]


def test_oversized_sequence_gets_its_own_micro_batch():
    assert plan_micro_batches([20, 2, 3], 10) == [[0], [2, 1]]
    with pytest.raises(ValueError, match="max_tokens"):
        plan_micro_batches([1], 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 60)), min_size=1, max_size=30),
       st.integers(1, 200))
def test_plans_cover_each_sequence_once_within_budget(lengths, budget):
    prompts, completions = [p for p, _ in lengths], [c for _, c in lengths]
    plan = plan_prompt_completion_batches(prompts, completions, budget)
    assert sorted(i for batch in plan for i in batch) == list(range(len(lengths)))
    for batch in plan:
        padded = len(batch) * (max(prompts[i] for i in batch) + max(completions[i] for i in batch))
        assert padded <= budget or len(batch) == 1
