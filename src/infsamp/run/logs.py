"""Run outputs: per-step JSONL metrics, progress and summary lines, trackers, lengths trace, plots.

Files in the run folder (docs/usage.md describes each): `metrics.jsonl`, `eval.jsonl`,
`lengths.jsonl` (one line per sampled group, the trace that `infsamp simulate` replays; with
`sampling.dynamic` the groups dropped from the update too, marked `"dropped": true`),
`completions.jsonl` (`completion_records`), `eval_completions.jsonl` (`problem_records`) and
`plots/training.png`. Every JSONL file is written by `append_jsonl`: whole lines in one `write` on
an append-only descriptor, so a killed process leaves at most a torn last line. Readers skip a
torn last line; a resumed run `rewind`s each file to its checkpoint's step (the torn line and the
rows after the checkpoint go; the run writes them again), atomically. Progress bars and summary
lines come from `progress.py`; the trackers chosen in `logging.report_to` (`trackers.py`) get
every metrics and eval record after it is on disk, the config and the plot.

Deliberately simple: trackers see the same flat records as the JSONL files, nothing more; a power
cut can lose the last lines (nothing written is lost to a kill).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infsamp.errors import DataError, RunFolderError
from infsamp.files import headless_pyplot, open_for_writing, replace_with, write_text
from infsamp.run.ownership import check_still_held
from infsamp.run.progress import RunProgress, format_value
from infsamp.run.trackers import Trackers, open_trackers

if TYPE_CHECKING:
    from infsamp.rewards.compute import RewardResult


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# the run's JSONL files: a resume rewinds each of them to the checkpoint's step
RUN_LOGS = ("metrics.jsonl", "eval.jsonl", "lengths.jsonl", "completions.jsonl",
            "eval_completions.jsonl")


def append_jsonl(path: Path, records: dict[str, Any] | list[dict[str, Any]]) -> None:
    """Append one or more records as whole lines with a single write (see module docstring)."""
    records = [records] if isinstance(records, dict) else records
    text = "".join(json.dumps({k: _clean(v) for k, v in r.items()}) + "\n" for r in records)
    data = memoryview(text.encode())
    try:
        fd = open_for_writing(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            while data:
                data = data[os.write(fd, data):]
        finally:
            os.close(fd)
    except OSError as err:
        raise RunFolderError(f"cannot append to {path}: {err.strerror or err}") from None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    # the part after the last newline is '' or a torn line (a write cut short by a kill)
    for number, line in enumerate(path.read_text(errors="replace").split("\n")[:-1], 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise DataError(f"{path}:{number}: not valid JSON") from None
    return records


def rewind(path: Path, step: int) -> int:
    """Keep the complete records with step <= `step` (atomic rewrite); returns how many went."""
    if not path.exists():
        return 0
    lines = path.read_text(errors="replace").split("\n")
    kept = [line for line in lines[:-1] if line.strip() and _step_of(line) <= step]
    dropped = len([line for line in lines if line.strip()]) - len(kept)
    if dropped:
        write_text(path, "".join(line + "\n" for line in kept))
    return dropped


def _step_of(line: str) -> float:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return math.inf  # a damaged line is dropped
    return record.get("step", 0) if isinstance(record, dict) else math.inf


class NullLogger:
    """What ranks other than 0 log: nothing (every RunLogger method is a no-op, no progress)."""

    def __init__(self) -> None:
        self.progress = RunProgress(0, 0, enabled=False)

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


class RunLogger:
    def __init__(self, output_dir: Path, max_steps: int, start_step: int, log_every: int,
                 progress_bar: bool):
        self.dir = output_dir
        self.log_every = log_every
        self.progress = RunProgress(max_steps, start_step, enabled=progress_bar)
        self.start_step = start_step
        self.trackers: Trackers | None = None

    def open_trackers(self, report_to: list[str], project: str, run_name: str,
                      config: dict[str, Any]) -> None:
        """Start (on resume: continue) the runs of the trackers in `report_to`, with the config."""
        self.trackers = open_trackers(report_to, self.dir, project, run_name, config,
                                      self.start_step, report=self.progress.write)

    def _append(self, name: str, records: dict[str, Any] | list[dict[str, Any]]) -> None:
        check_still_held(self.dir)  # a folder removed or replaced meanwhile: one line, no write
        append_jsonl(self.dir / name, records)

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        self._append("metrics.jsonl", {"step": step, **metrics})
        if self.trackers:
            self.trackers.log_metrics(step, metrics)
        self.progress.end_step(step)
        if step % self.log_every == 0:
            self.progress.write(self.progress.summary(step, metrics))

    def log_eval(self, step: int, metrics: dict[str, Any]) -> None:
        self._append("eval.jsonl", {"step": step, **metrics})
        if self.trackers:
            self.trackers.log_metrics(step, metrics)
        shown = " ".join(f"{k}={format_value(v)}" for k, v in metrics.items())
        self.progress.write(f"eval @ step {step}: {shown}")

    def log_plot(self, step: int) -> None:
        """Write plots/training.png and send it to the trackers; a failed write is a warning (the
        run and its checkpoint are complete: say so, do not fail)."""
        check_still_held(self.dir)
        try:
            path = plot_run(self.dir)
        except OSError as err:
            print(f"warning: plots/training.png not written ({err.strerror or err})",
                  file=sys.stderr)
            return
        if path is not None and self.trackers:
            self.trackers.log_image(step, path)

    def log_lengths(self, step: int, groups: list[dict[str, Any]]) -> None:
        self._append("lengths.jsonl", [{"step": step, **group} for group in groups])

    def log_completions(self, step: int, records: list[dict[str, Any]],
                        name: str = "completions.jsonl") -> None:
        """Rows of completions.jsonl (training) or eval_completions.jsonl (held-out)."""
        self._append(name, [{"step": step, **record} for record in records])

    def close(self, ok: bool = True) -> None:
        """Close the bars and finish the trackers' runs (marked failed when `ok` is False)."""
        self.progress.close()
        if self.trackers:
            self.trackers.finish(ok)


