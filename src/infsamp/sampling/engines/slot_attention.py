"""Decode attention straight from the slot cache: the shared prompt rows are read where they are,
never repeated per slot, concatenated, or repeated per query head.

The model's own attention (sdpa, eager) wants one key tensor per sequence, so the plain path
builds `cat(prompt rows, sample columns)` in every layer and step and, with grouped-query attention,
repeats it per query head (`repeat_kv`): per layer up to (1 + heads / kv_heads) times that
layer's whole slot KV in temporaries. Here the scores are computed in two parts, q.K_prompt and
q.K_slots, with the query heads grouped under their KV head ([S, H, 1, D] -> [S, H_kv, r, D]), one
softmax over both, and the two value products summed: the only temporaries are the scores
([S, H, P + W]), the samples' own columns (viewed or gathered by the cache's `update`) and,
when samples belong to different groups, each one's prompt row.

`slot_attention(model, cache)` switches the model's attention to this function for one decode
forward and back; the cache's `update` then returns the samples' own columns only. A layer that
asks for more than plain attention (a sliding window, logit soft-capping, attention sinks) gets
the model's own attention function over the concatenated keys, as before.

Shapes: S = the samples running this step (one row each); H, H_kv query and KV heads,
r = H / H_kv, P the widest prompt row, W the sample columns attended this step.

Deliberately simple: one query position per slot (decode); prefill runs the model's own attention.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from infsamp.models.device import base_model

NAME = "infsamp_slots"
SPECIAL_KWARGS = ("sliding_window", "softcap", "s_aux", "sinks")  # beyond plain attention
_active: list = []  # the slot cache of the decode forward in progress


def supports_split(model) -> bool:
    """Text models whose attention is the library's sdpa or eager (what the slot cache feeds)."""
    return getattr(base_model(model).config, "_attn_implementation", None) in ("sdpa", "eager")


@contextlib.contextmanager
def slot_attention(model, cache):
    """This forward's attention reads `cache` in place (see the module docstring)."""
    config = base_model(model).config
    original = config._attn_implementation
    config._attn_implementation = NAME
    try:
        with reading_in_place(cache, original):
            yield
    finally:
        config._attn_implementation = original


@contextlib.contextmanager
def reading_in_place(cache, split_from: str):
    """`split_attention_forward` reads `cache` (its `update` returns the samples' columns
    alone), for a caller that calls it itself (`lean_decode.py`: no model config to switch);
    `split_from`: the model's own attention, for layers that ask for more than plain."""
    cache.split_from = split_from
    _active.append(cache)
    try:
        yield
    finally:
        _active.pop()
        cache.split_from = None


def _prompt_product(left: torch.Tensor, cache, layer: int, values: bool) -> torch.Tensor:
    """left [S, Hk, r, X] times each slot's prompt row of the layer's keys (transposed) or
    values [R, Hk, P, D]: [S, Hk, r, *]."""
    table = (cache.prompt_values if values else cache.prompt_keys)[layer]
    right = table if values else table.transpose(-1, -2)  # [R, Hk, P, D] or [R, Hk, D, P]
    if cache.step_rows is not None:  # slots of several groups: each slot's own row
        return left @ cache.slot_prompt_rows(layer, values, right)  # [S, Hk, *, *] gathered
    micro_group, kv_heads, group, width = left.shape  # one row shared by every slot: no copy of it
    flat = left.transpose(0, 1).reshape(kv_heads, micro_group * group, width)  # [Hk, S*r, X]
    return (flat @ right[0]).reshape(kv_heads, micro_group, group, -1).transpose(0, 1)


def split_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: float | None = None, **kwargs):
    """Attention of one decode query per slot over its prompt row and its slot columns."""
    cache = _active[-1]
    layer = module.layer_idx
    if any(kwargs.get(name) is not None for name in SPECIAL_KWARGS):
        keys, values = cache.joined(layer, key, value)
        own = ALL_ATTENTION_FUNCTIONS.get_interface(cache.split_from, None)
        return own(module, query, keys, values, attention_mask, dropout=dropout, scaling=scaling,
                   **kwargs)
    micro_group, num_heads, _, head_dim = query.shape  # [S, H, 1, D]
    kv_heads = key.shape[1]
    grouped = query.reshape(micro_group, kv_heads, num_heads // kv_heads, head_dim)  # [S, Hk, r, D]
    prompt_k = cache.prompt_keys[layer]  # [R, Hk, P, D]
    has_prompt = prompt_k.shape[0] > 0 and prompt_k.shape[2] > 0
    parts = [grouped @ key.transpose(-1, -2)]  # [S, Hk, r, W]
    if has_prompt:
        parts.insert(0, _prompt_product(grouped, cache, layer, values=False))
    scores = torch.cat(parts, dim=-1).float() * (scaling or head_dim ** -0.5)  # [S, Hk, r, P + W]
    if attention_mask is not None:  # [S, 1, 1, P + W]: bool (sdpa) or additive (eager)
        scores = (scores.masked_fill(~attention_mask, float("-inf"))
                  if attention_mask.dtype == torch.bool else scores + attention_mask)
    probs = scores.softmax(-1).to(value.dtype)  # [S, Hk, r, P + W]
    width = prompt_k.shape[2] if has_prompt else 0
    out = probs[..., width:] @ value  # [S, Hk, r, D]
    if has_prompt:
        out = out + _prompt_product(probs[..., :width], cache, layer, values=True)
    return out.reshape(micro_group, 1, num_heads, head_dim), None  # [S, 1, H, D], as sdpa's


AttentionInterface.register(NAME, split_attention_forward)
