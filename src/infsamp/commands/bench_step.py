"""`infsamp bench step --config FILE [--steps N]`: where a step's time goes, for any config.

Runs N training steps of the config (no evaluation, no checkpoint, a temporary run folder) and
prints each step's `time/<phase>` split (timing.py), the training tokens forwarded and the
share of sequences skipped, then the median of each phase.

Deliberately simple: one process; the steps are real updates of a fresh run (step 1 included, so
its warm-up costs show in its row).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from infsamp.commands.train import add_config_flags, check_sources, config_overrides
from infsamp.timing import PHASES

COLUMNS = [f"time/{p}" for p in PHASES if p != "eval"] + ["step_time", "train/forwarded_tokens",
                                                          "train/skipped_sequences_frac"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--steps", type=int, default=3, help="steps to time (default 3)")
    add_config_flags(parser)


def run(args: argparse.Namespace) -> int:
    from infsamp.config_io import load_config

    if args.steps < 1:
        raise SystemExit(f"--steps: must be >= 1, got {args.steps}")
    with tempfile.TemporaryDirectory(prefix="infsamp-bench-step-") as folder:
        overrides = {**config_overrides(args), "logging.output_dir": folder,
                     "training.max_steps": args.steps, "eval.every_steps": 0,
                     "eval.num_problems": 0, "checkpointing.save_every": 0,
                     "checkpointing.keep_best": ""}
        cfg = load_config(args.config, overrides)
        check_sources(cfg)
        rows = _timed_steps(cfg, args.steps)
    print("  ".join(f"{c:>12}" for c in ["step", *COLUMNS]))
    for k, row in enumerate(rows, start=1):
        print("  ".join([f"{k:>12}", *(f"{row.get(c, 0.0):>12.4g}" for c in COLUMNS)]))
    print("  ".join([f"{'median':>12}", *(f"{statistics.median(r.get(c, 0.0) for r in rows):>12.4g}"
                                         for c in COLUMNS)]))
    return 0


def _timed_steps(cfg, steps: int) -> list[dict]:
    from infsamp.distributed.ranks import init_ranks
    from infsamp.run.trainer import GRPOTrainer

    trainer = GRPOTrainer(cfg, ranks=init_ranks(cfg))
    try:
        return [trainer.train_step() for _ in range(steps)]
    finally:
        trainer.close()
