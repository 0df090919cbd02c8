"""benchmarks/vs_trl.py: the ratio/table helpers, and a 1-step infsamp-only run at tiny size (TRL side skipped:
importing and starting TRL alone takes longer than this test's budget on a shared 2-core machine)."""

import json

import pytest


@pytest.fixture
def load_script(load_benchmark):
    return lambda: load_benchmark("vs_trl")


def row(framework, G, peak, seconds):
    return {"framework": framework, "G": G, "peak_mib": peak, "seconds_per_step": seconds,
            "mean_completion_length": 10.0}


def test_ratios_pair_each_infsamp_row_with_trl_at_same_G(load_script):
    vs_trl = load_script()
    rows = [row("trl", 8, 100.0, 2.0), row("infsamp", 8, 25.0, 3.0), row("infsamp", 32, 10.0, 1.0)]
    vs_trl.add_ratios(rows)
    assert rows[1]["peak_ratio"] == 0.25 and rows[1]["time_ratio"] == 1.5
    assert "peak_ratio" not in rows[0] and "peak_ratio" not in rows[2]  # no TRL row at G=32
    table = vs_trl.markdown_table(rows)
    assert table.count("\n") == len(rows) + 1 and "| infsamp | 8 | 25 | 3.00 | 10.0 | 0.25 | 1.5 |" in table


def test_quick_sets_one_group_and_one_step(load_script):
    args = load_script().parse_args(["--quick"])
    assert args.groups == [8] and args.steps == 1 and args.frameworks == ["trl", "infsamp"]


@pytest.mark.slow
def test_infsamp_side_one_step_tiny(tmp_path, load_script):
    out = tmp_path / "vs_trl.json"
    assert load_script().main(["--frameworks", "infsamp", "--groups", "4", "--steps", "1", "--hidden", "32",
                               "--layers", "2", "--max-completion", "8", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["trl_version"] and result["date"] == "2026-11-29" and result["num_parameters"] > 0
    (only,) = result["rows"]
    assert only["framework"] == "infsamp" and only["G"] == 4
    assert only["peak_mib"] >= 0 and only["seconds_per_step"] > 0 and len(only["step_seconds"]) == 1
    assert 1 <= only["mean_completion_length"] <= 8
