"""The sampler the trainer calls: B prompts x G completions under a KV-cache budget, on any engine.

`GroupSampler.sample` checks the request (before any work), reads g and the KV budget from the
run's sizes (`planner.sizes.RunSizes`, decided once at start-up), caps g by what the budget holds
for this call's prompts (`kv_budget.micro_group_within`: with the run's sizes it never binds), then
runs the one loop shared with the simulator (told in `scheduler.py`) on the engine it was given
(`engines/`: `slots` or `vllm`). The scheduler (`scheduler.py`, `policies/`) decides who runs; the
engine runs them and appends their tokens. With a `TurnHandler` (tools, `turns.py`) the loop also
resumes answered tool calls before each admission and parks the samples whose turn ended in a call
after each step. Each sample draws its random numbers from its own seed, so every policy and every
engine schedule return the same completions.

A call may ask for its prompts' common prefix to be held once (`share_prefix`, evaluation does:
its problems share the chat template and system prompt) on an engine that can (`shares_prefix`:
the slot engine): the scheduler then counts that prefix once, so the same KV budget holds more
rows, and `fill_budget` lets the call run as many as it holds (g = all it holds, not the run's g).

Deliberately simple: one device; a sampler given no sizes (used alone: tests, scripts) sizes each
call for its own prompts through the run's one path (`sampling.sizes.sampler_run_sizes`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from infsamp.config_algorithm import SamplingConfig
from infsamp.console import Notices
from infsamp.errors import SamplingError
from infsamp.models.loading import stop_token_ids
from infsamp.planner.kv_budget import micro_group_within, tokens_within_or_refuse
from infsamp.planner.sizes import RunSizes
from infsamp.sampling.engines.base import DecodeOptions, Engine, LogitsProcessorFactory
from infsamp.sampling.engines.slots import SlotEngine
from infsamp.sampling.scheduler import SlotScheduler
from infsamp.sampling.sizes import sampler_run_sizes
from infsamp.sampling.turns import TurnHandler, TurnLoop
from infsamp.sampling.types import (
    Completion,
    Sample,
    SampleGate,
    SampleResult,
    SamplerStats,
    make_samples,
)

# told after each decode step: the call's statistics so far, samples finished, samples running
ProgressCallback = Callable[[SamplerStats, int, int], None]


# ---------------------------------------------------------------- settings


def policy_options(cfg: SamplingConfig, policy: str) -> dict:
    """The `sampling.*` settings a policy takes (length_aware: refill, epsilon, k, preemption;
    probe: its k)."""
    if policy == "probe":
        return {"probe_tokens": cfg.probe_tokens}
    if policy != "length_aware":
        return {}
    return {"refill": cfg.refill, "epsilon": cfg.grouping_epsilon,
            "prefix_tokens": cfg.predictor_prefix_tokens, "preempt": cfg.preempt}


def shared_prefix_tokens(prompt_ids: Sequence[Sequence[int]]) -> int:
    """The tokens every prompt starts with, short of each one's last (it is fed at the first decode
    step, not prefilled); 0 for a single prompt (nothing to share)."""
    if len(prompt_ids) < 2:
        return 0
    first, most = prompt_ids[0], min(len(p) for p in prompt_ids) - 1
    length = 0
    while length < most and all(p[length] == first[length] for p in prompt_ids):
        length += 1
    return length


def _sample_keys(samples: Sequence[Sample], global_group_ids: Sequence[int] | None,
                 key_stride: int, most: int) -> tuple[int, ...]:
    """Each sample's random-stream key when the call samples part of a step (`global_group_ids`)
    or chunks of groups (`key_stride`): global id x stride + index in its group, so a group drawn
    at once or in chunks, in one process or several, gets the same numbers; () otherwise (the
    sample's id is its key)."""
    if global_group_ids is None and not key_stride:
        return ()
    stride = key_stride or most
    return tuple((global_group_ids[s.group_id] if global_group_ids is not None else s.group_id)
                 * stride + s.index_in_group for s in samples)


def draw_seed(generator: torch.Generator | None) -> int:
    """A sampler call's seed (the base of every sample's random stream), drawn from `generator`."""
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator).item())


def _timed(sched: SlotScheduler, call, *args):
    """A scheduler call (which runs the policy and the predictor), its time in the call's stats."""
    start = time.perf_counter()
    try:
        return call(*args)
    finally:
        sched.stats.schedule_time_s += time.perf_counter() - start


