"""Size the run from the memory planner: the sampler's KV budget and the training micro-batch.

`sampling.kv_budget: auto` and `training.train_micro_batch_tokens: 0` are resolved here, once, from
`infsamp.planner.plan_memory` for the loaded model on the run's device. The micro-batch changes
how gradients are summed (so the weights' last bits), so by default
(`training.micro_batch_memory: total`) the plan is made for the device's total memory, a constant
of the machine: the same command gives the same weights whatever else runs. `auto` plans for the
memory free at start (plus what the model holds) instead. A plan that does not fit is reported
with the planner's advice and the run continues with the smallest sizes.

Deliberately simple: planned once at start-up; the out-of-memory retries shrink the sizes later if
the estimate was too optimistic.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from infsamp.config import Config
from infsamp.models.device import base_model
from infsamp.planner import plan_memory, shape_from_config
from infsamp.sampling.engines.base import resolve_engine_name


@dataclass
class RunSizes:
    kv_budget_tokens: int | None  # None: keep the configured budget
    train_micro_batch_tokens: int
    note: str


def device_memory_bytes(device: torch.device, model: torch.nn.Module, basis: str = "total") -> int:
    """`total`: the device's memory; `auto`: what is free now plus what the model already holds."""
    if basis == "total":
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[1]
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] + held
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") + held


def plan_run(cfg: Config, model: torch.nn.Module, device: torch.device,
             num_ranks: int = 1, strategy: str = "single") -> RunSizes:
    """Sizes for this process; with several ranks it samples about 1/num_ranks of the prompts and
    holds what `strategy` (ddp, fsdp) leaves on one device."""
    base = base_model(model)
    memory = device_memory_bytes(device, model, cfg.training.micro_batch_memory)
    plan = plan_memory(
        shape_from_config(base.config), gpu_memory_bytes=memory,
        group_size=cfg.sampling.num_generations * -(-cfg.training.prompts_per_step // num_ranks),
        max_prompt=cfg.data.max_prompt_length,
        max_completion=cfg.sampling.max_new_tokens, lora_rank=cfg.model.lora_rank,
        optimizer=cfg.training.optimizer, gradient_checkpointing=cfg.model.gradient_checkpointing,
        beta=cfg.training.beta,
        precision=cfg.training.precision,  # 'auto' resolved by the planner for `device`
        load_in_4bit=cfg.model.load_in_4bit, device="cuda" if device.type == "cuda" else "cpu",
        micro_group=cfg.sampling.micro_group,
        train_micro_batch_tokens=cfg.training.train_micro_batch_tokens,  # 0: the plan picks it
        engine=resolve_engine_name(cfg.sampling.engine, device, cfg.model.load_in_4bit),
        engine_sleep=cfg.sampling.vllm_sleep != "off" and device.type == "cuda",
        num_devices=num_ranks, strategy=strategy)
    kv = plan.kv_budget_tokens if cfg.sampling.kv_budget == "auto" and plan.micro_group > 0 else None
    tokens = cfg.training.train_micro_batch_tokens or max(plan.train_micro_batch_tokens,
                                                          cfg.data.max_prompt_length + cfg.sampling.max_new_tokens)
    note = f"memory plan: peak {plan.peak_bytes / 2**30:.2f} GiB, g={plan.micro_group}, " \
           f"train micro-batch {tokens} tokens"
    if not plan.fits:
        note += " (does not fit; advice: " + "; ".join(plan.advice) + ")"
    return RunSizes(kv, tokens, note)
