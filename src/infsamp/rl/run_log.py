"""Run outputs: per-step JSONL metrics, console lines, a tqdm bar, the lengths trace and PNG plots.

Files in the run folder: `metrics.jsonl` (one object per step, TRL metric names where they exist),
`eval.jsonl` (held-out accuracy by step), `lengths.jsonl` (one line per sampled group, the trace that
`infsamp simulate` replays), `completions.jsonl` (with `logging.completions_every`: one line per
completion of the logged steps: prompt, completion, per-function rewards, advantage; TRL's
`log_completions`), `plots/training.png`. Every JSONL file is written by
`append_jsonl`: whole lines in one `write` on an append-only descriptor, so a killed process leaves
at most a torn last line. Readers skip a torn last line; a resumed run `rewind`s each file to its
checkpoint's step (the torn line and the rows after the checkpoint go; the run writes them again),
atomically. (A killed process loses nothing written; a power cut can lose the last lines.)

Deliberately simple: no TensorBoard/W&B integration; the JSONL files are easy to load into either.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from infsamp.errors import DataError, RunFolderError

CONSOLE_KEYS = ("reward", "accuracy", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                "loss", "kl", "clip_ratio/region_mean", "sampling/decode_steps", "step_time")


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# the run's JSONL files: a resume rewinds each of them to the checkpoint's step
RUN_LOGS = ("metrics.jsonl", "eval.jsonl", "lengths.jsonl", "completions.jsonl")


def append_jsonl(path: Path, records: dict[str, Any] | list[dict[str, Any]]) -> None:
    """Append one or more records as whole lines with a single write (see module docstring)."""
    records = [records] if isinstance(records, dict) else records
    text = "".join(json.dumps({k: _clean(v) for k, v in r.items()}) + "\n" for r in records)
    data = memoryview(text.encode())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            while data:
                data = data[os.write(fd, data):]
        finally:
            os.close(fd)
    except OSError as err:
        raise RunFolderError(f"cannot append to {path}: {err.strerror or err}") from None


def _complete_lines(path: Path) -> list[str]:
    """The file's lines without a torn last one (no newline: a write cut short by a kill)."""
    text = path.read_text(errors="replace")
    lines = text.split("\n")
    return lines[:-1]  # the part after the last newline is '' or a torn line


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(_complete_lines(path), 1):
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
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return dropped


def _step_of(line: str) -> float:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return math.inf  # a damaged line is dropped
    return record.get("step", 0) if isinstance(record, dict) else math.inf


class RunLogger:
    def __init__(self, output_dir: Path, max_steps: int, start_step: int, log_every: int, progress_bar: bool):
        self.dir = output_dir
        self.log_every = log_every
        self.bar = tqdm(total=max_steps, initial=start_step, desc="grpo", unit="step", disable=not progress_bar,
                        dynamic_ncols=True)

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        append_jsonl(self.dir / "metrics.jsonl", {"step": step, **metrics})
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{metrics.get('reward', float('nan')):.3f}",
                             len=f"{metrics.get('completions/mean_length', 0):.0f}")
        if step % self.log_every == 0:
            shown = " ".join(f"{k}={_fmt(metrics[k])}" for k in CONSOLE_KEYS if k in metrics)
            self.bar.write(f"step {step}: {shown}")

    def log_eval(self, step: int, metrics: dict[str, Any]) -> None:
        append_jsonl(self.dir / "eval.jsonl", {"step": step, **metrics})
        self.bar.write(f"eval @ step {step}: " + " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items()))

    def log_lengths(self, step: int, groups: list[dict[str, Any]]) -> None:
        append_jsonl(self.dir / "lengths.jsonl", [{"step": step, **group} for group in groups])

    def log_completions(self, step: int, records: list[dict[str, Any]]) -> None:
        append_jsonl(self.dir / "completions.jsonl", [{"step": step, **record} for record in records])

    def close(self) -> None:
        self.bar.close()


def completion_records(prompt_ids: list[str], prompts: list[str], completions: list[Any],
                       rewards: dict[str, list[float]], totals: list[float],
                       advantages: Any) -> list[dict[str, Any]]:
    """One record per completion (group-major, G per prompt): what the policy wrote and its score.

    `completions` carry `.text`, `.length`, `.finish_reason`; NaN rewards (None) become null.
    """
    group_size = len(completions) // max(len(prompts), 1)
    return [{"prompt_id": prompt_ids[row // group_size], "prompt": prompts[row // group_size],
             "completion": c.text, "length": c.length, "finish_reason": c.finish_reason,
             "rewards": {name: _clean(values[row]) for name, values in rewards.items()},
             "reward": totals[row], "advantage": float(advantages[row])}
            for row, c in enumerate(completions)]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


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
