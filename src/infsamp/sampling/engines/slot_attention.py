"""Decode attention straight from the slot cache: the call's shared prefix and the shared prompt
rows are read where they are, never repeated per slot, concatenated, or repeated per query head.

The model's own attention (sdpa, eager) wants one key tensor per sequence, so the plain path
builds `cat(prompt rows, sample columns)` in every layer and step and, with grouped-query attention,
repeats it per query head (`repeat_kv`): per layer up to (1 + heads / kv_heads) times that
layer's whole slot KV in temporaries. Here the scores are computed in parts, q.K_prefix
(when the call shares one), q.K_prompt and q.K_slots, with the query heads grouped under their KV
head ([S, H, 1, D] -> [S, H_kv, r, D]), one softmax over all, and the value products summed: the
only temporaries are the scores ([S, H, L + P + W]), the samples' own columns (viewed or gathered
by the cache's `update`) and, when samples belong to different groups, each one's prompt row.

`slot_attention(model, cache)` switches the model's attention to this function for one decode
forward and back; the cache's `update` then returns the samples' own columns only. A layer that
asks for more than plain attention (a sliding window, logit soft-capping, attention sinks) gets
the model's own attention function over the concatenated keys, as before.

Shapes: S = the samples running this step (one row each); H, H_kv query and KV heads,
r = H / H_kv, L the shared prefix, P the widest prompt row, W the sample columns attended this
step.

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


def supports_packed(model) -> bool:
    """Split attention with no layer asking for more than plain attention (a packed step's
    suffixes are attended here, never by the model's own function)."""
    config = base_model(model).config
    return supports_split(model) and not any(getattr(config, name, None) for name in
                                             ("sliding_window", "attn_logit_softcapping"))


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


def _prompt_product(left: torch.Tensor, cache, layer: int, table: torch.Tensor, rows,
                    values: bool) -> torch.Tensor:
    """left [S, Hk, r, X] times each slot's row of `table` [R, Hk, P, D] (keys, transposed, or
    values; `rows` [S], None: one row shared by every slot): [S, Hk, r, *]."""
    right = table if values else table.transpose(-1, -2)  # [R, Hk, P, D] or [R, Hk, D, P]
    if rows is not None:  # slots of several groups: each slot's own row, gathered once
        return left @ cache.slot_prompt_rows(layer, values, right)  # [S, Hk, *, *]
    micro_group, kv_heads, group, width = left.shape  # one row shared by every slot: no copy of it
    flat = left.transpose(0, 1).reshape(kv_heads, micro_group * group, width)  # [Hk, S*r, X]
    return (flat @ right[0]).reshape(kv_heads, micro_group, group, -1).transpose(0, 1)


def split_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: float | None = None, **kwargs):
    """Attention of one decode query per slot over its prompt row and its slot columns; in a
    packed step (query [1, H, T, D]: new prompt rows' suffixes, then one token per slot) the
    suffixes attend causally to the shared prefix and themselves."""
    cache = _active[-1]
    if not cache.packed_rows:
        return _decode_attention(cache, module, query, key, value, attention_mask, dropout,
                                 scaling, **kwargs)
    num_suffix = sum(width for _, width in cache.packed_rows)
    decoded, _ = _decode_attention(cache, module, query[:, :, num_suffix:].transpose(0, 2), key,
                                   value, attention_mask, dropout, scaling, **kwargs)  # [S,1,H,D]
    parts, start = [], 0
    for row, width in cache.packed_rows:
        parts.append(_suffix_attention(cache, module.layer_idx, query[:, :, start:start + width],
                                       row, scaling))  # [1, w, H, D]
        start += width
    return torch.cat([*parts, decoded.transpose(0, 1)], dim=1), None  # [1, T, H, D]


def _suffix_attention(cache, layer: int, query: torch.Tensor, row: int,
                      scaling: float | None) -> torch.Tensor:
    """A new prompt row's suffix queries [1, H, w, D] over the prefix and the row, causally."""
    width = query.shape[2]
    prefix = cache.prefix_width
    keys = torch.cat([cache.prefix_keys[layer], cache.prompt_keys[layer][row:row + 1, :, :width]],
                     dim=2)  # [1, Hk, L + w, D]
    values = torch.cat([cache.prefix_values[layer],
                        cache.prompt_values[layer][row:row + 1, :, :width]], dim=2)
    causal = torch.ones((width, prefix + width), dtype=torch.bool,
                        device=query.device).tril(prefix)  # [w, L + w]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys.to(query.dtype), values.to(query.dtype), attn_mask=causal, scale=scaling,
        enable_gqa=True)  # [1, H, w, D]
    return out.transpose(1, 2)


def _decode_attention(cache, module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, **kwargs):
    """One decode query per slot ([S, H, 1, D]) over the shared parts and its own columns."""
    layer = module.layer_idx
    if any(kwargs.get(name) is not None for name in SPECIAL_KWARGS):
        keys, values = cache.joined(layer, key, value)
        own = ALL_ATTENTION_FUNCTIONS.get_interface(cache.split_from, None)
        return own(module, query, keys, values, attention_mask, dropout=dropout, scaling=scaling,
                   **kwargs)
    micro_group, num_heads, _, head_dim = query.shape  # [S, H, 1, D]
    kv_heads = key.shape[1]
    grouped = query.reshape(micro_group, kv_heads, num_heads // kv_heads, head_dim)  # [S, Hk, r, D]
    # (keys, values, each slot's row or None: one shared by all) of the shared parts
    shared = [(cache.prefix_keys[layer], cache.prefix_values[layer], None),  # [1, Hk, L, D]
              (cache.prompt_keys[layer], cache.prompt_values[layer], cache.step_rows)]  # [R, ...]
    shared = [part for part in shared if part[0].shape[0] > 0 and part[0].shape[2] > 0]
    parts = [_prompt_product(grouped, cache, layer, k, rows, values=False)
             for k, _, rows in shared]
    parts.append(grouped @ key.transpose(-1, -2))  # [S, Hk, r, W]
    scores = torch.cat(parts, dim=-1).float() * (scaling or head_dim ** -0.5)  # [S, Hk, r, L+P+W]
    if attention_mask is not None:  # [S, 1, 1, L + P + W]: bool (sdpa) or additive (eager)
        scores = (scores.masked_fill(~attention_mask, float("-inf"))
                  if attention_mask.dtype == torch.bool else scores + attention_mask)
    probs = scores.softmax(-1).to(value.dtype)  # [S, Hk, r, L + P + W]
    width = sum(k.shape[2] for k, _, _ in shared)
    out = probs[..., width:] @ value  # [S, Hk, r, D]
    start = 0
    for keys, values, rows in shared:
        end = start + keys.shape[2]
        out = out + _prompt_product(probs[..., start:end], cache, layer, values, rows,
                                     values=True)
        start = end
    return out.reshape(micro_group, 1, num_heads, head_dim), None  # [S, 1, H, D], as sdpa's


AttentionInterface.register(NAME, split_attention_forward)