def completion_records(prompt_ids: list[str], prompts: list[str], completions: list[Any],
                       rewards: dict[str, list[float]], totals: list[float],
                       advantages: Any) -> list[dict[str, Any]]:
    """One record per completion (group-major, the same number per prompt): what the policy wrote
    and its score (NaN rewards become null)."""
    group_size = len(completions) // max(len(prompts), 1)
    return [{"prompt_id": prompt_ids[row // group_size], "prompt": prompts[row // group_size],
             "completion": c.text, "length": c.length, "finish_reason": c.finish_reason,
             "rewards": {name: _clean(values[row]) for name, values in rewards.items()},
             "reward": totals[row], "advantage": float(advantages[row])}
            for row, c in enumerate(completions)]


def problem_records(prompts: Sequence, texts: Sequence[str], ids: Sequence[Sequence[int]],
                    result: RewardResult, chosen: str, threshold: float) -> list[dict]:
    """One row per held-out problem (`prompts`: EncodedPrompt): its key, prompt, completion,
    length, each function's score (None where it gave none) and whether it counts as solved."""
    return [{"prompt_id": prompt.index, "prompt": prompt.text, "completion": text,
             "length": len(ids[row]),
             "rewards": {name: _clean(values[row])
                         for name, values in result.per_function.items()},
             "solved": bool(result.per_function[chosen][row] >= threshold)}
            for row, (prompt, text) in enumerate(zip(prompts, texts))]


SMOOTHING_STEPS = 10  # few prompts per step make per-step rewards noisy


def moving_average(values: list[float | None], window: int) -> list[float]:
    """Mean of the last `window` values at each position (fewer at the start); None/NaN are
    skipped."""
    out, recent = [], []
    for value in values:
        recent = (recent + [value])[-window:]
        finite = [v for v in recent if v is not None and v == v]
        out.append(sum(finite) / len(finite) if finite else float("nan"))
    return out


def plot_run(output_dir: Path) -> Path | None:
    """reward and held-out accuracy against step -> plots/training.png."""
    plt = headless_pyplot()

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
        ax_acc.plot([e["step"] for e in evals], [e.get("eval/accuracy") for e in evals], "o-",
                    color="tab:red", label="held-out accuracy")
        ax_acc.set_ylabel("held-out accuracy")
        ax_acc.set_ylim(0, 1)
        ax_acc.legend(loc="lower right")
    ax_reward.legend(loc="upper left")
    lengths = [m.get("completions/mean_length") for m in metrics]
    ax_len.plot(steps, lengths, color="tab:blue", alpha=0.3)
    ax_len.plot(steps, moving_average(lengths, SMOOTHING_STEPS), color="tab:blue",
                label="mean length (smoothed)")
    ax_len.plot(steps, [m.get("completions/max_length") for m in metrics], label="max length",
                alpha=0.5, color="tab:orange")
    ax_len.set_xlabel("step")
    ax_len.set_ylabel("completion tokens")
    ax_len.legend()
    fig.tight_layout()
    path = output_dir / "plots" / "training.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_with(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return path
