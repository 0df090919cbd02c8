"""What-if replay: probes wider than g, inside the same KV budget (issue 22, kept KV included).

Built since as `sampling.policy: probe`, which takes exactly these decode steps at B = 1 (a test);
this replay also tries keeping a parked probe's KV, which the policy does not.

    .venv/bin/python benchmarks/wide_probes.py \
        docs/img/bench_scheduling_issue22_smollm2/b1/trace_slots_seed*.jsonl --last-epoch
    .venv/bin/python benchmarks/wide_probes.py -B 4 --last-epoch \
        docs/img/bench_scheduling_issue22_smollm2/b4/trace_slots_seed*.jsonl
    .venv/bin/python benchmarks/wide_probes.py --max-new 256 --last-epoch \
        docs/img/bench_scheduling_issue22_b1/trace_slots_seed*.jsonl

Today every policy runs at most g samples at once, each reserving `max_new_tokens` of KV: the
budget is g x max_new. Most of a call's samples are short, and which ones is seen only once they
run. Here a sample starts as a *probe* that reserves only k tokens, so up to budget / k of them run
at once; a probe that ends within k tokens never needed more, one that reaches k is committed (its
reservation grows to max_new) when that fits, else parked (its KV dropped, recomputed when it
resumes; parked samples resume before new probes start, in arrival order). The reservations never
pass the budget, and no length is predicted.

Replayed on the committed traces (their true lengths, one token per running sample per step),
with `continuous` (arrival order, g slots: equal to the engines' decode steps, a test checks it)
and LPT on true lengths (`oracle`: longest first, g slots) beside it. Reported: decode steps, the
share of the oracle's gain over continuous, rows per step (mean and largest: a step's width; on a
GPU a wider decode step costs little more, on a CPU about in proportion) and recomputed tokens.

Deliberately simple: KV in tokens, no blocks; a group's prompt is held once (as in the scheduler's
books) and left out of both sides of the budget; one call at a time.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections.abc import Sequence
from pathlib import Path


class Replay:
    """One call's counts (a plain class: the tests load this file by path, not as a module)."""

    def __init__(self) -> None:
        self.decode_steps = 0
        self.row_steps = 0  # sum over steps of the samples running in it
        self.max_rows = 0
        self.recomputed_tokens = 0
        self.peak_reserved = 0


def continuous_steps(lengths: Sequence[int], micro_group: int) -> int:
    """Arrival order on g slots, each slot refilled when its sample ends."""
    ends = [0] * micro_group
    for length in lengths:
        heapq.heappush(ends, heapq.heappop(ends) + length)
    return max(ends)


def oracle_steps(lengths: Sequence[int], micro_group: int) -> int:
    """Longest first on g slots, true lengths known (the scheduler's own LPT)."""
    from infsamp.sampling.grouping import lpt, makespan

    return int(makespan(lpt(lengths, micro_group), lengths))


def wide_probe_replay(lengths: Sequence[int], micro_group: int, max_new: int,
                      probe_tokens: int, keep_parked_kv: bool = False) -> Replay:
    """With `keep_parked_kv` a parked probe keeps its k tokens of KV (counted in the budget, as
    when it ran), so nothing is recomputed, at the price of room for new probes; when the kept KV
    leaves room for nothing to run, all of it is dropped (recomputed on resume)."""
    budget = micro_group * max_new
    done = [0] * len(lengths)  # tokens so far
    pending, parked = list(range(len(lengths)))[::-1], []
    committed, probes, kept, out = set(), set(), set(), Replay()

    def reserved() -> int:
        return len(committed) * max_new + len(probes) * probe_tokens + sum(done[s] for s in kept)

    while pending or parked or committed or probes:
        while parked and reserved() - (done[parked[0]] if parked[0] in kept else 0) + max_new \
                <= budget:
            sample = parked.pop(0)
            if sample in kept:
                kept.discard(sample)
            else:
                out.recomputed_tokens += done[sample]
            committed.add(sample)
        while pending and reserved() + probe_tokens <= budget:
            probes.add(pending.pop())
        if not committed and not probes:  # kept KV leaves no room to run anything: drop it
            kept.clear()
            continue
        _check_budget(reserved(), budget)
        out.peak_reserved = max(out.peak_reserved, reserved())
        _one_step(out, lengths, done, committed, probes)
        for sample in sorted(s for s in probes if done[s] >= probe_tokens):
            probes.discard(sample)
            if reserved() + max_new <= budget:
                committed.add(sample)
            else:
                parked.append(sample)
                if keep_parked_kv:
                    kept.add(sample)  # it held these k tokens as a probe: they still fit
    return out


