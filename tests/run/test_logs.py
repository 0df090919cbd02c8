"""Run logs: the smoothing behind the training plot, the plot itself from a metrics file, and the
logged completions (records, truncation on resume)."""

import json
import math
from types import SimpleNamespace

from infsamp.run.logs import (
    RUN_LOGS,
    RunLogger,
    completion_records,
    moving_average,
    plot_run,
    read_jsonl,
    rewind,
)


def test_moving_average_uses_the_last_window_values_and_skips_gaps():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    smoothed = moving_average([None, 2.0, float("nan"), 4.0], 3)
    assert math.isnan(smoothed[0]) and smoothed[1:] == [2.0, 2.0, 3.0]


def test_plot_run_writes_a_png(tmp_path):
    rows = [{"step": i, "reward": i % 3, "completions/mean_length": 10 + i,
             "completions/max_length": 20 + i}
            for i in range(1, 25)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.jsonl").write_text(json.dumps({"step": 0, "eval/accuracy": 0.2}) + "\n")
    path = plot_run(tmp_path)
    assert path == tmp_path / "plots" / "training.png" and path.stat().st_size > 10_000


def test_completion_records_one_line_per_completion_and_none_for_missing_rewards():
    completions = [SimpleNamespace(text=f"c{i}", length=i, finish_reason="stop") for i in range(4)]
    records = completion_records(["7", "9"], ["p7", "p9"], completions,
                                 {"f": [1.0, math.nan, 0.0, 2.0]}, [1.0, math.nan, 0.0, 2.0],
                                 [0.5, 0.0, -1.0, 1.0])
    assert [(r["prompt_id"], r["prompt"], r["completion"]) for r in records] == [
        ("7", "p7", "c0"), ("7", "p7", "c1"), ("9", "p9", "c2"), ("9", "p9", "c3")]
    assert records[1]["rewards"] == {"f": None} and records[2]["advantage"] == -1.0


def test_a_resume_rewinds_logged_completions(tmp_path):
    logger = RunLogger(tmp_path, max_steps=4, start_step=0, log_every=1, progress_bar=False)
    for step in (1, 2, 3):
        logger.log_completions(step, [{"completion": "x", "reward": math.nan}])
    logger.close()
    assert "completions.jsonl" in RUN_LOGS  # the run folder rewinds every run log on resume
    rewind(tmp_path / "completions.jsonl", 2)
    assert [r["step"] for r in read_jsonl(tmp_path / "completions.jsonl")] == [1, 2]
    assert read_jsonl(tmp_path / "completions.jsonl")[0]["reward"] is None
