"""`infsamp bench sampling`: every policy side by side on the same model and prompts.

    infsamp bench sampling --quick            # < 2 minutes on a 2-core CPU
    infsamp bench sampling --out runs/bench   # G in 8, 32, 128, 512 (tens of minutes on a CPU)
    infsamp bench sampling --engine slots,vllm --micro-group 8,64   # both engines, two g
    infsamp bench sampling --quick --bound    # each cell's decode step beside its bound

Two workloads, one prompt per sampler call (= per training step):
  (a) `embedded`: the embedded arithmetic task, natural EOS, temperature 1;
  (b) `controlled`: lengths forced per sample (`target_lengths`: the slot engine bans EOS before
      the target and forces it there; vLLM sets min_tokens = max_tokens = the target);
      each prompt's median is log-normal around 180 tokens (sigma 0.7 across prompts), each sample's
      target log-normal around it (sigma 0.55), clipped to 16..1024 -- the paper's setting.
g is fixed (`--micro-group`, a list) and `rounds` / `continuous` get the KV budget of exactly g
samples (`kv_budget.kv_tokens_needed`: g slots of max_new_tokens plus one prompt; on vLLM in whole
blocks); `full` decodes all G at once (on vLLM within the pool the largest such budget sizes: it
may preempt). With `--engine slots,vllm` every cell runs on both engines, interleaved; each engine
is started and warmed up once before the measurements (start-up reported apart) and rows are tagged
`engine`. Writes a table (stdout), `sampling.json` and `sampling.png` (peak KV bytes and decode
steps against G), and a profile of where the slot engine's time goes at g=8. With `--bound`, each
slot-engine cell's decode steps (CPU ms) beside the model's own forward of the same rows over a
ready cache and their matrix products alone, replayed right after the cell
(`engines/decode_bound.py`).

Deliberately simple: one run per cell (no repetitions); timings depend on the machine's load.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import pstats
import random
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from infsamp.commands.bench_sampling_report import (
    POLICIES,
    check_targets,
    format_row,
    plot,
    print_report,
)
from infsamp.commands.engine_choice import (
    ENGINE_HELP,
    close_engines,
    engine_to_size,
    parse_engines,
    start_engines,
)
from infsamp.commands.sample import read_prompts
from infsamp.config import DataConfig, ModelConfig
from infsamp.config_algorithm import SamplingConfig
from infsamp.errors import SamplingError
from infsamp.planner.kv_budget import VLLM_BLOCK_SIZE, kv_tokens_needed


@dataclass
class Workload:
    name: str
    group_sizes: tuple[int, ...]
    max_new_tokens: int
    prompts_per_size: dict[int, int] = field(default_factory=dict)  # G -> sampler calls (prompts)
    median: float = 180.0
    sigma_prompt: float = 0.7
    sigma_sample: float = 0.55
    min_length: int = 16
    controlled: bool = False


def workloads(quick: bool) -> list[Workload]:
    if quick:
        return [Workload("embedded", (8, 32), 64, {8: 1, 32: 1}),
                Workload("controlled", (8, 32), 128, {8: 1, 32: 2}, median=40, min_length=8,
                         controlled=True)]
    return [Workload("embedded", (8, 32, 128, 512), 256, {8: 2, 32: 4, 128: 1, 512: 1}),
            Workload("controlled", (8, 32, 128, 512), 1024, {8: 2, 32: 4, 128: 1, 512: 1},
                     controlled=True)]


def customise(workload: Workload, args) -> Workload:
    """Apply --num-generations / --prompts to a workload."""
    if args.num_generations:
        workload.group_sizes = tuple(int(x) for x in args.num_generations.split(","))
    if args.num_generations or args.prompts:
        workload.prompts_per_size = {g: args.prompts or workload.prompts_per_size.get(g, 1)
                                     for g in workload.group_sizes}
    return workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small G and lengths (< 2 minutes)")
    parser.add_argument("--out", default="runs/bench",
                        help="folder for sampling.json and sampling.png")
    parser.add_argument("--model", default="embedded", help="checkpoint directory or 'embedded'")
    parser.add_argument("--micro-group", default="8",
                        help="g for rounds and continuous (a comma-separated list)")
    parser.add_argument("--engine", default="slots", help=ENGINE_HELP)
    parser.add_argument("--workload", choices=("embedded", "controlled"), action="append",
                        help="run only this workload (repeatable)")
    parser.add_argument("--num-generations", "-G",
                        help="comma-separated G values instead of the workload's list")
    parser.add_argument("--prompts", type=int,
                        help="sampler calls (prompts) per G instead of the default")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated subset of policies")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1 is fastest for tiny models)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bound", action="store_true",
                        help="beside each slot-engine cell, the decode step's bound: the model's "
                             "own forward of the same rows over a ready cache (decode_bound.py)")


def run(args: argparse.Namespace) -> int:
    import torch

    from infsamp.models.loading import load_model_and_tokenizer

    names, micro_groups = parse_engines(args.engine), parse_micro_groups(args.micro_group)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=args.model))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    selected = [customise(w, args) for w in workloads(args.quick) if not args.workload
                or w.name in args.workload]
    prompts = {w.name: bench_prompts(tokenizer, max(w.prompts_per_size.values()), args.seed)
               for w in selected}
    sizes = engine_sizes_for(model, names, selected, prompts, micro_groups)
    cfg = cell_config("continuous", micro_groups[0], sizes.kv_budget_tokens, sizes.max_new_tokens)
    engines, startup = start_engines(names, model, cfg, sizes, prompts[selected[0].name][0])
    try:
        rows = run_cells(model, tokenizer, selected, prompts, micro_groups, engines, args, out)
    finally:
        close_engines(engines)
    embedded = [w for w in selected if w.name == "embedded"]
    profile = (profile_overhead(model, tokenizer, embedded[0], args, micro_groups[0])
               if embedded and "slots" in names else {})
    report = {"rows": rows, "targets": check_targets(rows), "profile": profile,
              "engine_startup_s": startup,
              "command": "infsamp bench sampling " + " ".join(sys.argv[3:]),
              "date": time.strftime("%Y-%m-%d"), "threads": args.threads}
    (out / "sampling.json").write_text(json.dumps(report, indent=1))
    # rows so far, kept only if the run dies
    (out / "sampling.partial.json").unlink(missing_ok=True)
    print_report(rows, report)
    plot(rows, out / "sampling.png")
    print(f"wrote {out / 'sampling.json'} and {out / 'sampling.png'}")
    return 0


def parse_micro_groups(text: str) -> list[int]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SamplingError(f"--micro-group: give positive integers, e.g. 8 or 8,64 (got {text!r})")
    return values


def run_cells(model, tokenizer, selected, prompts, micro_groups, engines, args,
              out: Path) -> list[dict]:
    """Every workload x G x g x policy on every engine (engines innermost: same load for all)."""
    rows = []
    for workload in selected:
        for group_size in workload.group_sizes:
            for g in micro_groups:
                for policy in args.policies.split(","):
                    for engine in engines.values():
                        rows.append(run_cell(model, tokenizer, workload, prompts[workload.name],
                                             group_size, policy, args, engine, g))
                        print(format_row(rows[-1]), flush=True)
                        (out / "sampling.partial.json").write_text(json.dumps(rows, indent=1))
    return rows


def cell_budget(workload_max_new: int, prompts, g: int, block_size: int) -> int:
    """KV budget of exactly g samples at once on an engine with this block size."""
    return kv_tokens_needed(g, workload_max_new, max(len(p) for p in prompts), 1, block_size)


def cell_config(policy: str, g: int, budget: int, max_new_tokens: int):
    return SamplingConfig(policy=policy, micro_group=g, kv_budget=str(budget),
                          max_new_tokens=max_new_tokens, temperature=1.0)


def engine_sizes_for(model, names, selected, prompts, micro_groups):
    """One engine serves every cell: longest prompt and completion, all G of `full` admitted at
    once, a pool holding the largest g budget (whole vLLM blocks), planned as a run of them."""
    from infsamp.sampling.sizes import sampler_run_sizes

    blocks = (1, *VLLM_BLOCK_SIZE.values())
    budget = max(cell_budget(w.max_new_tokens, prompts[w.name], g, block)
                 for w in selected for g in micro_groups for block in blocks)
    longest = max(len(p) for ps in prompts.values() for p in ps)
    most = max(max(w.group_sizes) for w in selected)
    cfg = replace(cell_config("full", most, budget, max(w.max_new_tokens for w in selected)),
                  num_generations=most, engine=engine_to_size(names))
    return sampler_run_sizes(cfg, model, longest, 1, call_budget_tokens=budget)


# ---------------------------------------------------------------- workloads


def bench_encoded_prompts(tokenizer, num: int, seed: int, split: str = "test",
                          data_cfg=None) -> list:
    """`num` prompts (EncodedPrompt) of `split` of the embedded task (or of `data_cfg`'s
    dataset), shuffled by `seed`, encoded as the trainer encodes them."""
    data_cfg = data_cfg or DataConfig(num_eval_examples=200)
    prompts = read_prompts(data_cfg, split, tokenizer).prompts
    random.Random(seed).shuffle(prompts)
    return prompts[:num]


def bench_prompts(tokenizer, num: int, seed: int) -> list[list[int]]:
    return [p.token_ids for p in bench_encoded_prompts(tokenizer, num, seed)]


def target_lengths(workload: Workload, group_size: int, prompt_index: int, seed: int) -> list[int]:
    """The controlled workload's per-sample lengths for one prompt (the same for every policy)."""
    rng = random.Random(f"{seed}-{group_size}-{prompt_index}")
    median = rng.lognormvariate(math.log(workload.median), workload.sigma_prompt)
    return [min(workload.max_new_tokens, max(workload.min_length,
                                             round(rng.lognormvariate(math.log(median),
                                                                      workload.sigma_sample))))
            for _ in range(group_size)]


