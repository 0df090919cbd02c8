"""Size a run or a sampler, once, from the memory planner: the loaded model's shape and memory.

`plan_run` reads what only torch knows (the model's shape and dtype, the device and its memory, the
runtime's resident memory outside the tensors, measured once here) and hands it to
`planner.sizes.plan_run_sizes`, the function `infsamp plan` calls too; its `RunSizes` is what the
engine, the sampler and the GRPO step use, and its line is what the run prints. The micro-batch
changes how gradients are summed (so the weights' last bits), so by default
(`training.micro_batch_memory: total`) the plan is made for the device's total memory, a constant of
the machine: the same command gives the same weights whatever else runs. `auto` plans for the memory
free at start (plus what the model holds) instead.

A run that cannot fit is refused in one line with the planner's advice, before the weights load
(`check_fits_before_loading`): the step's samples must fit in the machine's memory
(SAMPLE_HOST_BYTES each, before a token is decoded), and the plan for the model's shape read from
its config (a folder, the hub's cache, a converted GGUF file) must fit the device. A model whose
config cannot be read before loading is planned right after, by `plan_run`, which refuses a plan
that does not fit too.

A sampler outside a training run (`infsamp sample`, the TRL plug-in, the benchmarks' engines, a
`GroupSampler` given no sizes, per call) is sized by the same function (`sampler_run_sizes`): its
calls planned as a run's steps, for the memory free now.

Deliberately simple: planned once at start-up; the out-of-memory retries halve the sizes later
if the estimate was too optimistic (`RunSizes.halve`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from infsamp.config import Config
from infsamp.config_algorithm import SamplingConfig
from infsamp.models.device import base_model, is_4bit, memory_bytes, runtime_bytes
from infsamp.models.loading import config_before_loading
from infsamp.options import ConfigError
from infsamp.planner import shape_from_config
from infsamp.planner.estimate import DEVICES
from infsamp.planner.kv_budget import tokens_within_or_refuse
from infsamp.planner.sizes import (
    RunSizes,
    kv_block_size,
    plan_line,
    plan_run_sizes,
    pool_holding,
    prompts_per_rank,
    run_engine,
)

RUNTIME_ROUND_BYTES = 32 * 2**20
# a Sample before its first token: 321 bytes each (tracemalloc over make_samples of 10,000,
# 2026-12-02); its completion, text, rewards and log-probs come on top
SAMPLE_HOST_BYTES = 320


@dataclass
class PlannedRun:
    sizes: RunSizes
    note: str  # the start-up line: the plan's peak and verdict, and `sizes` as they are


def device_memory_bytes(device: torch.device, model: torch.nn.Module, basis: str = "total") -> int:
    """`total`: the device's memory; `auto`: what is free now plus what the model already holds."""
    free, total = memory_bytes(device)
    if basis == "total":
        return total
    return free + sum(p.numel() * p.element_size() for p in model.parameters())


