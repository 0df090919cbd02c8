"""The slot engine: g decode slots over a transformers causal LM, with each group's prompt KV held
once.

Memory layout (per layer, keys and values alike):

    prompt table  [R, H_kv, P_max, D]   one row per group alive now (prompt minus its last token)
    slot buffers  [S, H_kv, C, D]       one row per slot, C = max_new_tokens; preallocated,
                                        never regrown

A sample of length L occupies its slot for exactly L decode steps: step 1 feeds the prompt's last
token, step n writes the KV of its input at column n-1 of the slot row. Each step attention sees,
through the cache object below, the prompt rows of the slots' groups and the slot columns [0, W)
under a [S, 1, 1, P_max + W] mask: the group's shared prompt plus the slot's own tokens and nothing
else. `slot_attention.py` reads both in place (no per-step copy); a model whose attention is neither
sdpa nor eager gets `cat(prompt rows, slot columns)` from `update` instead. Rotary
positions are explicit (`position_ids = prompt_len - 1 + n`), so the order of key columns is free.

Why not transformers' continuous batching (checked on 5.24): its loop runs in a background thread,
draws tokens with one global `torch.multinomial` (no per-sample random streams, so policies could
not agree sample for sample), accepts only its fixed temperature/top-k/top-p processors (no
per-sample forced lengths), and forks the `num_return_sequences` children of a request all at
prefill time, so a slot refilled later with the 20th sample of a group has no parent whose prompt
blocks it can share. This file is the missing piece: under 300 lines over the model's ordinary
forward.

Parking: a sample the scheduler takes out of its slot keeps its tokens; with `Sample.parked_kv` its
slot row's columns are copied out (`parked` store, counted in the held KV) and copied back into
whichever slot it resumes in, else they are dropped and recomputed at resume by one forward over
its tokens against its group's prompt row.

Deliberately simple: rectangular slot buffers (a slot reserves max_new_tokens columns; a paged pool
would hold only what samples have written); rows of inactive slots are computed and ignored, as
`generate` does.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from infsamp.models.device import base_model
from infsamp.sampling.engines.base import DecodeOptions, SlotLogitsProcessor
from infsamp.sampling.engines.select import ForcedLengths, build_warpers, select_tokens
from infsamp.sampling.engines.slot_attention import slot_attention, supports_split
from infsamp.sampling.types import Sample, SamplerStats


class SlotKVCache:
    """Duck-typed transformers cache: the model calls `update(k, v, layer_idx)` once per layer and
    step."""

    def __init__(self, num_layers: int, micro_group: int, slot_capacity: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        shape = (micro_group, kv_heads, slot_capacity, head_dim)
        self.slot_keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.slot_values = [torch.zeros(shape, dtype=dtype, device=device)
                            for _ in range(num_layers)]
        empty = (0, kv_heads, 0, head_dim)
        self.prompt_keys = [torch.zeros(empty, dtype=dtype, device=device)
                            for _ in range(num_layers)]
        self.prompt_values = [torch.zeros(empty, dtype=dtype, device=device)
                              for _ in range(num_layers)]
        self.parked: dict[int, tuple[list, list]] = {}  # sample id -> kept (keys, values) per layer
        self.group_rows: dict[int, int] = {}  # group id -> row of the prompt table
        self.prompt_lengths: list[int] = []  # KV tokens of each row (prompt length - 1)
        self.slot_index = torch.arange(micro_group, device=device)
        # [S] prompt row of each slot this step; None: one row
        self.step_rows: torch.Tensor | None = None
        self.write_index = torch.zeros(micro_group, dtype=torch.long, device=device)  # [S]
        self.width = 1  # slot columns attended this step
        self.split_from: str | None = None  # set while slot_attention reads the cache in place

    # ---- prompt table
    def add_prompt(self, group_id: int, keys: Sequence[torch.Tensor],
                   values: Sequence[torch.Tensor]) -> None:
        """Append a group's prompt KV (per layer [1, H, P-1, D]) as a new row of the table."""
        self.group_rows[group_id] = len(self.prompt_lengths)
        self.prompt_lengths.append(keys[0].shape[2])
        self.prompt_keys = [_append_row(t, k.to(t.dtype)) for t, k in zip(self.prompt_keys, keys)]
        self.prompt_values = [_append_row(t, v.to(t.dtype))
                              for t, v in zip(self.prompt_values, values)]

    def drop_prompt(self, group_id: int) -> None:
        row = self.group_rows.pop(group_id)
        del self.prompt_lengths[row]
        self.group_rows = {g: r - (r > row) for g, r in self.group_rows.items()}
        width = max(self.prompt_lengths, default=0)
        keep = [r for r in range(len(self.prompt_lengths) + 1) if r != row]
        self.prompt_keys = [t[keep, :, :width].contiguous() for t in self.prompt_keys]
        self.prompt_values = [t[keep, :, :width].contiguous() for t in self.prompt_values]

    def held_tensors(self) -> list[torch.Tensor]:
        parked = [t for keys, values in self.parked.values() for t in (*keys, *values)]
        return self.slot_keys + self.slot_values + self.prompt_keys + self.prompt_values + parked

    def held_tokens(self) -> int:
        micro_group, _, capacity, _ = self.slot_keys[0].shape
        num_rows, _, prompt_width, _ = self.prompt_keys[0].shape
        parked = sum(keys[0].shape[1] for keys, _ in self.parked.values())
        return micro_group * capacity + num_rows * prompt_width + parked

    # ---- parked samples
    def park(self, sample_id: int, slot: int, num_tokens: int) -> None:
        """Copy a slot row's first `num_tokens` columns out (per layer [H, n, D])."""
        self.parked[sample_id] = ([k[slot, :, :num_tokens].clone() for k in self.slot_keys],
                                  [v[slot, :, :num_tokens].clone() for v in self.slot_values])

    def unpark(self, sample_id: int, slot: int) -> bool:
        """Copy a parked sample's columns into `slot`'s row; False if none were kept."""
        if sample_id not in self.parked:
            return False
        keys, values = self.parked.pop(sample_id)
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.slot_keys[layer][slot, :, : k.shape[1]] = k
            self.slot_values[layer][slot, :, : v.shape[1]] = v
        return True

    def move(self, source: int, slot: int, num_tokens: int) -> None:
        for table in (*self.slot_keys, *self.slot_values):
            table[slot, :, :num_tokens] = table[source, :, :num_tokens]

    # ---- per step
    def prepare_step(self, slot_rows: list[int], write_index: list[int],
                     is_causal_eager: bool) -> torch.Tensor:
        """Set this step's layout; returns the attention mask [S, 1, 1, P_max + W] (bool, or
        additive)."""
        self.write_index = torch.tensor(write_index, device=self.slot_index.device)  # [S]
        self.width = max(write_index) + 1
        num_rows = len(self.prompt_lengths)
        self.step_rows = (None if num_rows <= 1
                          else torch.tensor(slot_rows, device=self.slot_index.device))
        lengths = torch.tensor([self.prompt_lengths[r] if num_rows else 0 for r in slot_rows],
                               device=self.slot_index.device)  # [S]
        prompt_cols = torch.arange(self.prompt_keys[0].shape[2], device=lengths.device)
        slot_cols = torch.arange(self.width, device=lengths.device)
        mask = torch.cat([prompt_cols[None, :] < lengths[:, None],
                          slot_cols[None, :] <= self.write_index[:, None]], dim=1)  # [S, P_max + W]
        mask = mask[:, None, None, :]
        if is_causal_eager:
            return torch.zeros(mask.shape, dtype=self.slot_keys[0].dtype,
                               device=mask.device).masked_fill(
                ~mask, torch.finfo(self.slot_keys[0].dtype).min)
        return mask

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               **_: Any):
        """Write the step's K/V [S, H, 1, D] at each slot's column; return prompt + slot K/V to
        attend."""
        slot_k, slot_v = self.slot_keys[layer_idx], self.slot_values[layer_idx]
        # under autocast (precision mixed) K/V come in bf16 or fp32: store the cache's dtype
        slot_k[self.slot_index, :, self.write_index] = key_states[:, :, 0].to(slot_k.dtype)
        slot_v[self.slot_index, :, self.write_index] = value_states[:, :, 0].to(slot_v.dtype)
        keys, values = slot_k[:, :, : self.width], slot_v[:, :, : self.width]  # [S, H, W, D] views
        if self.split_from is not None:  # slot_attention reads the prompt rows itself
            return keys, values
        return self.joined(layer_idx, keys, values)

    def joined(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor):
        """Each slot's prompt row and its slot columns as one tensor: [S, H, P_max + W, D] each."""
        return (self._with_prompt(self.prompt_keys[layer_idx], keys),
                self._with_prompt(self.prompt_values[layer_idx], values))

    def _with_prompt(self, table: torch.Tensor, slot_part: torch.Tensor) -> torch.Tensor:
        if table.shape[0] == 0 or table.shape[2] == 0:
            return slot_part
        rows = table.expand(slot_part.shape[0], -1, -1,
                            -1) if self.step_rows is None else table[self.step_rows]
        return torch.cat([rows, slot_part], dim=2)

    # transformers' mask helpers look for these on cache objects
    is_sliding = is_linear = is_dummy = ()


