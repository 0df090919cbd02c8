"""Multi-turn episodes in the sampler: engine idle time with a slow tool, and peak KV against G.

    .venv/bin/python benchmarks/tool_turns.py [--sleep-ms 50] [--prompts 4] [--max-new 64]

On the embedded model (slot engine, `continuous`, g = 16, KV budget fixed), every turn of two or
more tokens that ends at a stop token is a "tool call" whose answer (three fixed tokens) comes
back after `--sleep-ms` on a thread (a scripted `TurnHandler`, as tests/sampling/test_turns.py);
up to 3 calls per episode. For G = 8 and G = 64 it reports the sampler's wall time, the time the
engine waited with nothing to decode (`engine_idle_s`) and its share, the tool turns, and the
peak KV tokens in use (which the budget, not G, bounds). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "sampling"))
from infsamp.config import ModelConfig, SamplingConfig  # noqa: E402
from infsamp.models.loading import load_model_and_tokenizer  # noqa: E402
from infsamp.sampling.sampler import GroupSampler  # noqa: E402

from test_turns import EosBoost, ScriptedTurns  # noqa: E402


def run(model, tokenizer, G: int, args) -> dict:
    cfg = SamplingConfig(num_generations=G, policy="continuous", micro_group=16,
                         kv_budget=str(args.budget), max_new_tokens=args.max_new,
                         temperature=1.0, predictor="none", max_turns=3)
    prompts = [tokenizer(f"What is {i} + {i * 7}?")["input_ids"] for i in range(args.prompts)]
    start, cpu = time.perf_counter(), time.process_time()
    result = GroupSampler(model, tokenizer, cfg).sample(
        prompts, G, generator=torch.Generator().manual_seed(0), logits_processor_factory=EosBoost,
        turns=ScriptedTurns(delay_s=args.sleep_ms / 1000))
    stats = result.stats
    return {"G": G, "wall_s": round(time.perf_counter() - start, 3),
            "cpu_s": round(time.process_time() - cpu, 3),
            "engine_idle_s": round(stats.engine_idle_s, 3),
            "idle_share": round(stats.engine_idle_s / stats.wall_time_s, 4),
            "tool_turns": stats.num_tool_turns, "context_tokens": stats.context_tokens,
            "decode_steps": stats.decode_steps, "peak_kv_tokens_used": stats.peak_kv_tokens_used,
            "kv_budget_tokens": stats.kv_budget_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sleep-ms", type=float, default=50.0)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--budget", type=int, default=4096)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model_and_tokenizer(ModelConfig())
    rows = [run(model.eval(), tokenizer, G, args) for G in (8, 64)]
    print(json.dumps({"sleep_ms": args.sleep_ms, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
