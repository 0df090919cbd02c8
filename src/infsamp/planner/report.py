"""Human-readable text of a MemoryPlan: settings, the two-phase breakdown, g, micro-batch, verdict,
advice.

Deliberately plain: fixed-width columns in GiB (2**30 bytes), no colours, so it can be pasted into
docs.
"""

from __future__ import annotations

import math

from infsamp.planner.activations import (
    LOGITS_CHUNK_BUFFERS,
    activation_bytes_per_token,
    completion_rows,
    train_logits_bytes_per_row,
    train_logits_chunk_bytes,
)
from infsamp.planner.estimate import (
    GIB,
    PARTS,
    bytes_per_parameter,
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_cache_tokens,
)
from infsamp.planner.inputs import PlanInputs
from infsamp.planner.plan import MemoryPlan
from infsamp.planner.sizes import RunSizes

TIGHT_FRACTION = 0.95  # a plan above this share of the memory is flagged as tight


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:9.2f} GiB"


def _kib(num_bytes: float) -> str:
    return f"{num_bytes / 1024:,.1f} KiB"


def format_count(count: int) -> str:
    """A parameter count in the unit that fits: 1.236B, 187.0M, 12.5K, 950."""
    for unit, scale, digits in (("B", 1e9, 3), ("M", 1e6, 1), ("K", 1e3, 1)):
        if count >= scale:
            return f"{count / scale:,.{digits}f}{unit}"
    return str(count)


def precision_line(plan: MemoryPlan) -> str:
    p = plan.inputs
    per = bytes_per_parameter(p)
    terms = " + ".join(f"{name.replace('_', ' ')} {per[name]:g}" for name in
                       ("weights", "gradients", "optimizer", "compute_copies") if per[name])
    base = "; base in 4-bit NF4" if p.load_in_4bit else ""
    return (f"precision {p.precision}: {p.mode.summary}{base}; bytes per parameter: "
            f"{terms} = {per['total']:g}")


def header_lines(plan: MemoryPlan) -> list[str]:
    p = plan.inputs
    reference = "reference = base with adapters off" if p.lora_rank else (
        f"beta {p.beta:g}: reference model" if p.beta > 0 else "beta 0: no reference model")
    training = f"LoRA rank {p.lora_rank}" if p.lora_rank else "full fine-tuning"
    return [
        f"model {p.shape.name}: {format_count(plan.num_parameters)} parameters, "
        f"{format_count(plan.num_trainable_parameters)} trainable ({training})",
        precision_line(plan),
        f"{p.dtype} weights on {p.device} with {p.gpu_memory_bytes / GIB:.2f} GiB; "
        f"G = {p.num_generations} x B = {p.num_prompts} prompt(s) per step, prompt <= "
        f"{p.max_prompt_tokens}, completion <= {p.max_new_tokens} tokens, engine {p.engine}",
        f"optimizer {p.optimizer}, {reference}, gradient checkpointing "
        f"{'on' if p.gradient_checkpointing else 'off'}",
    ] + ([f"per device: {p.num_devices} GPU(s), {p.strategy} (every figure below is one GPU's)"]
         if p.strategy != "single" else [])


def breakdown_lines(plan: MemoryPlan) -> list[str]:
    lines = [f"{'':16}{'generation':>13}{'training':>14}"]
    for part in (*PARTS, "peak"):
        lines.append(f"  {part:<14}{_gib(plan.generation[part])} {_gib(plan.training[part])}")
    return lines


def kv_allocation(p: PlanInputs, g: int) -> str:
    """What the engine allocates for the run's KV budget (`estimate.kv_cache_tokens`)."""
    pool, prompts = kv_cache_tokens(p, g)
    budget = f"KV budget {p.kv_budget_tokens:,} tokens" if p.kv_budget_tokens else "KV budget auto"
    if p.engine == "vllm":
        block = p.kv_block_size
        return (f"vLLM's pool {pool // block:,} blocks x {block} = {pool:,} tokens (one spare "
                f"block), {_gib(pool * kv_bytes_per_token(p.shape, p.dtype)).strip()}; {budget}")
    rows = prompts // max(p.max_prompt_tokens - 1, 1)
    return (f"pool {pool:,} tokens for the running samples + {rows} prompt row(s) x "
            f"{p.max_prompt_tokens - 1} = {pool + prompts:,} tokens, "
            f"{_gib(kv_cache_bytes(p, g)).strip()}; {budget}, policy {p.policy}")


def sizes_lines(plan: MemoryPlan) -> list[str]:
    p = plan.inputs
    kv_token = kv_bytes_per_token(p.shape, p.dtype)
    g_text = (f"micro-group g = {plan.micro_group} of the step's {p.num_samples} samples decoded "
              "at once" if plan.micro_group else
              "micro-group: not even g = 1 fits (breakdown shows g = 1)")
    kv = f"KV cache {_kib(kv_token)}/token: {kv_allocation(p, plan.micro_group or 1)}"
    per_token = _kib(activation_bytes_per_token(p))
    logits_row = _kib(train_logits_bytes_per_row(p))
    chunks = LOGITS_CHUNK_BUFFERS * train_logits_chunk_bytes(
        p, completion_rows(p, plan.train_micro_batch_tokens or p.seq_len))
    if plan.train_micro_batch_tokens:
        sequences = plan.train_micro_batch_sequences
        batch = (f"training micro-batch = {plan.train_micro_batch_tokens:,} tokens ({sequences} x "
                 f"{p.seq_len}); the step's {p.num_samples} take "
                 f"{math.ceil(p.num_samples / sequences)} micro-batches")
    else:
        batch = (f"training micro-batch: not even one sequence of {p.seq_len} tokens fits "
                 f"(breakdown shows one)")
    checkpointing = "with" if p.gradient_checkpointing else "without"
    return [g_text, f"  {kv}", batch,
            f"  per token: activations {per_token} ({checkpointing} checkpointing), LM head "
            f"{chunks / 2**20:,.1f} MiB of logits chunks + {logits_row} per completion token; "
            f"peak at: {plan.training_peak_moment}"]


def verdict_lines(plan: MemoryPlan) -> list[str]:
    share = plan.peak_bytes / plan.inputs.gpu_memory_bytes
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    tight = (" (tight: allocator behaviour may push it over)"
             if plan.fits and share > TIGHT_FRACTION else "")
    return [f"{verdict}: peak {plan.peak_bytes / GIB:.2f} GiB = {100 * share:.0f}% of the "
            f"memory{tight}"] + [f"  advice: {line}" for line in plan.advice]


def format_plan(plan: MemoryPlan, sizes: RunSizes | None = None) -> str:
    """The plan as text; with `sizes` (`plan_run_sizes`) also the line of sizes a run prints."""
    sections = [header_lines(plan), breakdown_lines(plan), sizes_lines(plan), verdict_lines(plan)]
    if sizes is not None:
        sections.append([f"run sizes (as infsamp train prints them): {sizes.describe()}"])
    return "\n\n".join("\n".join(section) for section in sections)
