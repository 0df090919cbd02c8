"""The engine boundary: what the sampler's loop asks of a decoding engine.

The loop (see `infsamp.sampling.sampler`) owns the scheduler; an engine only executes its decisions:
`start(slot, spec)` puts a sample in a slot (prefilling the group's prompt the first time it is seen),
`decode_step(active)` runs one batched forward pass over the slots and returns the samples that ended.
A vLLM engine can implement the same three calls on top of its own paged cache.

Deliberately simple: one decode token per slot per step (no speculative decoding, no chunked prefill).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class SlotLogitsProcessor(Protocol):
    """Batched, per-sample logits rule (e.g. forced lengths). Rows are slots; inactive rows are ignored."""

    def __call__(self, sample_ids: torch.Tensor, num_generated: torch.Tensor,
                 scores: torch.Tensor) -> torch.Tensor:  # [S], [S], [S, V] -> [S, V]
        ...


LogitsProcessorFactory = Callable[[Sequence[Any]], SlotLogitsProcessor]  # called once with every SampleSpec


@dataclass
class DecodeOptions:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0  # base of the per-sample random streams
    sample_keys: tuple[int, ...] = ()  # random-stream key of each sample id (empty: the id itself)
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class EngineCounters:
    prefill_tokens: int = 0
    peak_kv_tokens: int = 0
    peak_kv_bytes: int = 0
    num_preemptions: int = 0
    recomputed_tokens: int = 0
    generated_tokens: int = 0
    model_time_s: float = 0.0  # prefill, decode forward passes and token selection (the rest is overhead)


class Engine(Protocol):
    counters: EngineCounters

    def start(self, slot: int, spec: Any) -> None:
        """Begin decoding `spec` (a SampleSpec) in `slot` before the next decode step."""

    def decode_step(self, active: dict[int, Any]) -> list[tuple[int, int]]:
        """One forward pass over the active slots; returns (sample_id, length) of samples that ended."""

    def tokens(self, sample_id: int) -> list[int]:
        """Tokens generated so far by a sample (complete once it has ended)."""

    def finish_reason(self, sample_id: int) -> str:
        """'eos' or 'length' for an ended sample."""
