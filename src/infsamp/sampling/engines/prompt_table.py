"""The slot engine's prompt KV (`PromptTable`): the call's shared prefix held once, one row per
group alive now, the step's mask over them, and parked samples' columns; the base of both column
layouts (`slot_cache.py`, whose docstring draws the whole cache).
"""

from __future__ import annotations

from collections.abc import Sequence

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
        # `slot_prompt_rows`' gathers per (layer, values?), and the step rows they were made for
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

    def add_prompts(self, group_ids: Sequence[int], keys: Sequence[Sequence[torch.Tensor]],
                    values: Sequence[Sequence[torch.Tensor]]) -> None:
        """Append groups' prompt KV (per group, per layer [1, H, P-1, D]) as new rows, in order:
        one copy of each layer's table, the same table as adding them one by one."""
        self._new_rows(group_ids, [k[0].shape[2] for k in keys])
        self.prompt_keys = [_append_rows(t, [k[layer].to(t.dtype) for k in keys])
                            for layer, t in enumerate(self.prompt_keys)]
        self.prompt_values = [_append_rows(t, [v[layer].to(t.dtype) for v in values])
                              for layer, t in enumerate(self.prompt_values)]

    def open_rows(self, group_ids: Sequence[int], widths: Sequence[int]) -> None:
        """Rows of zeros for groups whose suffixes the next step computes, packed ahead of the
        running samples' tokens (`update` writes them; `slot_attention` reads them)."""
        self._new_rows(group_ids, widths)
        _, kv_heads, _, head_dim = self.prompt_keys[0].shape
        zeros = [self.prompt_keys[0].new_zeros((1, kv_heads, w, head_dim)) for w in widths]
        self.prompt_keys = [_append_rows(t, zeros) for t in self.prompt_keys]
        self.prompt_values = [_append_rows(t, zeros) for t in self.prompt_values]
        self.packed_rows = [(self.group_rows[g], w) for g, w in zip(group_ids, widths)]

    def _new_rows(self, group_ids: Sequence[int], widths: Sequence[int]) -> None:
        for group_id, width in zip(group_ids, widths):
            self.group_rows[group_id] = len(self.prompt_lengths)
            self.prompt_lengths.append(width)
        self.kept_rows, self.kept_for = {}, None

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

    def drop_prompts(self, group_ids: Sequence[int]) -> None:
        """Remove groups' rows (the others keep their order; the table narrows to its widest
        row): one copy of each layer's table, the same table as dropping them one by one."""
        if not group_ids:
            return
        dropped = {self.group_rows.pop(g) for g in group_ids}
        keep = [r for r in range(len(self.prompt_lengths)) if r not in dropped]
        new_row = {old: new for new, old in enumerate(keep)}
        self.group_rows = {g: new_row[r] for g, r in self.group_rows.items()}
        self.prompt_lengths = [self.prompt_lengths[r] for r in keep]
        self.kept_rows, self.kept_for = {}, None
        width = max(self.prompt_lengths, default=0)
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

    def unpark(self, sample_id: int) -> None:
        """A parked sample's kept columns back in, if any were kept."""
        if sample_id in self.parked:
            self.write(sample_id, *self.parked.pop(sample_id))

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


def _append_rows(table: torch.Tensor, rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """`table` [R, H, P, D] and `rows` (each [1, H, w, D]) as one table, zero-padded to the
    widest."""
    width = max(table.shape[2], *(row.shape[2] for row in rows))
    return torch.cat([torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[2]))
                      for t in (table, *rows)], dim=0)
