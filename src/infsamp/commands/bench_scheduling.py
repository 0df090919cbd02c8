"""`infsamp bench scheduling`: the length-aware scheduler against rounds and continuous, real
engine.

    infsamp bench scheduling --quick                 # about a minute on a 2-core CPU
    infsamp bench scheduling --out runs/bench_sched  # G=32, g=8, 12 prompts, 2 epochs
    infsamp bench scheduling -B 1 --prompts 8 --seeds 0,1,2   # one prompt per step, three seeds
    infsamp bench scheduling --engine slots,vllm -B 4  # the same calls on both engines
    infsamp bench scheduling --model DIR --dataset rows.jsonl --prompt-column question
    infsamp bench scheduling --config examples/smollm2_reasoning_gym.yaml --max-new-tokens 96

The embedded task with natural lengths (or `--dataset`'s prompts for `--model`), B prompts per
sampler call (= one training step, `-B`, default 1), G samples per prompt and the same g slots
and KV budget for every policy. Epoch 1 warms the learning predictors (online, hidden) up as a
training run's first epoch would (every such variant runs every prompt, each with a predictor of
its own); the last epoch is measured. Per prompt and with one seed it runs `continuous` (arrival
order), `rounds`, `length_aware` + `online`, + `hidden` and + `oracle`, and `probe` (more
samples than g start as k-token probes in the same budget) alone and + `online`. The sampler
draws each sample's noise from its own key, so every policy produces the same completions for the
same seed
(the bench checks the lengths); the oracle is handed the lengths of the `continuous` call.
`--seeds` repeats the whole measurement per seed (its own prompts, sampling seeds and
predictors); the report has totals over all seeds and each seed's share of the oracle's gain.

`--engine slots,vllm` runs every call on each engine (rows tagged `engine`; each engine has its own
predictors and its oracle takes that engine's lengths). On vLLM a decode step is an engine step,
and `hidden` falls back to its token-level part (vLLM hands out no hidden states).
Writes `scheduling.json` (per-call rows, totals per engine and variant, targets) and prints a
table. Deliberately simple: one run per cell, engines and policies interleaved per prompt so that
machine load hits all of them alike; each engine is started once, before the measurements.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

from infsamp.choices import PROBE_TOKENS, WIDE_POLICIES
from infsamp.commands.bench_sampling import bench_encoded_prompts
from infsamp.commands.bench_scheduling_report import LEARNING, print_report, summarise
from infsamp.commands.engine_choice import (
    ENGINE_HELP,
    close_engines,
    engine_to_size,
    parse_engines,
    start_engines,
)
from infsamp.config import DataConfig, ModelConfig
from infsamp.config_algorithm import SamplingConfig
from infsamp.config_io import load_config
from infsamp.errors import SamplingError
from infsamp.planner.kv_budget import VLLM_BLOCK_SIZE, kv_tokens_needed
from infsamp.tasks.sources import check_dataset_source

VARIANTS = ("continuous", "rounds", "length_aware:online", "length_aware:hidden",
            "length_aware:oracle", "probe", "probe:online")
TRACE_ONLY = ("first_tokens", "prompt_texts")  # kept in the traces, not in scheduling.json's rows
ROW_STATS = ("decode_steps", "recomputed_tokens", "schedule_time_s", "lower_bound",
             "opt_lower_bound", "generated_tokens", "wall_time_s", "micro_group",
             "kv_budget_tokens", "peak_kv_tokens", "peak_kv_blocks", "num_preemptions",
             "prefill_tokens", "peak_rows", "row_steps")  # SamplerStats kept under their names


@dataclass(frozen=True)
class Variant:
    policy: str
    predictor: str = ""
    refill: str = "auto"

    @classmethod
    def parse(cls, text: str) -> Variant:
        """`policy[:predictor][/refill]`, e.g. `length_aware:noisy:0.5/sjf`."""
        head, _, refill = text.partition("/")
        policy, _, predictor = head.partition(":")
        return cls(policy, predictor, refill or "auto")

    @property
    def name(self) -> str:
        head = f"{self.policy}:{self.predictor}" if self.predictor else self.policy
        return head if self.refill == "auto" else f"{head}/{self.refill}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="3 prompts, G=16, g=4 (about a minute)")
    parser.add_argument("--out", default="runs/bench_scheduling", help="folder for scheduling.json")
    parser.add_argument("--model", default="",
                        help="checkpoint directory, 'embedded' (default) or 'smollm2-135m'")
    parser.add_argument("--prompts", type=int, default=12,
                        help="prompts (= sampler calls) per epoch")
    parser.add_argument("--prompts-per-step", "-B", type=int, default=1,
                        help="prompts per sampler call (= per training step; the demo trains "
                             "with 4)")
    parser.add_argument("--epochs", type=int, default=2,
                        help="epochs; all but the last warm the predictor up")
    parser.add_argument("--num-generations", "-G", type=int, default=32, help="samples per prompt")
    parser.add_argument("--micro-group", type=int, default=8, help="g, the slots of every policy")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7,
                        help="sampling temperature (the demo's)")
    parser.add_argument("--prefix-tokens", type=int, default=8,
                        help="k: a running sample is re-predicted every k tokens")
    parser.add_argument("--probe-tokens", type=int, default=PROBE_TOKENS,
                        help="probe: KV tokens a new sample first reserves (sampling.probe_tokens)")
    parser.add_argument("--kv-slack", type=int, default=0,
                        help="KV tokens every variant's budget gets beyond g full samples (room to "
                             "keep parked samples' KV; 0: parked KV is recomputed)")
    parser.add_argument("--dataset", default="",
                        help="prompts from this data.dataset instead of the embedded task")
    parser.add_argument("--prompt-column", default="prompt", help="--dataset: the prompt column")
    parser.add_argument("--config", default="",
                        help="a training config (e.g. examples/smollm2_reasoning_gym.yaml): its "
                             "data section gives the prompts (task options, system prompt) and "
                             "its model.name_or_path the model, unless --model is given")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated policy[:predictor][/refill]; continuous must come "
                             "first")
    parser.add_argument("--engine", default="slots", help=ENGINE_HELP)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", default="", help="comma-separated seeds, each a whole "
                        "measurement (default: --seed)")


def run(args: argparse.Namespace) -> int:
    import torch

    from infsamp.models.loading import load_model_and_tokenizer

    if args.quick:
        args.prompts, args.num_generations, args.micro_group, args.max_new_tokens = 3, 16, 4, 256
    variants = check_arguments(args)
    names = parse_engines(args.engine)
    data_cfg, model_name = bench_sources(args)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=model_name))
    seeds = parse_seeds(args)
    prompts = {seed: bench_prompts(tokenizer, args.prompts, seed, data_cfg) for seed in seeds}
    sizes = engine_sizes_for(model, names, [p for chunk in prompts.values() for p in chunk], args)
    cfg = sampling_config(Variant("continuous"), args, sizes.kv_budget_tokens)
    engines, startup = start_engines(names, model, cfg, sizes, prompts[seeds[0]][0][1])
    try:
        rows = [row for seed in seeds for row in run_epochs(model, tokenizer, prompts[seed],
                                                            variants, args, engines, seed)]
    finally:
        close_engines(engines)
    report = summarise(rows, variants, args)
    report["engine_startup_s"] = startup
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report["traces"] = {name: str(path) for name, path in write_traces(rows, out).items()}
    kept = [{k: v for k, v in r.items() if k not in TRACE_ONLY} for r in rows]  # in the traces
    (out / "scheduling.json").write_text(json.dumps({**report, "rows": kept}, indent=1))
    print_report(report)
    print(f"wrote {out / 'scheduling.json'}")
    return 0


def check_arguments(args: argparse.Namespace) -> list[Variant]:
    """Bad counts or variants end in one SamplingError line, before the model is loaded."""
    counts = ("prompts", "prompts_per_step", "epochs", "num_generations", "micro_group",
              "max_new_tokens")
    for name, value in [(name, getattr(args, name)) for name in counts] + [
            ("probe_tokens", probe_tokens(args))]:
        if value < 1:
            raise SamplingError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.temperature < 0 or args.prefix_tokens < 0:
        raise SamplingError(f"--temperature and --prefix-tokens must be >= 0, got "
                            f"{args.temperature}, {args.prefix_tokens}")
    if args.kv_slack < 0:
        raise SamplingError(f"--kv-slack must be >= 0, got {args.kv_slack}")
    parse_seeds(args)
    variants = [Variant.parse(v) for v in args.variants.split(",")]
    if variants[0] != Variant("continuous"):
        raise SamplingError(f"--variants must start with continuous (it feeds the oracle), got "
                            f"{args.variants!r}")
    return variants


def parse_seeds(args) -> list[int]:
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()] if args.seeds else [args.seed]
    except ValueError:
        raise SamplingError(f"--seeds must be comma-separated integers, got "
                            f"{args.seeds!r}") from None
    if len(set(seeds)) != len(seeds):
        raise SamplingError(f"--seeds repeats a seed: {args.seeds!r}")
    return seeds


def bench_sources(args):
    """(data config or None for the embedded task, model name): `--config`'s data section and
    model, `--dataset`/`--prompt-column` and `--model` overriding them. Checked before any load
    (an unknown task or option is one line)."""
    cfg = load_config(args.config) if args.config else None
    data = cfg.data if cfg else None
    if args.dataset:
        data = DataConfig(dataset=args.dataset, prompt_column=args.prompt_column)
    if data is not None:
        check_dataset_source(data)
    model = args.model or (cfg.model.name_or_path if cfg else "embedded")
    return data, model


def bench_prompts(tokenizer, num: int, seed: int,
                  data_cfg=None) -> list[tuple[str, list[int]]]:
    """(text, token ids) of `num` training prompts: the embedded task's, or `data_cfg`'s
    (`bench_sources`')."""
    prompts = bench_encoded_prompts(tokenizer, num, seed, split="train", data_cfg=data_cfg)
    return [(p.text, p.token_ids) for p in prompts]


# ---------------------------------------------------------------- the calls


def sampling_config(variant: Variant, args, budget: int):
    return SamplingConfig(policy=variant.policy, micro_group=args.micro_group,
                          kv_budget=str(budget), max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, refill=variant.refill,
                          predictor_prefix_tokens=args.prefix_tokens,
                          probe_tokens=probe_tokens(args))


def probe_tokens(args) -> int:
    """`--probe-tokens` (callers that build their own arguments may leave it out)."""
    return getattr(args, "probe_tokens", PROBE_TOKENS)


def call_budget(args, max_prompt_tokens: int, block_size: int = 1) -> int:
    """The budget a call needs for exactly g samples at once, prompts and blocks counted as the
    sampler counts them on this engine."""
    return kv_tokens_needed(args.micro_group, args.max_new_tokens, max_prompt_tokens,
                            args.prompts_per_step, block_size) + getattr(args, "kv_slack", 0)


def engine_sizes_for(model, names, prompts, args):
    """Enough for every call: the longest prompt, g at once (a wide policy: every sample of a
    call), a pool holding the largest budget (vLLM blocks), planned as a run of these calls."""
    from infsamp.sampling.sizes import sampler_run_sizes

    longest = max(len(p[1]) for p in prompts)
    budget = max(call_budget(args, longest, block) for block in (1, *VLLM_BLOCK_SIZE.values()))
    wide = any(Variant.parse(v).policy in WIDE_POLICIES for v in args.variants.split(","))
    cfg = replace(sampling_config(Variant("probe" if wide else "continuous"), args, budget),
                  num_generations=args.num_generations, engine=engine_to_size(names))
    return sampler_run_sizes(cfg, model, longest, args.prompts_per_step, call_budget_tokens=budget)


class Runner:
    """One predictor per variant, alive across calls: an online predictor learns only from its own
    variant's calls (two variants sharing one would see each other's identical completions)."""

    def __init__(self, model, tokenizer, args, engine):
        self.model, self.tokenizer, self.args, self.engine = model, tokenizer, args, engine
        self._predictors: dict = {}

    def predictor(self, variant: Variant):
        from infsamp.sampling.predictors import make_predictor

        if variant.predictor and variant.name not in self._predictors:
            self._predictors[variant.name] = make_predictor(variant.predictor)
        return self._predictors.get(variant.name)

    def set_true_lengths(self, lengths: list[list[int]]) -> None:
        """Oracle-type predictors get the lengths of the call about to run ([group][index in
        group])."""
        from infsamp.sampling.length_predictor import OraclePredictor

        for predictor in self._predictors.values():
            if isinstance(predictor, OraclePredictor):
                predictor.set_lengths(
                    lambda spec, lengths=lengths: lengths[spec.group_id][spec.index_in_group])

    def call(self, variant: Variant, prompts: list[tuple[str, list[int]]], keys: list[str],
             seed: int) -> dict:
        import torch

        from infsamp.sampling.sampler import GroupSampler

        budget = call_budget(self.args, max(len(p[1]) for p in prompts), self.engine.kv_block_size)
        cfg = sampling_config(variant, self.args, budget)
        sampler = GroupSampler(self.model, self.tokenizer, cfg, predictor=self.predictor(variant),
                               engine=self.engine)
        cpu_start = time.process_time()
        result = sampler.sample([p[1] for p in prompts], self.args.num_generations,
                                prompt_keys=keys, prompt_texts=[p[0] for p in prompts],
                                generator=torch.Generator().manual_seed(seed))
        cpu = time.process_time() - cpu_start
        s, kept = result.stats, max(self.args.prefix_tokens, probe_tokens(self.args))
        return {"engine": s.engine, "variant": variant.name, "prompt": ",".join(keys),
                "prompt_texts": [p[0] for p in prompts], "cpu_time_s": cpu,
                **{key: getattr(s, key) for key in ROW_STATS},
                "kendall_tau": s.predictor_kendall_tau, "mae": s.predictor_mae,
                "lengths": [[c.length for c in g] for g in result.groups],
                # enough for every prediction point a replay meets (k of the predictor and probes)
                "first_tokens": [[c.token_ids[:kept] for c in g] for g in result.groups],
                "prompt_tokens": [len(p[1]) for p in prompts]}


def run_epochs(model, tokenizer, prompts, variants: list[Variant], args,
               engines: dict | None = None, seed: int | None = None) -> list[dict]:
    """Every call on every engine (default: the slot engine), interleaved per call; the calls'
    seeds follow `seed` (default `args.seed`), and each run has predictors of its own."""
    from infsamp.sampling.engines.slots import SlotEngine

    engines = engines or {"slots": SlotEngine(model)}
    runners = [Runner(model, tokenizer, args, engine) for engine in engines.values()]
    for runner in runners:
        for variant in variants:
            runner.predictor(variant)
    rows, base = [], args.seed if seed is None else seed
    for epoch in range(1, args.epochs + 1):
        measured = epoch == args.epochs
        for first in range(0, len(prompts), args.prompts_per_step):
            chunk = prompts[first: first + args.prompts_per_step]
            keys = [str(first + i) for i in range(len(chunk))]
            call_seed = base + 1000 * epoch + first
            todo = variants if measured else [v for v in variants if v.predictor in LEARNING]
            for runner in runners:
                rows += run_variants(runner, todo, chunk, keys, call_seed, epoch, measured)
    for row in rows:
        row["seed"] = base
    return rows


def run_variants(runner: Runner, variants: list[Variant], chunk, keys, seed: int, epoch: int,
                 measured: bool) -> list[dict]:
    rows, lengths = [], None
    for variant in variants:
        row = runner.call(variant, chunk, keys, seed)
        if variant.policy == "continuous":  # the oracle's lengths for this call
            lengths = row["lengths"]
            runner.set_true_lengths(lengths)
        row.update(epoch=epoch, measured=measured,
                   same_lengths_as_continuous=row["lengths"] == lengths if measured else None)
        rows.append(row)
        print(format_call(row), flush=True)
    return rows


def write_traces(rows: list[dict], out: Path) -> dict[str, Path]:
    """Each engine's and seed's calls (one row per call: every variant draws the same
    completions) as a lengths trace with each completion's first k tokens:
    `infsamp simulate --trace ... --warmup-steps N` replays the bench's decisions from it."""
    from infsamp.sampling.traces import TraceGroup, write_trace

    paths = {}
    for engine, seed in dict.fromkeys((r["engine"], r.get("seed", 0)) for r in rows):
        calls = {}  # (epoch, prompts) -> the first row of that call
        for r in rows:
            if (r["engine"], r.get("seed", 0)) == (engine, seed):
                calls.setdefault((r["epoch"], r["prompt"]), r)
        groups = [TraceGroup(key, tokens, lengths, text, first)
                  for r in calls.values() for key, tokens, lengths, text, first in zip(
                      r["prompt"].split(","), r["prompt_tokens"], r["lengths"],
                      r["prompt_texts"], r["first_tokens"])]
        name = f"{engine}, seed {seed}"
        paths[name] = out / f"trace_{engine}_seed{seed}.jsonl"
        write_trace(groups, paths[name])
    return paths


def format_call(r: dict) -> str:
    tau = "" if r["kendall_tau"] is None else f" tau {r['kendall_tau']:.2f}"
    return (f"epoch {r['epoch']} prompts {r['prompt']:>6} {r['engine']:<6}{r['variant']:<22} "
            f"steps {r['decode_steps']:>5} bound {r['lower_bound']:>5} tokens "
            f"{r['generated_tokens']:>6} {r['wall_time_s']:6.1f}s{tau}")