def _append_row(table: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    width = max(table.shape[2], row.shape[2])
    table = torch.nn.functional.pad(table, (0, 0, 0, width - table.shape[2]))
    row = torch.nn.functional.pad(row, (0, 0, 0, width - row.shape[2]))
    return torch.cat([table, row], dim=0)


class SlotEngine:
    """Executes a SlotScheduler's decisions on a transformers model (see module docstring).

    Long-lived: it reads the trainer's model itself, so `load_weights` only swaps the model object;
    the KV tensors are allocated per call (`begin_call`) and freed at `end_call`."""

    name = "slots"
    kv_block_size = 1
    keeps_parked_kv = True  # a parked sample's KV can be held (copied out of its slot row)
    hands_hidden_states = True
    copies_weights = False  # decodes with the trainer's model itself
    max_micro_group = None
    kv_capacity_tokens = None

    def __init__(self, model, cfg=None, sizes=None):
        self.model = model
        self.eager_mask = getattr(model.config, "_attn_implementation", "sdpa") == "eager"
        self.cache_kwarg = _cache_kwarg_name(model)
        self.cache: SlotKVCache | None = None

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    # ---- Engine protocol
    def begin_call(self, prompts: Sequence[Sequence[int]], samples: Sequence[Sample],
                   micro_group: int, options: DecodeOptions, stats: SamplerStats,
                   processor: SlotLogitsProcessor | None = None) -> None:
        config, param = self.model.config, next(self.model.parameters())
        head_dim = getattr(config, "head_dim",
                           None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        capacity = max(s.max_new_tokens for s in samples)
        self.cache = SlotKVCache(config.num_hidden_layers, micro_group, capacity, kv_heads,
                                 head_dim, param.dtype, param.device)
        self.device, self.prompts, self.options, self.stats = param.device, prompts, options, stats
        if processor is None and options.target_lengths is not None:
            processor = ForcedLengths(options.target_lengths, options.eos_token_ids[0])
        self.processor = processor
        self.warpers = build_warpers(options)
        self.eos_ids = set(options.eos_token_ids)
        self.remaining = Counter(s.group_id for s in samples)  # samples of a group not yet ended
        self.slot_sample: list[Sample | None] = [None] * micro_group
        self.was_training = self.model.training
        self.split = supports_split(self.model)  # decode attention reads the cache in place
        self.model.eval()
        self._track_peak()

    def start(self, slot: int, sample: Sample) -> None:
        previous = self.slot_sample[slot]
        if previous is not None and previous is not sample and previous.finish_reason is None:
            self._take_back(slot)
        if sample.group_id not in self.cache.group_rows:
            self._prefill(sample.group_id)
        if sample.token_ids and previous is not sample:
            self._resume(slot, sample)
        self.slot_sample[slot] = sample

    def decode_step(self, active: dict[int, Sample]) -> list[Sample]:
        self._drop_taken_back(active)
        slots = sorted(active)
        inputs, positions, write_index, rows = self._step_layout()
        mask = self.cache.prepare_step(rows, write_index, self.eager_mask)
        start = time.perf_counter()
        with torch.inference_mode():
            logits, hidden = self._forward(inputs, positions, mask)  # [S, V], [S, H] or None
            tokens = self._select(logits, write_index).tolist()
        self.stats.model_time_s += time.perf_counter() - start
        if hidden is not None:
            self._hand_hidden_states(slots, hidden.float().cpu().numpy())
        return self._record(slots, tokens)

    def end_call(self) -> None:
        self.model.train(self.was_training)
        self.cache = None

    def load_weights(self, model) -> None:
        self.model = model  # the slot engine runs the trainer's own model: nothing to copy

    def reset(self) -> None:
        if self.cache is not None:
            self.end_call()

    def sleep(self) -> None:
        pass  # nothing is held between calls

    def close(self) -> None:
        self.reset()

    # ---- internals
    def _step_layout(self):
        inputs, positions, write_index, rows = [], [], [], []
        for sample in self.slot_sample:
            if sample is None or sample.finish_reason is not None:
                inputs.append(0), positions.append(0), write_index.append(0), rows.append(0)
                continue
            done = sample.token_ids
            prompt = self.prompts[sample.group_id]
            inputs.append(done[-1] if done else prompt[-1])
            positions.append(len(prompt) - 1 + len(done))
            write_index.append(len(done))
            rows.append(self.cache.group_rows[sample.group_id])
        return inputs, positions, write_index, rows

    def _forward(self, inputs: list[int], positions: list[int], mask: torch.Tensor):
        input_ids = torch.tensor(inputs, device=self.device)[:, None]  # [S, 1]
        position_ids = torch.tensor(positions, device=self.device)[:, None]  # [S, 1]
        with slot_attention(self.model, self.cache) if self.split else contextlib.nullcontext():
            out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                             use_cache=True, output_hidden_states=self.options.hidden_states,
                             **{self.cache_kwarg: self.cache})
        hidden = out.hidden_states[-1][:, -1] if self.options.hidden_states else None  # [S, H]
        return out.logits[:, -1].float(), hidden  # [S, V]

    def _hand_hidden_states(self, slots: list[int], hidden) -> None:
        """Each running sample gets the last layer's hidden state at its latest token (numpy)."""
        for slot in slots:
            self.slot_sample[slot].hidden_state = hidden[slot]

    def _select(self, logits: torch.Tensor, write_index: list[int]) -> torch.Tensor:
        sample_ids = torch.tensor([s.sample_id if s is not None else 0 for s in self.slot_sample],
                                  device=self.device)  # [S]
        num_generated = torch.tensor(write_index, device=self.device)  # [S]
        if self.processor is not None:
            logits = self.processor(sample_ids, num_generated, logits)
        return select_tokens(logits, sample_ids, num_generated, self.options, self.warpers)

    def _record(self, slots: list[int], tokens: list[int]) -> list[Sample]:
        ended = []
        for slot in slots:
            sample = self.slot_sample[slot]
            sample.token_ids.append(tokens[slot])
            if tokens[slot] in self.eos_ids or sample.num_tokens >= sample.max_new_tokens:
                sample.finish_reason = "eos" if tokens[slot] in self.eos_ids else "length"
                ended.append(sample)
                self._release_group(sample.group_id)
        return ended

    def _prefill(self, group_id: int) -> None:
        prompt_kv = self.prompts[group_id][:-1]
        cache = DynamicCache(config=self.model.config)
        start = time.perf_counter()
        if prompt_kv:
            input_ids = torch.tensor([prompt_kv], device=self.device)  # [1, P-1]
            with torch.inference_mode():
                self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1,  # logits unused
                           **{self.cache_kwarg: cache})
            keys = [layer.keys for layer in cache.layers]
            values = [layer.values for layer in cache.layers]
        else:  # a one-token prompt: a row of zero width (the table may have no row to copy yet)
            _, kv_heads, _, head_dim = self.cache.prompt_keys[0].shape
            empty = self.cache.prompt_keys[0].new_zeros((1, kv_heads, 0, head_dim))  # [1, H, 0, D]
            keys = values = [empty] * len(self.cache.prompt_keys)
        self.cache.add_prompt(group_id, keys, values)
        self.stats.model_time_s += time.perf_counter() - start
        self.stats.prefill_tokens += len(prompt_kv)
        self._track_peak()

    def _release_group(self, group_id: int) -> None:
        self.remaining[group_id] -= 1
        if self.remaining[group_id] == 0:
            self.cache.drop_prompt(group_id)

    def _drop_taken_back(self, active: dict[int, Sample]) -> None:
        for slot, sample in enumerate(self.slot_sample):
            if sample is None or sample.finish_reason is not None:
                continue
            if active.get(slot) is not sample:  # the scheduler parked it
                self._take_back(slot)

    def _take_back(self, slot: int) -> None:
        """A parked sample leaves its slot: its KV is copied out if the books keep it."""
        sample = self.slot_sample[slot]
        if sample.parked_kv:
            self.cache.park(sample.sample_id, slot, sample.num_tokens)
            self._track_peak()
        self.slot_sample[slot] = None

    def _resume(self, slot: int, sample: Sample) -> None:
        """A parked sample's KV into `slot`: from the slot it still sits in, the parked store,
        or recomputed (one forward over its tokens against the group's prompt)."""
        for source, other in enumerate(self.slot_sample):
            if other is sample:  # parked in this very admission: its row is still intact
                self.cache.move(source, slot, sample.num_tokens)
                self.slot_sample[source] = None
                return
        if not self.cache.unpark(sample.sample_id, slot):
            self._recompute(slot, sample)

    def _recompute(self, slot: int, sample: Sample) -> None:
        """KV of the inputs [prompt's last token, tokens[:-1]] into the slot row's first columns."""
        row, prompt = self.cache.group_rows[sample.group_id], self.prompts[sample.group_id]
        width = self.cache.prompt_lengths[row]
        cache = DynamicCache(config=self.model.config)
        if width:
            for layer, (k, v) in enumerate(zip(self.cache.prompt_keys, self.cache.prompt_values)):
                cache.update(k[row:row + 1, :, :width].clone(), v[row:row + 1, :, :width].clone(),
                             layer)
        num_tokens = sample.num_tokens
        inputs = torch.tensor([[prompt[-1], *sample.token_ids[:-1]]], device=self.device)  # [1, n]
        positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + num_tokens,
                                 device=self.device)[None, :]  # [1, n]
        start = time.perf_counter()
        with torch.inference_mode():
            self.model(input_ids=inputs, position_ids=positions, use_cache=True, logits_to_keep=1,
                       **{self.cache_kwarg: cache})
        self.stats.model_time_s += time.perf_counter() - start
        for layer, cached in enumerate(cache.layers):
            self.cache.slot_keys[layer][slot, :, :num_tokens] = cached.keys[0, :, width:]
            self.cache.slot_values[layer][slot, :, :num_tokens] = cached.values[0, :, width:]

    def _track_peak(self) -> None:
        held = sum(t.numel() * t.element_size() for t in self.cache.held_tensors())
        self.stats.peak_kv_bytes = max(self.stats.peak_kv_bytes, held)
        self.stats.peak_kv_tokens = max(self.stats.peak_kv_tokens, self.cache.held_tokens())
        self.stats.peak_kv_blocks = self.stats.peak_kv_tokens


def _cache_kwarg_name(model) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); use whichever this version
    takes."""
    import inspect

    base = base_model(model)
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
