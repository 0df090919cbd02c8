"""Held-out curves of several runs per arm (seeds), side by side: one table and one plot.

Reads run folders written by `infsamp train` (eval_completions.jsonl, eval.jsonl, metrics.jsonl)
and prints, per run, the accuracy at each evaluation, the start, best and final figure, the
exact McNemar test of the final evaluation against the start (the same held-out problems), the
completions sampled, the training time (sum of step times) and the arm's mean final accuracy.
The plot puts every run's curve against the completions it sampled (the budget, which a loaded
machine does not distort) or, with `--x seconds`, against its training seconds (the wall-clock
budget), one colour per arm.

    python benchmarks/seed_curves.py recipe=runs/r0,runs/r1 dynamic=runs/d0,runs/d1 --plot out.png
    (--start RUN: the step-0 evaluation of RUN is the start of runs made without one)

Deliberately simple: an arm is a label and a list of folders; no statistics across arms beyond
the mean (three seeds do not support more).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from infsamp.run.logs import read_jsonl


def solved_by_step(run: Path) -> dict[int, dict[int, bool]]:
    """{eval step: {prompt id: solved}} from the run's evaluation completions."""
    table: dict[int, dict[int, bool]] = {}
    for row in read_jsonl(run / "eval_completions.jsonl"):
        table.setdefault(row["step"], {})[row["prompt_id"]] = bool(row["solved"])
    return table


def totals_at(run: Path, key: str) -> dict[int, float]:
    """{step: the sum of metric `key` (e.g. step_time: training seconds, evaluations excluded)
    over the steps up to and including that step}."""
    total, sums = 0.0, {0: 0.0}
    for row in read_jsonl(run / "metrics.jsonl"):
        if key in row:
            total += row[key]
            sums[row["step"]] = total
    return sums


def completions_at(run: Path) -> dict[int, float]:
    """{step: completions sampled up to that step} (`sampling/completions` with dynamic sampling,
    else `sampling/num_samples`): the sampling budget, whatever else ran on the machine."""
    dynamic = totals_at(run, "sampling/completions")
    return dynamic if len(dynamic) > 1 else totals_at(run, "sampling/num_samples")


def mcnemar_p(before: dict[int, bool], after: dict[int, bool]) -> tuple[int, int, float]:
    """Problems gained, lost, and the exact two-sided McNemar p-value (binomial on discordants)."""
    gained = sum(after[i] and not before[i] for i in before)
    lost = sum(before[i] and not after[i] for i in before)
    n = gained + lost
    if n == 0:
        return 0, 0, 1.0
    tail = sum(math.comb(n, k) for k in range(min(gained, lost) + 1)) / 2**n
    return gained, lost, min(1.0, 2 * tail)


def summarise(run: Path, start: dict[int, bool] | None) -> dict:
    table = solved_by_step(run)
    if 0 not in table and start is not None:  # run with eval.on_start false
        table[0] = start
    steps = sorted(table)
    accuracy = {s: sum(table[s].values()) / len(table[s]) for s in steps}
    first, last = steps[0], steps[-1]
    gained, lost, p = mcnemar_p(table[first], table[last])
    seconds, completions = totals_at(run, "step_time"), completions_at(run)
    return {"run": str(run), "steps": steps, "accuracy": accuracy,
            "seconds": {s: seconds.get(s, float("nan")) for s in steps},
            "completions": {s: completions.get(s, float("nan")) for s in steps},
            "start": accuracy[first], "best": max(accuracy.values()), "final": accuracy[last],
            "gained": gained, "lost": lost, "p": p, "train_s": seconds[max(seconds)],
            "num_completions": completions[max(completions)],
            "wall_cpu": wall_and_cpu(run)}


def wall_and_cpu(run: Path) -> str:
    """'wall s / CPU s' of the whole run from RUN.time (GNU time: wall, user, sys), if written."""
    timing = run.parent / f"{run.name}.time"
    if not timing.exists():
        return "-"
    wall, user, system = (float(v) for v in timing.read_text().split()[-3:])
    return f"{wall:.0f} / {user + system:.0f}"


def print_table(arms: dict[str, list[dict]]) -> None:
    print("| arm | run | curve | start -> final (best) | gained / lost, McNemar p | completions "
          "| steps' wall s | run wall s / CPU s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for arm, runs in arms.items():
        for r in runs:
            curve = " -> ".join(f"{r['accuracy'][s]:.3f}" for s in r["steps"])
            print(f"| {arm} | {Path(r['run']).name} | {curve} | {r['start']:.3f} -> "
                  f"{r['final']:.3f} ({r['best']:.3f}) | {r['gained']} / {r['lost']}, "
                  f"p = {r['p']:.3g} | {r['num_completions']:.0f} | {r['train_s']:.0f} | "
                  f"{r['wall_cpu']} |")
        finals = [r["final"] for r in runs]
        gains = [r["final"] - r["start"] for r in runs]
        print(f"| {arm} | mean of {len(runs)} | | final {sum(finals) / len(finals):.3f}, gain "
              f"{100 * sum(gains) / len(gains):+.1f} points | | | | |")


AXES = {"completions": "completions sampled (the sampling budget)",
        "seconds": "training seconds (sum of step times, evaluations excluded)"}


def plot(arms: dict[str, list[dict]], path: str, x: str = "completions") -> None:
    if x not in AXES:
        raise ValueError(f"x axis {x!r}: choose {' or '.join(AXES)}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for colour, (arm, runs) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"],
                                   arms.items()):
        for i, r in enumerate(runs):
            xs = [r[x][s] for s in r["steps"]]
            ys = [r["accuracy"][s] for s in r["steps"]]
            ax.plot(xs, ys, marker="o", color=colour, alpha=0.8, label=arm if i == 0 else None)
    ax.set_xlabel(AXES[x])
    ax.set_ylabel("held-out accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arms", nargs="+", help="ARM=FOLDER,FOLDER,...")
    parser.add_argument("--plot", help="write the curves to this PNG")
    parser.add_argument("--x", choices=tuple(AXES), default="completions",
                        help="the plot's x axis: completions sampled or training seconds")
    parser.add_argument("--start", help="a run folder whose step-0 evaluation is every run's "
                                        "start (runs made with eval.on_start false)")
    args = parser.parse_args()
    start = solved_by_step(Path(args.start))[0] if args.start else None
    arms = {}
    for spec in args.arms:
        label, _, folders = spec.partition("=")
        arms[label] = [summarise(Path(f), start) for f in folders.split(",") if f]
    print_table(arms)
    if args.plot:
        plot(arms, args.plot, args.x)


if __name__ == "__main__":
    main()
