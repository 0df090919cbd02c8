"""The slot engine: decode slots over a transformers causal LM, with each group's prompt KV held
once and every running sample's own KV in `slot_cache.py`'s layouts.

Layout per call (`begin_call`): where the scheduler's pool holds a whole completion per slot (the
g-slot policies: `full`, `rounds`, `continuous`, `length_aware`), one row of max_new_tokens columns
per slot (`SlotRowCache`): the running samples' columns are read as a view, no per-step copy;
where it holds less (`probe`: more samples than g running, each holding what it has written), a
pool of token positions gathered per layer and step (`SlotKVCache`). Each step runs the running
samples only, in the cache's row order (`arrange`: a row's numbers do not depend on its place in
the batch), with explicit rotary positions (`position_ids = prompt_len - 1 + n`).

Why not transformers' continuous batching: no per-sample random streams or logits rules, and no
prompt blocks for a slot refilled later to share (docs/sampler.md). This file is the missing piece:
a few hundred lines over the model's ordinary forward.

Parking: a sample the scheduler takes out of its slot keeps its tokens; with `Sample.parked_kv` its
columns are copied out (`parked` store, counted in the held KV) and back into fresh positions when
it resumes, else they are given back and recomputed at resume by one forward over its tokens
against its group's prompt row. Both happen at the next decode step, after every sample parked in
that admission has given its positions back.

Shared prefix (`begin_call(shared_prefix=L)`, the sampler's choice): the call's first L prompt
tokens forwarded and held once, each group's row the rest (`slot_prefix.py`).

Deliberately simple: two layouts, chosen per call; the token pool gathers per token (no blocks).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections import Counter
from collections.abc import Sequence

import torch

from infsamp.models.device import base_model
from infsamp.planner.presets import shape_from_config
from infsamp.sampling.engines.base import DecodeOptions, SlotLogitsProcessor
from infsamp.sampling.engines.lean_decode import lean_decode
from infsamp.sampling.engines.select import ForcedLengths, build_warpers, select_tokens
from infsamp.sampling.engines.slot_attention import (
    reading_in_place,
    slot_attention,
    supports_packed,
    supports_split,
)
from infsamp.sampling.engines.slot_cache import SlotKVCache, SlotRowCache
from infsamp.sampling.engines.slot_prefix import SharedPrefixPrefill
from infsamp.sampling.types import Sample, SamplerStats


class SlotEngine(SharedPrefixPrefill):
    """Executes a SlotScheduler's decisions on a transformers model (see module docstring).

    Long-lived: it reads the trainer's model itself, so `load_weights` only swaps the model object;
    the KV tensors are allocated per call (`begin_call`) and freed at `end_call`."""

    name = "slots"
    kv_block_size = 1
    keeps_parked_kv = True  # a parked sample's KV can be held (copied out of the pool)
    hands_hidden_states = True
    shares_prefix = True  # holds a call's common prompt prefix once (`begin_call(shared_prefix)`)
    copies_weights = False  # decodes with the trainer's model itself
    max_micro_group = 0
    kv_capacity_tokens = 0

    def __init__(self, model, cfg=None, sizes=None):
        self.model = model
        self.eager_mask = getattr(model.config, "_attn_implementation", "sdpa") == "eager"
        self.cache_kwarg = cache_kwarg_name(model)
        self.cache: SlotKVCache | SlotRowCache | None = None
        # the longest prompt the run serves, as the planner sized a forward's working set
        # (`max(max_prompt_tokens, g)` tokens, planner/estimate.py); 0: unknown
        self.planned_prompt_tokens = sizes.max_prompt_tokens if sizes is not None else 0
        # when a list: (wall seconds, CPU seconds, KV length of each row) of every decode step
        # (the bound's replay, `decode_bound.py`)
        self.step_log: list[tuple[float, float, list[int]]] | None = None

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    # ---- Engine protocol
    def begin_call(self, prompts: Sequence[Sequence[int]], samples: Sequence[Sample],
                   num_slots: int, options: DecodeOptions, stats: SamplerStats,
                   processor: SlotLogitsProcessor | None = None,
                   pool_tokens: int | None = None, shared_prefix: int = 0) -> None:
        """`pool_tokens`: the KV positions running samples may hold at once (the scheduler's
        `max_running_tokens`); None: a whole completion per slot. `shared_prefix`: the first
        tokens every prompt shares, forwarded and held once (shorter than every prompt)."""
        shape, param = shape_from_config(self.model.config), next(self.model.parameters())
        layout = (shape.num_key_value_heads, shape.head_dim, param.dtype, param.device)
        max_new = max(s.max_new_tokens for s in samples)
        if pool_tokens is None or pool_tokens >= num_slots * max_new:  # a whole row per slot
            self.cache = SlotRowCache(shape.num_hidden_layers, num_slots, max_new, *layout)
        else:
            self.cache = SlotKVCache(shape.num_hidden_layers, pool_tokens, *layout, len(samples),
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
        # new rows' suffixes computed in a decode step's forward
        self.packs = self.split and supports_packed(self.model)
        # the model's layers called directly where that is bit-exact (`lean_decode.py`)
        self.lean = None if options.hidden_states else lean_decode(self.model)
        self.model.eval()
        self.shared_prefix = shared_prefix
        self.to_prefill: list[int] = []  # groups started whose rows are not filled yet
        if shared_prefix:
            self._prefill_prefix(prompts[0][:shared_prefix])
        self._track_peak()

    def start(self, slot: int, sample: Sample) -> None:
        previous = self.slot_sample[slot]
        if previous is not None and previous is not sample and previous.finish_reason is None:
            self._take_back(slot)
        if sample.group_id not in self.cache.group_rows and sample.group_id not in self.to_prefill:
            if self.shared_prefix:
                self.to_prefill.append(sample.group_id)  # at the next step, with the others
            else:
                self._prefill(sample.group_id)
        if sample.token_ids:  # parked, or back from a tool call (maybe to the slot it left)
            self._resume(sample)
        self.slot_sample[slot] = sample

    def decode_step(self, active: dict[int, Sample]) -> list[Sample]:
        logs = self.step_log is not None
        step_start, cpu_start = (time.perf_counter(), time.process_time()) if logs else (0, 0)
        self._drop_taken_back(active)
        packed = self._packed_groups(len(active))
        for sample in self.to_restore:  # after every parked sample gave its positions back
            self.cache.unpark(sample.sample_id)
            self._recompute(sample)  # what it lacks: all, or the tool tokens appended since
        self.to_restore = []
        running = self._allocate([active[slot] for slot in sorted(active)])
        inputs, positions, write_index, rows = self._step_layout(running)
        ids = [s.sample_id for s in running]
        step = torch.tensor([inputs, positions, write_index, ids], device=self.device)  # [4, S]
        mask = self.cache.prepare_step(ids, rows, write_index, self.eager_mask, step[2])
        start = time.perf_counter()
        with torch.inference_mode():
            logits, hidden = self._forward(step[0], step[1], mask, packed)  # [S, V]
            tokens = self._select(logits, step[3], step[2]).tolist()
        self.stats.model_time_s += time.perf_counter() - start
        if hidden is not None:
            for sample, state in zip(running, hidden.float().cpu().numpy()):
                sample.hidden_state = state  # the last layer at its latest token
        ended = self._record(running, tokens)
        if logs:
            self.step_log.append((time.perf_counter() - step_start,
                                  time.process_time() - cpu_start, [p + 1 for p in positions]))
        return ended

    def cancel(self, samples: Sequence[Sample]) -> None:
        self.cache.drop_prompts([g for s in samples for g in self._release_group(s.group_id)])

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
    def _allocate(self, running: list[Sample]) -> list[Sample]:
        """Each running sample's new column; the samples in the cache's batch order."""
        for sample in running:
            if self.cache.num_columns.get(sample.sample_id, 0) == len(sample.token_ids):
                self.cache.allocate(sample.sample_id)
        return self.cache.arrange(running)

    def _step_layout(self, running: list[Sample]):
        """Each running sample's input token, position, column and prompt row."""
        inputs, positions, write_index, rows = [], [], [], []
        for sample in running:
            done, prompt = sample.token_ids, self.prompts[sample.group_id]
            inputs.append(done[-1] if done else prompt[-1])
            positions.append(len(prompt) - 1 + len(done))
            write_index.append(len(done))
            rows.append(self.cache.group_rows[sample.group_id])
        return inputs, positions, write_index, rows

    def _forward(self, inputs: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                 packed: Sequence[int] = ()):
        """Logits [S, V] (and the last hidden states [S, H] if asked) of inputs [S] at positions
        [S], as a batch of S one-token rows; with `packed` groups, as one sequence [1, T]: their
        suffixes, then the S tokens (their rows' KV computed on the way); a plain Llama goes
        through `lean_decode` (bit for bit the model's forward)."""
        if packed:
            inputs, positions = self._packed_inputs(inputs, positions, packed)  # [1, T]
        else:
            inputs, positions = inputs[:, None], positions[:, None]  # [S, 1]
        try:
            if self.lean is not None:
                with reading_in_place(self.cache, self.model.config._attn_implementation):
                    return self.lean(inputs, positions, mask, self.cache,
                                     len(mask) if packed else 0), None
            kwargs = {"logits_to_keep": len(mask)} if packed else {}
            with slot_attention(self.model, self.cache) if self.split else \
                    contextlib.nullcontext():
                out = self.model(input_ids=inputs, position_ids=positions, attention_mask=mask,
                                 use_cache=True, output_hidden_states=self.options.hidden_states,
                                 **{self.cache_kwarg: self.cache}, **kwargs)
        finally:
            self.cache.packed_rows = []
        last = (lambda t: t[0]) if packed else (lambda t: t[:, -1])  # [S, *]: the S tokens'
        hidden = last(out.hidden_states[-1])[-len(mask):] if self.options.hidden_states else None
        return last(out.logits).float(), hidden  # [S, V]

    def _packed_inputs(self, inputs: torch.Tensor, positions: torch.Tensor,
                       packed: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed step's one sequence: the `packed` groups' suffixes, then the S tokens
        (inputs and positions [S]): both [1, T]."""
        suffixes = [self.prompts[g][self.shared_prefix:-1] for g in packed]
        tokens = [t for suffix in suffixes for t in suffix]
        places = [self.shared_prefix + i for suffix in suffixes for i in range(len(suffix))]
        self.stats.prefill_tokens += len(tokens)
        return (torch.cat([torch.tensor(tokens, dtype=torch.long, device=self.device),
                           inputs])[None],  # [1, T]
                torch.cat([torch.tensor(places, dtype=torch.long, device=self.device),
                           positions])[None])  # [1, T]

    def _select(self, logits: torch.Tensor, sample_ids: torch.Tensor,
                num_generated: torch.Tensor) -> torch.Tensor:  # [S, V], [S], [S] -> [S]
        if self.processor is not None:
            logits = self.processor(sample_ids, num_generated, logits)
        return select_tokens(logits, sample_ids, num_generated, self.options, self.warpers)

    def _record(self, running: list[Sample], tokens: list[int]) -> list[Sample]:
        ended, done_groups = [], []
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
                done_groups += self._release_group(sample.group_id)
        self.cache.drop_prompts(done_groups)  # the rows of groups whose last sample ended
        return ended

    def _prefill(self, group_id: int) -> None:
        prompt_kv = self.prompts[group_id][:-1]
        start = time.perf_counter()
        if prompt_kv:
            input_ids = torch.tensor([prompt_kv], device=self.device)  # [1, P-1]
            keys, values = self._forward_kv(input_ids)  # per layer [1, H, P-1, D]
        else:  # a one-token prompt: a row of zero width (the prefix has a row, maybe empty)
            keys = values = [p[:, :, :0] for p in self.cache.prefix_keys]  # [1, H, 0, D]
        self.cache.add_prompts([group_id], [keys], [values])
        self.stats.model_time_s += time.perf_counter() - start
        self.stats.prefill_tokens += len(prompt_kv)
        self._track_peak()

    def _release_group(self, group_id: int) -> list[int]:
        """A sample of the group ended (or was cancelled): [the group] if it was its last and
        its row is in the table (its row to drop)."""
        self.remaining[group_id] -= 1
        ended = self.remaining[group_id] == 0 and group_id in self.cache.group_rows
        return [group_id] if ended else []

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
        prompt_keys, prompt_values = self.cache.prompt_row(row)  # per layer [1, H, L + w, D]
        width = prompt_keys[0].shape[2]
        kept_keys, kept_values = self.cache.columns(sample.sample_id)  # per layer [H, held, D]
        past = ((), ())
        if width or held:  # per layer [1, H, L + w + held, D]
            past = ([torch.cat([k, own[None].to(k.dtype)], dim=2)
                     for k, own in zip(prompt_keys, kept_keys)],
                    [torch.cat([v, own[None].to(v.dtype)], dim=2)
                     for v, own in zip(prompt_values, kept_values)])
        inputs = torch.tensor([[prompt[-1], *sample.token_ids[:-1]][held:]],
                              device=self.device)  # [1, n]
        positions = torch.arange(len(prompt) - 1 + held, len(prompt) - 1 + num_tokens,
                                 device=self.device)[None, :]  # [1, n]
        start = time.perf_counter()
        keys, values = self._forward_kv(inputs, positions, past)  # per layer [1, H, n, D]
        self.stats.model_time_s += time.perf_counter() - start
        self.cache.write(sample.sample_id, [k[0] for k in keys], [v[0] for v in values])

    def _track_peak(self) -> None:
        held = sum(t.numel() * t.element_size() for t in self.cache.held_tensors())
        self.stats.peak_kv_bytes = max(self.stats.peak_kv_bytes, held)
        self.stats.peak_kv_tokens = max(self.stats.peak_kv_tokens, self.cache.held_tokens())
        self.stats.peak_kv_blocks = self.stats.peak_kv_tokens


def cache_kwarg_name(model) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); use whichever this version
    takes."""
    base = base_model(model)
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
