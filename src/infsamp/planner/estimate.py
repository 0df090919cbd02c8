"""The memory estimate: bytes of each part of the generation and training phases, and what fits.

Built on the second seed's rule of thumb (bytes per parameter: weights 2, reference 2, gradients 2,
AdamW 8, 8-bit AdamW 4), refined part by part as docs/planner.md ("How the estimate is built")
states: the precision mode's dtypes (`planner/precisions.py`), optimizer states as the code
allocates them, LoRA adapters and a 4-bit base, activations counted per micro-batch token from
what autograd saves, the chunked LM head's logits, the KV cache the engine allocates
(`kv_cache_tokens`), the runtime outside the tensors and the allocator's slack.

Several devices: data parallel only (`planner/parallel.py`: DDP replicas or FSDP2 shards, per
device, every precision mode's bytes sharded alike). Deliberately simplified: no tensor/pipeline
parallelism, no offloading; the no-grad passes for old / reference log-probs are assumed to stay
below the training peak (they hold no activations).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from infsamp.choices import WIDE_POLICIES
from infsamp.planner.activations import (
    activation_bytes_per_token,
    decode_logits_bytes_per_row,
    inference_workspace_bytes,
    prefill_logits_bytes,
    shared_mask_bytes,
    train_logits_bytes,
)
from infsamp.planner.inputs import ADAPTER_BYTES, DTYPE_BYTES, PlanInputs
from infsamp.planner.kv_budget import (
    auto_budget_tokens,
    largest_fitting,
    paged_pool_blocks,
    slot_pool,
)
from infsamp.planner.parallel import per_device_parts, shard_fraction
from infsamp.planner.presets import ModelShape, embedding_parameters

PARTS = ("weights", "reference", "gradients", "optimizer", "compute_copies", "activations",
         "logits", "kv_cache", "runtime", "overhead",
         "vllm_weights", "vllm_graphs")  # vLLM's copy and graphs
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # codes, 8-bit scale per 64, fp32 per 256 scales
GIB = 2**30


@dataclass(frozen=True)
class OptimizerSpec:
    # bytes per trainable parameter, given the parameter's bytes
    state_bytes: Callable[[int], float]
    # parameter-sized temporaries during step() when run as one foreach kernel
    step_temporaries: float
    kahan: bool  # keeps bf16 updates in a Kahan buffer of the parameter dtype (else: rounding)


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec(lambda p: 2 * p, 1.0, False),  # exp_avg + exp_avg_sq, parameter dtype
    "adamw8bit": OptimizerSpec(lambda p: 2 + 2 * 4 / 256, 0.0, False),  # 2 uint8 + fp32 per 256
    "sgd": OptimizerSpec(lambda p: 0, 0.0, True),  # without momentum: no state
}


# The CPU runtime when none is measured: the trainer's resident set at planning time less the
# model's tensors (Python, torch, transformers, tokenizer, prompts): 416 and 448 MiB measured on
# two models on 2026-12-01 (docs/planner.md, "Checked against measurements")
CPU_RUNTIME_BYTES = 448 * 2**20
CPU_FRAGMENTATION = 0.0  # glibc's heap slack is not modelled (docs/planner.md)


@dataclass(frozen=True)
class DeviceSpec:
    # the runtime's resident memory outside the tensors when the caller measured none (a run
    # measures it at start-up: `models.device.runtime_bytes`): the CUDA context and cuBLAS
    # workspaces on a GPU; Python, torch, transformers and the data on the CPU
    default_runtime_bytes: int
    fragmentation: float  # allocator slack, as a fraction of the tensors' bytes
    # True: step() temporaries span all parameters; False: one tensor at a time
    foreach_optimizer: bool


DEVICES: dict[str, DeviceSpec] = {
    "cuda": DeviceSpec(default_runtime_bytes=512 * 2**20, fragmentation=0.10,
                       foreach_optimizer=True),
    "cpu": DeviceSpec(default_runtime_bytes=CPU_RUNTIME_BYTES, fragmentation=CPU_FRAGMENTATION,
                      foreach_optimizer=False),
}


# --- per-part bytes -------------------------------------------------------------------------------


def kv_bytes_per_token(shape: ModelShape, dtype: str | int = "bf16") -> int:
    """K and V of one token in every layer: 2 * layers * kv_heads * head_dim * bytes; `dtype` a
    name of DTYPE_BYTES or an element size in bytes (a loaded model's). The one such function."""
    element = DTYPE_BYTES[dtype] if isinstance(dtype, str) else int(dtype)
    return 2 * shape.num_hidden_layers * shape.kv_dim * element


def weights_bytes(p: PlanInputs) -> int:
    adapters = p.num_trainable * ADAPTER_BYTES if p.lora_rank > 0 else 0
    quantized = p.num_quantized
    return int((p.num_parameters - quantized) * p.dtype_bytes + quantized * NF4_BYTES) + adapters


def reference_bytes(p: PlanInputs) -> int:
    """A frozen copy of the base; none with beta 0, none with LoRA (adapters disabled =
    reference)."""
    return p.num_parameters * p.dtype_bytes if p.beta > 0 and p.lora_rank == 0 else 0


def gradients_bytes(p: PlanInputs) -> int:
    return p.num_trainable * p.trainable_bytes


def optimizer_bytes(p: PlanInputs) -> int:
    spec = OPTIMIZERS[p.optimizer]
    low = p.trainable_bytes == 2
    kahan = p.trainable_bytes if spec.kahan and p.mode.keeps_updates and low else 0
    return int(p.num_trainable * (spec.state_bytes(p.trainable_bytes) + kahan))


def compute_copy_bytes(p: PlanInputs) -> int:
    """autocast's bf16 copies of fp32 matmul weights: cached for a forward, saved for backward.

    Full fine-tuning under `mixed`: all weights but the norms (a tied lm_head casts the embedding);
    LoRA under `mixed`: the fp32 adapters (the base is already bf16). None in the other modes.
    """
    if not p.mode.autocast:
        return 0
    if p.lora_rank > 0:
        return p.num_trainable * p.compute_bytes
    s = p.shape
    per_layer = 2 * s.hidden_size + (2 * s.head_dim if s.qk_norm else 0)
    norms = s.num_hidden_layers * per_layer + s.hidden_size
    return (p.num_parameters - norms) * p.compute_bytes


def bytes_per_parameter(p: PlanInputs) -> dict[str, float]:
    """Static bytes of the mode divided by the model's parameter count (LoRA: base + adapters)."""
    parts = dict(weights=weights_bytes(p), gradients=gradients_bytes(p),
                 optimizer=optimizer_bytes(p), compute_copies=compute_copy_bytes(p))
    per = {k: round(v / p.num_parameters, 3) for k, v in parts.items()}
    return {**per, "total": round(sum(parts.values()) / p.num_parameters, 3)}


def optimizer_step_temporaries(p: PlanInputs) -> int:
    """Extra bytes while optimizer.step() runs (AdamW's sqrt(v) temporaries)."""
    spec = OPTIMIZERS[p.optimizer]
    if spec.step_temporaries == 0:
        return 0
    if DEVICES[p.device].foreach_optimizer:  # FSDP steps on this device's shards only
        return int(spec.step_temporaries * p.num_trainable * p.trainable_bytes * shard_fraction(p))
    largest = embedding_parameters(p.shape) * shard_fraction(p) if p.lora_rank == 0 else 0
    # single-tensor loop: the largest tensor's sqrt, div
    return int(2 * largest * p.trainable_bytes)


# --- phases ---------------------------------------------------------------------------------------


def runtime_bytes(p: PlanInputs) -> int:
    """The runtime's resident memory outside the tensors: the caller's measurement (a run's, at
    start-up), else the device's default."""
    if p.runtime_bytes is not None:
        return p.runtime_bytes
    return DEVICES[p.device].default_runtime_bytes


def _with_overhead(parts: dict[str, int], p: PlanInputs) -> dict[str, int]:
    """The runtime and the allocator's slack on top of the tensors, and the sum: the peak."""
    tensors = sum(parts.values())
    parts = {**parts, "runtime": runtime_bytes(p),
             "overhead": int(DEVICES[p.device].fragmentation * tensors)}
    return {**parts, "peak": sum(parts.values())}


def kv_cache_tokens(p: PlanInputs, micro_group: int) -> tuple[int, int]:
    """(pool, prompt rows): the KV tokens the engine allocates when the run decodes g at once, for
    the run's budget (`auto`: what g needs, `kv_budget.auto_budget_tokens`). vLLM: its whole pool
    (`paged_pool_blocks`: the prompts and the spare block are in it) and no rows; the slot engine:
    its pool of running KV (`kv_budget.slot_pool`, as the scheduler sizes it) and one
    prompt row per group open at once (every group with probes, else min(B, g)), each the prompt
    minus its last token (whose KV is the sample's first column)."""
    block, wide = p.kv_block_size, p.policy in WIDE_POLICIES
    new, prompt = p.max_new_tokens, p.max_prompt_tokens
    budget = p.kv_budget_tokens or auto_budget_tokens(micro_group, new, prompt, p.num_prompts,
                                                      block)
    if p.engine == "vllm":
        most = p.num_samples if wide else micro_group
        return paged_pool_blocks(budget, most, new, prompt, block) * block, 0
    probe = p.probe_tokens if wide else 0
    _, pool = slot_pool(budget, micro_group, p.num_samples, p.num_prompts * prompt, new,
                        min(probe, new))
    num_rows = p.num_prompts if probe else min(p.num_prompts, micro_group)
    return pool, num_rows * (prompt - 1)


def kv_cache_bytes(p: PlanInputs, micro_group: int) -> int:
    return sum(kv_cache_tokens(p, micro_group)) * kv_bytes_per_token(p.shape, p.dtype)


VLLM_GRAPH_BYTES = {"cuda": 512 * 2**20, "cpu": 0}  # vLLM's CUDA graphs (none on CPU): assumed
VLLM_BATCHED_TOKENS = 8192  # the most tokens one vLLM engine step computes (TRL: 4096)


def vllm_step_tokens(micro_group: int, max_context: int) -> int:
    """Tokens one vLLM engine step may compute (its `max_num_batched_tokens`): g whole contexts,
    so parked requests resumed together recompute in one step, at most VLLM_BATCHED_TOKENS and
    never below one context (past the cap a request waits a step, whole: engines/vllm.py)."""
    return max(max_context, min(VLLM_BATCHED_TOKENS, micro_group * max_context))


def vllm_parts(p: PlanInputs, micro_group: int) -> dict[str, int]:
    """vLLM's resident memory: its weight copy, its KV pool, its graph pool."""
    return dict(vllm_weights=p.num_parameters * p.dtype_bytes,
                vllm_graphs=VLLM_GRAPH_BYTES[p.device],
                kv_cache=kv_cache_bytes(p, micro_group))


def vllm_generation_breakdown(p: PlanInputs, micro_group: int) -> dict[str, int]:
    """Decoding on vLLM: trainer weights and optimizer states stay resident beside vLLM's parts;
    its forward works on up to VLLM_BATCHED_TOKENS tokens per step; no slot-concat workspace."""
    tokens = vllm_step_tokens(micro_group, p.seq_len)
    parts = dict(weights=weights_bytes(p), reference=reference_bytes(p), gradients=0,
                 optimizer=optimizer_bytes(p), compute_copies=0,  # vLLM has its own copy
                 activations=inference_workspace_bytes(p, tokens),
                 logits=micro_group * decode_logits_bytes_per_row(p), **vllm_parts(p, micro_group))
    return _with_overhead(per_device_parts(p, parts, "generation"), p)


def generation_breakdown(p: PlanInputs, micro_group: int) -> dict[str, int]:
    """Bytes while decoding `micro_group` samples at once (optimizer states stay resident)."""
    if p.engine == "vllm":
        return vllm_generation_breakdown(p, micro_group)
    # one layer's K/V concat per step: a workspace beside the engine's KV
    concat = math.ceil(micro_group * p.seq_len / p.shape.num_hidden_layers)
    parts = dict(weights=weights_bytes(p), reference=reference_bytes(p), gradients=0,
                 optimizer=optimizer_bytes(p), compute_copies=compute_copy_bytes(p),
                 activations=inference_workspace_bytes(p, max(p.max_prompt_tokens, micro_group))
                 + concat * kv_bytes_per_token(p.shape, p.dtype),
                 logits=max(micro_group * decode_logits_bytes_per_row(p), prefill_logits_bytes(p)),
                 kv_cache=kv_cache_bytes(p, micro_group), vllm_weights=0,
                 vllm_graphs=0)
    return _with_overhead(per_device_parts(p, parts, "generation"), p)


def training_moments(p: PlanInputs, micro_batch_tokens: int) -> dict[str, dict[str, int]]:
    """Dynamic bytes at the three candidate peak moments of a step (static parts excluded).

    backward: all saved activations (with autocast's bf16 weight copies) + the logits' backward
    buffers + lm_head's fresh weight gradient; end of backward: with tied embeddings lm_head's
    gradient waits for the embedding's, then both are summed (3 x V x H), untied only the
    embedding's own (1 x); optimizer step: step() temporaries.
    """
    # one embedding-sized gradient (V x H), the largest tensor autograd creates; none with LoRA
    vocab_grad = 0 if p.lora_rank > 0 else embedding_parameters(p.shape) * p.trainable_bytes
    tied_factor = 3 if p.shape.tie_word_embeddings else 1
    return {
        "backward": dict(activations=micro_batch_tokens * activation_bytes_per_token(p)
                         + shared_mask_bytes(p, micro_batch_tokens),
                         logits=train_logits_bytes(p, micro_batch_tokens),
                         gradients=vocab_grad, compute_copies=compute_copy_bytes(p)),
        "end of backward": dict(gradients=tied_factor * vocab_grad),
        "optimizer step": dict(optimizer=optimizer_step_temporaries(p)),
    }


def peak_training_moment(p: PlanInputs, micro_batch_tokens: int) -> tuple[str, dict[str, int]]:
    moments = training_moments(p, micro_batch_tokens)
    name = max(moments, key=lambda m: sum(moments[m].values()))  # first wins ties: backward
    return name, moments[name]


def training_breakdown(p: PlanInputs, micro_batch_tokens: int) -> dict[str, int]:
    """Bytes at the peak moment of a training step with a micro-batch of `micro_batch_tokens`
    tokens."""
    parts = dict(weights=weights_bytes(p), reference=reference_bytes(p),
                 gradients=gradients_bytes(p),
                 optimizer=optimizer_bytes(p), compute_copies=0, activations=0, logits=0,
                 kv_cache=0, vllm_weights=0, vllm_graphs=0)
    parts = per_device_parts(p, parts, "training")
    if p.engine == "vllm" and not p.engine_sleep:  # awake, vLLM keeps its pool and weights
        parts.update(vllm_parts(p, p.micro_group or p.num_samples))
    for key, value in peak_training_moment(p, micro_batch_tokens)[1].items():
        parts[key] += value
    return _with_overhead(parts, p)


# --- choosing g and the micro-batch ---------------------------------------------------------------


def largest_micro_group(p: PlanInputs) -> int:
    """The most samples decoded at once within the memory (0 if not even one fits)."""
    return largest_fitting(p.num_samples,
                           lambda g: generation_breakdown(p, g)["peak"] <= p.gpu_memory_bytes)


def largest_micro_batch_sequences(p: PlanInputs) -> int:
    """The most full-length sequences one training micro-batch can hold (0 if not even one)."""
    return largest_fitting(p.num_samples,
                           lambda n: (training_breakdown(p, n * p.seq_len)["peak"]
                                      <= p.gpu_memory_bytes))
