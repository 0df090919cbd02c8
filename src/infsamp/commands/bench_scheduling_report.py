"""`infsamp bench scheduling`'s report: totals per engine and variant, the targets (each learning
predictor and the probe policy against continuous, rounds and the oracle), and the printed table.
Pure Python over the bench's rows (`bench_scheduling.py` measures them).

Deliberately simple: every figure is a sum or ratio of the measured epoch's rows; no statistics
across seeds beyond each seed's share of the oracle's gain.
"""

from __future__ import annotations

import sys
import time

from infsamp.commands.engine_choice import print_startup

LEARNING = ("online", "hidden")  # predictors that learn inside the run (warmed up by epoch 1)


def totals(rows: list[dict]) -> dict:
    keys = ("decode_steps", "lower_bound", "opt_lower_bound", "generated_tokens", "wall_time_s",
            "cpu_time_s", "num_preemptions", "recomputed_tokens", "schedule_time_s")
    total = {k: sum(r[k] for r in rows) for k in keys}
    total["tokens_per_second"] = total["generated_tokens"] / max(total["wall_time_s"], 1e-9)
    total["tokens_per_cpu_second"] = total["generated_tokens"] / max(total["cpu_time_s"], 1e-9)
    total["schedule_share"] = total["schedule_time_s"] / max(total["wall_time_s"], 1e-9)
    taus = [r["kendall_tau"] for r in rows  # tau is undefined when every sample has the same length
            if r["kendall_tau"] is not None and len({n for g in r["lengths"] for n in g}) > 1]
    total["kendall_tau"] = sum(taus) / len(taus) if taus else None
    maes = [r["mae"] for r in rows if r["mae"] is not None]
    total["mae"] = sum(maes) / len(maes) if maes else None
    total["calls"] = len(rows)
    total["identical_lengths"] = all(r["same_lengths_as_continuous"] for r in rows)
    total["peak_kv_tokens"] = max(r["peak_kv_tokens"] for r in rows)
    total["peak_rows"] = max(r.get("peak_rows", 0) for r in rows)
    total["mean_rows"] = sum(r.get("row_steps", 0) for r in rows) / max(1, total["decode_steps"])
    return total


def summarise(rows: list[dict], variants: list, args) -> dict:
    """Totals and targets per engine ({engine: {variant: ...}}), each seed's share of the
    oracle's gain, and vLLM against the slots."""
    measured = [r for r in rows if r["measured"]]
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    by_engine = {e: by_variant(measured, e, variants) for e in engines}
    warmup = [r for r in rows if not r["measured"]]
    seeds = list(dict.fromkeys(r.get("seed", args.seed) for r in rows))
    report = {"command": "infsamp bench scheduling " + " ".join(sys.argv[3:]),
              "date": time.strftime("%Y-%m-%d"),
              "G": args.num_generations, "g": sorted({r["micro_group"] for r in rows}),
              "prompts": args.prompts, "seeds": seeds,
              "B": args.prompts_per_step, "epochs": args.epochs, "temperature": args.temperature,
              "engines": engines, "totals": by_engine,
              "warmup_kendall_tau": totals(warmup)["kendall_tau"] if warmup else None}
    report["targets"] = {e: targets(t) for e, t in by_engine.items()}
    if len(seeds) > 1:
        for engine in engines:
            for seed in seeds:
                seeded = by_variant([r for r in measured if r.get("seed") == seed], engine,
                                    variants)
                report["targets"][f"{engine}, seed {seed}"] = {
                    name: value for name, value in targets(seeded).items() if "oracle's" in name}
    if {"slots", "vllm"} <= set(engines):
        report["targets"]["vllm vs slots"] = {
            f"{name}: vllm / slots tokens/s": by_engine["vllm"][name]["tokens_per_second"]
            / by_engine["slots"][name]["tokens_per_second"] for name in by_engine["vllm"]}
    return report


