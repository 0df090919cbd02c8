"""Parts 2 and 4 of the GPU suite: the planner against the device, and the precision modes.

Part 2: for each case (shape, full or LoRA rank 16) the planner (`plan_memory`, the profile's
precision mode, G = 32, for a `Profile.planner_gib` GPU) chooses g and the training micro-batch; one
whole GRPO step is then measured with exactly those sizes through infsamp's own pieces: the
mode's model and optimizer (`build_optimizer`; a warm-up step first creates its states and
compiles torchao's step), `GroupSampler` (continuous, g slots, the plan's KV budget, completions
forced to full length), `GRPOStep.optimize` on the G completions (random advantages). Measured:
`max_memory_allocated` of the generation phase and of the training phase (weights and optimizer
states included) against the plan's tensors (its peak minus the CUDA context, which
`max_memory_allocated` does not see); the goal is within 15%.

Part 4: `benchmarks/precision.py`'s follow ratio (the share of the fp32 update each mode applies;
bf16 = torchao stochastic rounding) on the embedded model, its fp32 reference and bf16 first,
then one GRPO step's time per mode on the `Profile.step_time_model` shape (a fixed random
rollout, after a warm-up step), then the other modes' follow ratios.

Deliberately simple: one prompt of random ids; the rollout's completions are random ids of the
sampled length (the step's memory and time do not depend on the ids).
"""

from __future__ import annotations

import time

from gpu_suite_common import (
    GIB,
    MIB,
    Part,
    Peak,
    free_device_memory,
    plan,
    random_model,
    random_prompt,
    sample_until,
    sampler_for,
    shape_of,
    slots_used,
    synchronize,
)


def random_rollout(vocab: int, num: int, prompt: int, completion: int, seed: int = 0):
    import torch

    from infsamp.algorithm.rollout import Rollout

    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, vocab, (num, prompt), generator=generator).tolist()
    completions = torch.randint(1, vocab, (num, completion), generator=generator).tolist()
    return Rollout(prompts, completions, torch.randn(num, generator=generator))


def constant_schedule(optimizer):
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


# ---------------------------------------------------------------- part 2


def plan_case(shape, profile, lora_rank: int):
    return plan(shape, profile.planner_group, gpu_memory_bytes=int(profile.planner_gib * GIB),
                max_prompt_tokens=profile.planner_prompt, max_new_tokens=profile.planner_completion,
                lora_rank=lora_rank, precision=profile.precision, device=profile.device)


def planned_tensors(parts: dict, device: str) -> int:
    """The plan's bytes that `max_memory_allocated` sees (no runtime: the CUDA context; no
    allocator slack)."""
    return parts["peak"] - parts["runtime"] - (parts["overhead"] if device == "cuda" else 0)


def whole_step(model, plan, profile, prompt: list[int], deadline: float) -> dict:
    """Warm-up step, then one measured GRPO step (sample G, train) at the plan's sizes."""
    from infsamp.algorithm.grpo_step import GRPOStep
    from infsamp.algorithm.optim import build_optimizer
    from infsamp.config_algorithm import TrainingConfig
    from infsamp.planner import PRECISIONS
    from infsamp.planner.kv_budget import auto_budget_tokens

    C, vocab = profile.planner_completion, model.config.vocab_size
    cfg = TrainingConfig(learning_rate=1e-6)
    optimizer = build_optimizer(model, cfg, PRECISIONS[profile.precision])
    scheduler = constant_schedule(optimizer)
    step = GRPOStep(model, cfg, pad_token_id=0, temperature=1.0, max_new_tokens=C,
                    micro_batch_tokens=plan.train_micro_batch_tokens)
    step.optimize(random_rollout(vocab, 1, 4, 4), optimizer, scheduler)  # states, compile
    peak = Peak(profile.device)
    budget = plan.inputs.kv_budget_tokens or auto_budget_tokens(
        plan.micro_group, C, plan.inputs.max_prompt_tokens, 1)
    sampler = sampler_for(model, "continuous", plan.micro_group, budget, C)
    stats, complete = sample_until(sampler, prompt, profile.planner_group, deadline)
    generation = peak.absolute().get("allocated", peak.above_start())
    peak.reset()
    rollout = random_rollout(vocab, profile.planner_group, len(prompt), C, seed=1)
    started = time.perf_counter()
    metrics = step.optimize(rollout, optimizer, scheduler)
    synchronize(profile.device)
    training = peak.absolute().get("allocated", peak.above_start())
    return {"sampling_complete": complete, "slots_used": slots_used(stats),
            "decode_steps": stats.decode_steps,
            "measured_generation_gib": generation / GIB, "measured_training_gib": training / GIB,
            "train_step_s": round(time.perf_counter() - started, 2),
            "oom_retries": metrics.get("train/oom_retries", 0)}


