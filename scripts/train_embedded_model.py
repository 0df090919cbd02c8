"""Reproduce the embedded default model: a tiny Llama warmed up by SFT on the arithmetic task.

    .venv/bin/python scripts/train_embedded_model.py            # writes src/infsamp/models/embedded/

Supervised fine-tuning on worked solutions (loss on completion tokens only), deliberately stopped
early so that GRPO has room to improve it. Deterministic for a given seed on CPU.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch

from infsamp.models.tiny import build_model, build_tokenizer
from infsamp.tasks.arithmetic import generate_problems

OUT_DIR = Path(__file__).resolve().parents[1] / "src/infsamp/models/embedded"


def encode(tokenizer, problem: dict) -> tuple[list[int], int]:
    prompt = tokenizer(problem["prompt"]).input_ids
    completion = tokenizer(problem["solution"]).input_ids + [tokenizer.eos_token_id]
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
    from infsamp.rl.evaluation import evaluate_accuracy

    return evaluate_accuracy(model, tokenizer, problems, max_new_tokens=max_new_tokens)


def length_buckets(tokenizer, problems: list[dict], batch_size: int, rng: random.Random) -> list[list[dict]]:
    """Batches of similar length (little padding), in random order."""
    ordered = sorted(problems, key=lambda p: len(p["prompt"]) + len(p["solution"]))
    batches = [ordered[i: i + batch_size] for i in range(0, len(ordered) - batch_size + 1, batch_size)]
    rng.shuffle(batches)
    return batches


def lr_at(step: int, max_steps: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, max_steps - warmup)))


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=args.seed)
    model.config._attn_implementation = "eager"  # faster than sdpa for this tiny model on CPU
    problems = generate_problems(args.num_problems, seed=1234, split="sft")
    held_out = generate_problems(args.num_eval, seed=1234, split="test")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    start = time.time()
    batches: list[list[dict]] = []
    for step in range(args.steps):
        if not batches:
            batches = length_buckets(tokenizer, problems, args.batch_size, rng)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.schedule_steps or args.steps, args.lr)
        input_ids, attention, labels = make_batch(tokenizer, batches.pop())
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 25 == 0:
            print(f"step {step + 1} loss {loss.item():.4f} ({time.time() - start:.0f}s)", flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            model.eval()
            acc = greedy_accuracy(model, tokenizer, held_out)
            model.train()
            print(f"step {step + 1} loss {loss.item():.4f} held-out acc {acc:.3f} ({time.time() - start:.0f}s)",
                  flush=True)
            if args.save_every_eval:
                model.save_pretrained(args.out / f"step_{step + 1}")
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    print(f"saved to {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--schedule-steps", type=int, default=3000,
                        help="length of the cosine schedule (default: --steps); stop early at --steps")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
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