# ---------------------------------------------------------------- one cell of the table


def run_cell(model, tokenizer, workload: Workload, prompts, group_size: int, policy: str, args,
             engine=None, micro_group: int | None = None) -> dict:
    import torch

    from infsamp.sampling.sampler import GroupSampler

    g = micro_group or args.micro_group
    num_prompts = workload.prompts_per_size.get(group_size, 1)
    block = engine.kv_block_size if engine else 1
    budget = cell_budget(workload.max_new_tokens, prompts[:num_prompts], g, block)
    cfg = cell_config(policy, g, budget, workload.max_new_tokens)
    sampler = GroupSampler(model, tokenizer, cfg, engine=engine)
    logs_steps = getattr(args, "bound", False) and hasattr(engine, "step_log")
    if logs_steps:
        engine.step_log = []
    total = {"decode_steps": 0, "lower_bound": 0, "generated_tokens": 0, "wall_time_s": 0.0,
             "model_time_s": 0.0, "cpu_time_s": 0.0, "num_preemptions": 0, "prefill_tokens": 0}
    peaks = dict.fromkeys(("peak_kv_bytes", "peak_kv_tokens", "peak_kv_blocks",
                           "peak_kv_tokens_used"), 0)
    for index, prompt in enumerate(prompts[:num_prompts]):
        targets = (target_lengths(workload, group_size, index, args.seed)
                   if workload.controlled else None)
        cpu_start = time.process_time()
        stats = sampler.sample([prompt], group_size, target_lengths=targets,
                               generator=torch.Generator().manual_seed(args.seed + index)).stats
        total["cpu_time_s"] += time.process_time() - cpu_start
        for key in total.keys() - {"cpu_time_s"}:
            total[key] += getattr(stats, key)
        peaks = {k: max(v, getattr(stats, k)) for k, v in peaks.items()}
    bound = {}
    if logs_steps:
        from infsamp.sampling.engines.decode_bound import step_figures

        bound, engine.step_log = step_figures(model, engine.step_log), None
    return {"engine": stats.engine, "workload": workload.name, "G": group_size, "policy": policy,
            "micro_group": g, "g": stats.micro_group, "kv_budget_tokens": budget,
            "num_prompts": num_prompts,
            **total, **peaks,
            "tokens_per_second": total["generated_tokens"] / max(total["wall_time_s"], 1e-9),
            "tokens_per_cpu_second": total["generated_tokens"] / max(total["cpu_time_s"], 1e-9),
            "overhead_fraction": 1 - total["model_time_s"] / max(total["wall_time_s"], 1e-9),
            **bound}


