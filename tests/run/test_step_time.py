"""Where a step's time goes: every step logs each phase of `timing.PHASES` (`time/<phase>`), and
`infsamp bench step --config FILE --steps N [--plot FILE]` prints the split per step and its
median, and draws it as a bar chart."""

from __future__ import annotations

import pytest
import yaml

from infsamp.cli import main
from infsamp.run.trainer import GRPOTrainer
from infsamp.timing import PHASES

TRAINED = [f"time/{p}" for p in PHASES if p != "eval"]


def test_every_step_logs_each_phase(tiny_config):
    trainer = GRPOTrainer(tiny_config(**{"training.max_steps": 1}))
    try:
        metrics = trainer.train_step()
    finally:
        trainer.close()
    assert all(metrics[name] >= 0 for name in TRAINED), metrics
    assert metrics["time/sampling"] > 0 and metrics["time/train"] > 0
    assert sum(metrics[name] for name in TRAINED) <= metrics["step_time"] + 1e-3


@pytest.fixture
def config_file(tiny_config, tmp_path):
    cfg = tiny_config()  # the same small run, as a file
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": cfg.model.name_or_path, "attn_implementation": "eager"},
        "data": {"num_train_examples": 40, "num_eval_examples": 4},
        "sampling": {"num_generations": 4, "max_new_tokens": 12, "micro_group": 4,
                     "kv_budget": "4096"},
        "training": {"prompts_per_step": 2, "learning_rate": 1e-2, "warmup_ratio": 0.0},
        "logging": {"progress_bar": False, "plot": False}}))
    return path


def test_bench_step_prints_the_split_and_draws_it(config_file, tmp_path, capsys):
    plot = tmp_path / "split"
    assert main(["bench", "step", "--config", str(config_file), "--steps", "2",
                 "--plot", str(plot)]) == 0
    out = capsys.readouterr().out.splitlines()
    lines = out[next(i for i, line in enumerate(out) if line.split()[:1] == ["step"]):]
    header = lines[0].split()
    assert header[:1 + len(TRAINED)] == ["step", *TRAINED]
    rows = {line.split()[0]: line.split() for line in lines[1:4]}
    assert set(rows) == {"1", "2", "median"}
    assert float(rows["1"][header.index("time/sampling")]) > 0
    png = tmp_path / "split.png"  # the extension matplotlib writes, added
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and lines[-1] == f"wrote {png}"
    # never over an existing file unasked: one line, before any step
    assert main(["bench", "step", "--config", str(config_file), "--steps", "1",
                 "--plot", str(png)]) == 2
    assert "exists (nothing was written)" in capsys.readouterr().err