def by_variant(rows: list[dict], engine: str, variants: list) -> dict:
    return {v.name: totals([r for r in rows if (r["engine"], r["variant"]) == (engine, v.name)])
            for v in variants}


def targets(t: dict) -> dict:
    out = {}
    rounds, cont, oracle = t.get("rounds"), t.get("continuous"), t.get("length_aware:oracle")
    if oracle:
        out["length_aware:oracle decode steps / lower bound (<= 1.03)"] = (
            oracle["decode_steps"] / oracle["lower_bound"])
        out["length_aware:oracle decode steps / pigeonhole bound"] = (
            oracle["decode_steps"] / oracle["opt_lower_bound"])
    for name in (n for n in t if n.split(":")[-1] in LEARNING or n.startswith("probe")):
        out.update(learning_targets(name, t[name], cont, rounds, oracle))
    return out


def learning_targets(name: str, v: dict, cont: dict | None, rounds: dict | None,
                     oracle: dict | None) -> dict:
    """One learning predictor's (or the probe policy's) variant against continuous, rounds and
    the oracle."""
    out = {}
    if cont:
        out[f"{name} / continuous decode steps (< 1)"] = v["decode_steps"] / cont["decode_steps"]
        out[f"{name} / continuous wall tokens/s (decode steps: continuous / it "
            f"{cont['decode_steps'] / v['decode_steps']:.3f})"] = (
            v["tokens_per_second"] / cont["tokens_per_second"])
    if cont and oracle and cont["decode_steps"] > oracle["decode_steps"]:
        out[f"{name} share of the oracle's decode-step gain over continuous (>= 0.6)"] = (
            (cont["decode_steps"] - v["decode_steps"])
            / (cont["decode_steps"] - oracle["decode_steps"]))
    if rounds:
        out[f"{name} decode steps saved vs rounds (>= 0.40)"] = (
            1 - v["decode_steps"] / rounds["decode_steps"])
        out[f"{name} / rounds wall tokens/s (>= 1.25)"] = (
            v["tokens_per_second"] / rounds["tokens_per_second"])
    out[f"{name} scheduling + prediction share of sampling wall time (<= 0.03)"] = (
        v["schedule_share"])
    if v["peak_rows"] > 0:
        out[f"{name} rows per decode step, mean (widest: {v['peak_rows']})"] = v["mean_rows"]
    if v["kendall_tau"] is not None:
        out[f"{name} predictor Kendall tau, measured epoch"] = v["kendall_tau"]
        out[f"{name} predictor MAE (tokens)"] = v["mae"]
    return out


def print_report(report: dict) -> None:
    print(f"\nmeasured epoch {report['epochs']}: G={report['G']} "
          f"g={','.join(map(str, report['g']))}, "
          f"{report['prompts']} prompts, {report['B']} per call")
    print(f"{'engine':<7}{'variant':<24}{'steps':>8}{'bound':>8}{'x bound':>8}{'tokens':>8}"
          f"{'wall s':>8}{'tok/s':>8}{'tok/cpu-s':>10}{'parked':>8}{'recomp':>8}{'tau':>6}")
    for engine, by_variant in report["totals"].items():
        for name, t in by_variant.items():
            tau = "" if t["kendall_tau"] is None else f"{t['kendall_tau']:.2f}"
            print(f"{engine:<7}{name:<24}{t['decode_steps']:>8}{t['lower_bound']:>8}"
                  f"{t['decode_steps'] / t['lower_bound']:>8.3f}{t['generated_tokens']:>8}"
                  f"{t['wall_time_s']:>8.1f}{t['tokens_per_second']:>8.0f}"
                  f"{t['tokens_per_cpu_second']:>10.0f}{t['num_preemptions']:>8}"
                  f"{t['recomputed_tokens']:>8}{tau:>6}")
    for scope, values in report["targets"].items():
        print(f"targets ({scope}):")
        for name, value in values.items():
            print(f"  {name}: {value:.3f}")
    print_startup(report.get("engine_startup_s", {}))
