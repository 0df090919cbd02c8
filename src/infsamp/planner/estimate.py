"""The memory estimate: bytes of each part of the generation and training phases, and what fits.

Built on the second seed's rule of thumb (bytes per parameter: weights 2, reference 2, gradients 2, AdamW 8,
8-bit AdamW 4) with these refinements, each stated in docs/planner.md:
- optimizer states follow what the code allocates: torch AdamW keeps exp_avg and exp_avg_sq in the
  parameter's dtype (2 x 2 B in bf16, 2 x 4 B in fp32); bitsandbytes AdamW8bit keeps two uint8 states plus
  one fp32 absmax per 256 values (~2.03 B); SGD (no momentum) keeps none;
- LoRA adapters (peft casts them to fp32) are the only trainable parameters; the reference model is the base
  with adapters disabled, so it costs nothing;
- the training step computes log-probs in micro-batches of `train_micro_batch_tokens` padded tokens, logits
  only for completion positions, fp32 log-softmax in row chunks: activations and logits scale with the
  micro-batch, never with G. Activations are counted tensor by tensor from what autograd saves per layer;
- optimizer states stay resident during generation (zero_grad frees the gradients);
- KV cache: the prompt once, shared by the g samples decoded at once, plus g * max_completion tokens.

Several devices: data parallel only (`planner/parallel.py`: DDP replicas or FSDP2 shards, per
device). Deliberately simplified: no tensor/pipeline parallelism, no offloading; the no-grad passes
for
old / reference log-probs are assumed to stay below the training peak (they hold no activations).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from infsamp.planner.parallel import per_device_parts, shard_fraction
from infsamp.planner.presets import (LORA_TARGETS_ALL_LINEAR, ModelShape, count_lora_parameters,
                                     count_parameters, embedding_parameters)

PARTS = ("weights", "reference", "gradients", "optimizer", "activations", "logits", "kv_cache", "overhead")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
ADAPTER_BYTES = 4  # peft keeps LoRA weights in fp32 (autocast_adapter_dtype)
GIB = 2**30


@dataclass(frozen=True)
class OptimizerSpec:
    state_bytes: Callable[[int], float]  # bytes per trainable parameter, given the parameter's bytes
    step_temporaries: float  # parameter-sized temporaries during step() when run as one foreach kernel
    summary: str


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec(lambda p: 2 * p, 1.0, "torch AdamW: exp_avg + exp_avg_sq in the parameter dtype"),
    "adamw8bit": OptimizerSpec(lambda p: 2 + 2 * 4 / 256, 0.0,
                               "bitsandbytes AdamW8bit: 2 uint8 states + fp32 absmax per 256 values"),
    "sgd": OptimizerSpec(lambda p: 0, 0.0, "SGD without momentum: no state"),
}


@dataclass(frozen=True)
class DeviceSpec:
    context_bytes: int  # runtime memory outside tensors (CUDA context, cuBLAS workspaces)
    fragmentation: float  # allocator slack, as a fraction of the tensors' bytes
    foreach_optimizer: bool  # True: step() temporaries span all parameters; False: one tensor at a time


DEVICES: dict[str, DeviceSpec] = {
    "cuda": DeviceSpec(context_bytes=512 * 2**20, fragmentation=0.10, foreach_optimizer=True),
    "cpu": DeviceSpec(context_bytes=0, fragmentation=0.0, foreach_optimizer=False),
}


@dataclass(frozen=True)
class PlanInputs:
    """Everything the estimate depends on (validated by `plan_memory`)."""

    shape: ModelShape
    gpu_memory_bytes: int
    group_size: int
    max_prompt: int
    max_completion: int
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = LORA_TARGETS_ALL_LINEAR
    optimizer: str = "adamw"
    gradient_checkpointing: bool = False
    beta: float = 0.0
    dtype: str = "bf16"
    device: str = "cuda"
    shared_prompt_kv: bool = True
    micro_group: int = 0  # 0: the largest g <= G that fits
    train_micro_batch_tokens: int = 0  # 0: the largest budget that fits
    num_devices: int = 1  # GPUs the run spreads over (planner/parallel.py)
    strategy: str = "single"  # single, ddp or fsdp: what each device holds

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def seq_len(self) -> int:
        return self.max_prompt + self.max_completion

    @property
    def num_parameters(self) -> int:
        return count_parameters(self.shape)

    @property
    def num_trainable(self) -> int:
        if self.lora_rank > 0:
            return count_lora_parameters(self.shape, self.lora_rank, self.lora_targets)
        return self.num_parameters

    @property
    def trainable_bytes(self) -> int:
        """Bytes of one trainable parameter (and of its gradient)."""
        return ADAPTER_BYTES if self.lora_rank > 0 else self.dtype_bytes


# --- per-part bytes --------------------------------------------------------------------------------


def kv_bytes_per_token(shape: ModelShape, dtype: str = "bf16") -> int:
    """K and V of one token in every layer: 2 * layers * kv_heads * head_dim * bytes."""
    return 2 * shape.num_hidden_layers * shape.kv_dim * DTYPE_BYTES[dtype]


def weights_bytes(p: PlanInputs) -> int:
    adapters = p.num_trainable * ADAPTER_BYTES if p.lora_rank > 0 else 0
    return p.num_parameters * p.dtype_bytes + adapters


def reference_bytes(p: PlanInputs) -> int:
    """A frozen copy of the base; none with beta 0, none with LoRA (adapters disabled = reference)."""
    return p.num_parameters * p.dtype_bytes if p.beta > 0 and p.lora_rank == 0 else 0


def gradients_bytes(p: PlanInputs) -> int:
    return p.num_trainable * p.trainable_bytes


def optimizer_bytes(p: PlanInputs) -> int:
    return int(p.num_trainable * OPTIMIZERS[p.optimizer].state_bytes(p.trainable_bytes))


def optimizer_step_temporaries(p: PlanInputs) -> int:
    """Extra bytes while optimizer.step() runs (AdamW's sqrt(v) temporaries)."""
    spec = OPTIMIZERS[p.optimizer]
    if spec.step_temporaries == 0:
        return 0
    if DEVICES[p.device].foreach_optimizer:  # FSDP steps on this device's shards only
        return int(spec.step_temporaries * p.num_trainable * p.trainable_bytes * shard_fraction(p))
    largest = embedding_parameters(p.shape) if p.lora_rank == 0 else 0
    return 2 * largest * p.trainable_bytes  # single-tensor loop: sqrt and division of the largest tensor


def layer_activation_bytes_per_token(p: PlanInputs) -> int:
    """Bytes autograd saves for one token in one decoder layer (HF Llama/Qwen layer, sdpa attention).

    RMSNorm: fp32 copy of its input + normalised output; attention: q, k and v repeated to all heads (a
    padding mask rules out sdpa's GQA path), output, fp32 log-sum-exp, o_proj's input copy, and the float
    mask row sdpa converts per layer; SwiGLU: gate, silu(gate), up, their product. With LoRA in a 16-bit
    dtype peft also keeps an fp32 copy of every adapted linear's input.
    """
    s, d = p.shape, p.dtype_bytes
    norms = 2 * (4 + d) * s.hidden_size
    qk_norm = (4 + d) * (s.q_dim + s.kv_dim) if s.qk_norm else 0
    attention = 5 * s.q_dim * d + 4 * s.num_attention_heads + p.seq_len * d
    mlp = 4 * s.intermediate_size * d
    lora_casts = 0
    if p.lora_rank > 0 and d != ADAPTER_BYTES:
        lora_casts = ADAPTER_BYTES * (5 * s.hidden_size + s.q_dim + s.intermediate_size)
    return norms + qk_norm + attention + mlp + lora_casts


def activation_bytes_per_token(p: PlanInputs) -> int:
    """Saved activations of one training token, whole model (with or without checkpointing)."""
    layer = layer_activation_bytes_per_token(p)
    final_norm = (4 + p.dtype_bytes) * p.shape.hidden_size
    if p.gradient_checkpointing:  # each layer keeps its input; one layer is recomputed at a time
        return p.shape.num_hidden_layers * p.dtype_bytes * p.shape.hidden_size + layer + final_norm
    return p.shape.num_hidden_layers * layer + final_norm


def train_logits_bytes_per_row(p: PlanInputs) -> int:
    """One completion position's logits in training: fp32 chunk kept by logsumexp + grad buffer + temp."""
    return p.shape.vocab_size * (4 + 2 * p.dtype_bytes)


def decode_logits_bytes_per_row(p: PlanInputs) -> int:
    """One decoding row: model logits + fp32 copy, scaled copy and probabilities for sampling."""
    return p.shape.vocab_size * (p.dtype_bytes + 12)


def prefill_logits_bytes(p: PlanInputs) -> int:
    """Logits of a prompt's prefill: the sampler keeps one row (logits_to_keep=1)."""
    return p.shape.vocab_size * p.dtype_bytes


def inference_workspace_bytes(p: PlanInputs, tokens: int) -> int:
    """No-grad forward working set: one layer's intermediates for `tokens` tokens at a time."""
    s = p.shape
    return tokens * (2 * s.hidden_size + s.q_dim + 2 * s.kv_dim + 3 * s.intermediate_size) * p.dtype_bytes


def completion_rows(p: PlanInputs, tokens: int) -> int:
    """Completion positions (logits rows) in a micro-batch of `tokens` padded tokens."""
    return math.ceil(tokens * p.max_completion / p.seq_len)


# --- phases ----------------------------------------------------------------------------------------


def _with_overhead(parts: dict[str, int], device: str) -> dict[str, int]:
    spec = DEVICES[device]
    tensors = sum(parts.values())
    parts = {**parts, "overhead": spec.context_bytes + int(spec.fragmentation * tensors)}
    return {**parts, "peak": sum(parts.values())}


def generation_breakdown(p: PlanInputs, micro_group: int) -> dict[str, int]:
    """Bytes while decoding `micro_group` samples at once (optimizer states stay resident)."""
    kv_tokens = (p.max_prompt + micro_group * p.max_completion if p.shared_prompt_kv
                 else micro_group * p.seq_len)
    kv_tokens += math.ceil(micro_group * p.seq_len / p.shape.num_hidden_layers)  # one layer's K/V concat per step
    prefill_tokens = p.max_prompt if p.shared_prompt_kv else micro_group * p.max_prompt
    parts = dict(weights=weights_bytes(p), reference=reference_bytes(p), gradients=0,
                 optimizer=optimizer_bytes(p),
                 activations=inference_workspace_bytes(p, max(prefill_tokens, micro_group)),
                 logits=max(micro_group * decode_logits_bytes_per_row(p), prefill_logits_bytes(p)),
                 kv_cache=kv_tokens * kv_bytes_per_token(p.shape, p.dtype))
    return _with_overhead(per_device_parts(p, parts, "generation"), p.device)


def embedding_grad_bytes(p: PlanInputs) -> int:
    """One embedding-sized gradient (V x H), the largest tensor autograd creates; none with LoRA."""
    return 0 if p.lora_rank > 0 else embedding_parameters(p.shape) * p.trainable_bytes


def training_moments(p: PlanInputs, micro_batch_tokens: int) -> dict[str, dict[str, int]]:
    """Dynamic bytes at the three candidate peak moments of a step (static parts excluded).

    backward: all saved activations + the logits' backward buffers + lm_head's fresh weight gradient;
    end of backward: with tied embeddings lm_head's gradient waits for the embedding's, then both are
    summed (3 x V x H), untied only the embedding's own (1 x); optimizer step: step() temporaries.
    """
    vocab_grad = embedding_grad_bytes(p)
    tied_factor = 3 if p.shape.tie_word_embeddings else 1
    return {
        "backward": dict(activations=micro_batch_tokens * activation_bytes_per_token(p),
                         logits=completion_rows(p, micro_batch_tokens) * train_logits_bytes_per_row(p),
                         gradients=vocab_grad),
        "end of backward": dict(gradients=tied_factor * vocab_grad),
        "optimizer step": dict(optimizer=optimizer_step_temporaries(p)),
    }


def peak_training_moment(p: PlanInputs, micro_batch_tokens: int) -> tuple[str, dict[str, int]]:
    moments = training_moments(p, micro_batch_tokens)
    name = max(moments, key=lambda m: sum(moments[m].values()))  # first wins ties: backward
    return name, moments[name]


def training_breakdown(p: PlanInputs, micro_batch_tokens: int) -> dict[str, int]:
    """Bytes at the peak moment of a training step with a micro-batch of `micro_batch_tokens` tokens."""
    parts = dict(weights=weights_bytes(p), reference=reference_bytes(p), gradients=gradients_bytes(p),
                 optimizer=optimizer_bytes(p), activations=0, logits=0, kv_cache=0)
    parts = per_device_parts(p, parts, "training")
    for key, value in peak_training_moment(p, micro_batch_tokens)[1].items():
        parts[key] += value
    return _with_overhead(parts, p.device)


# --- choosing g and the micro-batch ----------------------------------------------------------------


def _largest_fitting(low: int, high: int, fits: Callable[[int], bool]) -> int:
    """Largest n in [low, high] with fits(n) (fits is monotone: true then false); low - 1 if none."""
    if high < low or not fits(low):
        return low - 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def largest_micro_group(p: PlanInputs) -> int:
    """The most samples decoded at once within the memory (0 if not even one fits)."""
    return _largest_fitting(1, p.group_size,
                            lambda g: generation_breakdown(p, g)["peak"] <= p.gpu_memory_bytes)


def largest_micro_batch_sequences(p: PlanInputs) -> int:
    """The most full-length sequences one training micro-batch can hold (0 if not even one)."""
    return _largest_fitting(1, p.group_size,
                            lambda n: training_breakdown(p, n * p.seq_len)["peak"] <= p.gpu_memory_bytes)
