"""How often SmolLM2 calls the calculator before training: a few training prompts x G of
examples/smollm2_calculator.yaml through the sampler with the recipe's tool (slot engine, the
recipe's temperature), printing the share of episodes with a valid call (answered without a
tool error), calls and errors per episode, and the first episodes.

    taskset -c 1 .venv/bin/python benchmarks/smollm2_tool_probe.py --num-prompts 4
    taskset -c 1 .venv/bin/python benchmarks/smollm2_tool_probe.py --set 'data.example_turns=[]'

`--set KEY=VALUE` overrides the recipe (as the CLI's flags); `--first` skips training prompts.
Deliberately simple: the base model only (no adapter), one seed.
"""

from __future__ import annotations

import argparse
import time

import torch

from infsamp.config_io import load_config
from infsamp.models.loading import load_model_and_tokenizer, stop_token_ids
from infsamp.run.tooling import RunTools
from infsamp.sampling.sampler import GroupSampler
from infsamp.tasks.loading import load_splits
from infsamp.tasks.prompts import encode_prompt
from infsamp.tasks.tool_format import supports_tools

RECIPE = "examples/smollm2_calculator.yaml"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--first", type=int, default=0, help="training prompts skipped")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    overrides = dict(item.split("=", 1) for item in args.set)
    size = args.first + args.num_prompts
    cfg = load_config(RECIPE, overrides={"data.num_train_examples": size,
                                         "data.num_eval_examples": 2, "eval.num_problems": 2,
                                         "model.lora_rank": 0, **overrides})
    model, tokenizer = load_model_and_tokenizer(cfg.model)
    print("template renders tools:", supports_tools(tokenizer))
    tools = RunTools(cfg)
    tools.start(tokenizer, stop_token_ids(model, tokenizer))
    rows = load_splits(cfg.data, 2).train[args.first:size]
    ids = [encode_prompt(row, tokenizer, cfg.data, tools.schemas)[1] for row in rows]
    prompts, turns = tools.episodes(rows, ids, args.num_generations)
    start, cpu = time.perf_counter(), time.process_time()
    result = GroupSampler(model.eval(), tokenizer, cfg.sampling).sample(
        prompts, args.num_generations, generator=torch.Generator().manual_seed(0), turns=turns)
    completions = result.completions
    print(f"prompt tokens {len(ids[0])}; wall {time.perf_counter() - start:.1f} s, "
          f"CPU {time.process_time() - cpu:.1f} s;", tools.eval_metrics(len(completions)))
    for c in completions[:6]:
        print(repr(c.text[:300]), c.num_turns, c.finish_reason)
    tools.close()


if __name__ == "__main__":
    main()
