"""The sampler the trainer calls: B prompts x G completions under a KV-cache budget, on any engine.

`GroupSampler.sample` checks the request (before any work), turns `sampling.kv_budget` into tokens
and the number of concurrent samples g (`types.concurrency_for_budget`), then runs the one loop
shared with the simulator, on the engine it was given (`engines/`: `slots` or `vllm`):

    while not sched.done:
        for slot, sample in sched.admit(): engine.start(slot, sample)
        finished = engine.decode_step(sched.active())
        sched.step(finished)

The scheduler (`scheduler.py`, `policies.py`) decides who runs; the engine runs them and appends
their tokens. Policies differ only in admission: `full` (all samples at once), `rounds`,
`continuous`, `length_aware`. Each sample draws its random numbers from its own seed, so every
policy and every engine schedule return the same completions.

Deliberately simple: one device; the `auto` budget is a fixed share of free memory until the planner
refines it (`AUTO_BUDGET_FRACTION`, `resolve_budget`).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Sequence

import torch

from infsamp.config import SamplingConfig, parse_size, size_is_bytes
from infsamp.errors import SamplingError
from infsamp.models.loading import stop_token_ids
from infsamp.sampling.engines.base import (DecodeOptions, Engine, EngineLimits,
                                           LogitsProcessorFactory, model_kv_bytes_per_token)
from infsamp.sampling.engines.slots import SlotEngine
from infsamp.sampling.scheduler import SlotScheduler
from infsamp.sampling.types import (Completion, Sample, SampleResult, SamplerStats,
                                    concurrency_for_budget, kv_tokens_needed, largest_fitting,
                                    make_samples)

AUTO_BUDGET_FRACTION = {"cuda": 0.5, "cpu": 0.25}  # share of free memory the KV cache may take


# told after each decode step: the call's statistics so far, samples finished, samples running
ProgressCallback = Callable[[SamplerStats, int, int], None]


# ---------------------------------------------------------------- budget


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


def engine_limits(cfg: SamplingConfig, model, max_prompt_tokens: int,
                  num_prompts: int) -> EngineLimits:
    """What a long-lived engine must serve: prompts up to `max_prompt_tokens`, `num_prompts` x G
    samples per call, at most g at once (all of them under `full`), within `sampling.kv_budget`."""
    num_samples = num_prompts * cfg.num_generations
    concurrency = num_samples if cfg.policy == "full" else min(cfg.micro_group or num_samples,
                                                                num_samples)
    return EngineLimits(max_prompt_tokens=max_prompt_tokens, max_new_tokens=cfg.max_new_tokens,
                        max_num_seqs=concurrency,
                        kv_budget_tokens=resolve_budget(cfg.kv_budget, model))


def policy_options(cfg: SamplingConfig, policy: str) -> dict:
    """The `sampling.*` settings a policy takes (length_aware: refill, epsilon, k, preemption)."""
    if policy != "length_aware":
        return {}
    return {"refill": cfg.refill, "epsilon": cfg.grouping_epsilon,
            "prefix_tokens": cfg.predictor_prefix_tokens, "preempt": cfg.preempt}


def _timed(sched: SlotScheduler, call, *args):
    """A scheduler call (which runs the policy and the predictor), its time in the call's stats."""
    start = time.perf_counter()
    try:
        return call(*args)
    finally:
        sched.stats.schedule_time_s += time.perf_counter() - start


# ---------------------------------------------------------------- the sampler


