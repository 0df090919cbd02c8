"""`infsamp sample`: run the group sampler alone and print or write completions and statistics.

    infsamp sample --prompts prompts.txt --num-generations 8 --policy continuous --kv-budget 4096
    infsamp sample examples/gsm8k.yaml --model.name_or_path DIR --data.dataset DATA --num-prompts 2
    infsamp sample --prompts embedded:arithmetic --num-prompts 4 --out completions.jsonl \
        --trace lengths.jsonl

It reads the trainer's configuration: an optional recipe YAML, every `--section.key` flag of
`infsamp train`, and a few short flags for the sampler (`--prompts` is `--data.dataset`, `-G` is
`--sampling.num_generations`, ...). So the prompts (any `data.dataset` source, or a .txt file with
one prompt per line) go through the same columns, chat template, system prompt and token ids as in
training, and the sampler settings are the recipe's (`training.num_threads` too: CPU threads as
the trainer chooses them). `--split` defaults to the training split.
`--trace` writes the `infsamp simulate` trace of the run, so the same lengths can be replayed.

Tools (`tools.functions`, `tools.environment_factory`, `sampling.max_turns`) work as in training:
they are loaded and checked before the model loads (one line for a bad one), offered in every
prompt, run when a sample calls them, and their answers appended to its episode; `--out` then
holds each completion's context spans (the tools' answers) and tool latencies, `--trace` its
turns, and the statistics the tool turns and calls. An environment's reward is not computed
(nothing is scored here).
"""

from __future__ import annotations

import argparse
import json

from infsamp.commands.output_files import check_output_files
from infsamp.commands.train import add_config_flags, check_sources, config_overrides
from infsamp.config import DataConfig
from infsamp.config_io import load_config
from infsamp.files import create_text
from infsamp.options import ConfigError
from infsamp.tasks.loading import load_examples
from infsamp.tasks.prompts import encode_examples

