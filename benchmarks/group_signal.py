"""What a larger G buys at the same memory: the share of groups whose rewards do not spread
(no advantage, no gradient) for G = 2 ... 64, sampled from one policy on one task.

    nice -n 5 .venv/bin/python benchmarks/group_signal.py examples/smollm2_reasoning_gym.yaml \\
        --prompts 12 --max-g 64 --out /work/runs/group_signal

Each of `--prompts` training prompts of the recipe gets `--max-g` completions from the recipe's
policy (infsamp's own trainer: its sampler with the recipe's g and KV budget, its reward
functions), so the memory of sampling is the same for every G (`sampling/peak_kv_bytes` is
reported). A group of G < max-g is a uniform draw of G of those completions without replacement:
its chance of no spread is exact, from the counts of each reward value (`zero_spread_chance`);
`--check-g G` also samples real groups of G on the same prompts, for comparison with the exact
figure. Reported per G: the expected share of zero-spread groups, of completions with a nonzero
advantage, and the prompts whose rewards spread at all.

Deliberately simple: the base policy only (no training between samples), so this measures how
often a group carries signal, not the held-out curve of training at each G (issue 21 item 8).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from collections import Counter
from pathlib import Path

G_VALUES = (2, 4, 8, 16, 32, 64, 128, 256)


def zero_spread_chance(rewards: list[float], group: int) -> float:
    """P(all G rewards equal) for G drawn without replacement from `rewards`."""
    total = math.comb(len(rewards), group)
    return sum(math.comb(n, group) for n in Counter(rewards).values()) / total


def signal_table(per_prompt: list[list[float]], max_g: int) -> list[dict[str, float]]:
    """Per G <= max_g: expected share of groups with no spread (mean over the prompts)."""
    rows = []
    for group in (g for g in G_VALUES if g <= max_g):
        chances = [zero_spread_chance(rewards, group) for rewards in per_prompt]
        rows.append({"G": group, "zero_spread_share": sum(chances) / len(chances),
                     "prompts_with_signal": sum(c < 1.0 for c in chances) / len(chances)})
    return rows


def sample_groups(recipe: str | None, num_prompts: int, group: int, out: Path,
                  overrides: dict[str, str]) -> tuple[list[list[float]], dict[str, float]]:
    """Rewards of `group` completions for each of the first `num_prompts` training prompts,
    from the recipe's trainer (no update), and the sampler's peak KV bytes and decode steps."""
    from infsamp.config_io import load_config
    from infsamp.run.progress import RunProgress
    from infsamp.run.trainer import GRPOTrainer

    cfg = load_config(recipe, {**overrides, "sampling.num_generations": str(group),
                               "training.prompts_per_step": "1", "eval.num_problems": "0",
                               "checkpointing.keep_best": "",
                               "logging.completions_every": "1", "logging.plot": "false",
                               "logging.output_dir": str(out / f"g{group}")})
    trainer = GRPOTrainer(cfg)
    per_prompt, peak_kv, decode_steps = [], 0, 0
    try:
        for prompt in trainer.train_prompts.prompts[:num_prompts]:
            _, metrics, _, records = trainer.steps.rollout([(0, prompt)], RunProgress(0, 0, False))
            per_prompt.append([record["reward"] for record in records])
            peak_kv = max(peak_kv, metrics["sampling/peak_kv_bytes"])
            decode_steps += metrics["sampling/decode_steps"]
            print(f"G={group} prompt {prompt.index}: {sum(r > 0 for r in per_prompt[-1])}/"
                  f"{group} rewarded", flush=True)
    finally:
        trainer.close()
    return per_prompt, {"peak_kv_bytes": peak_kv, "decode_steps": decode_steps,
                        "micro_group": trainer.sizes.micro_group}


def report(result: dict) -> str:
    lines = [f"# group signal, {result['date']}, {result['recipe']}, {result['prompts']} prompts, "
             f"load {result['load']}",
             "| G | zero-spread groups (exact, from max-G samples) | prompts with any spread |",
             "|---|---|---|"]
    lines += [f"| {r['G']} | {r['zero_spread_share']:.3f} | {r['prompts_with_signal']:.2f} |"
              for r in result["table"]]
    for group, check in result["checks"].items():
        lines.append(f"sampled G={group}: zero-spread share {check['zero_spread_share']:.3f} "
                     f"(exact figure above: {check['exact']:.3f})")
    for group, memory in result["memory"].items():
        lines.append(f"G={group}: g={memory['micro_group']}, peak KV "
                     f"{memory['peak_kv_bytes'] / 2**20:.2f} MiB, "
                     f"{memory['decode_steps']} decode steps")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", nargs="?", help="a training config (default: the embedded demo)")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-g", type=int, default=64)
    parser.add_argument("--check-g", type=int, default=0, help="also sample real groups of G")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.max_g < 2 or not 0 <= args.check_g <= args.max_g:
        parser.error("--prompts >= 1, --max-g >= 2 and 0 <= --check-g <= --max-g")
    overrides = dict(item.split("=", 1) for item in args.set)
    per_prompt, memory = sample_groups(args.recipe, args.prompts, args.max_g, args.out, overrides)
    result = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
              "recipe": args.recipe or "embedded demo", "prompts": args.prompts,
              "load": round(os.getloadavg()[0], 1), "rewards": per_prompt,
              "table": signal_table(per_prompt, args.max_g), "checks": {},
              "memory": {args.max_g: memory}}
    if args.check_g:
        sampled, result["memory"][args.check_g] = sample_groups(
            args.recipe, args.prompts, args.check_g, args.out, overrides)
        exact = next(r for r in result["table"] if r["G"] == args.check_g)["zero_spread_share"]
        share = sum(len(set(rewards)) == 1 for rewards in sampled) / len(sampled)
        result["checks"][args.check_g] = {"zero_spread_share": share, "exact": exact}
    (args.out / "group_signal.json").write_text(json.dumps(result, indent=1))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
