"""`plan_memory`: pick g and the training micro-batch, say whether the run fits, and which switch
fixes it.

The run's sizes (`planner/sizes.py`) are read from this plan, once, for `infsamp train` and
`infsamp plan` alike.

Advice is not a lookup table: each switch (LoRA, 8-bit AdamW, gradient checkpointing, no reference
model, bf16 precision, a 4-bit base) is applied to the inputs and the estimate is re-run; the
smallest sets of switches that fit are named.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from infsamp.choices import POLICIES, PRECISION_CHOICES, PROBE_TOKENS, STRATEGIES
from infsamp.options import require
from infsamp.planner.estimate import (
    DEVICES,
    GIB,
    OPTIMIZERS,
    bytes_per_parameter,
    generation_breakdown,
    kv_cache_tokens,
    largest_micro_batch_sequences,
    largest_micro_group,
    peak_training_moment,
    training_breakdown,
)
from infsamp.planner.inputs import PlanInputs
from infsamp.planner.precisions import PRECISIONS, resolve_precision_name
from infsamp.planner.presets import LORA_TARGETS_ALL_LINEAR, ModelShape

DEFAULT_LORA_RANK = 16


@dataclass
class MemoryPlan:
    """The answer of `plan_memory`; byte maps have the keys of estimate.PARTS plus 'peak'."""

    fits: bool
    micro_group: int  # g: samples decoded at once (0: not even one fits)
    # padded tokens per training micro-batch (0: not even one sequence fits)
    train_micro_batch_tokens: int
    kv_cache_tokens: int  # KV tokens the engine allocates at g (estimate.kv_cache_tokens)
    generation: dict[str, int]
    training: dict[str, int]
    peak_bytes: int
    advice: list[str]
    training_peak_moment: str  # backward, end of backward, or optimizer step
    num_parameters: int
    num_trainable_parameters: int
    inputs: PlanInputs = field(repr=False)

    @property
    def train_micro_batch_sequences(self) -> int:
        return self.train_micro_batch_tokens // self.inputs.seq_len

    def to_dict(self, sizes: Any = None) -> dict[str, Any]:
        """The plan as JSON data; with `sizes` (a RunSizes) also the sizes a run uses."""
        settings = {k: v for k, v in dataclasses.asdict(self.inputs).items() if k != "shape"}
        extra = {} if sizes is None else {"run_sizes": sizes.state_dict()}
        own = {name: getattr(self, name) for name in (
            "fits", "micro_group", "train_micro_batch_tokens", "train_micro_batch_sequences",
            "kv_cache_tokens", "generation", "training", "peak_bytes")}
        return dict(**own, gpu_memory_bytes=self.inputs.gpu_memory_bytes,
                    training_peak_moment=self.training_peak_moment, advice=self.advice,
                    num_parameters=self.num_parameters,
                    num_trainable_parameters=self.num_trainable_parameters,
                    precision=self.inputs.precision,
                    bytes_per_parameter=bytes_per_parameter(self.inputs),
                    model=dataclasses.asdict(self.inputs.shape), settings=settings, **extra)

    def to_json(self, sizes: Any = None) -> str:
        return json.dumps(self.to_dict(sizes), indent=2)


# --- validation -----------------------------------------------------------------------------------


def validate_inputs(p: PlanInputs) -> None:
    """One ConfigError line naming the first bad setting."""
    require(p.gpu_memory_bytes > 0, "gpu_memory", p.gpu_memory_bytes, "must be > 0")
    for key in ("num_generations", "num_prompts", "max_prompt_tokens", "max_new_tokens"):
        require(getattr(p, key) > 0, key, getattr(p, key), "must be > 0")
    for key in ("lora_rank", "micro_group", "train_micro_batch_tokens", "kv_budget_tokens"):
        require(getattr(p, key) >= 0, key, getattr(p, key), "must be >= 0")
    require(p.beta >= 0, "beta", p.beta, "must be >= 0")
    for key, names in (("optimizer", OPTIMIZERS), ("precision", PRECISIONS), ("device", DEVICES),
                       ("engine", ("slots", "vllm")), ("policy", POLICIES),
                       ("strategy", STRATEGIES)):
        shown = PRECISION_CHOICES if key == "precision" else names
        require(getattr(p, key) in names, key, getattr(p, key),
                f"must be one of {', '.join(shown)}")
    require(p.probe_tokens >= 1, "probe_tokens", p.probe_tokens, "must be >= 1")
    if p.load_in_4bit:
        require(p.lora_rank > 0, "load_in_4bit", True,
                "trains LoRA adapters over the 4-bit base: set a LoRA rank")
        require(p.device == "cuda", "load_in_4bit", True, "bitsandbytes 4-bit needs a CUDA GPU")
    require(p.num_devices >= 1, "num_gpus", p.num_devices, "must be >= 1")
    require(p.runtime_bytes is None or p.runtime_bytes >= 0, "runtime_bytes", p.runtime_bytes,
            "must be >= 0")
    require(p.strategy != "fsdp" or p.lora_rank == 0, "strategy", p.strategy,
            "fsdp shards full fine-tuning; with LoRA use ddp")


# --- the plan -------------------------------------------------------------------------------------


def _choose(p: PlanInputs) -> tuple[int, int]:
    """(g, micro-batch tokens) that fit; 0 for a part where nothing fits."""
    if p.micro_group:
        fits_g = generation_breakdown(p, p.micro_group)["peak"] <= p.gpu_memory_bytes
        g = p.micro_group if fits_g else 0
    else:
        g = largest_micro_group(p)
    if p.train_micro_batch_tokens:
        # a longer sequence still gets its own micro-batch
        tokens = max(p.train_micro_batch_tokens, p.seq_len)
        fits = training_breakdown(p, tokens)["peak"] <= p.gpu_memory_bytes
        return g, tokens if fits else 0
    return g, largest_micro_batch_sequences(p) * p.seq_len


def plan_memory(shape: ModelShape, *, gpu_memory_bytes: int, num_generations: int,
                max_prompt_tokens: int, max_new_tokens: int, lora_rank: int = 0,
                optimizer: str = "adamw",
                gradient_checkpointing: bool = False, beta: float = 0.0, precision: str = "auto",
                device: str = "cuda", micro_group: int = 0, train_micro_batch_tokens: int = 0,
                load_in_4bit: bool = False,
                lora_targets: tuple[str, ...] = LORA_TARGETS_ALL_LINEAR, engine: str = "slots",
                engine_sleep: bool = True, num_devices: int = 1,
                strategy: str = "single", num_prompts: int = 1,
                runtime_bytes: int | None = None, kv_budget_tokens: int = 0,
                policy: str = "continuous", probe_tokens: int = PROBE_TOKENS,
                share_prompt: bool = False) -> MemoryPlan:
    """Estimate both phases, choose g and the micro-batch, and advise when it does not fit.

    One device's step samples `num_prompts` (B) prompts x `num_generations` (G).
    `precision`: a mode of planner.precisions, or 'auto' (the trainer's default on `device`).
    A micro_group above G x B means all of the step's samples at once. With `num_devices`
    and `strategy` (ddp, fsdp) every figure is one device's (planner/parallel.py).
    `runtime_bytes`: the runtime's resident memory outside the tensors, measured by the caller
    (None: the device's assumed default). The run's `kv_budget_tokens` (0: what g needs),
    `policy` and `probe_tokens` decide what the engine allocates (`estimate.kv_cache_tokens`);
    `share_prompt` adds the training step's block mask (`activations.shared_mask_bytes`)."""
    p = PlanInputs(
        shape, int(gpu_memory_bytes), num_generations, max_prompt_tokens, max_new_tokens,
        lora_rank=lora_rank, lora_targets=tuple(lora_targets), optimizer=optimizer,
        gradient_checkpointing=gradient_checkpointing, beta=float(beta),
        precision=resolve_precision_name(precision, device), device=device,
        micro_group=min(micro_group, num_generations * num_prompts),
        train_micro_batch_tokens=train_micro_batch_tokens, load_in_4bit=load_in_4bit,
        engine=engine, engine_sleep=engine_sleep, num_devices=num_devices, strategy=strategy,
        num_prompts=num_prompts,
        runtime_bytes=None if runtime_bytes is None else int(runtime_bytes),
        kv_budget_tokens=kv_budget_tokens, policy=policy, probe_tokens=probe_tokens,
        share_prompt=share_prompt)
    validate_inputs(p)
    g, tokens = _choose(p)
    # the breakdown shown: of the chosen sizes, or of the smallest when none fits
    shown_g = g or p.micro_group or 1
    shown_tokens = tokens or max(p.train_micro_batch_tokens, p.seq_len)
    generation, training = generation_breakdown(p, shown_g), training_breakdown(p, shown_tokens)
    fits = g > 0 and tokens > 0
    return MemoryPlan(fits=fits, micro_group=g, train_micro_batch_tokens=tokens,
                      kv_cache_tokens=sum(kv_cache_tokens(p, shown_g)),
                      generation=generation, training=training,
                      peak_bytes=max(generation["peak"], training["peak"]),
                      advice=[] if fits else advise(p, g, tokens),
                      training_peak_moment=peak_training_moment(p, shown_tokens)[0],
                      num_parameters=p.num_parameters, num_trainable_parameters=p.num_trainable,
                      inputs=p)


# --- advice: re-run the estimate with each switch -------------------------------------------------


def _only_if(condition: Callable[[PlanInputs], bool],
             **changes: Any) -> Callable[[PlanInputs], PlanInputs | None]:
    return lambda p: dataclasses.replace(p, **changes) if condition(p) else None


SWITCHES: dict[str, Callable[[PlanInputs], PlanInputs | None]] = {
    f"--lora-rank {DEFAULT_LORA_RANK}": _only_if(
        lambda p: p.lora_rank == 0 and p.strategy != "fsdp", lora_rank=DEFAULT_LORA_RANK),
    "--strategy fsdp": _only_if(lambda p: p.num_devices > 1 and p.strategy == "ddp",
                                strategy="fsdp"),
    "--optimizer adamw8bit": _only_if(lambda p: p.optimizer == "adamw", optimizer="adamw8bit"),
    "--gradient-checkpointing": _only_if(lambda p: not p.gradient_checkpointing,
                                         gradient_checkpointing=True),
    "--beta 0 (no reference model)": _only_if(lambda p: p.beta > 0 and p.lora_rank == 0, beta=0.0),
    "--precision bf16": _only_if(lambda p: p.precision in ("fp32", "mixed"), precision="bf16"),
    "--load-in-4bit": _only_if(lambda p: p.lora_rank > 0 and p.device == "cuda"
                               and not p.load_in_4bit, load_in_4bit=True),
}


def _apply(p: PlanInputs, names: tuple[str, ...]) -> PlanInputs | None:
    for name in names:
        p = SWITCHES[name](p)
        if p is None:
            return None
    return p


def _describe(names: tuple[str, ...], p: PlanInputs, g: int, tokens: int) -> str:
    peak = max(generation_breakdown(p, g)["peak"], training_breakdown(p, tokens)["peak"])
    sequences = tokens // p.seq_len
    return (f"fits with {' + '.join(names)}: peak {peak / GIB:.2f} GiB, g = {g}, micro-batch "
            f"{tokens} tokens ({sequences} sequence{'s' if sequences > 1 else ''})")


def _switch_advice(p: PlanInputs) -> list[str]:
    """The smallest combinations of switches that make the plan fit (all of that size)."""
    for size in range(1, len(SWITCHES) + 1):
        found = []
        for names in itertools.combinations(SWITCHES, size):
            changed = _apply(p, names)
            if changed is not None:
                g, tokens = _choose(changed)
                if g and tokens:
                    found.append(_describe(names, changed, g, tokens))
        if found:
            return found
    return []


def _smaller_setting_advice(p: PlanInputs, g: int, tokens: int) -> list[str]:
    """A user-fixed g or micro-batch that is too large: the largest that fits."""
    advice = []
    if p.micro_group and not g:
        best = largest_micro_group(dataclasses.replace(p, micro_group=0))
        if best:
            advice.append(f"fits with a smaller g: --micro-group {best} (or 0 for auto)")
    if p.train_micro_batch_tokens and not tokens:
        best = largest_micro_batch_sequences(p) * p.seq_len
        if best:
            advice.append(f"fits with a smaller micro-batch: --train-micro-batch-tokens {best} (or "
                          f"0 for auto)")
    return advice


def advise(p: PlanInputs, g: int, tokens: int) -> list[str]:
    advice = _smaller_setting_advice(p, g, tokens) or _switch_advice(p)
    if advice:
        return advice
    minimum = dataclasses.replace(p, micro_group=1, train_micro_batch_tokens=p.seq_len)
    need = max(generation_breakdown(minimum, 1)["peak"],
               training_breakdown(minimum, p.seq_len)["peak"])
    return [f"does not fit even with every switch; these settings need {need / GIB:.2f} GiB at g = "
            "1 and one sequence per micro-batch: use a larger GPU, a smaller model or shorter "
            "sequences"]
