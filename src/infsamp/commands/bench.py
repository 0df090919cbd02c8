"""`infsamp bench WHAT`: the benchmarks behind docs/results.md (index: docs/benchmarks.md).

    infsamp bench sampling ...     # full / rounds / continuous side by side (bench_sampling.py)
    infsamp bench scheduling ...   # length-aware scheduler, real engine (bench_scheduling.py)
    infsamp bench step --config F  # a step's time split by phase (bench_step.py)

This file only wires them up; each benchmark lives in its own module.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "sampling": "all sampling policies side by side: memory, decode steps and tokens/s against G",
    "scheduling": "length_aware (online and oracle predictor) against rounds "
                  "and continuous, real engine",
    "step": "where a training step's time goes: sampling, rewards, log-probs, train, optimizer",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="what", metavar="WHAT", required=True)
    for name, help_text in BENCHMARKS.items():
        _module(name).add_arguments(sub.add_parser(name, help=help_text, description=help_text))


def _module(name: str):
    return importlib.import_module(f"infsamp.commands.bench_{name}")


def run(args: argparse.Namespace) -> int:
    return _module(args.what).run(args)
