"""Reproduce the embedded default model: a tiny Llama warmed up by SFT on the arithmetic task.

    .venv/bin/python scripts/train_embedded_model.py            # writes src/infsamp/models/embedded/

Supervised fine-tuning, loss on completion tokens only, in two phases:
1. worked solutions only (`--steps`, stopped early in a longer cosine schedule), which teaches the
   column method (held-out greedy accuracy about 0.39);
2. a short phase on a mix of direct answers and worked solutions
   (`infsamp.tasks.arithmetic.sft_completions`, `DIRECT_SHARE` direct), after which the model answers
   directly more often than it works the sum out.
GRPO then has something to discover from the reward alone: working it out pays. Deterministic for a
given seed on CPU; `--init CKPT` starts phase 2 from a saved phase-1 model.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch

from transformers import LlamaForCausalLM

from infsamp.models.tiny import build_model, build_tokenizer
from infsamp.tasks.arithmetic import DIRECT_SHARE, generate_problems, sft_completions

OUT_DIR = Path(__file__).resolve().parents[1] / "src/infsamp/models/embedded"


def encode(tokenizer, problem: dict) -> tuple[list[int], int]:
    prompt = tokenizer(problem["prompt"]).input_ids
    completion = tokenizer(problem["target"]).input_ids + [tokenizer.eos_token_id]
    return prompt + completion, len(prompt)


def make_batch(tokenizer, problems: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    encoded = [encode(tokenizer, p) for p in problems]
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), width), tokenizer.pad_token_id)  # [B, T]
    labels = torch.full((len(encoded), width), -100)  # [B, T]
    attention = torch.zeros((len(encoded), width), dtype=torch.long)  # [B, T]
    for row, (ids, num_prompt) in enumerate(encoded):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, num_prompt: len(ids)] = torch.tensor(ids[num_prompt:])
        attention[row, : len(ids)] = 1
    return input_ids, attention, labels


@torch.no_grad()
def greedy_accuracy(model, tokenizer, problems: list[dict], max_new_tokens: int = 256) -> float:
    from infsamp.config import DataConfig
    from infsamp.models.loading import stop_token_ids
    from infsamp.run.evaluation import evaluate_accuracy
    from infsamp.tasks.prompts import encode_prompt

    prompt_ids = [encode_prompt(p, tokenizer, DataConfig())[1] for p in problems]
    return evaluate_accuracy(model, tokenizer, prompt_ids, [p["answer"] for p in problems],
                             stop_token_ids=stop_token_ids(model, tokenizer),
                             max_new_tokens=max_new_tokens)


def length_buckets(tokenizer, problems: list[dict], batch_size: int, rng: random.Random) -> list[list[dict]]:
    """Batches of similar length (little padding), in random order."""
    ordered = sorted(problems, key=lambda p: len(p["prompt"]) + len(p["target"]))
    batches = [ordered[i: i + batch_size] for i in range(0, len(ordered) - batch_size + 1, batch_size)]
    rng.shuffle(batches)
    return batches


def lr_at(step: int, max_steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, max_steps - warmup)))


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = build_tokenizer()
    problems = generate_problems(args.num_problems, seed=1234, split="sft")
    held_out = generate_problems(args.num_eval, seed=1234, split="test")
    # with --init, phase 1 is already done (its default run is bit-for-bit the same every time)
    model = LlamaForCausalLM.from_pretrained(args.init) if args.init else build_model(tokenizer, seed=args.seed)
    model.config._attn_implementation = "eager"  # faster than sdpa for this tiny model on CPU
    if not args.init:
        worked = [{**p, "target": p["solution"]} for p in problems]
        run_phase(model, tokenizer, worked, held_out, rng, args, "worked", args.steps, args.schedule_steps, args.lr)
    mixed = [{**p, "target": t} for p, t in zip(problems, sft_completions(problems, args.seed, args.direct_share))]
    mix_rng = random.Random(args.seed + 1)  # own stream, so that --init gives the same result
    run_phase(model, tokenizer, mixed, held_out, mix_rng, args, "mixed", args.mix_steps, args.mix_steps, args.mix_lr)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    print(f"saved to {args.out}")


def run_phase(model, tokenizer, problems, held_out, rng, args, name: str, steps: int, schedule_steps: int,
              lr: float) -> None:
    """`steps` optimizer steps on `problems` (their `target` completions), cosine schedule over
    `schedule_steps` (stopping early when it is longer), greedy held-out accuracy every eval_every."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    start = time.time()
    batches: list[list[dict]] = []
    warmup = min(100, max(1, steps // 10))
    for step in range(steps):
        if not batches:
            batches = length_buckets(tokenizer, problems, args.batch_size, rng)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, schedule_steps or steps, lr, warmup)
        input_ids, attention, labels = make_batch(tokenizer, batches.pop())
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == steps:
            model.eval()
            acc = greedy_accuracy(model, tokenizer, held_out)
            model.train()
            print(f"{name} step {step + 1} loss {loss.item():.4f} held-out acc {acc:.3f} ({time.time() - start:.0f}s)",
                  flush=True)
            if args.save_every_eval:
                model.save_pretrained(args.out / f"{name}_step_{step + 1}")
        elif (step + 1) % 25 == 0:
            print(f"{name} step {step + 1} loss {loss.item():.4f} ({time.time() - start:.0f}s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="phase 1 (worked solutions only) steps")
    parser.add_argument("--schedule-steps", type=int, default=3000,
                        help="length of phase 1's cosine schedule (default: --steps); stop early at --steps")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3, help="phase 1 peak learning rate")
    parser.add_argument("--mix-steps", type=int, default=200, help="phase 2 (direct + worked mix) steps")
    parser.add_argument("--mix-lr", type=float, default=2e-4, help="phase 2 peak learning rate")
    parser.add_argument("--direct-share", type=float, default=DIRECT_SHARE, help="phase 2 share of direct answers")
    parser.add_argument("--init", type=Path, help="skip phase 1 and start phase 2 from this checkpoint")
    parser.add_argument("--num-problems", type=int, default=20000)
    parser.add_argument("--num-eval", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--save-every-eval", action="store_true", help="also keep a checkpoint per evaluation")
    train(parser.parse_args())


if __name__ == "__main__":
    torch.set_num_threads(1)  # tiny model: one thread beats two (less sync, no oversubscription)
    main()
