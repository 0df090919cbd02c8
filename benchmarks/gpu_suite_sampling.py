"""Parts 1 and 5 of the GPU suite: the paper's memory table, and the slot engine's speed.

Part 1, the paper's table (Infinite Sampling reports 21.55 GB -> 10.64 GB on Qwen3-1.7B, one
prompt, 1024-token completions): for each G, the generation peak (`max_memory_allocated`: weights,
KV and every temporary) of `full` (all G at once, the paper's full-group decoding), and of `rounds`
and `continuous` at the planner's g for a `Profile.plan_gib` GPU (`plan_memory`, bf16, full
fine-tuning); decode steps against the schedule's lower bound and tokens/s. Where the planner's g
is G, `rounds` and `continuous` run the very schedule of `full`: those rows say so instead of
running it again. Cells run in order of value (the largest G first, continuous then full, then
full at the other G, then rounds); a call that reaches the cell cap stops with its statistics so
far (`complete: false`; every round decodes the same lengths, so after the first round its peak is
the call's).

Part 5: tokens/s of the slot engine (infsamp's sampler, `full` at g = G) against transformers'
`generate` at the same batch (the same prompt repeated, sampling at temperature 1, top-k off,
`DynamicCache`), both after a warm-up; then the peak of one training micro-batch (infsamp's GRPO
step with SGD, so no optimizer state adds to it) with and without the chunked LM head, where a
config switch for it exists (`chunked_head_switch`: feature detection; "not landed" otherwise).

Deliberately simple: one prompt of random ids; one run per cell; `generate` without a static cache
or torch.compile (their compile time is larger than the cell).
"""

from __future__ import annotations

import dataclasses
import time

from gpu_suite_common import (
    GIB,
    Part,
    Peak,
    free_device_memory,
    kv_tokens,
    plan,
    random_model,
    random_prompt,
    sample_until,
    sampler_for,
    shape_of,
    slots_used,
    synchronize,
)

POLICIES_AT_G = ("continuous", "rounds")


# ---------------------------------------------------------------- part 1


def planned_generation(shape, profile, group_size: int, micro_group: int = 0):
    """The planner's g (0: its choice) and generation tensor bytes at that g (no optimizer:
    this part samples only)."""
    result = plan(shape, group_size, gpu_memory_bytes=int(profile.plan_gib * GIB),
                  max_prompt_tokens=profile.memory_prompt, max_new_tokens=profile.memory_completion,
                  precision=profile.precision, device=profile.device, micro_group=micro_group)
    parts = result.generation
    slack = parts["overhead"] if profile.device == "cuda" else 0  # not in max_memory_allocated
    return result.micro_group, parts["peak"] - parts["optimizer"] - parts["runtime"] - slack


def memory_cells(groups: list[int]) -> list[tuple[int, str]]:
    """(G, policy) in order of value: the largest G continuous and full, full at the other G
    (smallest first), then the remaining continuous and rounds cells."""
    largest = max(groups)
    order = [(largest, "continuous"), (largest, "full")]
    order += [(G, "full") for G in sorted(groups) if G != largest]
    order += [(G, p) for p in POLICIES_AT_G for G in sorted(groups, reverse=True)
              if (G, p) not in order]
    return order


def memory_row(stats, complete: bool, group_size: int, policy: str, peak: Peak, planned: int,
               completion: int) -> dict:
    from infsamp.sampling.grouping import lower_bound

    absolute = peak.absolute()
    g = slots_used(stats)
    return {"G": group_size, "policy": policy, "g": g, "complete": complete,
            "decode_steps": stats.decode_steps,
            "expected_steps": lower_bound([completion] * group_size, g),
            "generated_tokens": stats.generated_tokens, "wall_s": round(stats.wall_time_s, 2),
            "tokens_per_s": stats.generated_tokens / max(stats.wall_time_s, 1e-9),
            "peak_allocated_gib": absolute.get("allocated", peak.above_start()) / GIB,
            "peak_reserved_gib": absolute.get("reserved", 0) / GIB,
            "kv_gib": stats.peak_kv_bytes / GIB, "planned_gib": planned / GIB}


