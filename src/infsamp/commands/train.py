"""`infsamp train [CONFIG.yaml] [--section.key VALUE ...] [--resume]`: GRPO training.

Several processes: `torchrun --nproc-per-node N -m infsamp train ...` or `accelerate launch
[--config_file examples/accelerate/ddp.yaml] -m infsamp train ...` (see docs/distributed.md).

With no arguments it runs the embedded demo (tiny model, arithmetic task, CPU-sized). Every config
option is also a flag, generated from the dataclass tree with its help text.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from infsamp.config_io import iter_options, load_config, type_name
from infsamp.distributed.ranks import init_ranks
from infsamp.models.source import check_model_source
from infsamp.tasks.sources import check_dataset_source

RUN_FILES = ("metrics.jsonl", "eval.jsonl", "lengths.jsonl", "plots/training.png")
DEMO_HINT = "no config given: running the embedded demo (tiny Llama, arithmetic task)"


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("config options (override the YAML file)")
    for key, annotation, default, help_text in iter_options():
        group.add_argument(f"--{key}", dest=f"cfg:{key}", default=None,
                           metavar=type_name(annotation).upper(),
                           help=f"{help_text} (default: {default!r})")


def config_overrides(args: argparse.Namespace) -> dict[str, object]:
    return {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg:") and v is not None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML config file (default: the embedded demo)")
    parser.add_argument("--resume", action="store_true",
                        help="resume from the newest checkpoint in output_dir that verifies (none "
                             "is an error; --checkpointing.resume auto starts a new run then)")
    parser.add_argument("--num-generations", "-G", dest="cfg:sampling.num_generations",
                        default=None, metavar="G",
                        help="completions per prompt, as in every command (= "
                             "--sampling.num_generations)")
    add_config_flags(parser)


def check_sources(cfg) -> None:
    """Model and dataset names decided before torch is imported: a missing path, or a hub id while
    the hub cannot be asked, is one line within a second of starting."""
    check_model_source(cfg.model.name_or_path)
    check_dataset_source(cfg.data)


def run(args: argparse.Namespace) -> int:
    overrides = config_overrides(args)
    if args.resume:
        overrides.setdefault("checkpointing.resume", "latest")
    cfg = load_config(args.config, overrides)
    check_sources(cfg)
    if args.config is None:
        print(DEMO_HINT)
    from infsamp.run.trainer import GRPOTrainer

    ranks = init_ranks(cfg)  # one process, or this rank of a torchrun / accelerate launch
    with ranks.guard():  # a failure here stops the other ranks, naming this one
        result = GRPOTrainer(cfg, ranks=ranks).train()
    before, after = result.eval_before, result.eval_after
    if before is not None and after is not None:
        print(f"held-out accuracy: {before:.3f} -> {after:.3f} ({100 * (after - before):+.1f} "
              f"points; scored by {result.eval_reward})")
    written = [name for name in RUN_FILES if (Path(result.output_dir) / name).exists()]
    print(f"run folder: {result.output_dir} ({', '.join(written)})")
    return 0
