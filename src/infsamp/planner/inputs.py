"""What the memory estimate depends on: one `PlanInputs` (a run's model, device and settings)
and the bytes of the dtypes it names.

Pure Python (no torch). Its own module so that `estimate.py` and `parallel.py` (which both read
it) import it from below instead of from each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from infsamp.choices import PROBE_TOKENS
from infsamp.planner.kv_budget import kv_block_size
from infsamp.planner.precisions import PRECISIONS, PrecisionMode, base_dtype
from infsamp.planner.presets import (
    LORA_TARGETS_ALL_LINEAR,
    ModelShape,
    count_lora_parameters,
    count_parameters,
    linear_shapes,
)

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
ADAPTER_BYTES = 4  # peft keeps LoRA weights in fp32 (autocast_adapter_dtype)


@dataclass(frozen=True)
class PlanInputs:
    """Everything the estimate depends on (validated by `plan_memory`)."""

    shape: ModelShape
    gpu_memory_bytes: int
    num_generations: int  # G: completions per prompt
    max_prompt_tokens: int
    max_new_tokens: int
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = LORA_TARGETS_ALL_LINEAR
    optimizer: str = "adamw"
    gradient_checkpointing: bool = False
    beta: float = 0.0
    precision: str = "bf16"  # a name of planner.precisions.PRECISIONS ('auto' is resolved before)
    device: str = "cuda"
    micro_group: int = 0  # 0: the largest g <= G that fits
    train_micro_batch_tokens: int = 0  # 0: the largest budget that fits
    load_in_4bit: bool = False  # QLoRA: NF4 base (needs LoRA and CUDA)
    engine: str = "slots"  # sampling engine: slots, or vllm (its weights, paged pool, graphs)
    engine_sleep: bool = True  # vllm: sleep mode frees its pool and weights while training
    num_devices: int = 1  # GPUs the run spreads over (planner/parallel.py)
    strategy: str = "single"  # single, ddp or fsdp: what each device holds
    num_prompts: int = 1  # B: prompts one device samples per step (may be open at once)
    # the runtime's resident memory outside the tensors, as the caller measured it (a run, at
    # start-up); None: the device's default (estimate.DEVICES)
    runtime_bytes: int | None = None
    kv_budget_tokens: int = 0  # the run's KV budget (RunSizes'); 0: `auto`, what g needs
    policy: str = "continuous"  # the sampling policy (`probe` runs more than g at once)
    probe_tokens: int = PROBE_TOKENS  # probe: KV tokens a new sample first reserves (k)
    share_prompt: bool = False  # training.share_prompt: rows under a [r, 1, W, W] block mask

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV allocation unit (`kv_budget.kv_block_size`)."""
        return kv_block_size(self.engine, self.device)

    @property
    def num_samples(self) -> int:
        """The samples of one device's step: G x B."""
        return self.num_generations * self.num_prompts

    @property
    def mode(self) -> PrecisionMode:
        return PRECISIONS[self.precision]

    @property
    def dtype(self) -> str:
        """dtype of the model's own weights (and of the KV cache, which follows them)."""
        return base_dtype(self.mode, self.lora_rank > 0)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def compute_bytes(self) -> int:
        """bytes of an activation element: matmul outputs in the compute dtype."""
        return DTYPE_BYTES[self.mode.compute]

    @property
    def seq_len(self) -> int:
        return self.max_prompt_tokens + self.max_new_tokens

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

    @property
    def num_quantized(self) -> int:
        """Base parameters stored in NF4: every decoder-layer linear weight (QLoRA); else 0."""
        if not self.load_in_4bit:
            return 0
        per_layer = sum(n_in * n_out for n_in, n_out in linear_shapes(self.shape).values())
        return self.shape.num_hidden_layers * per_layer
