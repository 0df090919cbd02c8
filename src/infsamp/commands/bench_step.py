"""`infsamp bench step --config FILE [--steps N]`: where a step's time goes, for any config.

Runs N training steps of the config (no evaluation, no checkpoint, a temporary run folder) and
prints each step's `time/<phase>` split (timing.py), the training tokens forwarded and the
share of sequences skipped, then the median of each phase; `--plot FILE` draws the split as one
stacked bar per step and one for the median (the README's recipe figure).

Deliberately simple: one process; the steps are real updates of a fresh run (step 1 included, so
its warm-up costs show in its row).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from infsamp.commands.output_files import check_output_files, check_plot_format, plot_name
from infsamp.commands.train import add_config_flags, check_sources, config_overrides
from infsamp.config_io import load_config
from infsamp.distributed.ranks import init_ranks
from infsamp.files import headless_pyplot, replace_with
from infsamp.timing import PHASES

COLUMNS = [f"time/{p}" for p in PHASES if p != "eval"] + ["step_time", "train/forwarded_tokens",
                                                          "train/skipped_sequences_frac"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--steps", type=int, default=3, help="steps to time (default 3)")
    parser.add_argument("--plot", help="also draw the split as a bar chart into this file (PNG)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --plot")
    add_config_flags(parser)


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise SystemExit(f"--steps: must be >= 1, got {args.steps}")
    if args.plot:
        args.plot = plot_name(args.plot)
        check_output_files({"--plot": args.plot}, [args.config], args.overwrite)
        check_plot_format("--plot", args.plot)
    with tempfile.TemporaryDirectory(prefix="infsamp-bench-step-") as folder:
        overrides = {**config_overrides(args), "logging.output_dir": folder,
                     "training.max_steps": args.steps, "eval.every_steps": 0,
                     "eval.num_problems": 0, "checkpointing.save_every": 0,
                     "checkpointing.keep_best": ""}
        cfg = load_config(args.config, overrides)
        check_sources(cfg)
        rows = _timed_steps(cfg, args.steps)
    median = {c: statistics.median(r.get(c, 0.0) for r in rows) for c in COLUMNS}
    print("  ".join(f"{c:>12}" for c in ["step", *COLUMNS]))
    for k, row in enumerate(rows, start=1):
        print("  ".join([f"{k:>12}", *(f"{row.get(c, 0.0):>12.4g}" for c in COLUMNS)]))
    print("  ".join([f"{'median':>12}", *(f"{median[c]:>12.4g}" for c in COLUMNS)]))
    if args.plot:
        plot_split([*rows, median], [*(f"step {k}" for k in range(1, len(rows) + 1)), "median"],
                   args.plot, title=args.config)
        print(f"wrote {args.plot}")
    return 0


def plot_split(rows: list[dict], labels: list[str], path: str, title: str) -> None:
    """One horizontal stacked bar per row: the seconds of each timed phase."""
    plt = headless_pyplot()

    phases = [c for c in COLUMNS if c.startswith("time/")]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.4))
    left = [0.0] * len(rows)
    for phase in phases:
        widths = [float(r.get(phase, 0.0)) for r in rows]
        ax.barh(labels, widths, left=left, label=phase.removeprefix("time/"))
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"where a step's time goes: {title}", fontsize=9)
    ax.legend(ncol=len(phases), fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.08))
    fig.tight_layout()
    replace_with(path, lambda tmp: fig.savefig(tmp, dpi=110, format=path.rsplit(".", 1)[-1]))
    plt.close(fig)


def _timed_steps(cfg, steps: int) -> list[dict]:
    from infsamp.run.trainer import GRPOTrainer

    trainer = GRPOTrainer(cfg, ranks=init_ranks(cfg))
    try:
        return [trainer.train_step() for _ in range(steps)]
    finally:
        trainer.close()