def measured_runtime_bytes(device: torch.device, model: torch.nn.Module) -> int | None:
    """The runtime's resident memory outside the tensors (`models.device.runtime_bytes`), measured
    once before planning and rounded up to RUNTIME_ROUND_BYTES, so that a few pages more or less
    from run to run do not move the planned micro-batch (and so the weights' last bits)."""
    measured = runtime_bytes(device, model, DEVICES["cuda"].default_runtime_bytes)
    if measured is None:
        return None
    return -(-measured // RUNTIME_ROUND_BYTES) * RUNTIME_ROUND_BYTES


def plan_run(cfg: Config, model: torch.nn.Module, device: torch.device, num_ranks: int = 1,
             strategy: str = "single", budget_is_pool: bool = True,
             refuse: bool = True) -> PlannedRun:
    """Sizes for this process; with several ranks it samples about 1/num_ranks of the prompts and
    holds what `strategy` (ddp, fsdp) leaves on one device; a plan that does not fit is refused
    (`refuse`: a training run; a sampler used alone runs as planned). `budget_is_pool`: as
    `plan_run_sizes`."""
    plan, sizes = _plan(cfg, shape_from_config(base_model(model).config), device, model,
                        num_ranks, strategy, quantized=is_4bit(model),
                        dtype_bytes=next(model.parameters()).element_size(),
                        budget_is_pool=budget_is_pool)
    if refuse:
        _refuse_unless_fits(plan, sizes, device, "")
    return PlannedRun(sizes, plan_line(plan, sizes))


def sampler_run_sizes(sampling: SamplingConfig, model: torch.nn.Module, max_prompt_tokens: int,
                      num_prompts: int, optimizer: str = "sgd", call_budget_tokens: int = 0,
                      engine_apart: bool = False) -> RunSizes:
    """The sizes of a sampler outside a training run, through `plan_run`: `sampling`'s calls of up
    to `num_prompts` prompts of up to `max_prompt_tokens` tokens, for the memory free now (plus
    what the model holds) beside `optimizer`'s states (`sgd`: none; the TRL plug-in: TRL's
    AdamW). `call_budget_tokens`: an engine for calls of up to that KV budget each (the
    benchmarks), started with the pool that holds it (`planner.sizes.pool_holding`).
    `engine_apart`: for an engine started apart, whose pool caps each call's budget."""
    device = next(model.parameters()).device
    cfg = Config()
    cfg = replace(cfg, sampling=sampling,
                  data=replace(cfg.data, max_prompt_length=max_prompt_tokens),
                  training=replace(cfg.training, prompts_per_step=num_prompts, optimizer=optimizer,
                                   micro_batch_memory="auto"))
    if call_budget_tokens:
        kind = "cuda" if device.type == "cuda" else "cpu"
        block = kv_block_size(run_engine(cfg, kind, is_4bit(model)), kind)
        cfg = replace(cfg, sampling=replace(
            sampling, kv_budget=str(pool_holding(call_budget_tokens, block))))
    return plan_run(cfg, model, device, budget_is_pool=not engine_apart, refuse=False).sizes


def check_fits_before_loading(cfg: Config, device: torch.device, num_ranks: int = 1,
                              strategy: str = "single", longest_prompt: int = 0) -> None:
    """Refuse, before the weights load, a run that cannot fit (see the module docstring); with
    `longest_prompt` (tokens) also a KV budget that cannot hold it plus one token."""
    num_samples = cfg.sampling.num_generations * prompts_per_rank(cfg, num_ranks)
    host = memory_bytes(torch.device("cpu"))[1]
    if num_samples * SAMPLE_HOST_BYTES > host:
        raise ConfigError(f"sampling.num_generations {cfg.sampling.num_generations} x "
                          f"training.prompts_per_step {cfg.training.prompts_per_step}: the step's "
                          f"{num_samples:,} samples need {_gib(num_samples * SAMPLE_HOST_BYTES)} "
                          f"of memory before a token is decoded, more than this machine's "
                          f"{_gib(host)}: at most {host // SAMPLE_HOST_BYTES:,} samples per step")
    config = config_before_loading(cfg.model.name_or_path, cfg.model.trust_remote_code)
    if config is None:
        return  # its shape is known once it loaded: plan_run checks then
    plan, sizes = _plan(cfg, shape_from_config(config), device, torch.nn.Module(), num_ranks,
                        strategy, quantized=cfg.model.load_in_4bit, dtype_bytes=None)
    _refuse_unless_fits(plan, sizes, device, " (planned from its config, before the weights load)")
    if longest_prompt:
        kind = "cuda" if device.type == "cuda" else "cpu"
        block = kv_block_size(run_engine(cfg, kind, cfg.model.load_in_4bit), kind)
        tokens_within_or_refuse(sizes.kv_budget_tokens, longest_prompt,
                                cfg.sampling.max_new_tokens, block, cfg.sampling.kv_budget)


def _plan(cfg: Config, shape, device: torch.device, model: torch.nn.Module, num_ranks: int,
          strategy: str, quantized: bool, dtype_bytes: int | None, budget_is_pool: bool = True):
    kind = "cuda" if device.type == "cuda" else "cpu"
    return plan_run_sizes(
        cfg, shape, device_memory_bytes(device, model, cfg.training.micro_batch_memory),
        device=kind, quantized=quantized, num_ranks=num_ranks, strategy=strategy,
        dtype_bytes=dtype_bytes, runtime_bytes=measured_runtime_bytes(device, model),
        budget_is_pool=budget_is_pool)


# the planner's advice names `infsamp plan` flags; a refused `infsamp train` names its options
TRAIN_OPTIONS = {
    "--lora-rank": "--model.lora_rank", "--strategy fsdp": "--distributed.strategy fsdp",
    "--optimizer": "--training.optimizer",
    "--gradient-checkpointing": "--model.gradient_checkpointing true",
    "--beta": "--training.beta", "--precision": "--training.precision",
    "--load-in-4bit": "--model.load_in_4bit true", "--micro-group": "--sampling.micro_group",
    "--train-micro-batch-tokens": "--training.train_micro_batch_tokens",
}


def _refuse_unless_fits(plan, sizes: RunSizes, device: torch.device, when: str) -> None:
    if plan.fits:
        return
    line = plan_line(plan, sizes)
    for flag, option in TRAIN_OPTIONS.items():
        line = re.sub(rf"{re.escape(flag)}\b", option, line)
    what = "GPU" if device.type == "cuda" else "machine"
    raise ConfigError(f"the run does not fit this {what}'s {_gib(plan.inputs.gpu_memory_bytes)}"
                      f"{when}: {line}")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:,.2f} GiB"
