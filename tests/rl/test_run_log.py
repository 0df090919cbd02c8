"""Run logs: the smoothing behind the training plot, and the plot itself from a metrics file."""

import json
import math

from infsamp.rl.run_log import moving_average, plot_run


def test_moving_average_uses_the_last_window_values_and_skips_gaps():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    smoothed = moving_average([None, 2.0, float("nan"), 4.0], 3)
    assert math.isnan(smoothed[0]) and smoothed[1:] == [2.0, 2.0, 3.0]


def test_plot_run_writes_a_png(tmp_path):
    rows = [{"step": i, "reward": i % 3, "completions/mean_length": 10 + i, "completions/max_length": 20 + i}
            for i in range(1, 25)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.jsonl").write_text(json.dumps({"step": 0, "eval/accuracy": 0.2}) + "\n")
    path = plot_run(tmp_path)
    assert path == tmp_path / "plots" / "training.png" and path.stat().st_size > 10_000