def planner_row(plan, measured: dict, device: str) -> dict:
    planned_gen = planned_tensors(plan.generation, device)
    planned_train = planned_tensors(plan.training, device)
    measured_peak = max(measured["measured_generation_gib"], measured["measured_training_gib"])
    planned_peak = max(planned_gen, planned_train) / GIB
    # the CPU's resident-set meter can see no growth at toy sizes: no error then
    error = 100 * (planned_peak - measured_peak) / measured_peak if measured_peak > 0 else None
    return {"g": plan.micro_group, "micro_batch_tokens": plan.train_micro_batch_tokens,
            "fits": plan.fits, "planned_generation_gib": planned_gen / GIB,
            "planned_training_gib": planned_train / GIB, **measured,
            "measured_peak_gib": measured_peak, "planned_peak_gib": planned_peak,
            "error_pct": None if error is None else round(error, 1),
            "within_15pct": None if error is None else abs(error) <= 15}


def part_planner(part: Part) -> None:
    profile = part.profile
    part.note("setting", {"G": profile.planner_group, "prompt": profile.planner_prompt,
                          "completion": profile.planner_completion,
                          "precision": profile.precision, "planner_gpu_gib": profile.planner_gib})

    def cell(preset: str, lora_rank: int):
        def run() -> dict:
            shape = shape_of(profile, preset)
            plan = plan_case(shape, profile, lora_rank)
            row = {"model": shape.name, "lora_rank": lora_rank}
            if not plan.micro_group or not plan.train_micro_batch_tokens:
                return {**row, "fits": False, "error": "the planner fits no g or micro-batch: "
                        + "; ".join(plan.advice)}
            model = random_model(shape, profile.device, profile.precision, lora_rank)
            prompt = random_prompt(shape.vocab_size, profile.planner_prompt)
            measured = whole_step(model, plan, profile, prompt, part.cell_deadline())
            del model
            free_device_memory()
            return {**row, **planner_row(plan, measured, profile.device)}
        return run

    part.run_cells([(f"{preset} {'LoRA' if lora else 'full'}", cell(preset, lora))
                    for preset, lora in profile.planner_cases])


# ---------------------------------------------------------------- part 4


def follow_rows(mode: str, result: dict, reference: dict) -> list[dict]:
    from precision import compare  # benchmarks/precision.py

    return [{"what": "follow ratio (embedded model)", "mode": mode, "steps": steps,
             **compare(result["deltas"][steps], reference["deltas"][steps]),
             "step_ms": result["step_ms"], "first_step_s": result["first_step_s"],
             "state_mib": result["state_bytes"] / MIB} for steps in sorted(result["deltas"])]


def step_time(profile, mode: str) -> dict:
    """ms per GRPO step of `mode` on the step-time shape (after a warm-up step)."""
    from infsamp.algorithm.grpo_step import GRPOStep
    from infsamp.planner import PRECISIONS

    from precision import CANDIDATES, config, make_optimizer  # benchmarks/precision.py

    shape = shape_of(profile, profile.step_time_model)
    base = CANDIDATES.get(mode, mode)
    model = random_model(shape, profile.device, base)
    cfg = config(mode, profile.device)
    optimizer = make_optimizer(model, cfg, PRECISIONS[base], mode)
    scheduler = constant_schedule(optimizer)
    num, prompt, completion = profile.step_time_rollout
    step = GRPOStep(model, cfg.training, pad_token_id=0, temperature=1.0,
                    max_new_tokens=completion,
                    micro_batch_tokens=num * (prompt + completion))
    rollout = random_rollout(shape.vocab_size, num, prompt, completion)
    started = time.perf_counter()
    step.optimize(rollout, optimizer, scheduler)
    synchronize(profile.device)
    first = time.perf_counter() - started
    peak = Peak(profile.device)
    started = time.perf_counter()
    for _ in range(profile.step_time_steps):
        step.optimize(rollout, optimizer, scheduler)
    synchronize(profile.device)
    per_step = (time.perf_counter() - started) / profile.step_time_steps
    return {"what": f"GRPO step ({shape.name}, {num} x {prompt}+{completion})", "mode": mode,
            "steps": profile.step_time_steps, "step_ms": 1000 * per_step,
            "first_step_s": round(first, 2), "peak_gib": peak.above_start() / GIB}


def part_precision(part: Part) -> None:
    from precision import train_updates  # benchmarks/precision.py

    profile = part.profile
    steps = list(profile.precision_steps)
    results: dict[str, dict] = {}

    def follow(mode: str):
        def run():
            results[mode] = train_updates(mode, steps, profile.device)
            if mode == "fp32":
                return {"what": "fp32 reference (embedded model)", "mode": mode,
                        "step_ms": results[mode]["step_ms"],
                        "first_step_s": results[mode]["first_step_s"]}
            for row in follow_rows(mode, results[mode], results["fp32"])[:-1]:
                part.add({"cell": f"follow {mode}", **row})
            return follow_rows(mode, results[mode], results["fp32"])[-1]
        return run

    def timed(mode: str):
        return lambda: step_time(profile, mode)

    others = [m for m in profile.precision_modes if m not in ("fp32", "bf16")]
    part.run_cells([("follow fp32", follow("fp32")), ("follow bf16", follow("bf16"))]
                   + [(f"step time {m}", timed(m)) for m in profile.step_time_modes]
                   + [(f"follow {m}", follow(m)) for m in others])
    bf16 = [r for r in part.rows if r.get("mode") == "bf16" and "follow_ratio" in r]
    if bf16:
        part.note("bf16 follow ratio by steps", {r["steps"]: round(r["follow_ratio"], 3)
                                                 for r in bf16})
