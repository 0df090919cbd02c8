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

Parked samples (`park` / `unpark`): columns copied out per layer ([H, n, D]) and back in. The
prefix, the prompt rows, the mask and parking are `PromptTable` (`prompt_table.py`), the base of
both layouts here.

Deliberately simple: the rows layout reserves max_new_tokens columns per slot (what the g-slot
budget reserves anyway); the token pool gathers per token (no blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from infsamp.sampling.engines.prompt_table import PromptTable


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
        rows = slice(0, self.num_running) if self.read_rows is None else self.read_rows
        return self._attended(layer_idx, keys[rows, :, :self.width], values[rows, :, :self.width])


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
        """As `SlotRowCache.prepare_step`."""
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
