"""The sampler the trainer calls: B prompts x G completions under a KV-cache budget.

`GroupSampler.sample` checks the request (before any work), turns `sampling.kv_budget` into tokens and
the number of slots g, then runs the one loop shared with the simulator:

    while not sched.done:
        for slot, spec in sched.admit(): engine.start(slot, spec)
        finished = engine.decode_step(sched.active())
        sched.step(finished)

The scheduler (`scheduler.py`, `policies.py`) decides who runs; the engine (`engines/slots.py`) runs
them. Policies differ only in admission: `full` (all samples at once), `rounds`, `continuous`,
`length_aware`.

Deliberately simple: one device; the `auto` budget is a fixed share of free memory until the planner
refines it (`AUTO_BUDGET_FRACTION`, `resolve_budget`).
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Sequence

import torch

from infsamp.config import SamplingConfig, parse_size, size_is_bytes
from infsamp.errors import SamplingError
from infsamp.models.loading import stop_token_ids
from infsamp.sampling.engines.base import DecodeOptions, LogitsProcessorFactory
from infsamp.sampling.engines.slots import SlotEngine
from infsamp.sampling.scheduler import SampleSpec, SlotScheduler, make_group_specs
from infsamp.sampling.types import (Completion, SampleResult, SamplerStats, kv_bytes_per_token,
                                    micro_group_for_budget)

AUTO_BUDGET_FRACTION = {"cuda": 0.5, "cpu": 0.25}  # share of free memory the KV cache may take


# ---------------------------------------------------------------- budget


def model_kv_bytes_per_token(model) -> int:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dtype_bytes = next(model.parameters()).element_size()
    return kv_bytes_per_token(config.num_hidden_layers, kv_heads, head_dim, dtype_bytes)


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_budget(kv_budget: str, model) -> int:
    """`sampling.kv_budget` -> KV tokens: '8192' is tokens, '2GiB' bytes, 'auto' a share of free memory."""
    per_token = model_kv_bytes_per_token(model)
    if kv_budget == "auto":
        device = next(model.parameters()).device
        return int(free_memory_bytes(device) * AUTO_BUDGET_FRACTION.get(device.type, 0.25)) // per_token
    try:
        size = parse_size(kv_budget)
    except ValueError as err:
        raise SamplingError(f"sampling.kv_budget: {err}") from None
    return size // per_token if size_is_bytes(kv_budget) else size


# ---------------------------------------------------------------- the sampler


class GroupSampler:
    def __init__(self, model, tokenizer, cfg: SamplingConfig, predictor=None):
        self.model, self.tokenizer, self.cfg, self.predictor = model, tokenizer, cfg, predictor
        self.last_num_slots = 0  # g of the latest call (the trainer halves it after an out-of-memory error)

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    def sample(self, prompt_ids: list[list[int]], num_generations: int, prompt_keys: list[str] | None = None,
               prompt_texts: list[str] | None = None, max_new_tokens: int | None = None,
               temperature: float | None = None, logits_processor_factory: LogitsProcessorFactory | None = None,
               generator: torch.Generator | None = None, policy: str | None = None,
               global_group_ids: Sequence[int] | None = None) -> SampleResult:
        """Every completion of every prompt, grouped by prompt, plus the sampler's statistics.

        `global_group_ids`: each prompt's place in the whole step when this call samples a rank's
        share of it; sample j of prompt i then draws the random stream a single process gives it
        (key `global_group_ids[i] * G + j`), so the completions do not depend on the process count.
        """
        policy = policy or self.cfg.policy
        max_new = max_new_tokens or self.cfg.max_new_tokens
        self._check_request(prompt_ids, num_generations, max_new)
        budget = resolve_budget(self.cfg.kv_budget, self.model)
        max_new = self._fit_budget(prompt_ids, max_new, budget)
        specs = self._specs(prompt_ids, num_generations, max_new, prompt_keys, prompt_texts)
        num_slots = self.num_slots(policy, budget, [len(p) for p in prompt_ids], max_new, len(specs))
        self.last_num_slots = num_slots
        options = self._decode_options(temperature, generator)
        if global_group_ids is not None:
            options.sample_keys = tuple(global_group_ids[spec.group_id] * num_generations
                                        + spec.index_in_group for spec in specs)
        sched = SlotScheduler(specs, policy, num_slots, max_kv_tokens=budget, predictor=self.predictor,
                              refill=self.cfg.refill, epsilon=self.cfg.grouping_epsilon,
                              prefix_tokens=self.cfg.predictor_prefix_tokens)
        processor = logits_processor_factory(specs) if logits_processor_factory else None
        engine = SlotEngine(self.model, prompt_ids, [num_generations] * len(prompt_ids), sched.num_slots,
                            max(s.max_new_tokens for s in specs), options, processor)
        wall_time = self._run(sched, engine)
        stats = self._stats(sched, engine, policy, budget, wall_time)
        return SampleResult(self._completions(specs, engine, num_generations), stats)

    def num_slots(self, policy: str, budget: int, prompt_lengths: Sequence[int], max_new: int,
                  num_samples: int) -> int:
        """g: `sampling.micro_group` if set, capped by what the budget holds in the worst case."""
        if policy == "full":
            return num_samples
        fits = micro_group_for_budget(budget, max_new, max(prompt_lengths), len(prompt_lengths), num_samples)
        return max(1, min(fits, self.cfg.micro_group or fits))

    # ---- checks, before any work
    def _check_request(self, prompt_ids: list[list[int]], num_generations: int, max_new: int) -> None:
        if num_generations < 1:
            raise SamplingError(f"num_generations (G) must be >= 1, got {num_generations}")
        if max_new < 1:
            raise SamplingError(f"max_new_tokens must be >= 1, got {max_new}")
        if not prompt_ids:
            raise SamplingError("no prompts given")
        for index, prompt in enumerate(prompt_ids):
            if len(prompt) == 0:
                raise SamplingError(f"prompt {index} is empty (0 tokens)")
            if len(prompt) > self.max_context - 1:
                raise SamplingError(f"prompt {index} has {len(prompt)} tokens; the model context is "
                                    f"{self.max_context}, so at most {self.max_context - 1} fit")

    def _fit_budget(self, prompt_ids: list[list[int]], max_new: int, budget: int) -> int:
        """Budget must hold the longest prompt plus one token; a smaller max_new_tokens than asked is
        used (with a warning) when it cannot hold a whole completion."""
        longest = max(len(p) for p in prompt_ids)
        if budget < longest + 1:
            raise SamplingError(f"sampling.kv_budget={self.cfg.kv_budget!r} ({budget} tokens) cannot hold "
                                f"the longest prompt ({longest} tokens) plus one token")
        if budget < longest + max_new:
            warnings.warn(f"sampling.kv_budget={self.cfg.kv_budget!r} ({budget} tokens) holds at most "
                          f"{budget - longest} new tokens per sample; max_new_tokens lowered from {max_new}")
            return budget - longest
        return max_new

    def _specs(self, prompt_ids, num_generations, max_new, prompt_keys, prompt_texts) -> list[SampleSpec]:
        lengths = [len(p) for p in prompt_ids]
        specs = make_group_specs(lengths, num_generations, max_new, prompt_keys, prompt_texts)
        # positions stop at the context: a sample of length L feeds positions P-1 .. P+L-2
        return [dataclasses.replace(s, max_new_tokens=min(s.max_new_tokens, self.max_context - s.prompt_tokens + 1))
                for s in specs]

    def _decode_options(self, temperature: float | None, generator: torch.Generator | None) -> DecodeOptions:
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator).item())
        temp = self.cfg.temperature if temperature is None else temperature
        return DecodeOptions(temperature=temp, top_p=self.cfg.top_p, top_k=self.cfg.top_k, seed=seed,
                             eos_token_ids=stop_token_ids(self.model, self.tokenizer))

    # ---- the loop
    def _run(self, sched: SlotScheduler, engine: SlotEngine) -> float:
        was_training = self.model.training
        self.model.eval()
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                while not sched.done:
                    for slot, spec in sched.admit():
                        engine.start(slot, spec)
                    finished = engine.decode_step(sched.active())
                    self._report_prefixes(sched, engine)
                    sched.step(finished)
        finally:
            self.model.train(was_training)
        return time.perf_counter() - start

    @staticmethod
    def _report_prefixes(sched: SlotScheduler, engine: SlotEngine) -> None:
        wanted = sched.prefix_tokens_wanted
        if wanted <= 0:
            return
        for spec in sched.active().values():
            tokens = engine.tokens(spec.sample_id)
            if len(tokens) == wanted and engine.is_running(spec.sample_id):
                sched.observe_prefix(spec.sample_id, tokens)

    # ---- results
    def _completions(self, specs: list[SampleSpec], engine: SlotEngine, num_generations: int):
        groups: list[list[Completion]] = [[] for _ in range(len(specs) // num_generations)]
        for spec in specs:
            ids = engine.tokens(spec.sample_id)
            reason = engine.finish_reason(spec.sample_id)
            text_ids = ids[:-1] if reason == "eos" else ids
            text = self.tokenizer.decode(text_ids, skip_special_tokens=True) if self.tokenizer else ""
            groups[spec.group_id].append(Completion(list(ids), text, len(ids), reason, spec.group_id,
                                                    spec.index_in_group))
        return groups

    @staticmethod
    def _stats(sched: SlotScheduler, engine: SlotEngine, policy: str, budget: int, wall_time: float):
        s, c = sched.stats(), engine.counters
        stats = SamplerStats(
            decode_steps=s.decode_steps, lower_bound=s.lower_bound, opt_lower_bound=s.opt_lower_bound,
            prefill_tokens=c.prefill_tokens,
            peak_kv_tokens=c.peak_kv_tokens, peak_kv_bytes=c.peak_kv_bytes,
            num_preemptions=c.num_preemptions + s.num_preemptions, recomputed_tokens=c.recomputed_tokens,
            generated_tokens=c.generated_tokens, wall_time_s=wall_time,
            tokens_per_second=c.generated_tokens / max(wall_time, 1e-9), num_slots=sched.num_slots,
            kv_budget_tokens=budget, policy=policy)
        stats.extra["peak_kv_tokens_used"] = s.peak_kv_tokens  # occupied, as the simulator counts
        stats.extra["model_time_s"] = c.model_time_s
        stats.extra["overhead_fraction"] = max(0.0, 1.0 - c.model_time_s / max(wall_time, 1e-9))
        if s.kendall_tau is not None:
            stats.extra["predictor_kendall_tau"] = s.kendall_tau
            stats.extra["predictor_mae"] = s.mae or 0.0
        return stats
