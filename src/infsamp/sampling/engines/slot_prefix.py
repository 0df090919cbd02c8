"""The slot engine's shared prefix (`begin_call(shared_prefix=L)`, the sampler's choice:
evaluation's prompts share their chat template and system prompt): the call's first L prompt
tokens are forwarded once at `begin_call` and held once (`PromptTable.set_prefix`); each group's
row holds the rest of its prompt (its suffix, minus the last token), computed at the next decode
step. No forward takes more than the run's longest prompt (`RunSizes.max_prompt_tokens`, where
the engine was given the run's sizes), the call's longest prompt or its slots in tokens, whichever
is most: what the planner counts a forward's working set at. The numbers differ from a
whole-prompt forward in the last bits (other matmul shapes), so the sampler shares a prefix only
where it is asked to.

Prefill paths: `_packed_groups` (the rows a decode step's one packed forward computes, the cache's
`update` writing them and `slot_attention` attending them) and `_prefill_suffixes` (right-padded
batches of their own, for what a step cannot pack and for attention that is not plain).

Deliberately simple: one prefix per call (the longest common one), never a tree of prefixes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import DynamicCache


def no_logits(device) -> torch.Tensor:
    """`logits_to_keep` selecting no position: a prefill forward computes its KV and skips the
    LM head (on a small model's prompt rows a tenth of the forward or more)."""
    return torch.empty(0, dtype=torch.long, device=device)


class SharedPrefixPrefill:
    """The slot engine's prefill of prompts, of a shared prefix and of its groups' suffixes (a
    mixin: reads the engine's model, cache, prompts, stats and `shared_prefix`)."""

    def _forward_kv(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                    past: tuple[Sequence, Sequence] = ((), ())) -> tuple[list, list]:
        """KV of `input_ids` [B, n] at `positions` [B, n] (None: from 0) after the `past` KV (per
        layer [B, H, p, D]), per layer [B, H, n, D]; the LM head skipped."""
        cache = DynamicCache(config=self.model.config)
        for layer, (k, v) in enumerate(zip(*past)):
            cache.update(k, v, layer)
        with torch.inference_mode():
            self.model(input_ids=input_ids, position_ids=positions, use_cache=True,
                       logits_to_keep=no_logits(self.device), **{self.cache_kwarg: cache})
        width = past[0][0].shape[2] if past[0] else 0
        return ([c.keys[:, :, width:] for c in cache.layers],
                [c.values[:, :, width:] for c in cache.layers])

    def _prefill_prefix(self, prefix: Sequence[int]) -> None:
        start = time.perf_counter()
        input_ids = torch.tensor([list(prefix)], device=self.device)  # [1, L]
        self.cache.set_prefix(*self._forward_kv(input_ids))
        self.stats.model_time_s += time.perf_counter() - start
        self.stats.prefill_tokens += len(prefix)

    def _packed_groups(self, num_running: int) -> list[int]:
        """The groups started since the last step whose rows this step's forward computes
        (`supports_packed`, no sample of theirs to recompute first, and as many as keep the
        forward within `_most_tokens` beside the `num_running` samples); the others prefilled
        now."""
        groups, self.to_prefill = self.to_prefill, []
        if not groups:
            return []
        packed, room = [], self._most_tokens() - num_running
        if self.packs and not {s.group_id for s in self.to_restore} & set(groups):
            for group_id in groups:
                if self._suffix_width(group_id) <= room:
                    packed.append(group_id)
                    room -= self._suffix_width(group_id)
        self._prefill_suffixes([g for g in groups if g not in packed])
        if packed:
            self.cache.open_rows(packed, [self._suffix_width(g) for g in packed])
            self._track_peak()
        return packed

    def _most_tokens(self) -> int:
        """The most tokens one prefill forward takes (the module docstring says why)."""
        return max(max(len(p) for p in self.prompts), len(self.slot_sample),
                   self.planned_prompt_tokens)

    def _prefill_suffixes(self, group_ids: list[int]) -> None:
        """These groups' rows: each prompt after the shared prefix (minus its last token), in
        right-padded batches of at most `_most_tokens` padded tokens, attending to the
        prefix."""
        most = self._most_tokens()
        batch: list[int] = []
        for group_id in group_ids:
            width = max(self._suffix_width(g) for g in (*batch, group_id))
            if batch and (len(batch) + 1) * width > most:
                self._prefill_batch(batch)
                batch = []
            batch.append(group_id)
        if batch:
            self._prefill_batch(batch)

    def _suffix_width(self, group_id: int) -> int:
        return len(self.prompts[group_id]) - 1 - self.shared_prefix

    def _prefill_batch(self, group_ids: list[int]) -> None:
        """One forward of these groups' suffixes over the shared prefix; each one's KV is its
        row."""
        suffixes = [list(self.prompts[g][self.shared_prefix:-1]) for g in group_ids]
        start = time.perf_counter()
        keys, values = self._suffix_kv(suffixes)  # per layer [B, H, w, D]
        rows = list(enumerate(map(len, suffixes)))
        self.cache.add_prompts(group_ids, [[k[i:i + 1, :, :n] for k in keys] for i, n in rows],
                               [[v[i:i + 1, :, :n] for v in values] for i, n in rows])
        self.stats.model_time_s += time.perf_counter() - start
        self.stats.prefill_tokens += sum(len(s) for s in suffixes)
        self._track_peak()

    def _suffix_kv(self, suffixes: list[list[int]]) -> tuple[list, list]:
        """KV of right-padded suffixes after the shared prefix, per layer [B, H, w, D] (a pad is
        never attended to by a real token: the mask is causal)."""
        num_rows, prefix = len(suffixes), self.shared_prefix
        width = max(len(s) for s in suffixes)
        if not width:
            return ([k[:, :, :0].expand(num_rows, -1, -1, -1) for k in self.cache.prefix_keys],
                    [v[:, :, :0].expand(num_rows, -1, -1, -1) for v in self.cache.prefix_values])
        past = ([k.expand(num_rows, -1, -1, -1) for k in self.cache.prefix_keys],
                [v.expand(num_rows, -1, -1, -1) for v in self.cache.prefix_values])  # [B, H, L, D]
        input_ids = torch.tensor([s + [0] * (width - len(s)) for s in suffixes],
                                 device=self.device)  # [B, w]
        positions = torch.arange(prefix, prefix + width, device=self.device)  # [w]
        return self._forward_kv(input_ids, positions.expand(num_rows, -1), past)