# ---------------------------------------------------------------- the sampler


class GroupSampler:
    """`sizes`: the run's (only read here: the out-of-memory retry halves them, `RunSizes.halve`);
    None: each call is sized for its own prompts (`call_sizes`). `notices`: the run's, when it
    makes a sampler per step (each notice is said once)."""

    def __init__(self, model, tokenizer, cfg: SamplingConfig, predictor=None,
                 engine: Engine | None = None, sizes: RunSizes | None = None,
                 notices: Notices | None = None):
        self.model, self.tokenizer, self.cfg, self.predictor = model, tokenizer, cfg, predictor
        self.engine = engine if engine is not None else SlotEngine(model)
        self.notices = notices if notices is not None else Notices()
        if getattr(predictor, "uses_hidden", False) and not self.engine.hands_hidden_states:
            self.notices.say("hidden", f"sampling.predictor {predictor.name}: the "
                             f"{self.engine.name} engine hands out no hidden states; its "
                             "token-level part (as online) predicts instead")
        self.sizes = sizes

    def sample(self, prompt_ids: list[list[int]], num_generations: int | Sequence[int],
               prompt_keys: list[str] | None = None,
               prompt_texts: list[str] | None = None, max_new_tokens: int | None = None,
               temperature: float | None = None,
               logits_processor_factory: LogitsProcessorFactory | None = None,
               generator: torch.Generator | None = None, policy: str | None = None,
               target_lengths: Sequence[int] | None = None,
               global_group_ids: Sequence[int] | None = None,
               progress: ProgressCallback | None = None,
               first_index: Sequence[int] | None = None, seed: int | None = None,
               key_stride: int = 0, turns: TurnHandler | None = None,
               share_prefix: bool = False, fill_budget: bool = False,
               gate: SampleGate | None = None) -> SampleResult:
        """Every completion of every prompt, grouped by prompt, plus the sampler's statistics.

        `target_lengths` (one per sample, group-major): each sample ends after exactly that many
        tokens (the benchmarks' controlled workload). `global_group_ids`: each prompt's place in
        the whole step when this call samples a rank's share of it; sample j of prompt i then
        draws the stream a single process gives it (key `global_group_ids[i] * G + j`), so the
        completions do not depend on the process count. `progress` (a `ProgressCallback`): called
        after every decode step. Chunks of a group (dynamic sampling): `num_generations` one
        count per prompt, `first_index` the index in its group of each prompt's first sample,
        `seed` the step's seed (else one is drawn from `generator`) and `key_stride` the keys' G
        (global id * key_stride + index); chunks then draw exactly what one call of the whole
        group does.
        `turns`: multi-turn episodes (tool calls, `turns.py`), up to `sampling.max_turns` each.
        `share_prefix`: the prompts' common prefix forwarded and held once (where the engine can;
        the numbers then differ from unshared ones in the last bits); `fill_budget`: as many
        samples at once as the KV budget holds, the run's g aside (evaluation).
        `gate`: decisions inside the call (dynamic sampling, `types.SampleGate`: held samples
        released, waiting ones cancelled, the call stopped); cancelled samples are not in the
        result.
        """
        max_new = max_new_tokens or self.cfg.max_new_tokens
        counts = ([num_generations] * len(prompt_ids) if isinstance(num_generations, int)
                  else list(num_generations))
        self._check_request(prompt_ids, min(counts, default=1), max_new, logits_processor_factory)
        sizes = self.sizes or self.call_sizes(prompt_ids, max(counts), max_new)
        policy = policy or sizes.sampling_policy(self.cfg.policy)
        budget = self.budget_tokens(sizes)
        max_new = self._fit_budget(prompt_ids, max_new, budget)
        lengths = [len(p) for p in prompt_ids]
        samples = self._samples(lengths, counts, max_new, prompt_keys, prompt_texts, first_index)
        prefix = shared_prefix_tokens(prompt_ids) if share_prefix and \
            self.engine.shares_prefix else 0
        micro_group = self.micro_group(policy, sizes, budget, lengths, max_new, len(samples),
                                       prefix, fill_budget)
        options = self._decode_options(temperature, generator, seed, target_lengths)
        options.sample_keys = _sample_keys(samples, global_group_ids, key_stride, max(counts))
        held = gate.begin(samples) if gate is not None else ()
        sched = self._scheduler(samples, policy, micro_group, budget, prefix, held)
        processor = logits_processor_factory(samples) if logits_processor_factory else None
        stats = sched.stats
        stats.kv_budget_tokens, stats.engine = budget, self.engine.name
        loop = TurnLoop(turns, sched, stats, self.cfg.max_turns) if turns is not None else None
        options.turn_ends = loop.continues if loop is not None else None
        self.engine.begin_call(prompt_ids, samples, sched.num_slots, options, stats, processor,
                               pool_tokens=sched.max_running_tokens, shared_prefix=prefix)
        stats.wall_time_s = self._run(sched, progress, loop, gate)
        return SampleResult(self._completions(samples, len(prompt_ids)), stats)

    def _scheduler(self, samples: list[Sample], policy: str, micro_group: int, budget: int,
                   prefix: int, held=()) -> SlotScheduler:
        """The call's scheduler over this sampler's predictor and what its engine can do."""
        return SlotScheduler(samples, policy, micro_group, max_kv_tokens=budget,
                             predictor=self.predictor, kv_block_size=self.engine.kv_block_size,
                             keep_parked_kv=self.engine.keeps_parked_kv,
                             max_micro_group=self.engine.max_micro_group,
                             shared_prefix_tokens=prefix, held=held,
                             **policy_options(self.cfg, policy))

    def call_sizes(self, prompt_ids: list[list[int]], num_generations: int,
                   max_new: int) -> RunSizes:
        """A sampler used alone: one call sized as a run's step of its prompts, for the engine it
        was given, started apart (`sampling.sizes.sampler_run_sizes`)."""
        sampling = replace(self.cfg, num_generations=num_generations, max_new_tokens=max_new,
                           engine=self.engine.name)
        return sampler_run_sizes(sampling, self.model, max(len(p) for p in prompt_ids),
                                 len(prompt_ids), engine_apart=True)

    def budget_tokens(self, sizes: RunSizes) -> int:
        """The KV budget in tokens, capped by the engine's fixed KV pool (vLLM)."""
        budget = sizes.kv_budget_tokens
        return min(budget, self.engine.kv_capacity_tokens or budget)

    def micro_group(self, policy: str, sizes: RunSizes, budget: int,
                    prompt_lengths: Sequence[int], max_new: int, num_samples: int,
                    shared_prefix: int = 0, fill_budget: bool = False) -> int:
        """g: the sizes' g (0 or `fill_budget`: all the budget holds), capped by what the budget
        holds for this call's prompts in the worst case, a shared prefix counted once (and by the
        engine's concurrency)."""
        if policy == "full":
            return num_samples
        fits = micro_group_within(budget - shared_prefix, max_new,
                                  max(prompt_lengths) - shared_prefix, len(prompt_lengths),
                                  num_samples, self.engine.kv_block_size)
        g = max(1, min(fits, (not fill_budget and sizes.micro_group) or fits))
        return min(g, self.engine.max_micro_group or g)

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
        context = self.engine.max_context
        for index, prompt in enumerate(prompt_ids):
            if len(prompt) == 0:
                raise SamplingError(f"prompt {index} is empty (0 tokens)")
            if len(prompt) > context - 1:
                raise SamplingError(f"prompt {index} has {len(prompt)} tokens; the model context "
                                    f"is {context}, so at most {context - 1} fit")

    def check_budget(self, prompt_ids: list[list[int]]) -> None:
        """A run's start: the KV budget holds its longest prompt plus one token (SamplingError,
        one line, before anything is sampled or written)."""
        self._tokens_within(prompt_ids, self.cfg.max_new_tokens, self.budget_tokens(self.sizes))

    def _tokens_within(self, prompt_ids: list[list[int]], max_new: int, budget: int) -> int:
        """The new tokens per sample `budget` holds beside the longest prompt (at most max_new);
        SamplingError when it cannot hold that prompt plus one token."""
        return tokens_within_or_refuse(budget, max(len(p) for p in prompt_ids), max_new,
                                       self.engine.kv_block_size, self.cfg.kv_budget)

    def _fit_budget(self, prompt_ids: list[list[int]], max_new: int, budget: int) -> int:
        """Budget must hold the longest prompt plus one token; a smaller max_new_tokens than asked
        is used (said once per sampler) when it cannot hold a whole completion."""
        fits = self._tokens_within(prompt_ids, max_new, budget)
        if fits < max_new:
            self.notices.say("budget", f"sampling.kv_budget={self.cfg.kv_budget!r} ({budget} "
                             f"tokens) holds at most {fits} new tokens per sample: max_new_tokens "
                             f"lowered from {max_new} (said once)")
        return fits

    def _samples(self, lengths, counts, max_new, prompt_keys, prompt_texts,
                 first_index) -> list[Sample]:
        samples = make_samples(lengths, counts, max_new, prompt_keys, prompt_texts, first_index)
        for sample in samples:  # a sample stops at the context: prompt + completion <= max_context
            sample.max_new_tokens = min(sample.max_new_tokens,
                                        self.engine.max_context - sample.prompt_tokens)
        return samples

    def _decode_options(self, temperature: float | None, generator: torch.Generator | None,
                        seed: int | None, target_lengths: Sequence[int] | None) -> DecodeOptions:
        if seed is None:
            seed = draw_seed(generator)
        temp = self.cfg.temperature if temperature is None else temperature
        options = DecodeOptions(temperature=temp, top_p=self.cfg.top_p, top_k=self.cfg.top_k,
                                seed=seed, eos_token_ids=stop_token_ids(self.model, self.tokenizer))
        if target_lengths is not None:
            options.target_lengths = tuple(int(n) for n in target_lengths)
        options.hidden_states = getattr(self.predictor, "uses_hidden", False) and \
            self.engine.hands_hidden_states
        return options

    # ---- the loop
    def _run(self, sched: SlotScheduler, progress: ProgressCallback | None = None,
             turns: TurnLoop | None = None, gate: SampleGate | None = None) -> float:
        start = time.perf_counter()
        try:
            while not sched.done:
                if turns is not None:
                    turns.resume_answered()
                for slot, sample in _timed(sched, sched.admit):
                    self.engine.start(slot, sample)
                running = sched.active()
                if not running:  # every sample left waits on a tool call
                    turns.wait_for_answer()
                    continue
                finished = self.engine.decode_step(running)
                _timed(sched, sched.step, [s for s in finished if s.finish_reason != "tool_call"])
                if turns is not None:
                    turns.park_calls(finished)
                if gate is not None and self._ask_gate(sched, gate, finished):
                    self.engine.reset()  # stopped with samples running: the engine drops them
                    return time.perf_counter() - start
                if progress is not None:
                    sched.stats.wall_time_s = time.perf_counter() - start  # so far
                    progress(sched.stats, sched.num_finished, len(running))
        except BaseException:
            self.engine.reset()
            raise
        self.engine.end_call()
        return time.perf_counter() - start

    def _ask_gate(self, sched: SlotScheduler, gate: SampleGate,
                  finished: Sequence[Sample]) -> bool:
        """The gate's decisions after a decode step, over the completions that ended in it;
        True when it stopped the call with samples still running."""
        ended = [self._completion(s) for s in sorted(finished, key=lambda s: s.sample_id)
                 if s.status == "finished"]
        release, cancel, stop = gate.after_step(ended)
        if stop:
            return sched.stop()
        sched.release(release)
        self.engine.cancel(sched.cancel(cancel))
        return False

    # ---- results
    def _completions(self, samples: list[Sample], num_groups: int) -> list[list[Completion]]:
        """Every finished sample's completion by group (a gate's cancelled samples left out)."""
        groups: list[list[Completion]] = [[] for _ in range(num_groups)]
        for sample in samples:
            if sample.status == "finished":
                groups[sample.group_id].append(self._completion(sample))
        return groups

    def _completion(self, sample: Sample) -> Completion:
        ids = sample.token_ids
        text_ids = ids[:-1] if sample.finish_reason == "eos" else ids
        text = self.tokenizer.decode(text_ids, skip_special_tokens=True) if self.tokenizer else ""
        return Completion(list(ids), text, len(ids), sample.finish_reason, sample.group_id,
                          sample.index_in_group, sample.logprobs, list(sample.context_spans),
                          sample.num_turns, sample.num_context_tokens,
                          list(sample.tool_latencies_s))
