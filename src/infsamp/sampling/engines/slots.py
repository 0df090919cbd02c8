"""The slot engine: decode slots over a transformers causal LM, with each group's prompt KV held
once and every sample's own KV in one pool of token positions.

Memory layout (per layer, keys and values alike):

    prompt table  [R, H_kv, P_max, D]   one row per group alive now (prompt minus its last token)
    column pool   [H_kv, N, D]          N token positions, preallocated for the call (the
                                        scheduler's `max_running_tokens`), never regrown

A running sample owns pool positions, one per KV column it has written (`table`): a
sample of length L writes L columns (step 1 feeds the prompt's last token, step n writes the KV of
its input as column n-1), each taken from the free list when written and all given back when it
ends or is parked. So the pool holds what samples have written, not a row of max_new_tokens per
slot, and a slot is only a number: more samples than g can run as long as the scheduler's books
(which never reserve more than the pool) hold them. Each step runs the running samples only:
attention sees, through the cache object below, each one's prompt row and its columns gathered
from the pool ([S, H_kv, W, D]) under a [S, 1, 1, P_max + W] mask: the group's shared prompt plus
the sample's own tokens and nothing else. `slot_attention.py` reads the prompt rows in place; a
model whose attention is neither sdpa nor eager gets `cat(prompt rows, columns)` from `update`
instead. Rotary positions are explicit (`position_ids = prompt_len - 1 + n`), so the order of key
columns is free.

Why not transformers' continuous batching (checked on 5.24): its loop runs in a background thread,
draws tokens with one global `torch.multinomial` (no per-sample random streams, so policies could
not agree sample for sample), accepts only its fixed temperature/top-k/top-p processors (no
per-sample forced lengths), and forks the `num_return_sequences` children of a request all at
prefill time, so a slot refilled later with the 20th sample of a group has no parent whose prompt
blocks it can share. This file is the missing piece: a few hundred lines over the model's ordinary
forward.

Parking: a sample the scheduler takes out of its slot keeps its tokens; with `Sample.parked_kv` its
columns are copied out (`parked` store, counted in the held KV) and back into fresh positions when
it resumes, else they are given back and recomputed at resume by one forward over its tokens
against its group's prompt row. Both happen at the next decode step, after every sample parked in
that admission has given its positions back.

Deliberately simple: positions of one token each (no blocks: the gather is per token); one gather
of each sample's columns per layer and step.
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

    def __init__(self, num_layers: int, pool_tokens: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, num_samples: int = 1,
                 max_columns: int = 1):
        shape = (kv_heads, pool_tokens, head_dim)  # a gather of positions: [H, S, W, D]
        self.pool_keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.pool_values = [torch.zeros(shape, dtype=dtype, device=device)
                            for _ in range(num_layers)]
        self._free = list(range(pool_tokens - 1, -1, -1))  # a stack: the lowest position on top
        # the pool position of each sample's KV columns, [samples, columns] (stale past the ones
        # it has written, `num_columns`: masked)
        self.table = torch.zeros((num_samples, max_columns), dtype=torch.long, device=device)
        self.num_columns: dict[int, int] = {}  # sample id -> KV columns it holds in the pool
        empty = (0, kv_heads, 0, head_dim)
        self.prompt_keys = [torch.zeros(empty, dtype=dtype, device=device)
                            for _ in range(num_layers)]
        self.prompt_values = [torch.zeros(empty, dtype=dtype, device=device)
                              for _ in range(num_layers)]
        self.parked: dict[int, tuple[list, list]] = {}  # sample id -> kept (keys, values) per layer
        self.group_rows: dict[int, int] = {}  # group id -> row of the prompt table
        self.prompt_lengths: list[int] = []  # KV tokens of each row (prompt length - 1)
        self.device = device
        # this step's layout (`prepare_step`): prompt row of each sample (None: one row), the
        # position each one writes, and the positions of its columns (padded)
        self.step_rows: torch.Tensor | None = None
        self.write_positions = torch.zeros(0, dtype=torch.long, device=device)  # [S]
        self.read_positions = torch.zeros((0, 1), dtype=torch.long, device=device)  # [S, W]
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
        return self.pool_keys + self.pool_values + self.prompt_keys + self.prompt_values + parked

    def held_tokens(self) -> int:
        num_rows, _, prompt_width, _ = self.prompt_keys[0].shape
        parked = sum(keys[0].shape[1] for keys, _ in self.parked.values())
        return self.pool_keys[0].shape[1] + num_rows * prompt_width + parked

    # ---- a sample's columns
    def allocate(self, sample_id: int, num_columns: int = 1) -> list[int]:
        """`num_columns` more pool positions for a sample (its next KV columns)."""
        if len(self._free) < num_columns:
            raise RuntimeError(f"slot KV pool full ({self.pool_keys[0].shape[1]} tokens): the "
                               "scheduler's books let more KV run than the pool was sized for")
        positions = [self._free.pop() for _ in range(num_columns)]
        held = self.num_columns.get(sample_id, 0)
        if num_columns == 1:
            self.table[sample_id, held] = positions[0]
        else:
            self.table[sample_id, held:held + num_columns] = torch.tensor(positions)
        self.num_columns[sample_id] = held + num_columns
        return positions

    def positions(self, sample_id: int) -> torch.Tensor:
        """The pool positions of a sample's columns, in order: [n]."""
        return self.table[sample_id, :self.num_columns.get(sample_id, 0)]

    def release(self, sample_id: int) -> None:
        """A sample's positions back to the free list (it ended, or was parked)."""
        self._free.extend(reversed(self.positions(sample_id).tolist()))
        self.num_columns.pop(sample_id, None)

    def write(self, sample_id: int, keys: Sequence[torch.Tensor],
              values: Sequence[torch.Tensor]) -> None:
        """Per layer [H, n, D] as a sample's first n columns (a resumed sample's KV)."""
        positions = torch.tensor(self.allocate(sample_id, keys[0].shape[1]), device=self.device)
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.pool_keys[layer][:, positions] = k.to(self.pool_keys[layer].dtype)
            self.pool_values[layer][:, positions] = v.to(self.pool_values[layer].dtype)

    # ---- parked samples
    def park(self, sample_id: int) -> None:
        """Copy a sample's columns out (per layer [H, n, D]) and give its positions back."""
        positions = self.positions(sample_id)
        self.parked[sample_id] = ([k[:, positions] for k in self.pool_keys],  # copies
                                  [v[:, positions] for v in self.pool_values])
        self.release(sample_id)

    def unpark(self, sample_id: int) -> bool:
        """A parked sample's kept columns back into the pool; False if none were kept."""
        if sample_id not in self.parked:
            return False
        self.write(sample_id, *self.parked.pop(sample_id))
        return True

    # ---- per step
    def prepare_step(self, sample_ids: list[int], slot_rows: list[int], write_index: list[int],
                     is_causal_eager: bool) -> torch.Tensor:
        """Set this step's layout for the running samples (each has its column `write_index`
        allocated); returns the attention mask [S, 1, 1, P_max + W] (bool, or additive)."""
        device = self.device
        width = max(write_index) + 1
        ids = torch.tensor(sample_ids, device=device)  # [S]
        written = torch.tensor(write_index, device=device)  # [S]
        self.write_positions = self.table[ids, written]  # [S]
        self.read_positions = self.table[ids, :width]  # [S, W]
        num_rows = len(self.prompt_lengths)
        self.step_rows = None if num_rows <= 1 else torch.tensor(slot_rows, device=device)
        lengths = torch.tensor([self.prompt_lengths[r] if num_rows else 0 for r in slot_rows],
                               device=device)  # [S]
        prompt_cols = torch.arange(self.prompt_keys[0].shape[2], device=device)
        slot_cols = torch.arange(width, device=device)
        mask = torch.cat([prompt_cols[None, :] < lengths[:, None],
                          slot_cols[None, :] <= written[:, None]], dim=1)  # [S, P_max + W]
        mask = mask[:, None, None, :]
        if is_causal_eager:
            dtype = self.pool_keys[0].dtype
            return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(
                ~mask, torch.finfo(dtype).min)
        return mask

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               **_: Any):
        """Write the step's K/V [S, H, 1, D] at each sample's new position; return its columns
        (prompt included unless slot_attention reads the prompt rows itself) to attend."""
        pool_k, pool_v = self.pool_keys[layer_idx], self.pool_values[layer_idx]
        # under autocast (precision mixed) K/V come in bf16 or fp32: store the cache's dtype
        pool_k[:, self.write_positions] = key_states[:, :, 0].transpose(0, 1).to(pool_k.dtype)
        pool_v[:, self.write_positions] = value_states[:, :, 0].transpose(0, 1).to(pool_v.dtype)
        keys = pool_k[:, self.read_positions].transpose(0, 1)  # [H, S, W, D] -> [S, H, W, D]
        values = pool_v[:, self.read_positions].transpose(0, 1)
        if self.split_from is not None:  # slot_attention reads the prompt rows itself
            return keys, values
        return self.joined(layer_idx, keys, values)

    def joined(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor):
        """Each sample's prompt row and its columns as one tensor: [S, H, P_max + W, D] each."""
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
    keeps_parked_kv = True  # a parked sample's KV can be held (copied out of the pool)
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
                   num_slots: int, options: DecodeOptions, stats: SamplerStats,
                   processor: SlotLogitsProcessor | None = None,
                   pool_tokens: int | None = None) -> None:
        """`pool_tokens`: the KV positions running samples may hold at once (the scheduler's
        `max_running_tokens`); None: a whole completion per slot."""
        config, param = self.model.config, next(self.model.parameters())
        head_dim = getattr(config, "head_dim",
                           None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        max_new = max(s.max_new_tokens for s in samples)
        self.cache = SlotKVCache(config.num_hidden_layers, pool_tokens or num_slots * max_new,
                                 kv_heads, head_dim, param.dtype, param.device, len(samples),
                                 max_new)
        self.device, self.prompts, self.options, self.stats = param.device, prompts, options, stats
        if processor is None and options.target_lengths is not None:
            processor = ForcedLengths(options.target_lengths, options.eos_token_ids[0])
        self.processor = processor
        self.warpers = build_warpers(options)
        self.eos_ids = set(options.eos_token_ids)
        self.turn_ends = options.turn_ends
        self.remaining = Counter(s.group_id for s in samples)  # samples of a group not yet ended
        self.slot_sample: list[Sample | None] = [None] * num_slots
        self.to_restore: list[Sample] = []  # resumed samples whose KV is not in the pool yet
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
        if sample.token_ids:  # parked, or back from a tool call (maybe to the slot it left)
            self._resume(sample)
        self.slot_sample[slot] = sample

    def decode_step(self, active: dict[int, Sample]) -> list[Sample]:
        self._drop_taken_back(active)
        for sample in self.to_restore:  # after every parked sample gave its positions back
            self.cache.unpark(sample.sample_id)
            self._recompute(sample)  # what it lacks: all, or the tool tokens appended since
        self.to_restore = []
        running = [active[slot] for slot in sorted(active)]
        inputs, positions, write_index, rows = self._step_layout(running)
        mask = self.cache.prepare_step([s.sample_id for s in running], rows, write_index,
                                       self.eager_mask)
        start = time.perf_counter()
        with torch.inference_mode():
            logits, hidden = self._forward(inputs, positions, mask)  # [S, V], [S, H] or None
            tokens = self._select(logits, running, write_index).tolist()
        self.stats.model_time_s += time.perf_counter() - start
        if hidden is not None:
            for sample, state in zip(running, hidden.float().cpu().numpy()):
                sample.hidden_state = state  # the last layer at its latest token
        return self._record(running, tokens)

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
    def _step_layout(self, running: list[Sample]):
        """Each running sample's input token, position and new column (allocated here)."""
        inputs, positions, write_index, rows = [], [], [], []
        for sample in running:
            done, prompt = sample.token_ids, self.prompts[sample.group_id]
            inputs.append(done[-1] if done else prompt[-1])
            positions.append(len(prompt) - 1 + len(done))
            write_index.append(len(done))
            rows.append(self.cache.group_rows[sample.group_id])
            if self.cache.num_columns.get(sample.sample_id, 0) == len(done):
                self.cache.allocate(sample.sample_id)
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

    def _select(self, logits: torch.Tensor, running: list[Sample],
                write_index: list[int]) -> torch.Tensor:
        sample_ids = torch.tensor([s.sample_id for s in running], device=self.device)  # [S]
        num_generated = torch.tensor(write_index, device=self.device)  # [S]
        if self.processor is not None:
            logits = self.processor(sample_ids, num_generated, logits)
        return select_tokens(logits, sample_ids, num_generated, self.options, self.warpers)

    def _record(self, running: list[Sample], tokens: list[int]) -> list[Sample]:
        ended = []
        for sample, token in zip(running, tokens):
            sample.token_ids.append(token)
            if token in self.eos_ids and self.turn_ends is not None and self.turn_ends(sample):
                sample.finish_reason = "tool_call"  # the sampler parks it while its call runs
                ended.append(sample)
                continue
            if token in self.eos_ids or sample.num_tokens >= sample.max_new_tokens:
                sample.finish_reason = "eos" if token in self.eos_ids else "length"
                ended.append(sample)
                self.cache.release(sample.sample_id)
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
        """A parked sample leaves its slot: its KV is copied out if the books keep it, else its
        positions are given back."""
        sample = self.slot_sample[slot]
        if sample.parked_kv:
            self.cache.park(sample.sample_id)
            self._track_peak()
        else:
            self.cache.release(sample.sample_id)
        self.slot_sample[slot] = None

    def _resume(self, sample: Sample) -> None:
        """A parked sample starts again: still in the slot it was parked from in this very
        admission (its columns intact: it only changes slot; tool tokens appended since are
        computed at the next decode step), else its KV is restored at the next decode step
        (`to_restore`)."""
        for source, other in enumerate(self.slot_sample):
            if other is sample:
                self.slot_sample[source] = None
                if self.cache.num_columns.get(sample.sample_id, 0) < sample.num_tokens:
                    self.to_restore.append(sample)
                return
        self.to_restore.append(sample)

    def _recompute(self, sample: Sample) -> None:
        """KV of the inputs [prompt's last token, tokens[:-1]] the sample's columns lack (all of
        them, or those after its kept columns: tool tokens appended while it waited), attending
        to its group's prompt row and its kept columns."""
        held = self.cache.num_columns.get(sample.sample_id, 0)
        num_tokens = sample.num_tokens
        if held >= num_tokens:
            return
        row, prompt = self.cache.group_rows[sample.group_id], self.prompts[sample.group_id]
        width = self.cache.prompt_lengths[row]
        kept = self.cache.positions(sample.sample_id)  # [held]
        cache = DynamicCache(config=self.model.config)
        if width or held:
            for layer, (k, v) in enumerate(zip(self.cache.prompt_keys, self.cache.prompt_values)):
                own_k = self.cache.pool_keys[layer][:, kept][None]  # [1, H, held, D]
                own_v = self.cache.pool_values[layer][:, kept][None]
                cache.update(torch.cat([k[row:row + 1, :, :width], own_k.to(k.dtype)], dim=2),
                             torch.cat([v[row:row + 1, :, :width], own_v.to(v.dtype)], dim=2),
                             layer)
        inputs = torch.tensor([[prompt[-1], *sample.token_ids[:-1]][held:]],
                              device=self.device)  # [1, n]
        positions = torch.arange(len(prompt) - 1 + held, len(prompt) - 1 + num_tokens,
                                 device=self.device)[None, :]  # [1, n]
        start = time.perf_counter()
        with torch.inference_mode():
            self.model(input_ids=inputs, position_ids=positions, use_cache=True, logits_to_keep=1,
                       **{self.cache_kwarg: cache})
        self.stats.model_time_s += time.perf_counter() - start
        self.cache.write(sample.sample_id,
                         [c.keys[0, :, width + held:] for c in cache.layers],  # [H, n, D]
                         [c.values[0, :, width + held:] for c in cache.layers])

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
