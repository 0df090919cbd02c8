"""Dynamic sampling over two processes gives the run one process gives.

Each rank samples its whole groups; after every round the ranks gather the round's rewards, so
both take the decisions one process takes and draw the same replacements (a replacement is
sampled where the group it replaces was); sample keys are by place in the step. So two gloo
processes draw every completion one process draws, log the same groups (dropped ones marked)
and metrics, and end within 1e-6 of its weights (fp32 sums in another order), for dapo with
`scale_rewards: batch` (one std over groups of unequal sizes, the token normaliser over both
ranks), for grpo with a fixed completion budget and an uneven B of 3, and for a step where one
rank's groups are all dropped.
"""

from __future__ import annotations

import json

import pytest

from launching import HERE, final_weights, launch, max_difference, one_process, train_argv
from test_equal_to_one_process import TOLERANCE, case_settings, metrics

REWARD = f"{HERE / 'recording_reward.py'}:first_token_reward"
DYNAMIC = {"rewards.functions": REWARD, "sampling.dynamic": True, "sampling.num_generations": 4,
           "sampling.max_num_generations": 12, "logging.completions_every": 1}
CASES = {"dapo-batch": ("dapo", "batch", {}),
         "grpo-budget-b3": ("grpo", "group", {"training.completions_per_step": 40,
                                              "training.prompts_per_step": 3}),
         # B = 2 by round robin, no replacements: at step 3 rank 0's one group is dropped and it
         # trains on nothing (its zero backward meets rank 1's reduction); step 2 has no group
         # with spread (both train on their dropped groups, all advantages 0)
         "dapo-empty-rank": ("dapo", "group", {"training.prompts_per_step": 2,
                                               "sampling.max_replaced_prompts": 0,
                                               "distributed.assignment": "round_robin"})}
SAME_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                "rewards/first_token_reward/mean", "loss", "grad_norm", "learning_rate",
                "sampling/completions", "sampling/dropped_prompts", "sampling/trained_groups",
                "sampling/replaced_prompts", "sampling/zero_std_groups_before",
                "sampling/extra_completions_frac", "sampling/dynamic_rounds",
                "sampling/reward_sampled")


def every_completion(record) -> list[str]:
    """Every (prompt, completion ids) the reward saw, over the run and both ranks, sorted."""
    return sorted(json.dumps([prompt, ids]) for path in record.glob("rank-*.jsonl")
                  for line in path.read_text().splitlines()
                  for prompt, ids in zip(json.loads(line)["prompts"], json.loads(line)["ids"]))


def rows(run, name: str) -> list[dict]:
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


@pytest.mark.slow
def test_two_processes_with_dynamic_sampling_equal_one_process(tiny_model_dir, tmp_path,
                                                               monkeypatch, one_thread):
    values = {name: case_settings(tiny_model_dir, tmp_path / f"two-{name}", loss, scale,
                                  {**DYNAMIC, **extra})
              for name, (loss, scale, extra) in CASES.items()}
    result = launch(tmp_path, [(train_argv(v), tmp_path / f"record-two-{name}")
                               for name, v in values.items()])
    assert result.returncode == 0, result.output[-3000:]
    for name, (loss, scale, extra) in CASES.items():
        one = one_process(case_settings(tiny_model_dir, tmp_path / f"one-{name}", loss, scale,
                                        {**DYNAMIC, **extra}),
                          tmp_path / f"record-one-{name}", monkeypatch)
        two = tmp_path / f"two-{name}"
        sampled = every_completion(tmp_path / f"record-one-{name}")
        assert every_completion(tmp_path / f"record-two-{name}") == sampled
        lines = rows(one, "lengths.jsonl")
        assert rows(two, "lengths.jsonl") == lines
        assert any(line.get("dropped") for line in lines)  # some groups were dropped
        assert len({len(line["lengths"]) for line in lines}) > 1  # groups of unequal sizes
        assert rows(two, "completions.jsonl") == rows(one, "completions.jsonl")
        difference = max_difference(final_weights(one, 3), final_weights(two, 3))
        assert difference <= TOLERANCE, (name, difference)
        for row_one, row_two in zip(metrics(one), metrics(two), strict=True):
            for key in SAME_METRICS:
                noise = 1e-6 if key == "loss" else 1e-8
                assert row_two[key] == pytest.approx(row_one[key], rel=1e-5, abs=noise), key
        if name == "dapo-empty-rank":
            assert [m["sampling/trained_groups"] for m in metrics(one)] == [2, 2, 1]
            assert [m["sampling/dropped_prompts"] for m in metrics(one)] == [0, 2, 1]
        else:
            assert sum(m["sampling/replaced_prompts"] for m in metrics(one)) > 0
