"""`infsamp simulate`: replay completion lengths through a scheduling policy, without a model.

    infsamp simulate --trace runs/demo/lengths.jsonl --micro-group 8 --policy length_aware \
        --predictor online
    infsamp simulate --synthetic lognormal --groups 20 --num-generations 32 --micro-group 8 \
        --policy rounds --json
    infsamp simulate --synthetic lognormal --groups 20 --num-generations 32 --micro-group 8 \
        --plot quality.png

A trace with turns (tool calls, `sampling.simulator`) replays its episodes: `--step-seconds S`
makes a call of latency L wait ceil(L / S) decode steps; 0 (the default) answers it at the next.

`--plot` sweeps predictor quality (the true length times a log-normal error, sigma 0 .. 1.5, plus
the `none` and `online` predictors) under `length_aware` and draws decode steps against the measured
Kendall tau, with `continuous` and the lower bound as lines and `rounds` as a number.

Bounds, stated before any work: a synthetic workload holds at most MAX_SAMPLES samples (groups x
G x epochs; 200,000 lognormal samples replay in ~30 CPU seconds), every integer option at most
config.MAX_INTEGER. A replay that runs longer than PROGRESS_EVERY_S prints a progress line on
stderr that often.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from functools import partial
from pathlib import Path

from infsamp.choices import PROBE_TOKENS, REFILL_ORDERS
from infsamp.commands.output_files import check_output_files, check_plot_format, plot_name
from infsamp.errors import SamplingError
from infsamp.files import headless_pyplot, replace_with
from infsamp.options import MAX_INTEGER
from infsamp.sampling.policies import POLICIES
from infsamp.sampling.policies.length_aware import PARK_RATIO
from infsamp.sampling.simulator import simulate
from infsamp.sampling.traces import arithmetic_trace, read_trace, synthetic_trace, write_trace
from infsamp.sampling.types import SamplerStats

SYNTHETIC = {"lognormal": synthetic_trace, "arithmetic": arithmetic_trace}
PLOT_SIGMAS = (0.0, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5)
PLOT_REPLAYS = 2 * len(PLOT_SIGMAS) + 4  # _plot's: two refills per sigma, online, none, 2 lines
MAX_SAMPLES = 1_000_000  # a synthetic workload's groups x G x epochs: ~2.5 CPU-minutes of replay
PROGRESS_EVERY_S = 5.0


INTEGER_OPTIONS = {  # flag -> (default, lowest value, help); every one at most MAX_INTEGER
    "groups": (20, 1, "synthetic: prompts per epoch"),
    "num-generations": (32, 1, "synthetic: G, samples per prompt"),
    "epochs": (1, 1, "synthetic: passes over the same prompts"),
    "seed": (0, -MAX_INTEGER, "synthetic: random seed"),
    "prompts-per-step": (1, 1, "B: trace lines per training step"),
    "micro-group": (None, 1, "g: samples decoded at once"),
    "kv-budget": (None, 1, "KV-cache budget in tokens (g follows unless --micro-group)"),
    "max-new-tokens": (None, 1, "completion limit (default: longest in trace)"),
    "prefix-tokens": (8, 1, "length_aware: k, re-predict every k tokens (the trace's first_tokens "
                      "give the token-conditioned predictor what the run's engine saw)"),
    "probe-tokens": (PROBE_TOKENS, 1, "probe: k, the KV tokens a new sample first reserves"),
    "warmup-steps": (0, 0, "replay the first N training steps (the predictor learns) but leave "
                     "them out of the figures, as bench scheduling measures its last epoch"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="JSONL trace: {prompt_id, prompt_tokens, lengths} per line")
    source.add_argument("--synthetic", choices=sorted(SYNTHETIC),
                        help="generate a workload instead: lognormal (the paper's length-controlled"
                             " one) or arithmetic (worked-solution lengths of the embedded task, "
                             "with prompt text)")
    for flag, (default, _, help_text) in INTEGER_OPTIONS.items():
        names = [f"--{flag}", "-G"] if flag == "num-generations" else [f"--{flag}"]
        parser.add_argument(*names, type=int, default=default, help=help_text)
    parser.add_argument("--direct-share", type=float, default=0.0,
                        help="synthetic arithmetic: share of samples that are direct guesses (the "
                             "shipped model guesses on about half of its samples at the start of "
                             "a run)")
    parser.add_argument("--write-trace", metavar="FILE",
                        help="also write the (synthetic) trace here")
    parser.add_argument("--policy", choices=sorted(POLICIES), default="continuous")
    parser.add_argument("--predictor", default="none", help="none, oracle, online or noisy:SIGMA "
                        "(hidden needs the model's hidden states: bench scheduling runs it)")
    parser.add_argument("--refill", choices=("auto",) + REFILL_ORDERS, default="auto",
                        help="length_aware runtime refill order")
    parser.add_argument("--epsilon", type=float, default=0.1,
                        help="FPTAS epsilon of the global grouping")
    parser.add_argument("--no-preempt", action="store_true",
                        help="length_aware: never park a running sample (admission-time decisions)")
    parser.add_argument("--park-ratio", type=float, default=PARK_RATIO,
                        help="length_aware: park a sample at its first point when the best waiting "
                             "one is predicted this many times its remaining length")
    parser.add_argument("--step-seconds", type=float, default=0.0,
                        help="a trace with turns: seconds per decode step; a tool call waits "
                             "ceil(latency / step-seconds) decode steps (0: answered at the next)")
    parser.add_argument("--length-sorted", action="store_true",
                        help="rounds: fill from the longest predicted")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--plot", metavar="FILE",
                        help="PNG of decode steps against predictor quality (another image format "
                             "by its extension: .svg, .pdf, ...; none: .png)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --plot / --write-trace file (never the --trace)")


def run(args: argparse.Namespace) -> int:
    _check_arguments(args)
    groups = _load(args)
    replays = 1 + (PLOT_REPLAYS if args.plot else 0)
    replay = partial(simulate, groups, micro_group=args.micro_group, kv_budget=args.kv_budget,
                     prompts_per_step=args.prompts_per_step, max_new_tokens=args.max_new_tokens,
                     warmup_steps=args.warmup_steps, step_seconds=args.step_seconds,
                     on_tokens=Progress(replays * sum(sum(g.lengths) for g in groups)))
    _print(replay(args.policy, predictor=args.predictor, **_policy_options(args)), args)
    if args.plot:
        _plot(replay, groups, args)
        print(f"wrote {args.plot}")
    return 0


class Progress:
    """A line on stderr every PROGRESS_EVERY_S seconds of a long replay (a short one prints
    none): tokens replayed of all the replays will decode, and about how long is left."""

    def __init__(self, total_tokens: int):
        self.total_tokens, self.done_tokens = total_tokens, 0
        self.started = time.monotonic()
        self.next_line = self.started + PROGRESS_EVERY_S

    def __call__(self, num_tokens: int) -> None:
        self.done_tokens += num_tokens
        now = time.monotonic()
        if now < self.next_line:
            return
        self.next_line = now + PROGRESS_EVERY_S
        share = self.done_tokens / max(1, self.total_tokens)
        left = (now - self.started) * (1 - share) / max(share, 1e-9)
        print(f"simulate: {share:.0%} ({self.done_tokens:,} of {self.total_tokens:,} tokens "
              f"replayed), {now - self.started:.0f} s, about {left:.0f} s left",
              file=sys.stderr, flush=True)


def _check_arguments(args) -> None:
    """Options that would fail after the simulation, or make it meaningless, fail first."""
    for flag, (_, low, _) in INTEGER_OPTIONS.items():
        value = getattr(args, flag.replace("-", "_"))
        if value is not None and not low <= value <= MAX_INTEGER:
            raise SamplingError(f"--{flag} must be between {low} and {MAX_INTEGER}, got {value}")
    if args.micro_group is None and args.kv_budget is None:
        raise SamplingError("give --micro-group or --kv-budget (or both)")
    if not 0 < args.epsilon < math.inf:
        raise SamplingError(f"--epsilon must be > 0 and finite, got {args.epsilon}")
    if not 0 <= args.step_seconds < math.inf:
        raise SamplingError(f"--step-seconds must be >= 0 and finite, got {args.step_seconds}")
    if not args.park_ratio > 0:
        raise SamplingError(f"--park-ratio must be > 0, got {args.park_ratio}")
    if args.predictor.partition(":")[0] == "hidden":
        raise SamplingError("--predictor hidden needs the model's hidden states, which a trace "
                            "does not keep; replay online, or run infsamp bench scheduling")
    if args.plot:
        args.plot = plot_name(args.plot)  # said as written
    check_output_files({"--plot": args.plot, "--write-trace": args.write_trace}, [args.trace],
                       args.overwrite)
    if args.plot:
        check_plot_format("--plot", args.plot)


def _load(args):
    if args.trace:
        return read_trace(args.trace)
    num_samples = args.groups * args.num_generations * args.epochs
    if num_samples > MAX_SAMPLES:
        raise SamplingError(f"--groups {args.groups} x --num-generations {args.num_generations} x "
                            f"--epochs {args.epochs} is {num_samples:,} samples; a synthetic "
                            f"workload holds at most {MAX_SAMPLES:,}")
    if not 0.0 <= args.direct_share <= 1.0:
        raise SamplingError(f"--direct-share must be between 0 and 1, got {args.direct_share}")
    options = {"direct_share": args.direct_share} if args.synthetic == "arithmetic" else {}
    groups = SYNTHETIC[args.synthetic](args.groups, args.num_generations, args.epochs, args.seed,
                                       **options)
    if args.write_trace:
        write_trace(groups, args.write_trace)
    return groups


def _policy_options(args) -> dict:
    if args.policy == "length_aware":
        return {"refill": args.refill, "epsilon": args.epsilon, "prefix_tokens": args.prefix_tokens,
                "preempt": not args.no_preempt, "park_ratio": args.park_ratio}
    if args.policy == "rounds" and args.length_sorted:
        return {"length_sorted": True}
    if args.policy == "probe":
        return {"probe_tokens": args.probe_tokens}
    return {}


SCHEDULE_KEYS = ("decode_steps", "lower_bound", "opt_lower_bound", "peak_kv_tokens_used",
                 "num_samples", "generated_tokens", "num_calls", "micro_group", "peak_rows",
                 "row_steps", "num_preemptions", "recomputed_tokens", "predictor_kendall_tau",
                 "predictor_mae", "num_tool_turns", "context_tokens")


def _print(result: SamplerStats, args) -> None:
    if args.json:
        print(json.dumps({key: getattr(result, key) for key in SCHEDULE_KEYS}))
        return
    ratio = result.decode_steps / max(1, result.lower_bound)
    print(f"policy {args.policy}, predictor {args.predictor}, g={result.micro_group}, "
          f"{result.num_calls} steps of {args.prompts_per_step} prompt(s), "
          f"{result.num_samples} samples")
    print(f"decode steps {result.decode_steps} (lower bound {result.lower_bound}, x{ratio:.3f}; "
          f"pigeonhole bound {result.opt_lower_bound}), peak KV {result.peak_kv_tokens_used} "
          f"tokens, generated {result.generated_tokens} tokens")
    if result.num_preemptions:
        print(f"parked {result.num_preemptions} times, {result.recomputed_tokens} tokens "
              "recomputed")
    if result.num_tool_turns:
        print(f"tool turns {result.num_tool_turns}, {result.context_tokens} context tokens "
              f"appended (step seconds {args.step_seconds})")
    if result.peak_rows > result.micro_group:
        print(f"rows per decode step: {result.mean_rows:.1f} mean, {result.peak_rows} at most")
    if result.predictor_kendall_tau is not None:
        print(f"predictor: Kendall tau {result.predictor_kendall_tau:.3f}, "
              f"MAE {result.predictor_mae:.1f} tokens")


def _plot(replay, groups, args) -> None:
    """`--plot`: each `replay(policy, predictor=..., **options)` is one point or line."""
    plt = headless_pyplot()

    def run_one(policy, predictor, refill="auto"):
        options = {**_policy_options(args), "refill": refill} if policy == "length_aware" else {}
        return replay(policy, predictor=predictor, **options)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for refill, marker in (("sjf", "o"), ("ljf", "s")):
        points = [run_one("length_aware", f"noisy:{sigma}", refill) for sigma in PLOT_SIGMAS]
        taus = [p.predictor_kendall_tau for p in points]
        ax.plot(taus, [p.decode_steps for p in points], marker=marker,
                label=f"length_aware, noisy oracle, refill {refill}")
    for predictor, marker in (("online", "*"), ("none", "x")):
        point = run_one("length_aware", predictor)
        ax.scatter([point.predictor_kendall_tau], [point.decode_steps], marker=marker, s=90,
                   zorder=3, label=f"length_aware, {predictor} predictor")
    continuous = run_one("continuous", "none").decode_steps
    ax.axhline(continuous, linestyle="--", color="gray", label="continuous (arrival order)")
    ax.axhline(point.lower_bound, color="black", linewidth=0.8, label="lower bound")
    top = 1.05 * max([continuous] + [line.get_ydata().max() for line in ax.get_lines()[:2]])
    ax.set_ylim(0.98 * point.lower_bound, top)
    rounds = run_one("rounds", "none").decode_steps
    ax.text(0.01, 0.98, f"rounds: {rounds} decode steps", transform=ax.transAxes, va="top",
            fontsize=8)
    ax.set_xlabel("predictor Kendall tau (per step, mean)")
    ax.set_ylabel("decode steps")
    ax.set_title(f"{len(groups)} groups, g={point.micro_group}, "
                 f"{args.prompts_per_step} prompt(s)/step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fmt = Path(args.plot).suffix.lstrip(".") or "png"
    replace_with(args.plot, lambda tmp: fig.savefig(tmp, dpi=120, format=fmt))
    plt.close(fig)