PROFILE_PARTS = {  # part -> (file suffix, function) whose cumulative time it is
    "model forward (minus KV update)": [("slots.py", "_forward")],
    "KV cache update + prompt/slot concat": [("slot_cache.py", "update")],
    "prompt prefill": [("slots.py", "_prefill")],
    "token selection + logits rule": [("slots.py", "_select")],
    "engine bookkeeping": [("slots.py", "_allocate"), ("slots.py", "_step_layout"),
                           ("slot_cache.py", "prepare_step"), ("slots.py", "_record"),
                           ("slots.py", "_drop_taken_back")],
    "scheduler and policy": [("scheduler.py", "admit"), ("scheduler.py", "step")],
}


def profile_overhead(model, tokenizer, workload: Workload, args, micro_group: int) -> dict:
    """cProfile one continuous call (G=32, g) on the slot engine and split the loop's time into
    parts (cumulative times)."""
    prompts = bench_prompts(tokenizer, 1, args.seed)
    profiler = cProfile.Profile()
    profiler.enable()
    row = run_cell(model, tokenizer, workload, prompts, 32, "continuous", args,
                   micro_group=micro_group)
    profiler.disable()
    cumulative = {(path, name): entry[3] for (path, _, name),
                  entry in pstats.Stats(profiler).stats.items()}

    def seconds(keys):
        return sum(t for (path, name), t in cumulative.items()
                   if any(path.endswith(f) and name == n for f, n in keys))

    total = seconds([("sampler.py", "_run")]) or 1.0
    parts = {name: seconds(keys) for name, keys in PROFILE_PARTS.items()}
    parts["model forward (minus KV update)"] -= parts["KV cache update + prompt/slot concat"]
    parts["other (loop, start, timers)"] = total - sum(parts.values())
    return {"workload": workload.name, "G": 32, "g": row["g"], "profiled_wall_s": total,
            "share_of_profiled_time": {k: v / total for k, v in parts.items()}}
