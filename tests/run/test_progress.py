"""Progress display: bars per phase only on a terminal, one summary line per logged step always."""

import io
import sys

from infsamp.run.progress import RunProgress, format_duration
from infsamp.run.trainer import GRPOTrainer
from infsamp.sampling.types import SamplerStats


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def _stats(generated_tokens: int) -> SamplerStats:
    """A call of 8 samples on 4 slots, 0.5 s in."""
    return SamplerStats(num_samples=8, micro_group=4, generated_tokens=generated_tokens,
                        wall_time_s=0.5)


def test_summary_line_has_the_step_the_metrics_and_the_eta():
    progress = RunProgress(10, 0, enabled=True, file=io.StringIO())
    progress.started -= 30.0  # three steps took 30 s
    line = progress.summary(3, {"reward": 0.5, "loss": -0.25, "other": 1, "step_time": 9.5})
    assert line == "step 3/10: reward=0.5 loss=-0.25 step_time=9.5 | eta 1:10"
    assert progress.summary(10, {"reward": 1.0}) == "step 10/10: reward=1"
    assert format_duration(3725) == "1:02:05"


def test_no_bars_when_the_output_is_not_a_terminal():
    pipe = io.StringIO()
    progress = RunProgress(4, 0, enabled=True, file=pipe)
    progress.phase("sampling", 8, "samples")
    progress.sampling(_stats(100), 8, 2)
    progress.end_step(1)
    progress.close()
    assert not progress.bars_shown and pipe.getvalue() == ""


def test_phase_bars_on_a_terminal_show_tokens_per_second_and_slots():
    terminal = FakeTerminal()
    progress = RunProgress(4, 1, enabled=True, file=terminal)
    progress.phase("sampling", 8, "samples")
    progress.sampling(_stats(1000), 8, 3)
    progress.phase("update", 8, "sequences")
    progress.advance(8)
    progress.end_step(2)
    shown = terminal.getvalue()
    assert "sampling 8/8 samples" in shown and "2,000 tok/s, slots 3/4" in shown
    assert "update 8/8 sequences" in shown and "run:  50%" in shown and "2/4" in shown
    assert RunProgress(4, 0, enabled=False, file=FakeTerminal()).bars_shown is False


def test_training_shows_every_phase_on_a_terminal(tiny_config, monkeypatch, capsys):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    GRPOTrainer(tiny_config(**{"training.max_steps": 2, "logging.progress_bar": True})).train()
    bars = terminal.getvalue()
    for text in ("evaluating", "sampling 8/8 samples", "tok/s, slots", "scoring 8/8 completions",
                 "update 8/8 sequences", "run: 100%"):
        assert text in bars, text


def test_training_in_a_pipe_prints_only_the_summary_lines(tiny_config, capsys):
    overrides = {"training.max_steps": 4, "logging.log_every": 2, "eval.num_problems": 0,
                 "logging.progress_bar": True}
    GRPOTrainer(tiny_config(**overrides)).train()
    captured = capsys.readouterr()
    steps = [line.split(":")[0] for line in captured.out.splitlines() if line.startswith("step ")]
    assert steps == ["step 2/4", "step 4/4"]
    assert "sampling" not in captured.err and "run:" not in captured.err
