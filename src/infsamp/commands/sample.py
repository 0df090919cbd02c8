"""`infsamp sample`: run the group sampler alone and print or write completions and statistics.

    infsamp sample --prompts prompts.txt --num-generations 8 --policy continuous --kv-budget 4096
    infsamp sample --prompts embedded:arithmetic --num-prompts 4 --out completions.jsonl --trace lengths.jsonl

`--prompts` is a .txt file (one prompt per line) or any `data.dataset` source (`embedded:arithmetic`,
a .jsonl with a 'prompt' column, a datasets id), rendered like the trainer renders it. `--trace` writes
the `infsamp simulate` trace of the run, so the same lengths can be replayed under other settings.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from infsamp.config import EMBEDDED_MODEL, DataConfig, ModelConfig, SamplingConfig
from infsamp.errors import DataError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = SamplingConfig()
    parser.add_argument("--model", default=EMBEDDED_MODEL, help="checkpoint directory or 'embedded'")
    parser.add_argument("--prompts", required=True, help=".txt (one per line), .jsonl, or embedded:arithmetic")
    parser.add_argument("--split", default="test", help="split of a dataset source")
    parser.add_argument("--num-prompts", type=int, default=0, help="use only the first N prompts (0: all)")
    parser.add_argument("--num-generations", "-G", type=int, default=defaults.num_generations, help="G")
    parser.add_argument("--policy", default=defaults.policy, help="full, rounds, continuous, length_aware")
    parser.add_argument("--kv-budget", default=defaults.kv_budget, help="tokens, bytes ('2GiB') or auto")
    parser.add_argument("--micro-group", type=int, default=defaults.micro_group, help="g (0: from the budget)")
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--temperature", type=float, default=defaults.temperature, help="0: greedy")
    parser.add_argument("--predictor", default="none", help="length predictor for length_aware")
    parser.add_argument("--engine", default=defaults.engine, help="slots, vllm or auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write completions here (JSON lines)")
    parser.add_argument("--trace", help="write the lengths trace for `infsamp simulate` here")
    parser.add_argument("--quiet", action="store_true", help="print statistics only")


def run(args: argparse.Namespace) -> int:
    import torch

    from infsamp.models.loading import load_model_and_tokenizer
    from infsamp.sampling.sampler import GroupSampler

    cfg = SamplingConfig(num_generations=args.num_generations, policy=args.policy, kv_budget=args.kv_budget,
                         micro_group=args.micro_group, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, predictor=args.predictor,
                         engine=args.engine)
    cfg.validate()
    model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=args.model))
    texts = read_prompts(args.prompts, args.split, tokenizer)[: args.num_prompts or None]
    prompt_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    predictor = _predictor(args.predictor) if args.policy == "length_aware" else None
    engine = _engine(cfg, model, prompt_ids)
    try:
        result = GroupSampler(model, tokenizer, cfg, predictor, engine=engine).sample(
            prompt_ids, args.num_generations, prompt_keys=texts, prompt_texts=texts,
            generator=torch.Generator().manual_seed(args.seed))
    finally:
        engine.close()
    if not args.quiet:
        print_completions(texts, result)
    print(format_stats(result.stats))
    if args.out:
        write_completions(args.out, texts, result)
    if args.trace:
        write_lengths_trace(args.trace, texts, prompt_ids, result)
    return 0


def read_prompts(source: str, split: str, tokenizer) -> list[str]:
    """Prompt texts from a .txt file or a dataset source (rendered as the trainer renders them)."""
    if source.endswith(".txt"):
        path = Path(source)
        if not path.exists():
            raise DataError(f"prompt file {source}: does not exist")
        lines = [line.rstrip("\n") for line in path.read_text().splitlines()]
        return [line.replace("\\n", "\n") for line in lines if line.strip()]
    from infsamp.tasks.loading import load_examples, render_prompt

    data_cfg = DataConfig(dataset=source, num_eval_examples=200)
    return [render_prompt(example, tokenizer, data_cfg) for example in load_examples(data_cfg, split)]


def _engine(cfg: SamplingConfig, model, prompt_ids: list[list[int]]):
    """The `--engine` engine, sized for these prompts (`sampling.engine`)."""
    from infsamp.sampling.engines.base import make_engine
    from infsamp.sampling.sampler import engine_limits

    longest = max((len(p) for p in prompt_ids), default=1)
    limits = engine_limits(cfg, model, longest, len(prompt_ids))
    return make_engine(cfg.engine, model, cfg, limits)


def _predictor(name: str):
    from infsamp.sampling.length_predictor import make_predictor

    return make_predictor(name)


def print_completions(texts: list[str], result) -> None:
    for text, group in zip(texts, result.groups):
        print(f"=== prompt: {text!r}")
        for c in group:
            print(f"  [{c.index_in_group:>3}] {c.length:>4} tok {c.finish_reason:<6} {c.text!r}")


def format_stats(stats) -> str:
    rows = [("policy", stats.policy), ("slots (g)", stats.num_slots), ("kv budget (tokens)", stats.kv_budget_tokens),
            ("decode steps", stats.decode_steps), ("lower bound", stats.lower_bound),
            ("prefill tokens", stats.prefill_tokens), ("generated tokens", stats.generated_tokens),
            ("peak kv tokens", stats.peak_kv_tokens), ("peak kv bytes", stats.peak_kv_bytes),
            ("preemptions", stats.num_preemptions), ("wall time (s)", f"{stats.wall_time_s:.2f}"),
            ("tokens / s", f"{stats.tokens_per_second:.1f}"),
            ("sampler overhead", f"{100 * stats.overhead_fraction:.1f}% of wall time")]
    return "\n".join(f"{name:>20}: {value}" for name, value in rows)


def write_completions(path: str, texts: list[str], result) -> None:
    with open(path, "w") as handle:
        for text, group in zip(texts, result.groups):
            for c in group:
                row = {"prompt": text, "group_id": c.group_id, "index_in_group": c.index_in_group,
                       "text": c.text, "token_ids": c.token_ids, "length": c.length,
                       "finish_reason": c.finish_reason}
                handle.write(json.dumps(row) + "\n")
    print(f"wrote {path}")


def write_lengths_trace(path: str, texts: list[str], prompt_ids: list[list[int]], result) -> None:
    from infsamp.sampling.simulator import TraceGroup, write_trace

    write_trace([TraceGroup(text, len(ids), [c.length for c in group])
                 for text, ids, group in zip(texts, prompt_ids, result.groups)], path)
    print(f"wrote {path}")
