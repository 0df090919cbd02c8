"""benchmarks/vs_trl.py: the ratio/table helpers, a 1-step infsamp-only run at tiny size, and a
1-step run of TRL with the infsamp rollout (plain TRL is skipped: that run starts TRL anyway)."""

import json
import re

import pytest
import torch


@pytest.fixture
def load_script(load_benchmark):
    return lambda: load_benchmark("vs_trl")


def row(framework, G, peak, seconds):
    return {"framework": framework, "G": G, "peak_mib": peak, "generation_peak_mib": peak / 2,
            "seconds_per_step": seconds, "mean_completion_length": 10.0}


def test_ratios_pair_each_infsamp_row_with_trl_at_same_G(load_script):
    vs_trl = load_script()
    rows = [row("trl", 8, 100.0, 2.0), row("infsamp", 8, 25.0, 3.0), row("infsamp", 32, 10.0, 1.0),
            row("trl_infsamp", 8, 50.0, 2.2)]
    vs_trl.add_ratios(rows)
    assert rows[1]["peak_ratio"] == 0.25 and rows[1]["time_ratio"] == 1.5
    assert rows[1]["generation_peak_ratio"] == 0.25
    assert rows[3]["peak_ratio"] == 0.5 and rows[3]["time_ratio"] == 1.1
    assert "peak_ratio" not in rows[0] and "peak_ratio" not in rows[2]  # no TRL row at G=32
    table = vs_trl.markdown_table(rows)
    assert table.count("\n") == len(rows) + 1
    assert "| infsamp | 8 | 25 | 12 | 3.00 | 10.0 | 0.25 | 0.25 | 1.5 |" in table


def test_quick_sets_one_group_and_one_step(load_script):
    args = load_script().parse_args(["--quick"])
    assert args.groups == [8] and args.steps == 1 and args.frameworks == ["trl", "infsamp"]


@pytest.mark.slow
def test_infsamp_side_one_step_tiny(tmp_path, load_script):
    out = tmp_path / "vs_trl.json"
    assert load_script().main(["--frameworks", "infsamp", "--groups", "4", "--steps", "1",
                               "--hidden", "32",
                               "--layers", "2", "--max-completion", "8", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["trl_version"] and result["num_parameters"] > 0
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", result["date"])
    (only,) = result["rows"]
    assert only["framework"] == "infsamp" and only["G"] == 4
    assert only["peak_mib"] >= 0 and only["seconds_per_step"] > 0 and len(only["step_seconds"]) == 1
    assert only["generation_peak_mib"] >= 0
    assert 1 <= only["mean_completion_length"] <= 8


@pytest.mark.slow
def test_trl_with_the_infsamp_rollout_one_step_tiny(tmp_path, load_script):
    """The trl_infsamp worker in this process (a child would import TRL again: ~a minute here)."""
    vs_trl = load_script()
    args = vs_trl.parse_args(["--steps", "1", "--max-completion", "8", "--trl-batch", "2"])
    model_dir = vs_trl.build_random_llama(tmp_path / "model", hidden=32, layers=2)
    threads = torch.get_num_threads()
    try:
        raw = vs_trl.run_trl_infsamp(args, 4, model_dir, tmp_path)
    finally:
        torch.set_num_threads(threads)
    row = vs_trl.summarise("trl_infsamp", 4, raw)
    assert row["peak_mib"] >= 0 and row["seconds_per_step"] > 0 and len(row["step_seconds"]) == 1
    assert 0 <= row["generation_peak_mib"]
    assert 1 <= row["mean_completion_length"] <= 8
