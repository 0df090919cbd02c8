"""infsamp vs TRL's GRPOTrainer at its best settings: peak memory and speed per optimizer step.

    .venv/bin/python benchmarks/vs_trl.py --groups 64 --frameworks trl,trl_cb,infsamp \
        --hidden 384 --layers 4 --max-completion 128 --out /tmp/vs_trl.json
    # the largest G
    .venv/bin/python benchmarks/vs_trl.py --groups 64,128,256,512 --memory-budget-mib 200
    .venv/bin/python benchmarks/vs_trl.py --frameworks trl_vllm,infsamp_vllm --device cuda
    .venv/bin/python benchmarks/vs_trl.py --frameworks infsamp_vllm   # infsamp on vLLM-CPU
    .venv/bin/python benchmarks/vs_trl.py --quick          # G=8, 1 measured step: a smoke check
    # frameworks run apart (e.g. at once on two cores), reported as one run
    .venv/bin/python benchmarks/vs_trl.py --merge a.json,b.json --memory-budget-mib 100

Frameworks (`vs_trl_frameworks.py`): `trl` (TRL's own generation), `trl_cb` (TRL with
transformers' continuous batching), `trl_vllm` (TRL's vLLM colocate mode), `trl_infsamp` (TRL with
`infsamp_rollout` as its `rollout_func`), `infsamp`, `infsamp_vllm` (infsamp's trainer on the slot
or vLLM engine). By default every framework trains in micro-batches of the same tokens: TRL B = g
completions per forward/backward (gradient accumulation over G / B, one optimizer step per
prompt), infsamp B x (prompt + completion) tokens; `--trl-batch B` or
`--train-micro-batch-tokens T` sets it (one is derived from the other; both, disagreeing, is one
error line; `--trl-batch all` is TRL's default layout, all G in one backward). Every KV cache is
held to infsamp's budget, g x (prompt + completion) tokens.

Both sides train the SAME random-init Llama (built once and saved to a temp dir, or `--model PATH`)
on the same prompts (the embedded arithmetic task) with the same rewards (`format_reward`,
`accuracy_reward`), G, max completion length, temperature 1.0, learning rate, one prompt per step,
beta 0, dapo, fp32 on the CPU (`--device cuda --precision bf16` on a GPU), gradient checkpointing
on in all (TRL 1.16's GRPOConfig default; `off` for none).

Each (framework, G) case runs in a fresh subprocess. After model load and one warm-up step the
memory in use is the baseline (`peak_meter.py`); "peak MiB" is the whole step's peak above it,
"generation peak MiB" the largest growth during one step's generation (TRL's `_generate`, which
calls the rollout_func when one is given; infsamp's sampler call) above the memory in use at its
start. glibc's malloc is told to give large blocks back (MALLOC_MMAP_THRESHOLD_), so a freed warm-up
peak is not counted as baseline. s/step and CPU s/step: medians over `--steps` measured steps;
completion tokens per step-second: the measured steps' completion tokens over their seconds (wall,
and CPU: the process's CPU time, fairer on a shared machine). With `--memory-budget-mib M` a
framework whose peak passed M is not run at larger G, and the report names each framework's
largest G within M. `--merge` reports the rows of earlier `--out` files (the same model and
sizes, frameworks run in separate invocations) as one: ratios, tables and the budget summary.

Deliberately simple: one prompt per step, no KL (beta 0: no reference model on either side).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ (also when loaded by path)
from vs_trl_frameworks import (  # noqa: F401  (the names tests and the GPU suite use)
    FRAMEWORKS,
    MAX_PROMPT_TOKENS,
    NUM_PROMPTS,
    SizeError,
    case_sizes,
    continuous_batching_config,
    infsamp_trainer,
    reward_functions,
    train_problems,
)

RESULT_PREFIX = "VS_TRL_RESULT "
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
PROFILE_FUNCTIONS = {  # label -> (file suffix, function name) whose cumulative time is reported
    "sampling": ("sampling/sampler.py", "sample"),
    "rewards": ("run/trainer.py", "_score"),
    "train: log-prob forward": ("algorithm/logprobs.py", "micro_batch_logprobs_and_entropy"),
    "train: backward": ("torch/_tensor.py", "backward"),
    "train: optimizer": ("torch/optim/optimizer.py", "wrapper"),
    "train: whole grpo step": ("algorithm/grpo_step.py", "optimize"),
}
# row -> (its whole-step peak against, its generation peak against, its speed against the faster of)
COMPARED = {"infsamp": ("trl", "trl_cb", ("trl", "trl_cb")),
            "trl_infsamp": ("trl", "trl_cb", ("trl", "trl_cb")),
            "infsamp_vllm": ("trl_vllm", "trl_vllm", ("trl_vllm",))}


# ---------------------------------------------------------------- the model


def build_random_llama(out_dir: Path, hidden: int, layers: int, seed: int = 0) -> Path:
    """A random Llama with the embedded character tokenizer, saved as an HF checkpoint."""
    import torch
    from transformers import LlamaForCausalLM

    from infsamp.models.tiny import build_tokenizer, model_config

    tokenizer = build_tokenizer()
    config = model_config(tokenizer)
    head_dim = 32 if hidden <= 128 else 64
    num_heads = max(1, hidden // head_dim)
    config.update({"hidden_size": hidden, "intermediate_size": 3 * hidden,
                   "num_hidden_layers": layers, "num_attention_heads": num_heads,
                   "num_key_value_heads": max(1, num_heads // 2), "head_dim": head_dim})
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def resolve_model(args, tmp: Path) -> Path:
    if args.model:
        from infsamp.models.loading import resolve_path

        return Path(resolve_path(args.model))
    return build_random_llama(tmp / "model", args.hidden, args.layers)


def count_parameters(model_dir: Path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with __import__("torch").device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- one case (the child process)


def profile_infsamp(args, G: int, model_dir: Path, tmp: Path) -> dict[str, float]:
    """Cumulative seconds per phase of one infsamp step (after a warm-up step), from cProfile."""
    trainer = infsamp_trainer(args, G, model_dir, tmp)
    trainer.train_step()
    profiler = cProfile.Profile()
    profiler.runcall(trainer.train_step)
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    breakdown = {"total": sum(tt for _, _, tt, _, _ in stats.values())}
    for label, (suffix, name) in PROFILE_FUNCTIONS.items():
        breakdown[label] = sum(ct for (file, _, fn), (_, _, _, ct, _) in stats.items()
                               if fn == name and file.endswith(suffix))
    return {k: round(v, 2) for k, v in breakdown.items()}


WORKERS = {**FRAMEWORKS, "profile": profile_infsamp}


def run_worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    framework, G = args.worker.split(":")
    with tempfile.TemporaryDirectory() as tmp:
        result = WORKERS[framework](args, int(G), Path(args.model_dir), Path(tmp))
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_case(args, worker: str, model_dir: Path) -> dict:
    """Runs one case in a fresh interpreter; returns its result (raises with the child's tail)."""
    return run_child([__file__, "--worker", worker, "--model-dir", str(model_dir),
                      *shared_argv(args)], worker)


def run_child(argv: list[str], what: str, log: Path | None = None) -> dict:
    """`python ARGV` in a fresh interpreter (glibc told to give large blocks back, MALLOC_ENV);
    returns the result it printed after RESULT_PREFIX (raises with its output's tail). With `log`
    its output also goes to that file as it runs."""
    env = {**os.environ, **MALLOC_ENV}
    if log is None:
        proc = subprocess.run([sys.executable, *argv], check=False, capture_output=True,
                              text=True, env=env)
        output = proc.stdout + proc.stderr
    else:
        with open(log, "w") as out:
            proc = subprocess.run([sys.executable, *argv], check=False, stdout=out,
                                  stderr=subprocess.STDOUT, text=True, env=env)
        output = log.read_text()
    for line in output.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise RuntimeError(f"case {what} failed (exit {proc.returncode}):\n{output[-3000:]}")


def shared_argv(args) -> list[str]:
    names = ("steps", "max_completion", "learning_rate", "micro_group", "train_micro_batch_tokens",
             "threads", "gradient_checkpointing", "trl_batch", "device", "precision")
    return [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in names]


# ---------------------------------------------------------------- rows, ratios, tables


def summarise(framework: str, G: int, raw: dict, sizes=None) -> dict:
    wall, cpu, lengths = raw["step_seconds"], raw.get("step_cpu_seconds") or [], raw["mean_lengths"]
    tokens = G * sum(lengths)  # completion tokens of the measured steps
    row = {"framework": framework, "G": G, "peak_mib": round(raw["peak_bytes"] / 2**20, 1),
           "generation_peak_mib": round(raw["generation_peak_bytes"] / 2**20, 1),
           "seconds_per_step": round(statistics.median(wall), 2),
           "mean_completion_length": round(statistics.mean(lengths), 1),
           "max_micro_batch_tokens": raw.get("max_micro_batch_tokens", 0),
           "completion_tokens_per_step_s": round(tokens / max(sum(wall), 1e-9), 1),
           "step_seconds": [round(s, 2) for s in wall]}
    if cpu:
        row.update({"cpu_seconds_per_step": round(statistics.median(cpu), 2),
                    "completion_tokens_per_cpu_s": round(tokens / max(sum(cpu), 1e-9), 1),
                    "step_cpu_seconds": [round(s, 2) for s in cpu]})
    if sizes is not None:
        row.update({"train_batch": sizes.train_batch,
                    "train_micro_batch_tokens": sizes.train_micro_batch_tokens,
                    "kv_budget_tokens": sizes.kv_budget_tokens})
    return row


def ratio(value: float, base: float) -> float:
    return round(value / max(base, 1e-9), 3)


def add_ratios(rows: list[dict]) -> None:
    """On infsamp rows: whole-step peak / TRL's, generation peak / trl_cb's (vLLM rows: both /
    trl_vllm's), completion tokens per step-second (and per CPU second) / the faster peer's;
    issue 20's goals at G=64 are <= 1.0, <= 0.5, >= 1.2."""
    by = {(r["framework"], r["G"]): r for r in rows if "peak_mib" in r}
    for (framework, G), row in by.items():
        if framework not in COMPARED:
            continue
        peak_peer, generation_peer, speed_peers = COMPARED[framework]
        if (peak := by.get((peak_peer, G))) is not None:
            row[f"peak_ratio_{peak_peer}"] = ratio(row["peak_mib"], peak["peak_mib"])
        if (gen := by.get((generation_peer, G))) is not None:
            row[f"generation_peak_ratio_{generation_peer}"] = ratio(row["generation_peak_mib"],
                                                                    gen["generation_peak_mib"])
        peers = [by[(p, G)] for p in speed_peers if (p, G) in by]
        for key, name in (("completion_tokens_per_step_s", "tokens_per_s_ratio_best_peer"),
                          ("completion_tokens_per_cpu_s", "tokens_per_cpu_s_ratio_best_peer")):
            if peers and key in row and all(key in p for p in peers):
                row[name] = ratio(row[key], max(p[key] for p in peers))


def ratio_cells(row: dict) -> list[str]:
    """The row's three ratios as 'x.xx (peer)' cells, empty where it has none."""
    cells = []
    for prefix in ("peak_ratio_", "generation_peak_ratio_"):
        key = next((k for k in row if k.startswith(prefix)), None)
        cells.append(f"{row[key]:.2f} ({key[len(prefix):]})" if key else "")
    for key in ("tokens_per_s_ratio_best_peer", "tokens_per_cpu_s_ratio_best_peer"):
        cells.append(f"{row[key]:.2f}" if key in row else "")
    return cells


def markdown_table(rows: list[dict]) -> str:
    lines = [("| framework | G | train batch | largest micro-batch tokens | peak MiB | "
              "generation peak MiB | s/step | "
              "CPU s/step | mean completion len | completion tokens / step-s | per CPU-s | "
              "peak / peer | generation peak / peer | tokens/s / best peer | "
              "per CPU-s / best peer |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [r["framework"], r["G"], r.get("train_batch", ""),
                 r.get("max_micro_batch_tokens", ""), f"{r['peak_mib']:.0f}",
                 f"{r['generation_peak_mib']:.0f}", f"{r['seconds_per_step']:.2f}",
                 r.get("cpu_seconds_per_step", ""), f"{r['mean_completion_length']:.1f}",
                 f"{r['completion_tokens_per_step_s']:.0f}",
                 r.get("completion_tokens_per_cpu_s", ""), *ratio_cells(r)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def budget_summary(rows: list[dict], budget_mib: float, groups: list[int],
                   frameworks: list[str]) -> list[dict]:
    """Per framework: its peak at each G run, the largest G within the budget, and whether the
    budget bounded it (a G over it) or only the sweep did."""
    summary = []
    for framework in frameworks:
        peaks = {r["G"]: r["peak_mib"] for r in rows if r["framework"] == framework}
        within = [G for G, peak in peaks.items() if peak <= budget_mib]
        over = sorted(G for G, peak in peaks.items() if peak > budget_mib)
        summary.append({"framework": framework, "peaks_mib": peaks,
                        "largest_G_within_budget": max(within, default=0),
                        "bounded_by_memory": bool(over), "first_G_over_budget": over[0] if over
                        else None, "largest_G_tried": max(peaks, default=0)})
    return summary


def budget_table(summary: list[dict], budget_mib: float) -> str:
    lines = [f"| framework | whole-step peak MiB by G | largest G within {budget_mib:g} MiB |",
             "|---|---|---|"]
    for s in summary:
        peaks = ", ".join(f"G={G}: {p:.0f}" for G, p in sorted(s["peaks_mib"].items()))
        largest = s["largest_G_within_budget"]
        note = (f"{largest} (G={s['first_G_over_budget']} over)" if s["bounded_by_memory"]
                else f"{largest}, the largest tried: not bounded by memory")
        lines.append(f"| {s['framework']} | {peaks} | {note} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- driver


def run_benchmark(args) -> dict:
    """Every (G, framework) case in turn; with `--out` the results so far are written after each
    case (`"partial": true` until the last), so a long sweep stopped midway keeps its rows."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = resolve_model(args, Path(tmp))
        num_params = count_parameters(model_dir)
        rows, over_budget = [], set()
        for G in args.groups:
            for framework in args.frameworks:
                if framework in over_budget:
                    continue
                print(f"running {framework} G={G} ...", file=sys.stderr, flush=True)
                raw = run_case(args, f"{framework}:{G}", model_dir)
                rows.append(summarise(framework, G, raw, case_sizes(args, G)))
                print(f"  peak {rows[-1]['peak_mib']} MiB, generation peak "
                      f"{rows[-1]['generation_peak_mib']} MiB", file=sys.stderr, flush=True)
                if args.memory_budget_mib and rows[-1]["peak_mib"] > args.memory_budget_mib:
                    over_budget.add(framework)
                write_result(args, report(args, rows, num_params, None) | {"partial": True})
        profile = run_case(args, f"profile:{args.profile}", model_dir) if args.profile else None
    result = report(args, rows, num_params, profile)
    write_result(args, result)
    return result


def report(args, rows: list[dict], num_params: int, profile) -> dict:
    """The run's result: rows with their ratios, the budget summary, settings and versions."""
    from importlib.metadata import version

    add_ratios(rows)
    budget = (budget_summary(rows, args.memory_budget_mib, args.groups, args.frameworks)
              if args.memory_budget_mib else None)
    return {"date": datetime.date.today().isoformat(), "trl_version": version("trl"),
            "command": " ".join(sys.argv), "load_average": os.getloadavg(), "rows": rows,
            "budget": budget, "num_parameters": num_params,
            "model": args.model or f"random llama hidden={args.hidden} layers={args.layers}",
            "settings": vars(args) | {"groups": args.groups}, "infsamp_profile": profile}


def write_result(args, result: dict) -> None:
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


def merge_results(paths: list[str], budget_mib: float) -> dict:
    """One report from the rows of earlier `--out` files (ratios across them; a framework's
    rows from the first file that has it); their settings must agree but for groups and
    frameworks."""
    results = [json.loads(Path(path).read_text()) for path in paths]
    varying = {"groups", "frameworks", "out", "memory_budget_mib", "merge"}
    settings = [{k: v for k, v in r["settings"].items() if k not in varying} for r in results]
    if any(s != settings[0] for s in settings[1:]):
        raise SizeError(f"vs_trl.py: --merge: {', '.join(paths)} ran with different settings")
    rows, seen = [], set()
    for result in results:
        names = {row["framework"] for row in result["rows"]} - seen
        rows += [row for row in result["rows"] if row["framework"] in names]
        seen |= names
    rows.sort(key=lambda row: row["G"])
    add_ratios(rows)
    frameworks = list(dict.fromkeys(row["framework"] for row in rows))
    groups = sorted({row["G"] for row in rows})
    budget = budget_summary(rows, budget_mib, groups, frameworks) if budget_mib else None
    return {**results[0], "command": " ".join(sys.argv), "rows": rows, "budget": budget,
            "merged": paths, "load_average": os.getloadavg(),
            "partial": any(r.get("partial", False) for r in results)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", default="8,32,64", help="comma-separated G values")
    p.add_argument("--frameworks", default="trl,trl_cb,infsamp",
                   help="comma-separated: " + ", ".join(FRAMEWORKS))
    p.add_argument("--steps", type=int, default=2,
                   help="measured optimizer steps (after 1 warm-up)")
    p.add_argument("--model", default="",
                   help="HF checkpoint dir or 'embedded' (default: build a random Llama)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size of the random Llama")
    p.add_argument("--layers", type=int, default=4, help="layers of the random Llama")
    p.add_argument("--max-completion", type=int, default=128, help="max completion length (tokens)")
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--micro-group", type=int, default=8,
                   help="g: samples infsamp decodes at once; the KV budget is g x (prompt + "
                   "completion) tokens for every framework; TRL's default training micro-batch")
    p.add_argument("--trl-batch", default="",
                   help="TRL's completions per forward/backward (default: g, or what "
                   "--train-micro-batch-tokens holds; 'all': TRL's default layout, all G)")
    p.add_argument("--train-micro-batch-tokens", type=int, default=0,
                   help="infsamp's tokens per training micro-batch (default: the TRL batch x "
                   "(prompt + completion))")
    p.add_argument("--memory-budget-mib", type=float, default=0,
                   help="a whole-step memory budget: a framework over it is not run at larger G; "
                   "the report gives each one's largest G within it")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--precision", default="fp32", help="infsamp's training.precision (TRL: bf16 "
                   "weights and bf16=True when it starts with bf16 on cuda)")
    p.add_argument("--threads", type=int, default=1, help="torch threads in each case (1: on a "
                   "shared CPU, 2 threads spin-wait and run ~10x slower)")
    p.add_argument("--gradient-checkpointing", choices=("on", "off"), default="on",
                   help="every framework (on: TRL 1.16's GRPOConfig default)")
    p.add_argument("--profile", type=int, default=0,
                   help="also cProfile one infsamp step at this G")
    p.add_argument("--quick", action="store_true", help="smoke check: G=8, 1 measured step")
    p.add_argument("--out", default="", help="write the results as JSON here")
    p.add_argument("--merge", default="", help="comma-separated --out files of earlier runs: "
                   "report their rows as one run (nothing is run)")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.steps = "8", 1
    args.groups = [int(g) for g in str(args.groups).split(",")]
    args.frameworks = args.frameworks.split(",")
    unknown = sorted(set(args.frameworks) - set(FRAMEWORKS))
    if unknown:
        raise SizeError(f"vs_trl.py: --frameworks: unknown {', '.join(unknown)} (choose from "
                        f"{', '.join(FRAMEWORKS)})")
    for G in args.groups:  # sizes that cannot run are one line (SizeError) before any work
        case_sizes(args, G)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    result = (merge_results(args.merge.split(","), args.memory_budget_mib) if args.merge
              else run_benchmark(args))
    print(f"TRL {result['trl_version']}, model: {result['model']} "
          f"({result['num_parameters'] / 1e6:.1f}M params), load average "
          f"{', '.join(f'{x:.1f}' for x in result['load_average'])}")
    print(markdown_table(result["rows"]))
    if result["budget"]:
        print(budget_table(result["budget"], args.memory_budget_mib))
    if result["infsamp_profile"]:
        print("infsamp step profile (cumulative s):", json.dumps(result["infsamp_profile"]))
    if args.merge:
        write_result(args, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
