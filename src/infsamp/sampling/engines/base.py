"""The engine boundary: what the sampler's loop asks of a decoding engine, and the engine registry.

The loop (see `infsamp.sampling.sampler`) owns the scheduler; an engine only executes its
decisions. An engine is long-lived (the trainer keeps one for the whole run); per sampler call it
is told the prompts and samples (`begin_call`), then `start(slot, sample)` puts a sample in a slot
and `decode_step(active)` runs one forward step over the running samples, appends one token to each
sample that advanced and returns the samples that ended. Between calls the trainer pushes new
weights (`load_weights`); `reset` drops any half-done call (after an error); `close` frees it.

Engines (`sampling.engine`): `slots` (infsamp's slot engine over the transformers model, exact
reference, any device) and `vllm` (vLLM in the trainer's process, paged KV with prefix caching);
`auto` picks vLLM where it is installed and a CUDA GPU holds the model, else slots.

Deliberately simple: one decode token per sample per step (no speculative decoding).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from infsamp.errors import SamplingError
from infsamp.models.device import is_4bit
from infsamp.options import ConfigError
from infsamp.planner.sizes import (
    RunSizes,
    resolve_engine,
    vllm_installed,  # noqa: F401 (engines and tests read it here)
)
from infsamp.sampling.types import Sample, SamplerStats

if TYPE_CHECKING:
    from infsamp.config_algorithm import SamplingConfig


class SlotLogitsProcessor(Protocol):
    """Batched, per-sample logits rule (e.g. forced lengths). Rows are slots; inactive rows are
    ignored."""

    def __call__(self, sample_ids: torch.Tensor, num_generated: torch.Tensor,
                 scores: torch.Tensor) -> torch.Tensor:  # [S], [S], [S, V] -> [S, V]
        ...


LogitsProcessorFactory = Callable[[Sequence[Sample]], SlotLogitsProcessor]  # given all samples


@dataclass
class DecodeOptions:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0  # base of the per-sample random streams
    sample_keys: tuple[int, ...] = ()  # random-stream key of each sample id (empty: the id itself)
    eos_token_ids: tuple[int, ...] = ()
    target_lengths: tuple[int, ...] | None = None  # per sample id: end after exactly this many
    hidden_states: bool = False  # hand each running sample its last hidden state (Sample's)
    # multi-turn episodes (`sampling/turns.py`): asked at a stop token whether the sample's turn
    # ends in a tool call, i.e. it ends its decode as "tool_call" (KV and prompt kept); None: never
    turn_ends: Callable[[Sample], bool] | None = None

    def stream_key(self, sample_id: int) -> int:
        """The key of a sample's random stream: its place in the whole step (`sample_keys`)."""
        return self.sample_keys[sample_id] if self.sample_keys else sample_id


class Engine(Protocol):
    name: str
    kv_block_size: int  # tokens per KV allocation unit (the slot engine: 1)
    max_context: int  # the most tokens (prompt + completion) one sample may hold
    max_micro_group: int  # the most samples it runs at once (0: any)
    kv_capacity_tokens: int  # its fixed KV pool in tokens (0: allocated per call)
    copies_weights: bool  # holds its own copy of the weights (load_weights copies them in)
    keeps_parked_kv: bool  # can hold a parked sample's KV (else it recomputes it on resume)
    hands_hidden_states: bool  # fills Sample.hidden_state when DecodeOptions.hidden_states
    shares_prefix: bool  # can hold a call's common prompt prefix once (begin_call's shared_prefix)

    def begin_call(self, prompts: Sequence[Sequence[int]], samples: Sequence[Sample],
                   num_slots: int, options: DecodeOptions, stats: SamplerStats,
                   processor: SlotLogitsProcessor | None = None,
                   pool_tokens: int | None = None, shared_prefix: int = 0) -> None:
        """Prepare one sampler call of up to `num_slots` samples running at once, holding up to
        `pool_tokens` KV beside their prompts (the scheduler's `max_running_tokens`) and, when
        `shared_prefix` > 0 (only if `shares_prefix`), the first `shared_prefix` tokens every
        prompt shares once; the engine's counters go to `stats`."""

    def start(self, slot: int, sample: Sample) -> None:
        """Begin decoding `sample` in `slot` before the next decode step; a sample that has tokens
        was parked and resumes (its KV restored if kept, else recomputed)."""

    def decode_step(self, active: dict[int, Sample]) -> list[Sample]:
        """One forward step over the running samples; returns the samples that ended in it. A
        sample that was running and is missing from `active` (not finished) was parked: it
        keeps its tokens, and its KV only if `Sample.parked_kv`."""

    def cancel(self, samples: Sequence[Sample]) -> None:
        """Samples of the call that never started and never will (a gate cancelled them): a
        group whose other samples all ended gives its prompt back."""

    def end_call(self) -> None:
        """The call is over (every sample finished)."""

    def load_weights(self, model: torch.nn.Module) -> None:
        """Take the trainer model's current weights (after an optimizer step)."""

    def reset(self) -> None:
        """Forget any half-done call and cached state."""

    def sleep(self) -> None:
        """Free what it can for the training phase (vLLM sleep mode on CUDA); back next call."""

    def close(self) -> None:
        """Free the engine."""


ENGINES = {  # name -> "module:class"; imported only when chosen (importing vLLM takes seconds)
    "slots": "infsamp.sampling.engines.slots:SlotEngine",
    "vllm": "infsamp.sampling.engines.vllm:VLLMEngine",
}


def resolve_engine_name(name: str, device: torch.device, quantized: bool = False,
                        temperature: float = 0.0) -> str:
    """`planner.sizes.resolve_engine` for a torch device (the one rule `infsamp plan` uses too)."""
    try:
        return resolve_engine(name, device.type, quantized, temperature)
    except ConfigError as err:
        raise SamplingError(str(err)) from None


def make_engine(name: str, model, cfg: SamplingConfig, sizes: RunSizes) -> Engine:
    """The engine `sampling.engine` names, for `model` (a transformers causal LM, peft or not),
    started for the run's `sizes` (its prompts, completions, concurrency and KV budget)."""
    name = resolve_engine_name(name, next(model.parameters()).device, quantized=is_4bit(model),
                               temperature=cfg.temperature)
    module, _, cls = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls)(model, cfg, sizes)