SHORT_FLAGS = {  # short flag -> (config key, help)
    "model": ("model.name_or_path", "checkpoint folder or 'embedded'"),
    "prompts": ("data.dataset", ".txt (one prompt per line) or any data.dataset source"),
    "num-generations": ("sampling.num_generations", "G"),
    "policy": ("sampling.policy", "full, rounds, continuous, length_aware, probe"),
    "kv-budget": ("sampling.kv_budget", "tokens, bytes ('2GiB') or auto"),
    "micro-group": ("sampling.micro_group", "g (0: from the budget)"),
    "max-new-tokens": ("sampling.max_new_tokens", "completion limit"),
    "temperature": ("sampling.temperature", "0: greedy"),
    "predictor": ("sampling.predictor",
                  "length predictor for length_aware and probe: online, hidden or none"),
    "engine": ("sampling.engine", "slots, vllm or auto"),
    "seed": ("training.seed", "sampling seed"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="recipe YAML: its model, data, sampling settings")
    for flag, (key, help_text) in SHORT_FLAGS.items():
        names = [f"--{flag}", "-G"] if flag == "num-generations" else [f"--{flag}"]
        parser.add_argument(*names, dest=f"short:{key}", default=None,
                            metavar=key.partition(".")[2].upper(), help=f"{help_text} (= --{key})")
    parser.add_argument("--split", help="split of a dataset source (default: data.train_split)")
    parser.add_argument("--num-prompts", type=int, default=0,
                        help="use only the first N prompts (0: all)")
    parser.add_argument("--out", help="write completions here (JSON lines)")
    parser.add_argument("--trace", help="write the lengths trace for `infsamp simulate` here")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out / --trace file (never an input)")
    parser.add_argument("--quiet", action="store_true", help="print statistics only")
    add_config_flags(parser)


def run(args: argparse.Namespace) -> int:
    if args.num_prompts < 0:  # before anything loads or samples
        raise ConfigError(f"--num-prompts: must be >= 0 (0: all) (got {args.num_prompts})")
    shortcuts = {key[6:]: value for key, value in vars(args).items()
                 if key.startswith("short:") and value is not None}
    cfg = load_config(args.config, {**config_overrides(args), **shortcuts})
    check_output_files({"--out": args.out, "--trace": args.trace},
                       [args.config, cfg.data.dataset, cfg.model.name_or_path], args.overwrite)
    check_sources(cfg)
    from infsamp.run.tooling import RunTools

    tools = RunTools(cfg)  # a bad tool reference: one line, before anything loads
    import torch

    from infsamp.models.device import check_device
    from infsamp.models.loading import load_model_and_tokenizer, load_tokenizer, require_stop_tokens
    from infsamp.sampling.policies import uses_predictor
    from infsamp.sampling.predictors import make_predictor
    from infsamp.sampling.sampler import GroupSampler

    check_device(cfg.model)
    tokenizer = load_tokenizer(cfg.model.name_or_path, cfg.model.trust_remote_code)
    split = args.split or cfg.data.train_split
    encoded = read_prompts(cfg.data, split, tokenizer, args.num_prompts, tools.schemas)
    if encoded.num_dropped:
        print(encoded.note("sample", cfg.data.max_prompt_length))
    prompts = encoded.prompts
    model, _ = load_model_and_tokenizer(cfg.model, tokenizer=tokenizer)
    from infsamp.run.setup import set_num_threads

    set_num_threads(cfg.training.num_threads, model, next(model.parameters()).device)
    predictor = (make_predictor(cfg.sampling.predictor) if uses_predictor(cfg.sampling.policy)
                 else None)
    prompt_ids, texts = [p.token_ids for p in prompts], [p.text for p in prompts]
    turns = None
    if tools.enabled:  # with an environment, each group's prompt holds its first observation
        tools.start(tokenizer, require_stop_tokens(model, tokenizer, cfg.model.name_or_path))
        prompt_ids, turns = tools.episodes([p.example for p in prompts], prompt_ids,
                                           cfg.sampling.num_generations)
    sizes, engine = _engine(cfg.sampling, model, prompt_ids)
    try:
        result = GroupSampler(model, tokenizer, cfg.sampling, predictor, engine=engine,
                              sizes=sizes).sample(
            prompt_ids, cfg.sampling.num_generations, prompt_keys=[str(p.index) for p in prompts],
            prompt_texts=texts, generator=torch.Generator().manual_seed(cfg.training.seed),
            turns=turns)
        tool_metrics = tools.metrics(result.completions)
    finally:
        engine.close()
        tools.close()
    if not args.quiet:
        print_completions(texts, result)
    print(format_stats(result.stats, tool_metrics))
    if args.out:
        write_completions(args.out, texts, result)
    if args.trace:
        write_lengths_trace(args.trace, texts, prompt_ids, result,
                            cfg.sampling.predictor_prefix_tokens)
    return 0


def read_prompts(data_cfg: DataConfig, split: str, tokenizer, num_prompts: int = 0,
                 tools: list[dict] | None = None):
    """The first `num_prompts` (0: all) prompts of `split`, encoded as the trainer encodes them (an
    `EncodedSplit`: over-long prompts are skipped and counted; `tools`: the schemas offered in
    each prompt); the answer column is optional."""
    examples = load_examples(data_cfg, split, need_answer=False)[: num_prompts or None]
    what = f"data.dataset {data_cfg.dataset} split {split!r}"
    return encode_examples(examples, tokenizer, data_cfg, what, tools)


def _engine(cfg, model, prompt_ids: list[list[int]]):
    """(sizes, engine): the sizes for these prompts (`sampling.sizes.sampler_run_sizes`, the
    planner's `plan_run_sizes`) and the `sampling.engine` (`--engine`) engine started for them."""
    from infsamp.sampling.engines.base import make_engine
    from infsamp.sampling.sizes import sampler_run_sizes

    longest = max((len(p) for p in prompt_ids), default=1)
    sizes = sampler_run_sizes(cfg, model, longest, len(prompt_ids))
    return sizes, make_engine(cfg.engine, model, cfg, sizes)


def print_completions(texts: list[str], result) -> None:
    for text, group in zip(texts, result.groups):
        print(f"=== prompt: {text!r}")
        for c in group:
            print(f"  [{c.index_in_group:>3}] {c.length:>4} tok {c.finish_reason:<6} {c.text!r}")


def format_stats(stats, tool_metrics: dict[str, float] | None = None) -> str:
    rows = [("policy", stats.policy), ("micro-group (g)", stats.micro_group),
            ("kv budget (tokens)", stats.kv_budget_tokens),
            ("decode steps", stats.decode_steps), ("lower bound", stats.lower_bound),
            ("prefill tokens", stats.prefill_tokens), ("generated tokens", stats.generated_tokens),
            ("peak kv tokens", stats.peak_kv_tokens), ("peak kv bytes", stats.peak_kv_bytes),
            ("preemptions", stats.num_preemptions),
            ("rows per step", f"{stats.mean_rows:.1f} mean, {stats.peak_rows} at most"),
            ("wall time (s)", f"{stats.wall_time_s:.2f}"),
            ("tokens / s", f"{stats.tokens_per_second:.1f}"),
            ("sampler overhead", f"{100 * stats.overhead_fraction:.1f}% of wall time")]
    if tool_metrics:  # tools were offered
        rows += [("tool calls", f"{tool_metrics['tools/calls']:g} "
                                f"({tool_metrics['tools/errors']:g} errors)"),
                 ("tool turns", stats.num_tool_turns), ("context tokens", stats.context_tokens),
                 ("engine idle (s)", f"{stats.engine_idle_s:.2f}")]
    return "\n".join(f"{name:>20}: {value}" for name, value in rows)


def write_completions(path: str, texts: list[str], result) -> None:
    with create_text(path) as handle:
        for text, group in zip(texts, result.groups):
            for c in group:
                row = {"prompt": text, "group_id": c.group_id, "index_in_group": c.index_in_group,
                       "text": c.text, "token_ids": c.token_ids, "length": c.length,
                       "finish_reason": c.finish_reason}
                if c.num_turns:  # tools' answers: [start, end) of token_ids, each call's time
                    row.update(num_turns=c.num_turns,
                               context_spans=[list(span) for span in c.context_spans],
                               tool_latencies_s=[round(t, 6) for t in c.tool_latencies_s])
                handle.write(json.dumps(row) + "\n")
    print(f"wrote {path}")


def write_lengths_trace(path: str, texts: list[str], prompt_ids: list[list[int]], result,
                        prefix_tokens: int = 16) -> None:
    """The `infsamp simulate` trace: lengths, each completion's first `prefix_tokens` ids, and
    its turns when the group called tools."""
    from infsamp.sampling.traces import TraceGroup, group_turns, write_trace

    write_trace([TraceGroup(text, len(ids), [c.length for c in group],
                            first_tokens=[list(c.token_ids[:prefix_tokens]) for c in group]
                            if prefix_tokens else None, turns=group_turns(group))
                 for text, ids, group in zip(texts, prompt_ids, result.groups)], path)
    print(f"wrote {path}")
