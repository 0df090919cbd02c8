"""The decode step's bound: the model's own forward of the same rows over a ready cache.

The bound is a slot engine step without what the engine adds (laying the step out, gathering or
viewing each sample's KV, the mask, token selection): the same rows (one query token each, each
attending to as many KV columns as in the engine) through the model's own forward and attention
over `ReadyCache`, contiguous K/V already laid out ([S, H_kv, W, D] per layer, the step's new
column written in place); the LM head included. A tighter floor beside it, `matmul_seconds`:
every linear layer of the model applied to S rows once, nothing else.

`bound_seconds` replays a step of `SlotEngine.step_log` here, so `infsamp bench sampling --bound`
prints the engine's decode-step time beside the bound of the very same steps (docs/decoding.md).

Deliberately simple: the prompt is held per row (a plain batch, as transformers' generate holds
it); random cache contents (a forward's time does not depend on them); one timing per step, wall
and CPU seconds (the machine may be shared).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from infsamp.models.device import base_model
from infsamp.planner.presets import shape_from_config
from infsamp.sampling.engines.slots import cache_kwarg_name


class ReadyCache:
    """Duck-typed transformers cache over preallocated contiguous K/V: [S, H_kv, W, D] per layer,
    row i holding `lengths[i]` columns (its last one written by the step)."""

    def __init__(self, model, lengths: Sequence[int], generator: torch.Generator):
        shape, param = shape_from_config(base_model(model).config), next(model.parameters())
        size = (len(lengths), shape.num_key_value_heads, max(lengths), shape.head_dim)
        self.keys = [torch.randn(size, generator=generator).to(param.dtype)
                     for _ in range(shape.num_hidden_layers)]
        self.values = [torch.randn(size, generator=generator).to(param.dtype)
                       for _ in range(shape.num_hidden_layers)]
        self.write_index = torch.tensor(lengths) - 1  # [S] the column the step writes
        self.rows = torch.arange(len(lengths))  # [S]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               **_: Any):
        """Write the step's K/V [S, H, 1, D] at each row's last column; return the whole cache."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[self.rows, :, self.write_index] = key_states[:, :, 0].to(keys.dtype)
        values[self.rows, :, self.write_index] = value_states[:, :, 0].to(values.dtype)
        return keys, values

    # transformers' mask helpers look for these on cache objects
    is_sliding = is_linear = is_dummy = ()


def ready_step_inputs(model, lengths: Sequence[int], seed: int = 0) -> dict:
    """The model's keyword arguments for one decode step of rows with these KV lengths."""
    generator = torch.Generator().manual_seed(seed)
    config = base_model(model).config
    device = next(model.parameters()).device
    lengths_t = torch.tensor(lengths, device=device)  # [S]
    columns = torch.arange(max(lengths), device=device)  # [W]
    mask = (columns[None, :] < lengths_t[:, None])[:, None, None, :]  # [S, 1, 1, W]
    if getattr(config, "_attn_implementation", "sdpa") == "eager":
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(
            ~mask, torch.finfo(dtype).min)
    input_ids = torch.randint(0, config.vocab_size, (len(lengths), 1), generator=generator)
    return {"input_ids": input_ids.to(device),  # [S, 1]
            "position_ids": (lengths_t - 1)[:, None],  # [S, 1]
            "attention_mask": mask, "use_cache": True,
            cache_kwarg_name(model): ReadyCache(model, lengths, generator)}


def bound_seconds(model, lengths: Sequence[int]) -> tuple[float, float]:
    """Wall and CPU seconds of one forward of rows with these KV lengths over a ready cache."""
    inputs = ready_step_inputs(model, lengths)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            start, cpu_start = time.perf_counter(), time.process_time()
            model(**inputs).logits[:, -1].float()  # [S, V], as the engine takes them
            return time.perf_counter() - start, time.process_time() - cpu_start
    finally:
        model.train(was_training)


def matmul_seconds(model, num_rows: int) -> tuple[float, float]:
    """Wall and CPU seconds of the step's matrix products: each linear layer of the model on
    `num_rows` rows (inputs [S, in_features], random)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    param = next(model.parameters())
    inputs = {m.in_features: torch.randn(num_rows, m.in_features, dtype=param.dtype,
                                         device=param.device) for m in linears}  # [S, in]
    with torch.inference_mode():
        start, cpu_start = time.perf_counter(), time.process_time()
        for layer in linears:
            torch.nn.functional.linear(inputs[layer.in_features], layer.weight, layer.bias)
        return time.perf_counter() - start, time.process_time() - cpu_start


BOUND_STEPS = 24  # decode steps of a cell replayed for its bound (evenly spaced)


def step_figures(model, step_log: list[tuple[float, float, list[int]]]) -> dict:
    """The engine's decode steps (`SlotEngine.step_log`) beside both bounds of the same steps:
    the model's own forward over a ready cache and its matrix products alone; up to BOUND_STEPS
    of the steps, evenly spaced, replayed now. Per step means in ms, wall and CPU."""
    chosen = step_log[::max(1, math.ceil(len(step_log) / BOUND_STEPS))]
    parts = {"step": [(wall, cpu) for wall, cpu, _ in chosen],
             "forward": [bound_seconds(model, lengths) for _, _, lengths in chosen],
             "matmul": [matmul_seconds(model, len(lengths)) for _, _, lengths in chosen]}
    figures = {"bound_steps": len(chosen),
               "decode_step_ms": 1000 * sum(w for w, _, _ in step_log) / len(step_log)}
    for name, times in parts.items():
        figures[f"{name}_ms"] = 1000 * sum(w for w, _ in times) / len(times)
        figures[f"{name}_cpu_ms"] = 1000 * sum(c for _, c in times) / len(times)
    for name in ("forward", "matmul"):
        figures[f"step_over_{name}"] = figures["step_ms"] / max(figures[f"{name}_ms"], 1e-9)
        figures[f"step_over_{name}_cpu"] = (figures["step_cpu_ms"]
                                            / max(figures[f"{name}_cpu_ms"], 1e-9))
    return figures