def part_memory_table(part: Part) -> None:
    profile = part.profile
    shape = shape_of(profile, profile.memory_model)
    model = random_model(shape, profile.device, profile.precision)
    prompt = random_prompt(shape.vocab_size, profile.memory_prompt)
    P, C = profile.memory_prompt, profile.memory_completion
    sampler_for(model, "continuous", 2, kv_tokens(2, 8, P), 8).sample([prompt], 2)  # warm-up
    plans = {G: planned_generation(shape, profile, G) for G in profile.memory_groups}
    part.note("setting", {"model": shape.name, "prompt": P, "completion": C,
                          "planner_gpu_gib": profile.plan_gib, "planner_g": {
                              G: g for G, (g, _) in plans.items()}})
    peak = Peak(profile.device)

    def cell(G: int, policy: str):
        def run() -> dict:
            g = G if policy == "full" else min(plans[G][0], G)
            if policy != "full" and g >= G:
                return {"G": G, "policy": policy, "g": G, "same_as": "full (planner's g >= G)"}
            if g < 1:
                return {"G": G, "policy": policy, "error": "the planner fits no sample"}
            planned = planned_generation(shape, profile, G, g)[1]
            sampler = sampler_for(model, policy, g, kv_tokens(g, C, P), C)
            peak.reset()
            stats, complete = sample_until(sampler, prompt, G, part.cell_deadline())
            return memory_row(stats, complete, G, policy, peak, planned, C)
        return run

    part.run_cells([(f"G={G} {policy}", cell(G, policy))
                    for G, policy in memory_cells(list(profile.memory_groups))])
    full = {r["G"]: r for r in part.rows if r.get("policy") == "full" and "error" not in r}
    micro = [r for r in part.rows if r.get("policy") == "continuous" and "peak_allocated_gib" in r]
    for row in micro:
        if row["G"] in full:
            part.note(f"G={row['G']}: continuous / full peak",
                      round(row["peak_allocated_gib"] / full[row["G"]]["peak_allocated_gib"], 3))


# ---------------------------------------------------------------- part 5


class Deadline:
    """A transformers StoppingCriteria that ends `generate` at a time.monotonic deadline."""

    def __init__(self, deadline: float):
        self.deadline, self.reached = deadline, False

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        self.reached = self.reached or time.monotonic() > self.deadline
        return torch.full((input_ids.shape[0],), self.reached, dtype=torch.bool,
                          device=input_ids.device)


def generate_row(model, prompt: list[int], batch: int, new_tokens: int, deadline: float) -> dict:
    """transformers' generate on `batch` copies of the prompt, sampled, every row to new_tokens."""
    import torch
    from transformers import StoppingCriteriaList

    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt] * batch, device=device)  # [g, P]
    stop = Deadline(deadline)
    synchronize(device.type)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=new_tokens, pad_token_id=0,
                             stopping_criteria=StoppingCriteriaList([stop]))
    synchronize(device.type)
    wall = time.perf_counter() - started
    tokens = batch * (out.shape[1] - len(prompt))
    return {"engine": "generate", "g": batch, "complete": not stop.reached, "tokens": tokens,
            "wall_s": round(wall, 2), "tokens_per_s": tokens / max(wall, 1e-9)}


def slots_row(model, prompt: list[int], batch: int, new_tokens: int, deadline: float) -> dict:
    sampler = sampler_for(model, "full", batch, kv_tokens(batch, new_tokens, len(prompt)),
                          new_tokens)
    stats, complete = sample_until(sampler, prompt, batch, deadline)
    return {"engine": "slots", "g": slots_used(stats), "complete": complete,
            "tokens": stats.generated_tokens, "wall_s": round(stats.wall_time_s, 2),
            "tokens_per_s": stats.tokens_per_second, "decode_steps": stats.decode_steps}


def chunked_head_switch():
    """(field name, on, off) of a TrainingConfig switch for the chunked LM head, by feature
    detection; None when no such field exists (issue 20 not landed)."""
    from infsamp.config_algorithm import TrainingConfig

    for spec in dataclasses.fields(TrainingConfig):
        if "chunk" in spec.name or "lm_head" in spec.name:
            if isinstance(spec.default, bool):
                return spec.name, True, False
            if isinstance(spec.default, int) and spec.default > 0:
                return spec.name, spec.default, 0
            return spec.name, None, None
    return None


