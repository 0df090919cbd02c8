"""benchmarks/group_signal.py: the exact chance that a group drawn from a prompt's completions has
no reward spread, the table per G, and the script end to end on the embedded demo."""

import json
import math
import random

import pytest


@pytest.fixture
def bench(load_benchmark):
    return load_benchmark("group_signal")


def test_zero_spread_chance_is_exact(bench):
    assert bench.zero_spread_chance([1.0, 1.0, 0.0, 0.0], 2) == pytest.approx(2 / 6)
    assert bench.zero_spread_chance([1.0, 1.0, 0.0, 0.0], 4) == 0.0
    assert bench.zero_spread_chance([0.5] * 5, 3) == 1.0
    rewards = [1.0] * 3 + [0.0] * 13  # p = 3/16: a draw of 8 is all zeros with C(13,8)/C(16,8)
    expected = math.comb(13, 8) / math.comb(16, 8)
    assert bench.zero_spread_chance(rewards, 8) == pytest.approx(expected)
    rng = random.Random(0)  # against draws: the same figure within sampling noise
    draws = [len(set(rng.sample(rewards, 8))) == 1 for _ in range(20000)]
    assert sum(draws) / len(draws) == pytest.approx(bench.zero_spread_chance(rewards, 8), abs=0.01)


def test_larger_groups_never_spread_less(bench):
    table = bench.signal_table([[1.0] * 2 + [0.0] * 62, [0.0] * 64, [1.0] * 32 + [0.0] * 32], 64)
    assert [row["G"] for row in table] == [2, 4, 8, 16, 32, 64]
    shares = [row["zero_spread_share"] for row in table]
    assert shares == sorted(shares, reverse=True) and shares[-1] == pytest.approx(1 / 3)
    assert table[-1]["prompts_with_signal"] == pytest.approx(2 / 3)


def test_the_script_on_the_embedded_demo(bench, tmp_path, capsys):
    assert bench.main(["--prompts", "2", "--max-g", "8", "--check-g", "4", "--out",
                       str(tmp_path), "--set", "data.num_train_examples=8",
                       "--set", "data.num_eval_examples=2", "--set", "sampling.max_new_tokens=16"]
                      ) == 0
    result = json.loads((tmp_path / "group_signal.json").read_text())
    assert [len(rewards) for rewards in result["rewards"]] == [8, 8]
    assert [row["G"] for row in result["table"]] == [2, 4, 8]
    assert set(result["memory"]) == {"8", "4"} and "4" in result["checks"]
    assert "| 8 |" in capsys.readouterr().out
