"""The run's sizes, decided once at start-up and only read afterwards (as nano-vllm's KV size).

    RunSizes   the KV budget in tokens, g (samples decoded at once), the most samples the engine
               runs at once, the training micro-batch in tokens, and the out-of-memory retries

`plan_run_sizes` is the one function that decides them, from the config, the model's shape and
the device's memory, for `infsamp train`, every sampler outside a run (`sampling/sizes.py`) and
`infsamp plan`; its sampling half (`sampling_sizes`) sizes the KV budget by the sampler's own
rule (`kv_budget.kv_tokens_needed`), so the g the start-up line prints is the g every sampler
call runs. Afterwards only the out-of-memory retry changes them (`halve`); the checkpoint stores
them (`state_dict`). See docs/planner.md ("The run's sizes, decided once").

Pure Python (no torch). Deliberately simple: sized for the longest prompt the run allows
(`data.max_prompt_length`), not for each step's prompts.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass, field
from typing import Any

from infsamp.choices import ENGINES, WIDE_POLICIES
from infsamp.config import Config
from infsamp.config_algorithm import VLLM_MAX_TEMPERATURE
from infsamp.errors import SamplingError
from infsamp.options import ConfigError, parse_size, size_is_bytes
from infsamp.planner.estimate import kv_bytes_per_token
from infsamp.planner.kv_budget import (
    auto_budget_tokens,
    kv_block_size,
    kv_tokens_needed,
    max_new_tokens_within,
    micro_group_within,
    paged_pool_blocks,
    spare_block_tokens,
    usable_kv_tokens,
)
from infsamp.planner.plan import MemoryPlan, plan_memory
from infsamp.planner.precisions import PRECISIONS, base_dtype, resolve_precision_name
from infsamp.planner.presets import ModelShape

OOM_PARTS = ("sampling", "training")  # what an out-of-memory retry halves: g, or the micro-batch
MIN_TRAIN_MICRO_BATCH_TOKENS = 64
ENGINE_CHOICES = ("auto", *ENGINES)


@dataclass
class RunSizes:
    """Every size the sampler, its engine and the GRPO step use (see the module docstring)."""

    kv_budget_tokens: int  # KV tokens the sampler may hold (vLLM: its pool, one block of it null)
    # g: samples decoded at once (a call's all under `full`); 0: what the budget holds
    micro_group: int
    max_micro_group: int  # the most samples the engine runs at once (vLLM's max_num_seqs); 0: any
    max_prompt_tokens: int  # the longest prompt served
    max_new_tokens: int
    train_micro_batch_tokens: int = 0  # padded tokens per training micro-batch (0: not training)
    oom_retries: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OOM_PARTS, 0))

    def halve(self, part: str) -> int:
        """The out-of-memory retry: halve g ('sampling') or the micro-batch ('training'), count
        it, and return the new size."""
        self.oom_retries[part] += 1
        if part == "sampling":
            self.micro_group = max(1, self.micro_group // 2)
            return self.micro_group
        self.train_micro_batch_tokens = max(MIN_TRAIN_MICRO_BATCH_TOKENS,
                                            self.train_micro_batch_tokens // 2)
        return self.train_micro_batch_tokens

    def sampling_policy(self, configured: str) -> str:
        """`full` runs every sample at once until an out-of-memory retry halved g below them:
        then `continuous` with that g."""
        halved = self.micro_group < self.max_micro_group
        return "continuous" if configured == "full" and halved else configured

    def describe(self) -> str:
        """The sizes as the start-up line prints them."""
        engine = f" (engine: up to {self.max_micro_group} at once)" \
            if self.max_micro_group != self.micro_group else ""
        return (f"g={self.micro_group}{engine}, KV budget {self.kv_budget_tokens} tokens, "
                f"train micro-batch {self.train_micro_batch_tokens} tokens")

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """What the run changed since its start: g (at most what the engine runs; 0: the one
        planned now), the micro-batch and the retry counts; the KV budget and the engine stay
        as started."""
        saved = state["micro_group"] or self.micro_group
        self.micro_group = min(saved, self.max_micro_group or saved)
        self.train_micro_batch_tokens = state["train_micro_batch_tokens"]
        self.oom_retries = {part: int(state["oom_retries"].get(part, 0)) for part in OOM_PARTS}


# ---------------------------------------------------------------- the rules


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_engine(name: str, device: str, quantized: bool = False,
                   temperature: float = 0.0) -> str:
    """`auto`: vLLM where it is installed and the model is on a CUDA GPU, else the slot engine;
    a 4-bit (bitsandbytes) base, or a temperature past vLLM's limit, always decodes on the slot
    engine (vLLM cannot serve them)."""
    if name not in ENGINE_CHOICES:
        raise ConfigError(f"sampling.engine: unknown engine {name!r}; choose one of "
                          f"{', '.join(ENGINE_CHOICES)}")
    if name == "auto":
        use_vllm = device == "cuda" and vllm_installed() and not quantized \
            and temperature <= VLLM_MAX_TEMPERATURE
        return "vllm" if use_vllm else "slots"
    return name


def run_engine(cfg: Config, device: str, quantized: bool = False) -> str:
    """The engine a run of `cfg` decodes with on `device` ('cuda' or 'cpu'; `quantized`: a 4-bit
    base): `sampling.engine` resolved with the run's sampling temperature. `plan_run_sizes` calls
    it, so `infsamp plan` and `infsamp train` size a config with the same engine."""
    return resolve_engine(cfg.sampling.engine, device, quantized, cfg.sampling.temperature)


def pool_holding(budget_tokens: int, block_size: int) -> int:
    """The KV budget to start an engine with whose pool holds `budget_tokens` for its samples:
    whole blocks, and the spare one."""
    return -(-budget_tokens // block_size) * block_size + spare_block_tokens(block_size)


def vllm_pool(sizes: RunSizes, block_size: int, kv_budget: str) -> tuple[int, int]:
    """(blocks, KV tokens its samples may hold) of vLLM's pool for the run's sizes: what the run's
    largest g needs at most, never over the budget (`kv_budget.paged_pool_blocks`), less its
    spare block; SamplingError when the budget (`sampling.kv_budget`) holds no full sequence."""
    budget, prompt, new = sizes.kv_budget_tokens, sizes.max_prompt_tokens, sizes.max_new_tokens
    if max_new_tokens_within(usable_kv_tokens(budget, block_size), prompt, new, block_size) < new:
        raise SamplingError(
            f"sampling.kv_budget={kv_budget!r} ({budget} tokens) is below one full sequence on "
            f"vLLM ({kv_tokens_needed(1, new, prompt, 1, block_size)} tokens in blocks of "
            f"{block_size}: prompt {prompt} + max_new_tokens {new}); raise sampling.kv_budget or "
            "lower sampling.max_new_tokens / data.max_prompt_length")
    blocks = paged_pool_blocks(budget, max(1, sizes.max_micro_group), new, prompt, block_size)
    return blocks, usable_kv_tokens(blocks * block_size, block_size)


def parse_kv_budget(text: str, bytes_per_token: int) -> int:
    """`sampling.kv_budget` in tokens: '8192' is tokens, '2GiB' bytes; 0 for 'auto'."""
    if text == "auto":
        return 0
    try:
        size = parse_size(text)
    except ValueError as err:
        raise ConfigError(f"sampling.kv_budget: {err}") from None
    tokens = size // bytes_per_token if size_is_bytes(text) else size
    if tokens < 1:
        raise ConfigError(f"sampling.kv_budget: {text!r} holds no KV token (one takes "
                          f"{bytes_per_token} bytes)")
    return tokens


def sampling_sizes(*, policy: str, micro_group: int, kv_budget_tokens: int,
                   num_generations: int, num_prompts: int, max_prompt_tokens: int,
                   max_new_tokens: int, block_size: int = 1, memory_micro_group: int = 0,
                   budget_is_pool: bool = True) -> RunSizes:
    """g, the KV budget and the engine's concurrency for calls of B prompts x G samples.

    `full`: g is all of a call's samples. A given budget: g is `micro_group` capped by what the
    budget holds for the longest prompt (0: all it holds). No budget (0, `auto`): g is
    `micro_group` (0: `memory_micro_group`, the planner's largest that fits) and the budget is
    what g needs (`auto_budget_tokens`). A wide policy (`probe`) may run every sample of a call
    at once inside that budget: the engine's concurrency is then the call's samples.
    `budget_is_pool`: the engine is started for this budget (a paged one keeps its spare block
    in it); False for a sampler given an engine started apart (its pool caps the budget per call).
    """
    num_samples = num_generations * num_prompts
    if policy == "full":
        g = num_samples
    elif not kv_budget_tokens:
        g = min(micro_group or memory_micro_group or num_samples, num_samples)
    else:
        usable = usable_kv_tokens(kv_budget_tokens, block_size) if budget_is_pool \
            else kv_budget_tokens
        holds = micro_group_within(usable, max_new_tokens, max_prompt_tokens, num_prompts,
                                   num_samples, block_size)
        g = min(micro_group or holds, max(holds, 1))
    budget = kv_budget_tokens or auto_budget_tokens(g, max_new_tokens, max_prompt_tokens,
                                                    num_prompts, block_size)
    most = num_samples if policy in WIDE_POLICIES else g or num_samples  # wide: up to all
    return RunSizes(kv_budget_tokens=budget, micro_group=g, max_micro_group=most,
                    max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens)


def training_sizes(train_micro_batch_tokens: int, max_new_tokens: int) -> RunSizes:
    """The sizes of a GRPO step used alone (no sampler planned beside it): its micro-batch, which
    an out-of-memory retry halves; no sampling part (0: none)."""
    return RunSizes(kv_budget_tokens=0, micro_group=0, max_micro_group=0, max_prompt_tokens=0,
                    max_new_tokens=max_new_tokens,
                    train_micro_batch_tokens=train_micro_batch_tokens)


def prompts_per_rank(cfg: Config, num_ranks: int) -> int:
    """B: the prompts one rank samples per step (the step's prompts split between the ranks)."""
    return -(-cfg.training.prompts_per_step // num_ranks)


def plan_run_sizes(cfg: Config, shape: ModelShape, memory_bytes: int, *, device: str,
                   quantized: bool = False, num_ranks: int = 1, strategy: str = "single",
                   dtype_bytes: int | None = None, runtime_bytes: int | None = None,
                   budget_is_pool: bool = True) -> tuple[MemoryPlan, RunSizes]:
    """The memory plan and the sizes of one rank of a run, on the engine `run_engine` picks
    (`quantized`: the base is 4-bit).

    The sizes come first (`sampling_sizes`; only `micro_group: 0` with `kv_budget: auto` asks
    the memory for g), then the plan prices exactly them: its g, the KV budget and policy (so
    its KV cache is what the engine allocates) and the micro-batch.
    `memory_bytes`: what the plan may use on one device; `dtype_bytes`: the loaded weights'
    element size (the KV cache's), else the planner's precision decides it; `runtime_bytes`:
    the runtime's resident memory outside the tensors as the caller measured it (None: the
    device's default); `budget_is_pool`: the engine is started for these sizes (False: a sampler
    given an engine started apart, whose spare block is not taken off the budget).
    """
    engine = run_engine(cfg, device, quantized)
    sampling, data, training, model = cfg.sampling, cfg.data, cfg.training, cfg.model
    num_prompts = prompts_per_rank(cfg, num_ranks)
    settings = dict(
        gpu_memory_bytes=memory_bytes, num_generations=sampling.num_generations,
        num_prompts=num_prompts, max_prompt_tokens=data.max_prompt_length,
        max_new_tokens=sampling.max_new_tokens, lora_rank=model.lora_rank,
        optimizer=training.optimizer, gradient_checkpointing=model.gradient_checkpointing,
        beta=training.beta, precision=training.precision, load_in_4bit=model.load_in_4bit,
        device=device, engine=engine,
        train_micro_batch_tokens=training.train_micro_batch_tokens,  # 0: the plan picks it
        engine_sleep=sampling.vllm_sleep != "off" and device == "cuda",
        num_devices=num_ranks, strategy=strategy, runtime_bytes=runtime_bytes,
        policy=sampling.policy, probe_tokens=sampling.probe_tokens,
        share_prompt=training.share_prompt)
    precision = resolve_precision_name(training.precision, device)
    per_token = kv_bytes_per_token(shape, dtype_bytes or base_dtype(
        PRECISIONS[precision], model.lora_rank > 0))
    budget = parse_kv_budget(sampling.kv_budget, per_token)
    memory_g = 0
    if not (budget or sampling.micro_group or sampling.policy == "full"):
        memory_g = plan_memory(shape, **settings).micro_group or 1
    sizes = sampling_sizes(
        policy=sampling.policy, micro_group=sampling.micro_group, kv_budget_tokens=budget,
        num_generations=sampling.num_generations, num_prompts=num_prompts,
        max_prompt_tokens=data.max_prompt_length, max_new_tokens=sampling.max_new_tokens,
        block_size=kv_block_size(engine, device), memory_micro_group=memory_g,
        budget_is_pool=budget_is_pool)
    plan = plan_memory(shape, micro_group=sizes.micro_group,
                       kv_budget_tokens=sizes.kv_budget_tokens, **settings)
    sizes.train_micro_batch_tokens = (training.train_micro_batch_tokens
                                      or max(plan.train_micro_batch_tokens, plan.inputs.seq_len))
    return plan, sizes


def plan_line(plan: MemoryPlan, sizes: RunSizes) -> str:
    """The start-up line: the plan's peak (and the runtime's part of it, measured or assumed) and
    verdict, and the sizes the run uses, as they are."""
    how = "assumed" if plan.inputs.runtime_bytes is None else "measured"
    runtime = plan.training["runtime"]
    line = (f"memory plan: peak {plan.peak_bytes / 2**30:.2f} GiB (runtime {runtime / 2**30:.2f} "
            f"GiB {how} + tensors {(plan.peak_bytes - runtime) / 2**30:.2f} GiB), "
            f"{sizes.describe()}")
    if not plan.fits:
        line += " (does not fit; advice: " + "; ".join(plan.advice) + ")"
    return line
