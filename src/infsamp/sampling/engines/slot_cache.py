"""The slot engine's KV: each group's prompt held once, every running sample's own columns in
one of two layouts, both duck-typed transformers caches (the model calls `update(k, v, layer)`
once per layer and step).

    shared prefix [1, H_kv, L, D]       the call's common prompt prefix, held once for every
                                        group (L = 0 unless the sampler shares one: `set_prefix`)
    prompt table  [R, H_kv, P_max, D]   one row per group alive now (its prompt minus the shared
                                        prefix and its last token)

    rows          [L, N, H_kv, C, D]    the g-slot policies (a whole completion per slot:
                                        N = slots, C = max_new_tokens): a sample holding KV owns
                                        one row, the holders fill rows [0, n) (one leaving moves
                                        the last row's columns into its place), so the S running
                                        samples' columns are the view [:S, :, :W]: no per-step copy
    token pool    [H_kv, N, D]          probes (`probe`: more samples than g run, each holding only
                                        what it has written): N token positions, one per written
                                        column, gathered per layer and step ([S, H_kv, W, D])

A sample of length L writes L columns: step 1 feeds the prompt's last token, step n writes the KV of
its input as column n-1. Each step attention sees the shared prefix, each running sample's prompt
row and its columns under a [S, 1, 1, L + P_max + W] mask (`prepare_step`): the group's shared
prompt plus the sample's own tokens. Rotary positions are explicit, so the order of key columns
and of rows is free.
`slot_attention.py` reads the prefix and the prompt rows in place; a model whose attention is
neither sdpa nor eager gets `cat(prefix, prompt rows, columns)` from `update` instead (`joined`).

Parked samples (`park` / `unpark`): columns copied out per layer ([H, n, D]) and back in.

Deliberately simple: the rows layout reserves max_new_tokens columns per slot (what the g-slot
budget reserves anyway); the token pool gathers per token (no blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# the per-slot prompt rows `slot_prompt_rows` keeps between decode steps (every layer's keys and
# values): a step's temporaries otherwise, small beside the KV for short prompts and few slots
MAX_KEPT_ROWS_BYTES = 16 << 20


class PromptTable:
    """The prompt rows, the parked store and the step's mask: what both layouts share."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        empty = (0, kv_heads, 0, head_dim)
        self.prompt_keys = [torch.zeros(empty, dtype=dtype, device=device)
                            for _ in range(num_layers)]
        self.prompt_values = [torch.zeros(empty, dtype=dtype, device=device)
                              for _ in range(num_layers)]
        # the call's shared prefix, per layer [1, H, L, D] (L = 0: none)
        self.prefix_keys = [t[:1].new_zeros((1, kv_heads, 0, head_dim)) for t in self.prompt_keys]
        self.prefix_values = list(self.prefix_keys)
        self.parked: dict[int, tuple[list, list]] = {}  # sample id -> kept (keys, values) per layer
        self.group_rows: dict[int, int] = {}  # group id -> row of the prompt table
        self.prompt_lengths: list[int] = []  # KV tokens of each row (prompt length - 1)
        self.num_columns: dict[int, int] = {}  # sample id -> KV columns it holds
        self.device, self.dtype = device, dtype
        self.step_rows: torch.Tensor | None = None  # [S] prompt row of each sample; None: one row
        # each slot's prompt row gathered per (layer, values?), kept while the steps' rows and
        # the table stay the same (`slot_prompt_rows`); at most MAX_KEPT_ROWS_BYTES
        self.kept_rows: dict[tuple[int, bool], torch.Tensor] = {}
        self.kept_for: tuple[int, ...] | None = None
        self.split_from: str | None = None  # set while slot_attention reads the cache in place
        # a packed step (`open_rows`): the new prompt rows (row, width) whose suffix tokens come
        # first in the step's one sequence, before the running samples' tokens
        self.packed_rows: list[tuple[int, int]] = []

    # ---- prompt table
    def set_prefix(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """The call's shared prefix KV (per layer [1, H, L, D]), held once for every group."""
        self.prefix_keys = [k.to(self.dtype) for k in keys]
        self.prefix_values = [v.to(self.dtype) for v in values]

    @property
    def prefix_width(self) -> int:
        return self.prefix_keys[0].shape[2]

    def prompt_row(self, row: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A group's whole prompt KV: the shared prefix and its row, per layer [1, H, L + w, D]."""
        width = self.prompt_lengths[row]
        return ([torch.cat([p, t[row:row + 1, :, :width]], dim=2)
                 for p, t in zip(self.prefix_keys, self.prompt_keys)],
                [torch.cat([p, t[row:row + 1, :, :width]], dim=2)
                 for p, t in zip(self.prefix_values, self.prompt_values)])

    def add_prompt(self, group_id: int, keys: Sequence[torch.Tensor],
                   values: Sequence[torch.Tensor]) -> None:
        """Append a group's prompt KV (per layer [1, H, P-1, D]) as a new row of the table."""
        self.group_rows[group_id] = len(self.prompt_lengths)
        self.kept_rows, self.kept_for = {}, None
        self.prompt_lengths.append(keys[0].shape[2])
        self.prompt_keys = [_append_row(t, k.to(t.dtype)) for t, k in zip(self.prompt_keys, keys)]
        self.prompt_values = [_append_row(t, v.to(t.dtype))
                              for t, v in zip(self.prompt_values, values)]

    def open_rows(self, group_ids: Sequence[int], widths: Sequence[int]) -> None:
        """Rows of zeros for groups whose suffixes the next step computes, packed ahead of the
        running samples' tokens (`update` writes them; `slot_attention` reads them)."""
        empty = [self.prompt_keys[0].new_zeros((1, t.shape[1], 0, t.shape[3]))
                 for t in self.prompt_keys]
        for group_id, width in zip(group_ids, widths):
            zeros = [torch.nn.functional.pad(e, (0, 0, 0, width)) for e in empty]  # [1, H, w, D]
            self.add_prompt(group_id, zeros, zeros)
        self.packed_rows = [(self.group_rows[g], w) for g, w in zip(group_ids, widths)]

    def _take_suffixes(self, layer_idx: int, key_states: torch.Tensor,
                       value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed step's K/V [1, H, T, D]: each new row's suffix written into its row; the
        running samples' part returned as a decode step's [S, H, 1, D]."""
        if not self.packed_rows:
            return key_states, value_states
        start = 0
        keys, values = self.prompt_keys[layer_idx], self.prompt_values[layer_idx]
        for row, width in self.packed_rows:
            keys[row, :, :width] = key_states[0, :, start:start + width].to(self.dtype)
            values[row, :, :width] = value_states[0, :, start:start + width].to(self.dtype)
            start += width
        return (key_states[:, :, start:].transpose(0, 2),
                value_states[:, :, start:].transpose(0, 2))  # [S, H, 1, D]

    def drop_prompt(self, group_id: int) -> None:
        row = self.group_rows.pop(group_id)
        del self.prompt_lengths[row]
        self.kept_rows, self.kept_for = {}, None
        self.group_rows = {g: r - (r > row) for g, r in self.group_rows.items()}
        width = max(self.prompt_lengths, default=0)
        keep = [r for r in range(len(self.prompt_lengths) + 1) if r != row]
        self.prompt_keys = [t[keep, :, :width].contiguous() for t in self.prompt_keys]
        self.prompt_values = [t[keep, :, :width].contiguous() for t in self.prompt_values]

    def prompt_tensors(self) -> list[torch.Tensor]:
        parked = [t for keys, values in self.parked.values() for t in (*keys, *values)]
        return (self.prefix_keys + self.prefix_values + self.prompt_keys + self.prompt_values
                + parked)

    def prompt_tokens(self) -> int:
        """KV tokens of the shared prefix, the prompt table and the parked store."""
        num_rows, _, prompt_width, _ = self.prompt_keys[0].shape
        return (self.prefix_width + num_rows * prompt_width
                + sum(keys[0].shape[1] for keys, _ in self.parked.values()))

    # ---- parked samples
    def park(self, sample_id: int) -> None:
        """Copy a sample's columns out (per layer [H, n, D]) and give its own KV back."""
        self.parked[sample_id] = self.columns(sample_id)
        self.release(sample_id)

    def unpark(self, sample_id: int) -> bool:
        """A parked sample's kept columns back in; False if none were kept."""
        if sample_id not in self.parked:
            return False
        self.write(sample_id, *self.parked.pop(sample_id))
        return True

    # ---- per step
    def step_mask(self, slot_rows: list[int], write_index: list[int], is_causal_eager: bool,
                  written: torch.Tensor) -> torch.Tensor:
        """Set the step's prompt rows; the attention mask [S, 1, 1, L + P_max + W] (bool, or
        additive): the shared prefix, each sample's prompt row and its columns [0, write_index]
        (`written`, [S])."""
        device = self.device
        num_rows = len(self.prompt_lengths)
        self.step_rows = None if num_rows <= 1 else torch.tensor(slot_rows, device=device)
        if tuple(slot_rows) != self.kept_for:
            self.kept_rows, self.kept_for = {}, tuple(slot_rows)
        lengths = torch.tensor([self.prompt_lengths[r] if num_rows else 0 for r in slot_rows],
                               device=device)  # [S]
        prompt_cols = torch.arange(self.prompt_keys[0].shape[2], device=device)
        slot_cols = torch.arange(max(write_index) + 1, device=device)
        prefix = torch.ones((len(slot_rows), self.prefix_width), dtype=torch.bool,
                            device=device)  # [S, L]
        mask = torch.cat([prefix, prompt_cols[None, :] < lengths[:, None],
                          slot_cols[None, :] <= written[:, None]], dim=1)  # [S, L + P_max + W]
        mask = mask[:, None, None, :]
        if is_causal_eager:
            return torch.zeros(mask.shape, dtype=self.dtype, device=device).masked_fill(
                ~mask, torch.finfo(self.dtype).min)
        return mask

    def slot_prompt_rows(self, layer_idx: int, values: bool, table: torch.Tensor) -> torch.Tensor:
        """`table[step_rows]` ([S, ...]: the layer's prompt keys, transposed, or values, one row
        per slot), gathered once while the steps' rows stay the same (a decode step changes them
        only when a sample ends or starts), if the kept gathers stay within MAX_KEPT_ROWS_BYTES."""
        kept = self.kept_rows.get((layer_idx, values))
        if kept is None:
            kept = table[self.step_rows]
            all_layers = kept.numel() * kept.element_size() * 2 * len(self.prompt_keys)
            if all_layers <= MAX_KEPT_ROWS_BYTES:
                self.kept_rows[layer_idx, values] = kept
        return kept

    def _attended(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor):
        """`update`'s answer: the samples' columns, with the prompt unless slot_attention reads
        the prompt rows itself."""
        if self.split_from is not None:
            return keys, values
        return self.joined(layer_idx, keys, values)

    def joined(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor):
        """The shared prefix, each sample's prompt row and its columns as one tensor:
        [S, H, L + P_max + W, D] each."""
        return (self._with_prompt(self.prefix_keys[layer_idx], self.prompt_keys[layer_idx], keys),
                self._with_prompt(self.prefix_values[layer_idx], self.prompt_values[layer_idx],
                                  values))

    def _with_prompt(self, prefix: torch.Tensor, table: torch.Tensor,
                     slot_part: torch.Tensor) -> torch.Tensor:
        num_samples = slot_part.shape[0]
        parts = [prefix.expand(num_samples, -1, -1, -1)] if prefix.shape[2] else []
        if table.shape[0] and table.shape[2]:
            parts.append(table.expand(num_samples, -1, -1, -1) if self.step_rows is None
                         else table[self.step_rows])
        return torch.cat([*parts, slot_part], dim=2) if parts else slot_part

    # transformers' mask helpers look for these on cache objects
    is_sliding = is_linear = is_dummy = ()


class SlotRowCache(PromptTable):
    """One row of `row_columns` columns per sample holding KV, the holders in rows [0, n)."""

    def __init__(self, num_layers: int, num_rows: int, row_columns: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        super().__init__(num_layers, kv_heads, head_dim, dtype, device)
        shape = (num_layers, num_rows, kv_heads, row_columns, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, N, H, C, D]
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.row_of: dict[int, int] = {}  # sample id -> its row
        self.row_sample: list[int] = []  # the holders, in row order
        # this step: the rows written (and read, unless `read_rows` is None: rows [0, S)), the
        # column each writes, the columns attended
        self.write_rows = torch.zeros(0, dtype=torch.long, device=device)  # [S]
        self.write_columns = torch.zeros(0, dtype=torch.long, device=device)  # [S]
        self.write_flat = torch.zeros(0, dtype=torch.long, device=device)  # [S * H]
        self.read_rows: torch.Tensor | None = None
        self.num_running, self.width = 0, 1

    def held_tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values] + self.prompt_tensors()

    def held_tokens(self) -> int:
        _, num_rows, _, row_columns, _ = self.keys.shape
        return num_rows * row_columns + self.prompt_tokens()

    def allocate(self, sample_id: int, num_columns: int = 1) -> None:
        """`num_columns` more columns for a sample (its row, the first time)."""
        _, num_rows, _, row_columns, _ = self.keys.shape
        if sample_id not in self.row_of:
            if len(self.row_sample) == num_rows:
                raise RuntimeError(f"slot KV rows full ({num_rows}): the scheduler ran more "
                                   "samples than slots")
            self.row_of[sample_id] = len(self.row_sample)
            self.row_sample.append(sample_id)
        held = self.num_columns.get(sample_id, 0) + num_columns
        if held > row_columns:
            raise RuntimeError(f"sample {sample_id} wrote past its row ({row_columns} columns)")
        self.num_columns[sample_id] = held

    def release(self, sample_id: int) -> None:
        """A sample's row given back (it ended, or was parked): the last holder moves into it."""
        row = self.row_of.pop(sample_id, None)
        self.num_columns.pop(sample_id, None)
        if row is None:
            return
        last = self.row_sample.pop()
        if last != sample_id:
            written = self.num_columns[last]
            for table in (self.keys, self.values):  # every layer at once: [L, H, n, D]
                table[:, row, :, :written] = table[:, len(self.row_sample), :, :written]
            self.row_sample[row], self.row_of[last] = last, row

    def columns(self, sample_id: int) -> tuple[list, list]:
        """Copies of a sample's columns, per layer [H, n, D] (n = 0 for a sample holding none)."""
        if sample_id not in self.row_of:
            empty = self.keys[:, 0, :, :0]  # [L, H, 0, D]
            return list(empty), list(empty)
        row, written = self.row_of[sample_id], self.num_columns[sample_id]
        return ([k.clone() for k in self.keys[:, row, :, :written]],
                [v.clone() for v in self.values[:, row, :, :written]])

    def write(self, sample_id: int, keys: Sequence[torch.Tensor],
              values: Sequence[torch.Tensor]) -> None:
        """Per layer [H, n, D] as a sample's next n columns (a resumed sample's KV, or the
        tokens appended to its kept columns)."""
        held, written = self.num_columns.get(sample_id, 0), keys[0].shape[1]
        self.allocate(sample_id, written)
        row = self.row_of[sample_id]
        self.keys[:, row, :, held:held + written] = torch.stack(keys).to(self.dtype)  # [L,H,n,D]
        self.values[:, row, :, held:held + written] = torch.stack(values).to(self.dtype)

    def arrange(self, samples: list) -> list:
        """The step's batch order: the samples' rows, so that rows [0, S) are read as a view."""
        return sorted(samples, key=lambda s: self.row_of[s.sample_id])

    def prepare_step(self, sample_ids: list[int], slot_rows: list[int], write_index: list[int],
                     is_causal_eager: bool, written: torch.Tensor | None = None) -> torch.Tensor:
        """Set this step's layout for the running samples (each has its column `write_index`
        allocated, `written` the same as a tensor if at hand); returns the attention mask
        [S, 1, 1, L + P_max + W]."""
        rows = [self.row_of[s] for s in sample_ids]
        self.write_rows = torch.tensor(rows, device=self.device)  # [S]
        self.read_rows = None if rows == list(range(len(rows))) else self.write_rows
        self.write_columns = _as_tensor(written, write_index, self.device)  # [S]
        _, _, kv_heads, row_columns, _ = self.keys.shape
        heads = torch.arange(kv_heads, device=self.device)
        # where each (sample, head)'s new column lies in a layer's [N * H * C, D] view
        self.write_flat = ((self.write_rows[:, None] * kv_heads + heads) * row_columns
                           + self.write_columns[:, None]).reshape(-1)  # [S * H]
        self.num_running, self.width = len(rows), max(write_index) + 1
        return self.step_mask(slot_rows, write_index, is_causal_eager, self.write_columns)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               **_: Any):
        """Write the step's K/V [S, H, 1, D] at each sample's column; return the running rows'
        columns [S, H, W, D] (a view when they are rows [0, S))."""
        key_states, value_states = self._take_suffixes(layer_idx, key_states, value_states)
        keys, values = self.keys[layer_idx], self.values[layer_idx]  # [N, H, C, D]
        _, _, _, head_dim = keys.shape
        # under autocast (precision mixed) K/V come in bf16 or fp32: store the cache's dtype
        for table, states in ((keys, key_states), (values, value_states)):  # [S, H, 1, D]
            table.view(-1, head_dim).index_copy_(0, self.write_flat,
                                                 states.reshape(-1, head_dim).to(self.dtype))
        if self.read_rows is None:
            running = slice(0, self.num_running)
            return self._attended(layer_idx, keys[running, :, :self.width],
                                  values[running, :, :self.width])
        return self._attended(layer_idx, keys[self.read_rows, :, :self.width],
                              values[self.read_rows, :, :self.width])


class SlotKVCache(PromptTable):
    """A pool of `pool_tokens` positions, each holding one KV column of one sample."""

    def __init__(self, num_layers: int, pool_tokens: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, num_samples: int = 1,
                 max_columns: int = 1):
        super().__init__(num_layers, kv_heads, head_dim, dtype, device)
        shape = (kv_heads, pool_tokens, head_dim)  # a gather of positions: [H, S, W, D]
        self.pool_keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.pool_values = [torch.zeros(shape, dtype=dtype, device=device)
                            for _ in range(num_layers)]
        self._free = list(range(pool_tokens - 1, -1, -1))  # a stack: the lowest position on top
        # the pool position of each sample's KV columns, [samples, columns] (stale past the ones
        # it has written, `num_columns`: masked)
        self.table = torch.zeros((num_samples, max_columns), dtype=torch.long, device=device)
        self.write_positions = torch.zeros(0, dtype=torch.long, device=device)  # [S]
        self.read_positions = torch.zeros((0, 1), dtype=torch.long, device=device)  # [S, W]

    def held_tensors(self) -> list[torch.Tensor]:
        return self.pool_keys + self.pool_values + self.prompt_tensors()

    def held_tokens(self) -> int:
        return self.pool_keys[0].shape[1] + self.prompt_tokens()

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

    def columns(self, sample_id: int) -> tuple[list, list]:
        """Copies of a sample's columns, per layer [H, n, D]."""
        positions = self.positions(sample_id)
        return ([k[:, positions] for k in self.pool_keys],
                [v[:, positions] for v in self.pool_values])

    def write(self, sample_id: int, keys: Sequence[torch.Tensor],
              values: Sequence[torch.Tensor]) -> None:
        """Per layer [H, n, D] as a sample's first n columns (a resumed sample's KV)."""
        positions = torch.tensor(self.allocate(sample_id, keys[0].shape[1]), device=self.device)
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.pool_keys[layer][:, positions] = k.to(self.pool_keys[layer].dtype)
            self.pool_values[layer][:, positions] = v.to(self.pool_values[layer].dtype)

    def arrange(self, samples: list) -> list:
        return samples  # any order: the step gathers

    def prepare_step(self, sample_ids: list[int], slot_rows: list[int], write_index: list[int],
                     is_causal_eager: bool, written: torch.Tensor | None = None) -> torch.Tensor:
        """Set this step's layout for the running samples (each has its column `write_index`
        allocated, `written` the same as a tensor if at hand); returns the attention mask
        [S, 1, 1, L + P_max + W]."""
        ids = torch.tensor(sample_ids, device=self.device)  # [S]
        written = _as_tensor(written, write_index, self.device)  # [S]
        self.write_positions = self.table[ids, written]  # [S]
        self.read_positions = self.table[ids, :max(write_index) + 1]  # [S, W]
        return self.step_mask(slot_rows, write_index, is_causal_eager, written)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               **_: Any):
        """Write the step's K/V [S, H, 1, D] at each sample's new position; return its columns
        gathered from the pool [S, H, W, D]."""
        key_states, value_states = self._take_suffixes(layer_idx, key_states, value_states)
        pool_k, pool_v = self.pool_keys[layer_idx], self.pool_values[layer_idx]
        # under autocast (precision mixed) K/V come in bf16 or fp32: store the cache's dtype
        for pool, states in ((pool_k, key_states), (pool_v, value_states)):  # [S, H, 1, D]
            pool.index_copy_(1, self.write_positions,
                             states[:, :, 0].transpose(0, 1).to(pool.dtype))
        keys = pool_k[:, self.read_positions].transpose(0, 1)  # [H, S, W, D] -> [S, H, W, D]
        values = pool_v[:, self.read_positions].transpose(0, 1)
        return self._attended(layer_idx, keys, values)


def _as_tensor(given: torch.Tensor | None, values: list[int], device) -> torch.Tensor:
    return given if given is not None else torch.tensor(values, device=device)


def _append_row(table: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    width = max(table.shape[2], row.shape[2])
    table = torch.nn.functional.pad(table, (0, 0, 0, width - table.shape[2]))
    row = torch.nn.functional.pad(row, (0, 0, 0, width - row.shape[2]))
    return torch.cat([table, row], dim=0)