def micro_batch_peak(model, profile, cfg, tokens: int) -> dict:
    """Peak above weights and optimizer states of one GRPO step on a single micro-batch."""
    import torch

    from infsamp.algorithm.grpo_step import GRPOStep
    from infsamp.algorithm.optim import build_optimizer
    from infsamp.algorithm.rollout import Rollout
    from infsamp.planner import PRECISIONS

    P, C = profile.speed_prompt, profile.speed_completion
    rows = max(1, tokens // (P + C))
    vocab = model.config.vocab_size
    rollout = Rollout(torch.randint(1, vocab, (rows, P)).tolist(),
                      torch.randint(1, vocab, (rows, C)).tolist(), torch.randn(rows))
    optimizer = build_optimizer(model, cfg, PRECISIONS[profile.precision])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    step = GRPOStep(model, cfg, pad_token_id=0, temperature=1.0, max_new_tokens=C,
                    micro_batch_tokens=rows * (P + C))
    step.optimize(Rollout(rollout.prompt_ids[:1], rollout.completion_ids[:1], torch.ones(1)),
                  optimizer, scheduler)  # warm-up: optimizer states, compiled steps
    peak = Peak(profile.device)
    started = time.perf_counter()
    step.optimize(rollout, optimizer, scheduler)
    synchronize(profile.device)
    return {"micro_batch_tokens": rows * (P + C), "peak_gib": peak.above_start() / GIB,
            "wall_s": round(time.perf_counter() - started, 2)}


def lm_head_cells(part: Part, shape) -> list:
    from infsamp.config_algorithm import TrainingConfig

    profile = part.profile
    switch = chunked_head_switch()
    part.note("chunked_lm_head", "not landed (no TrainingConfig switch found)" if switch is None
              else f"switch training.{switch[0]}")

    def cell(setting):
        def run() -> dict:
            overrides = {} if setting is None else {switch[0]: setting}
            model = random_model(shape, profile.device, profile.precision)
            model.train()
            # SGD: no optimizer state to compile or hold; the peak is the micro-batch's own
            cfg = TrainingConfig(learning_rate=1e-6, optimizer="sgd", **overrides)
            row = micro_batch_peak(model, profile, cfg, profile.lm_head_tokens)
            label = "as configured" if setting is None else f"{switch[0]}={setting}"
            return {"what": "training micro-batch", "chunked_lm_head": label, **row}
        return run

    if switch is None:
        return [("micro-batch, today's LM head", cell(None))]
    if switch[1] is None:
        part.note("chunked_lm_head_switch", f"training.{switch[0]}: values not understood")
        return [("micro-batch, default", cell(None))]
    return [(f"micro-batch, {switch[0]}={value}", cell(value)) for value in switch[1:]]


def speed_cells(part: Part, shape) -> None:
    """Slot engine and generate at each g, on one model (freed when this returns)."""
    profile = part.profile
    model = random_model(shape, profile.device, profile.precision)
    prompt = random_prompt(shape.vocab_size, profile.speed_prompt)
    C = profile.speed_completion
    far = time.monotonic() + 600
    slots_row(model, prompt, 2, 4, far), generate_row(model, prompt, 2, 4, far)  # warm-up

    def cell(engine, g: int):
        def run() -> dict:
            peak = Peak(profile.device)
            row = (slots_row if engine == "slots" else generate_row)(
                model, prompt, g, C, part.cell_deadline())
            return {"what": "decode speed", **row, "peak_gib": peak.above_start() / GIB}
        return run

    part.run_cells([(f"{engine} g={g}", cell(engine, g)) for g in profile.speed_slots
                    for engine in ("slots", "generate")])


def part_engine_speed(part: Part) -> None:
    profile = part.profile
    shape = shape_of(profile, profile.speed_model)
    part.note("setting", {"model": shape.name, "prompt": profile.speed_prompt,
                          "completion": profile.speed_completion})
    speed_cells(part, shape)
    free_device_memory()
    by = {(r.get("engine"), r.get("g")): r for r in part.rows if "tokens_per_s" in r}
    for g in profile.speed_slots:
        if ("slots", g) in by and ("generate", g) in by:
            part.note(f"g={g}: slots / generate tokens/s", round(
                by[("slots", g)]["tokens_per_s"] / by[("generate", g)]["tokens_per_s"], 3))
    part.run_cells(lm_head_cells(part, shape))
