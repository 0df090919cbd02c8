"""How often SmolLM2 calls the calculator before training: 2 training prompts x G = 8 of
examples/smollm2_calculator.yaml through the sampler with the recipe's tool (slot engine, the
recipe's temperature), printing the tool metrics and the first episodes.

    taskset -c 0 .venv/bin/python benchmarks/smollm2_tool_probe.py
"""

from __future__ import annotations

import time

import torch

from infsamp.config_io import load_config
from infsamp.models.loading import load_model_and_tokenizer, stop_token_ids
from infsamp.run.tooling import RunTools
from infsamp.sampling.sampler import GroupSampler
from infsamp.tasks.loading import load_splits
from infsamp.tasks.prompts import encode_prompt
from infsamp.tasks.tool_format import supports_tools


def main() -> None:
    torch.set_num_threads(1)
    cfg = load_config("examples/smollm2_calculator.yaml",
                      overrides={"data.num_train_examples": 8, "data.num_eval_examples": 2,
                                 "eval.num_problems": 2})
    model, tokenizer = load_model_and_tokenizer(cfg.model)
    print("template renders tools:", supports_tools(tokenizer))
    tools = RunTools(cfg)
    tools.start(tokenizer, stop_token_ids(model, tokenizer))
    rows = load_splits(cfg.data, 2).train[:2]
    ids = [encode_prompt(row, tokenizer, cfg.data, tools.schemas)[1] for row in rows]
    prompts, turns = tools.episodes(rows, ids, 8)
    start = time.perf_counter()
    result = GroupSampler(model.eval(), tokenizer, cfg.sampling).sample(
        prompts, 8, generator=torch.Generator().manual_seed(0), turns=turns)
    print("wall", round(time.perf_counter() - start, 1), "s", tools.metrics(result.completions))
    for c in result.completions[:6]:
        print(repr(c.text[:300]), c.num_turns, c.finish_reason)
    tools.close()


if __name__ == "__main__":
    main()