def _one_step(out: Replay, lengths, done, committed: set, probes: set) -> None:
    """One decode step: a token for every running sample; the ones that end leave."""
    out.decode_steps += 1
    rows = len(committed) + len(probes)
    out.row_steps += rows
    out.max_rows = max(out.max_rows, rows)
    for running in (committed, probes):
        for sample in sorted(running):
            done[sample] += 1
            if done[sample] == lengths[sample]:
                running.discard(sample)


def _check_budget(reserved: int, budget: int) -> None:
    if reserved > budget:
        raise AssertionError(f"reserved {reserved} tokens > budget {budget}")


def read_calls(paths: Sequence[str], prompts_per_call: int, last_epoch: bool) -> list[list[int]]:
    """Each trace's groups in calls of B prompts (a call's lengths in arrival order); with
    `last_epoch`, only the second half of each file's calls (the bench's measured epoch)."""
    from infsamp.sampling.traces import read_trace

    calls = []
    for path in paths:
        groups = read_trace(path)
        chunks = [sum((g.lengths for g in groups[i:i + prompts_per_call]), [])
                  for i in range(0, len(groups), prompts_per_call)]
        calls += chunks[len(chunks) // 2:] if last_epoch else chunks
    return calls


def summarise(calls: list[list[int]], micro_group: int, max_new: int,
              probe_tokens: Sequence[int], keep_parked_kv: bool = False) -> dict:
    continuous = sum(continuous_steps(c, micro_group) for c in calls)
    oracle = sum(oracle_steps(c, micro_group) for c in calls)
    gain = continuous - oracle
    rows = []
    for k in probe_tokens:
        replays = [wide_probe_replay(c, micro_group, max_new, k, keep_parked_kv) for c in calls]
        steps = sum(r.decode_steps for r in replays)
        rows.append({"probe_tokens": k, "decode_steps": steps,
                     "share_of_oracle_gain": (continuous - steps) / gain if gain else 0.0,
                     "mean_rows": sum(r.row_steps for r in replays) / steps,
                     "max_rows": max(r.max_rows for r in replays),
                     "recomputed_tokens": sum(r.recomputed_tokens for r in replays)})
    return {"calls": len(calls), "generated_tokens": sum(map(sum, calls)),
            "continuous": continuous, "oracle": oracle, "wide": rows}


def print_report(result: dict) -> None:
    print(f"{result['calls']} calls, {result['generated_tokens']} tokens: continuous "
          f"{result['continuous']} decode steps, oracle (LPT, true lengths) {result['oracle']}")
    for row in result["wide"]:
        print(f"  probes of {row['probe_tokens']:>3} tokens: {row['decode_steps']} steps, "
              f"{row['share_of_oracle_gain']:.0%} of the oracle's gain, rows per step "
              f"{row['mean_rows']:.1f} mean / {row['max_rows']} max, "
              f"{row['recomputed_tokens']} recomputed tokens")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", help="trace_*.jsonl files (infsamp bench scheduling)")
    p.add_argument("-B", "--prompts-per-call", type=int, default=1)
    p.add_argument("-g", "--micro-group", type=int, default=8)
    p.add_argument("--max-new", type=int, default=96, help="the traces' max_new_tokens")
    p.add_argument("--probe-tokens", default="8,12,16", help="comma-separated k values")
    p.add_argument("--last-epoch", action="store_true", help="only each file's second half")
    p.add_argument("--keep-parked-kv", action="store_true",
                   help="a parked probe keeps its k tokens of KV (no recomputation)")
    p.add_argument("--out", default="", help="write the result as JSON here")
    args = p.parse_args(argv)
    from infsamp.errors import DataError

    try:
        calls = read_calls(args.traces, args.prompts_per_call, args.last_epoch)
    except DataError as err:
        p.error(str(err))
    too_long = [max(c) for c in calls if max(c) > args.max_new]
    if too_long:
        p.error(f"--max-new {args.max_new}: a trace has a completion of {too_long[0]} tokens")
    result = summarise(calls, args.micro_group, args.max_new,
                       [int(k) for k in args.probe_tokens.split(",")], args.keep_parked_kv)
    print_report(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
