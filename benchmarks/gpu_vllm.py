"""Slot engine against vLLM engine on a CUDA GPU, one command (under 10 minutes on an H200).

    pip install 'infsamp[gpu]'               # the CUDA build of vLLM (a separate environment)
    python benchmarks/gpu_vllm.py --out runs/gpu_vllm

A Qwen3-1.7B-shaped model with random weights is built from its config here (no download; bf16,
sdpa). EOS is disabled, so every completion runs to `--max-new-tokens` (the same work on both
engines). For G = 8, 32, 128 (one prompt of `--prompt-tokens` random ids, all G decoded at once,
`continuous`) both engines get the same KV budget: the tokens G concurrent samples need
(`types.kv_tokens_needed`, whole vLLM blocks). Measured per cell, after one warm-up call: tokens/s
(engine start-up excluded, reported apart) and peak GPU memory (torch's peak allocation for the
slot engine; device memory in use for vLLM, whose pool is allocated once). Then one GRPO step with
sleep mode: a vLLM rollout, `sleep` (pool and weights freed: `discard`), the optimizer step
(AdamW), weights pushed back, a second rollout. Writes `gpu_vllm.json` and prints a table.

Targets (issue 11): vLLM >= 5x the slot engine's tokens/s at G = 128.

Deliberately simple: one prompt, one run per cell, fixed lengths; vLLM with CUDA graphs (default).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

GIB = 2**30
TIME_LIMIT_S = 9 * 60


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/gpu_vllm")
    parser.add_argument("--model", default="qwen3-1.7b", help="planner preset of the shape")
    parser.add_argument("--num-generationss", default="8,32,128")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    return parser.parse_args(argv)


def build_model(preset: str):
    import torch
    from transformers import AutoModelForCausalLM

    from infsamp.planner import load_shape

    from memory import hf_config  # benchmarks/memory.py: a config of the shape's family

    torch.manual_seed(0)
    config = hf_config(load_shape(preset))
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to("cuda").eval()
    model.config.eos_token_id = None  # every completion runs to max_new_tokens
    return model


def cell(model, engine, prompt: list[int], group_size: int, budget: int, max_new: int) -> dict:
    import torch

    from infsamp.config import SamplingConfig
    from infsamp.models.device import memory_bytes
    from infsamp.sampling.sampler import GroupSampler

    cfg = SamplingConfig(policy="continuous", micro_group=group_size, kv_budget=str(budget),
                         max_new_tokens=max_new, temperature=1.0)
    sampler = GroupSampler(model, None, cfg, engine=engine)
    sampler.sample([prompt], group_size, generator=torch.Generator().manual_seed(0))  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    stats = sampler.sample([prompt], group_size, generator=torch.Generator().manual_seed(1)).stats
    free, total = memory_bytes(torch.device("cuda"))
    return {"engine": stats.engine, "G": group_size, "g": stats.micro_group,
            "decode_steps": stats.decode_steps,
            "generated_tokens": stats.generated_tokens, "wall_time_s": stats.wall_time_s,
            "tokens_per_second": stats.tokens_per_second, "peak_kv_bytes": stats.peak_kv_bytes,
            "num_preemptions": stats.num_preemptions,
            "torch_peak_allocated_gib": (torch.cuda.max_memory_allocated() - before) / GIB,
            "device_in_use_gib": (total - free) / GIB}


def grpo_step_with_sleep(model, engine, prompt: list[int], group_size: int, max_new: int) -> dict:
    """Rollout on vLLM -> sleep -> one optimizer step -> weights pushed -> rollout again."""
    import torch

    from infsamp.algorithm.grpo_step import GRPOStep, Rollout
    from infsamp.config import SamplingConfig, TrainingConfig
    from infsamp.models.device import memory_bytes
    from infsamp.sampling.sampler import GroupSampler

    cfg = SamplingConfig(policy="continuous", micro_group=group_size, kv_budget=str(10**9),
                         max_new_tokens=max_new, temperature=1.0)
    sampler = GroupSampler(model, None, cfg, engine=engine)
    result = sampler.sample([prompt], group_size, generator=torch.Generator().manual_seed(2))
    completions = result.completions
    advantages = torch.randn(len(completions))
    rollout = Rollout([prompt] * len(completions), [c.token_ids for c in completions], advantages,
                      engine_logprobs=[torch.tensor(c.logprobs) for c in completions])
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    step = GRPOStep(model, TrainingConfig(), pad_token_id=0, temperature=1.0,
                    max_completion_length=max_new, micro_batch_tokens=8192)
    free_awake = memory_bytes(torch.device("cuda"))[0]
    engine.sleep()
    free_asleep = memory_bytes(torch.device("cuda"))[0]
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    metrics = step.optimize(rollout, optimizer, scheduler)
    torch.cuda.synchronize()
    train_s = time.perf_counter() - started
    train_peak = torch.cuda.max_memory_allocated() / GIB
    started = time.perf_counter()
    engine.load_weights(model)
    push_s = time.perf_counter() - started
    model.eval()
    again = sampler.sample([prompt], group_size, generator=torch.Generator().manual_seed(3))
    return {"freed_by_sleep_gib": (free_asleep - free_awake) / GIB, "train_step_s": train_s,
            "train_peak_allocated_gib": train_peak, "weight_push_s": push_s,
            "logprob_abs_diff_max_before_step": metrics.get("sampling/logprob_abs_diff_max"),
            "second_rollout_tokens": again.stats.generated_tokens}


def main(argv=None) -> int:
    import torch

    from infsamp.planner.sizes import RunSizes
    from infsamp.sampling.engines.base import make_engine
    from infsamp.sampling.engines.slots import SlotEngine
    from infsamp.sampling.types import kv_tokens_needed

    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_vllm: needs a CUDA GPU", file=sys.stderr)
        return 2
    began = time.perf_counter()
    sizes = [int(x) for x in args.group_sizes.split(",")]
    model = build_model(args.model)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, model.config.vocab_size, (args.prompt_tokens,),
                           generator=generator).tolist()
    budget = {G: kv_tokens_needed(G, args.max_new_tokens, args.prompt_tokens, 1, block_size=16)
              for G in sizes}
    pool = max(budget.values()) + 16  # one block more: vLLM's null block
    limits = RunSizes(kv_budget_tokens=pool, micro_group=max(sizes), max_micro_group=max(sizes),
                      max_prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens)
    from infsamp.config import SamplingConfig

    started = time.perf_counter()
    vllm = make_engine("vllm", model, SamplingConfig(vllm_sleep="discard"), limits)
    startup = time.perf_counter() - started
    rows = []
    for G in sizes:
        for engine in (SlotEngine(model), vllm):
            if time.perf_counter() - began > TIME_LIMIT_S:
                print(f"time limit: skipping G={G} {engine.name}", flush=True)
                continue
            rows.append(cell(model, engine, prompt, G, budget[G], args.max_new_tokens))
            print(json.dumps(rows[-1]), flush=True)
    step = grpo_step_with_sleep(model, vllm, prompt, min(32, max(sizes)), args.max_new_tokens)
    vllm.close()
    by = {(r["engine"], r["G"]): r for r in rows}
    ratios = {G: by[("vllm", G)]["tokens_per_second"] / by[("slots", G)]["tokens_per_second"]
              for G in sizes if ("vllm", G) in by and ("slots", G) in by}
    report = {"command": "python benchmarks/gpu_vllm.py " + " ".join(argv or sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
              "model": args.model,
              "vllm_startup_s": startup, "rows": rows, "vllm_over_slots_tokens_per_second": ratios,
              "grpo_step_with_sleep": step, "total_s": time.perf_counter() - began}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_vllm.json").write_text(json.dumps(report, indent=1))
    print("\n| engine | G | tokens/s | peak GPU memory (GiB) |\n|---|---:|---:|---:|")
    for r in rows:
        slots = r["engine"] == "slots"
        memory = r["torch_peak_allocated_gib"] if slots else r["device_in_use_gib"]
        print(f"| {r['engine']} | {r['G']} | {r['tokens_per_second']:.0f} | {memory:.2f} |")
    print(f"vLLM / slots tokens/s: {ratios} (target >= 5 at G=128); vLLM start-up {startup:.1f} s")
    print(f"GRPO step with sleep mode: {step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
