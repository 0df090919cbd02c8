"""The `infsamp` command line: train, sample, bench, simulate, plan, export.

Each subcommand lives in `infsamp.commands.<name>` and exposes `add_arguments(parser)` and
`run(args) -> int`; this file only wires them up, imports them lazily (fast `--help`), and turns
the project's expected errors into one clear line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from infsamp.errors import InfsampError, RunStopped
from infsamp.options import ConfigError

SUBCOMMANDS = {
    "train": "GRPO training (no arguments: the embedded demo)",
    "sample": "run the sampler alone and print or write completions and statistics",
    "bench": "benchmarks: bench sampling (policies side by side), bench scheduling (length-aware)",
    "simulate": "replay completion lengths through a scheduling policy without a model",
    "plan": "memory plan: what fits on a GPU, and which switches make it fit",
    "export": "a run's checkpoint as a model folder transformers and vLLM load (LoRA merged)",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infsamp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if a in SUBCOMMANDS), None)
    for name, help_text in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # import only the module that will run
            _module(name).add_arguments(sp)
    return parser


def _module(name: str):
    return importlib.import_module(f"infsamp.commands.{name}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv) or ["train"]
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(_module(args.command).run(args) or 0)
    except RunStopped as err:  # a signal, after saving: not an error of the user's
        _say(f"infsamp {args.command}: {err}", err)
        return err.exit_code
    except InfsampError as err:
        _say(f"infsamp {args.command}: error: {_rank_prefix(err)}{err}", err)
        return getattr(err, "exit_code", 2)
    except KeyboardInterrupt as err:
        print(f"infsamp {args.command}: {err or 'interrupted'}", file=sys.stderr)
        return getattr(err, "exit_code", 130)


def _launch_rank() -> int | None:
    """This process's rank under torchrun / accelerate launch with several processes, else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ.get("RANK", "0"))
    return None


def _reached_together(err: BaseException) -> bool:
    """An error every process raised at the same point (a config error, a decision taken on
    gathered values, a signal after saving)."""
    return getattr(err, "agreed", False) or isinstance(err, (ConfigError, RunStopped))


def _rank_prefix(err: BaseException) -> str:
    rank = _launch_rank()
    shared = _reached_together(err) or str(err).startswith("rank ")
    return "" if rank is None or shared else f"rank {rank}: "


def _say(line: str, err: BaseException) -> None:
    """Print the error line; with several processes an error they all reached together is printed
    by rank 0 alone."""
    rank = _launch_rank()
    if rank is None or rank == 0 or not _reached_together(err):
        print(line, file=sys.stderr)

if __name__ == "__main__":
    sys.exit(main())
