"""Run outputs: per-step JSONL metrics, progress and summary lines, trackers, lengths trace, plots.

Files in the run folder: `metrics.jsonl` (one object per step, TRL metric names where they exist),
`eval.jsonl` (held-out accuracy by step), `lengths.jsonl` (one line per sampled group, the trace that
`infsamp simulate` replays), `plots/training.png`. Lines are appended and flushed, so a crash loses at
most the step in flight; a resumed run truncates them back to the checkpoint's step.
Progress bars and summary lines come from `progress.py`; the experiment trackers chosen in
`logging.report_to` (`trackers.py`) get every metrics and eval record after it is on disk, the
config and the plot.

Deliberately simple: trackers see the same flat records as the JSONL files, nothing more.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from infsamp.rl.progress import RunProgress, format_value
from infsamp.rl.trackers import Trackers, open_trackers


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as fh:
        fh.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_after_step(path: Path, step: int) -> None:
    """Drop records past `step` (a resumed run rewrites them)."""
    if path.exists():
        kept = [r for r in read_jsonl(path) if r.get("step", 0) <= step]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))


class RunLogger:
    def __init__(self, output_dir: Path, max_steps: int, start_step: int, log_every: int, progress_bar: bool):
        self.dir = output_dir
        self.log_every = log_every
        for name in ("metrics.jsonl", "eval.jsonl", "lengths.jsonl"):
            truncate_after_step(self.dir / name, start_step)
        self.progress = RunProgress(max_steps, start_step, enabled=progress_bar)
        self.start_step = start_step
        self.trackers: Trackers | None = None

    def open_trackers(self, report_to: list[str], project: str, run_name: str,
                      config: dict[str, Any]) -> None:
        """Start (on resume: continue) the runs of the trackers in `report_to`, with the config."""
        self.trackers = open_trackers(report_to, self.dir, project, run_name, config,
                                      self.start_step, report=self.progress.write)

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        append_jsonl(self.dir / "metrics.jsonl", {"step": step, **metrics})
        if self.trackers:
            self.trackers.log_metrics(step, metrics)
        self.progress.end_step(step)
        if step % self.log_every == 0:
            self.progress.write(self.progress.summary(step, metrics))

    def log_eval(self, step: int, metrics: dict[str, Any]) -> None:
        append_jsonl(self.dir / "eval.jsonl", {"step": step, **metrics})
        if self.trackers:
            self.trackers.log_metrics(step, metrics)
        shown = " ".join(f"{k}={format_value(v)}" for k, v in metrics.items())
        self.progress.write(f"eval @ step {step}: {shown}")

    def log_plot(self, step: int) -> Path | None:
        """Write plots/training.png and send it to the trackers."""
        path = plot_run(self.dir)
        if path is not None and self.trackers:
            self.trackers.log_image(step, path)
        return path

    def log_lengths(self, step: int, groups: list[dict[str, Any]]) -> None:
        with (self.dir / "lengths.jsonl").open("a") as fh:
            for group in groups:
                fh.write(json.dumps({"step": step, **group}) + "\n")

    def close(self, ok: bool = True) -> None:
        """Close the bars and finish the trackers' runs (marked failed when `ok` is False)."""
        self.progress.close()
        if self.trackers:
            self.trackers.finish(ok)


SMOOTHING_STEPS = 10  # few prompts per step make per-step rewards noisy


def moving_average(values: list[float | None], window: int) -> list[float]:
    """Mean of the last `window` values at each position (fewer at the start); None/NaN are skipped."""
    out, recent = [], []
    for value in values:
        recent = (recent + [value])[-window:]
        finite = [v for v in recent if v is not None and v == v]
        out.append(sum(finite) / len(finite) if finite else float("nan"))
    return out


def plot_run(output_dir: Path) -> Path | None:
    """reward and held-out accuracy against step -> plots/training.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics, evals = read_jsonl(output_dir / "metrics.jsonl"), read_jsonl(output_dir / "eval.jsonl")
    if not metrics:
        return None
    fig, (ax_reward, ax_len) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [m["step"] for m in metrics]
    rewards = [m.get("reward") for m in metrics]
    ax_reward.plot(steps, rewards, label="train reward", color="tab:blue", alpha=0.3)
    ax_reward.plot(steps, moving_average(rewards, SMOOTHING_STEPS), color="tab:blue",
                   label=f"train reward, mean of {SMOOTHING_STEPS} steps")
    ax_reward.set_xlabel("step")
    ax_reward.set_ylabel("mean reward")
    if evals:
        ax_acc = ax_reward.twinx()
        ax_acc.plot([e["step"] for e in evals], [e.get("eval/accuracy") for e in evals], "o-", color="tab:red",
                    label="held-out accuracy")
        ax_acc.set_ylabel("held-out accuracy")
        ax_acc.set_ylim(0, 1)
        ax_acc.legend(loc="lower right")
    ax_reward.legend(loc="upper left")
    lengths = [m.get("completions/mean_length") for m in metrics]
    ax_len.plot(steps, lengths, color="tab:blue", alpha=0.3)
    ax_len.plot(steps, moving_average(lengths, SMOOTHING_STEPS), color="tab:blue", label="mean length (smoothed)")
    ax_len.plot(steps, [m.get("completions/max_length") for m in metrics], label="max length", alpha=0.5,
                color="tab:orange")
    ax_len.set_xlabel("step")
    ax_len.set_ylabel("completion tokens")
    ax_len.legend()
    fig.tight_layout()
    path = output_dir / "plots" / "training.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