class GroupSampler:
    def __init__(self, model, tokenizer, cfg: SamplingConfig, predictor=None,
                 engine: Engine | None = None):
        self.model, self.tokenizer, self.cfg, self.predictor = model, tokenizer, cfg, predictor
        self.engine = engine if engine is not None else SlotEngine(model)
        if getattr(predictor, "uses_hidden", False) and not self.engine.hands_hidden_states:
            warnings.warn(f"sampling.predictor {predictor.name}: the {self.engine.name} engine "
                          "hands out no hidden states; its token-level part (as online) predicts "
                          "instead")
        self.last_num_slots = 0  # g of the latest call (the trainer halves it after an out-of-memory error)

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def sample(self, prompt_ids: list[list[int]], num_generations: int, prompt_keys: list[str] | None = None,
               prompt_texts: list[str] | None = None, max_new_tokens: int | None = None,
               temperature: float | None = None, logits_processor_factory: LogitsProcessorFactory | None = None,
               generator: torch.Generator | None = None, policy: str | None = None,
               target_lengths: Sequence[int] | None = None,
               global_group_ids: Sequence[int] | None = None,
               progress: ProgressCallback | None = None) -> SampleResult:
        """Every completion of every prompt, grouped by prompt, plus the sampler's statistics.

        `target_lengths` (one per sample, group-major) makes each sample end after exactly that
        many tokens: the benchmarks' controlled workload.
        `global_group_ids`: each prompt's place in the whole step when this call samples a rank's
        share of it; sample j of prompt i then draws the random stream a single process gives it
        (key `global_group_ids[i] * G + j`), so the completions do not depend on the process count.
        `progress`, if given, is called after every decode step (see `ProgressCallback`).
        """
        policy = policy or self.cfg.policy
        max_new = max_new_tokens or self.cfg.max_new_tokens
        self._check_request(prompt_ids, num_generations, max_new, logits_processor_factory)
        budget = self.budget_tokens()
        max_new = self._fit_budget(prompt_ids, max_new, budget)
        samples = self._samples(prompt_ids, num_generations, max_new, prompt_keys, prompt_texts)
        lengths = [len(p) for p in prompt_ids]
        num_slots = self.num_slots(policy, budget, lengths, max_new, len(samples))
        self.last_num_slots = num_slots
        options = self._decode_options(temperature, generator)
        if target_lengths is not None:
            options.target_lengths = tuple(int(n) for n in target_lengths)
        if global_group_ids is not None:
            options.sample_keys = tuple(global_group_ids[s.group_id] * num_generations
                                        + s.index_in_group for s in samples)
        options.hidden_states = getattr(self.predictor, "uses_hidden", False) and \
            self.engine.hands_hidden_states
        sched = SlotScheduler(samples, policy, num_slots, max_kv_tokens=budget,
                              predictor=self.predictor, kv_block_size=self.engine.kv_block_size,
                              keep_parked_kv=self.engine.keeps_parked_kv,
                              **policy_options(self.cfg, policy))
        processor = logits_processor_factory(samples) if logits_processor_factory else None
        stats = sched.stats
        stats.kv_budget_tokens, stats.engine = budget, self.engine.name
        self.engine.begin_call(prompt_ids, samples, sched.num_slots, options, stats, processor)
        stats.wall_time_s = self._run(sched, progress)
        return SampleResult(self._completions(samples, num_generations), stats)

    def budget_tokens(self) -> int:
        """`sampling.kv_budget` in tokens, capped by the engine's fixed KV pool (vLLM)."""
        budget = resolve_budget(self.cfg.kv_budget, self.model)
        capacity = self.engine.kv_capacity_tokens
        return budget if capacity is None else min(budget, capacity)

    def num_slots(self, policy: str, budget: int, prompt_lengths: Sequence[int], max_new: int,
                  num_samples: int) -> int:
        """g: `sampling.micro_group` if set, capped by what the budget holds in the worst case (and
        by the engine's concurrency)."""
        if policy == "full":
            return num_samples
        fits = concurrency_for_budget(budget, max_new, max(prompt_lengths), len(prompt_lengths),
                                      num_samples, self.engine.kv_block_size)
        g = max(1, min(fits, self.cfg.micro_group or fits))
        return min(g, self.engine.max_num_seqs or g)

    # ---- checks, before any work
    def _check_request(self, prompt_ids: list[list[int]], num_generations: int, max_new: int,
                       logits_processor_factory) -> None:
        if num_generations < 1:
            raise SamplingError(f"num_generations (G) must be >= 1, got {num_generations}")
        if max_new < 1:
            raise SamplingError(f"max_new_tokens must be >= 1, got {max_new}")
        if not prompt_ids:
            raise SamplingError("no prompts given")
        if logits_processor_factory is not None and self.engine.name != "slots":
            raise SamplingError(f"a logits processor runs on the slot engine only (sampling.engine"
                                f" is {self.engine.name}); use target_lengths or --sampling.engine"
                                " slots")
        for index, prompt in enumerate(prompt_ids):
            if len(prompt) == 0:
                raise SamplingError(f"prompt {index} is empty (0 tokens)")
            if len(prompt) > self.max_context - 1:
                raise SamplingError(f"prompt {index} has {len(prompt)} tokens; the model context is "
                                    f"{self.max_context}, so at most {self.max_context - 1} fit")

    def _fit_budget(self, prompt_ids: list[list[int]], max_new: int, budget: int) -> int:
        """Budget must hold the longest prompt plus one token; a smaller max_new_tokens than asked is
        used (with a warning) when it cannot hold a whole completion."""
        longest, block = max(len(p) for p in prompt_ids), self.engine.kv_block_size
        fits = largest_fitting(max_new,
                               lambda m: kv_tokens_needed(1, m, longest, 1, block) <= budget)
        if fits < 1:
            raise SamplingError(f"sampling.kv_budget={self.cfg.kv_budget!r} ({budget} tokens) cannot hold "
                                f"the longest prompt ({longest} tokens) plus one token")
        if fits < max_new:
            warnings.warn(f"sampling.kv_budget={self.cfg.kv_budget!r} ({budget} tokens) holds at most "
                          f"{fits} new tokens per sample; max_new_tokens lowered from {max_new}")
        return fits

    def _samples(self, prompt_ids, num_generations, max_new, prompt_keys,
                 prompt_texts) -> list[Sample]:
        samples = make_samples([len(p) for p in prompt_ids], num_generations, max_new, prompt_keys,
                               prompt_texts)
        for sample in samples:  # a sample stops at the context: prompt + completion <= max_context
            sample.max_new_tokens = min(sample.max_new_tokens,
                                        self.max_context - sample.prompt_tokens)
        return samples

    def _decode_options(self, temperature: float | None, generator: torch.Generator | None) -> DecodeOptions:
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator).item())
        temp = self.cfg.temperature if temperature is None else temperature
        return DecodeOptions(temperature=temp, top_p=self.cfg.top_p, top_k=self.cfg.top_k, seed=seed,
                             eos_token_ids=stop_token_ids(self.model, self.tokenizer))

    # ---- the loop
    def _run(self, sched: SlotScheduler, progress: ProgressCallback | None = None) -> float:
        start = time.perf_counter()
        try:
            while not sched.done:
                for slot, sample in _timed(sched, sched.admit):
                    self.engine.start(slot, sample)
                running = sched.active()
                finished = self.engine.decode_step(running)
                _timed(sched, sched.step, finished)
                if progress is not None:
                    sched.stats.wall_time_s = time.perf_counter() - start  # so far
                    progress(sched.stats, sched.num_finished, len(running))
        except BaseException:
            self.engine.reset()
            raise
        self.engine.end_call()
        return time.perf_counter() - start

    # ---- results
    def _completions(self, samples: list[Sample], num_generations: int) -> list[list[Completion]]:
        groups: list[list[Completion]] = [[] for _ in range(len(samples) // num_generations)]
        for sample in samples:
            ids = sample.token_ids
            text_ids = ids[:-1] if sample.finish_reason == "eos" else ids
            text = self.tokenizer.decode(text_ids, skip_special_tokens=True) if self.tokenizer else ""
            groups[sample.group_id].append(Completion(
                list(ids), text, len(ids), sample.finish_reason, sample.group_id,
                sample.index_in_group, sample.logprobs))
        return groups
