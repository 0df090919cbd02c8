"""The cost of one decode step by its width: how many rows a step can hold before it costs more.

    PYTHONPATH=src taskset -c 0 .venv/bin/python benchmarks/step_width.py \
        --model smollm2-135m --rows 1,4,8,16,32

One forward of one new token per row over a KV cache of `--context` tokens per row (transformers'
own DynamicCache, the model's ordinary forward), median of `--repeats` after two warm-ups, one
torch thread. What it answers: whether a step wider than g (wide probes, `wide_probes.py`) costs
in proportion to its rows on this machine, or nearly the same (weights read once per step).

Deliberately simple: random token ids; every row has the same context length.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def step_seconds(model, rows: int, context: int, repeats: int) -> float:
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    with torch.no_grad():
        cache = DynamicCache()
        model(input_ids=torch.randint(0, vocab, (rows, context)), past_key_values=cache,
              use_cache=True)
        token = torch.randint(0, vocab, (rows, 1))  # [rows, 1]
        times = []
        for _ in range(repeats + 2):
            start = time.perf_counter()
            model(input_ids=token, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="model.name_or_path")
    p.add_argument("--rows", default="1,4,8,16,32")
    p.add_argument("--context", type=int, default=98, help="KV tokens per row")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    from infsamp.config import ModelConfig
    from infsamp.models.loading import load_model_and_tokenizer

    torch.set_num_threads(1)
    model, _ = load_model_and_tokenizer(ModelConfig(name_or_path=args.model), torch.device("cpu"))
    model.eval()
    base = None
    for rows in (int(r) for r in args.rows.split(",")):
        seconds = step_seconds(model, rows, args.context, args.repeats)
        base = base or seconds
        print(f"rows {rows:>3}: {1000 * seconds:7.1f} ms per decode step ({seconds / base:.2f}x "
              f"the first)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
