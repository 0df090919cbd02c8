"""Replay completion lengths (a trace, `traces.py`) through a scheduling policy, without a
model. Pure Python, no torch.

Each `prompts_per_step` consecutive trace lines form one training step (one sampler call): every
sample of a step finishes before the next step starts. The replay runs the very loop the real
engine runs (`SlotScheduler.admit / active / step`) with `TraceEngine` standing in for the model,
so decode steps agree with the real engine by construction.

A trace's first tokens are decoded as traced, so a token-conditioned predictor sees the prefixes
the model wrote. Past them, or in a trace without them, a sample's tokens are placeholder ids (0):
the predictor learns only that it survived k tokens.

Multi-turn episodes (tool calls, `turns.py`): the replay drives `turns.TurnLoop` (the sampler's own
turn loop) with `TraceTurns`: a turn ends with finish reason "tool_call" after its model tokens,
the sample waits (parked) while the call "runs", and resumes with its context tokens appended. The
rule for the wait: a call made in decode step n is answered before decode step n + 1 +
ceil(latency_s / step_seconds); `step_seconds` 0 (the default) is a zero-latency replay, the answer
there at the next step, as a tool that answers at once in the real loop. When every sample left
waits, the clock jumps to the first answer (idle time is not decode steps). A line without turns
replays as single-turn samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from infsamp.choices import WIDE_POLICIES
from infsamp.errors import SamplingError
from infsamp.planner.kv_budget import kv_tokens_needed, max_new_tokens_within, micro_group_within
from infsamp.sampling.length_predictor import LengthPredictor, OraclePredictor
from infsamp.sampling.policies import uses_predictor
from infsamp.sampling.predictors import make_predictor
from infsamp.sampling.scheduler import SlotScheduler
from infsamp.sampling.traces import MAX_TRACE_TOKENS, TraceGroup
from infsamp.sampling.turns import TurnLoop
from infsamp.sampling.types import Sample, SamplerStats


class TraceEngine:
    """Stands in for the model: a sample ends after exactly its traced length of decode steps.
    Its tokens are the traced first tokens, then placeholders (id 0). A parked sample keeps its
    tokens and resumes where it stopped, as on an engine. With `turn_ends` (the turn loop's
    `continues`, over a `TraceTurns`), a turn ends with finish reason "tool_call" where the
    trace's did, as an engine's turn ends at a stop token when `DecodeOptions.turn_ends` says so."""

    def __init__(self, lengths: Sequence[int], first_tokens: Sequence[Sequence[int]] = ()):
        self.lengths = lengths
        self.first_tokens = first_tokens  # per sample id; () when the trace has none
        self.turn_ends: Callable[[Sample], bool] | None = None  # set by `run_call` with turns

    def start(self, slot: int, sample: Sample) -> None:
        pass

    def decode_step(self, active: dict[int, Sample]) -> list[Sample]:
        finished = []
        for sample in active.values():
            sample.token_ids.append(self.token_at(sample.sample_id, sample.num_tokens))
            if sample.num_tokens >= self.lengths[sample.sample_id]:
                sample.finish_reason = "length"
                finished.append(sample)
            elif self.turn_ends is not None and self.turn_ends(sample):
                sample.finish_reason = "tool_call"
                finished.append(sample)
        return finished

    def token_at(self, sample_id: int, position: int) -> int:
        traced = self.first_tokens[sample_id] if self.first_tokens else ()
        return traced[position] if position < len(traced) else 0


class TraceTurns:
    """The `TurnHandler` of a replay: a sample's turn holds a tool call where the trace's ended
    in one; its answer is the traced number of context tokens, ready after the traced latency
    in decode steps (the module docstring's rule). `tick()` after each decode step."""

    def __init__(self, turns: Sequence[Sequence[Sequence]], engine: TraceEngine,
                 step_seconds: float = 0.0):
        self.step_seconds, self.engine = step_seconds, engine
        self.calls = [self._calls_of(episode) for episode in turns]  # sample id -> end -> call
        self.now = 0  # decode steps so far
        self.pending: list[tuple[int, Sample, int]] = []  # (answered before step, sample, tokens)

    @staticmethod
    def _calls_of(episode: Sequence[Sequence]) -> dict[int, tuple[int, float]]:
        """Token position where each tool turn ends -> (context tokens, latency_s)."""
        calls, position = {}, 0
        for model_tokens, context_tokens, latency_s in episode[:-1]:
            position += model_tokens
            calls[position] = (context_tokens, latency_s)
            position += context_tokens
        return calls

    def continues(self, sample: Sample) -> bool:
        return sample.num_tokens in self.calls[sample.sample_id]

    def submit(self, sample: Sample) -> None:
        context_tokens, latency_s = self.calls[sample.sample_id][sample.num_tokens]
        wait = math.ceil(latency_s / self.step_seconds) if self.step_seconds > 0 else 0
        self.pending.append((self.now + 1 + wait, sample, context_tokens))

    def answered(self, timeout_s: float) -> list[tuple[Sample, list[int]]]:
        """The calls due by now; blocking (timeout_s > 0, nothing decodes): the clock jumps to
        the first due."""
        if timeout_s > 0 and self.pending:
            self.now = max(self.now, min(due for due, _, _ in self.pending))
        ready = [(sample, tokens) for due, sample, tokens in self.pending if due <= self.now]
        self.pending = [entry for entry in self.pending if entry[0] > self.now]
        return [(sample, [self.engine.token_at(sample.sample_id, sample.num_tokens + i)
                          for i in range(tokens)]) for sample, tokens in ready]

    def tick(self) -> None:
        self.now += 1


def run_call(samples: Sequence[Sample], lengths: Sequence[int], policy: str, micro_group: int,
             max_kv_tokens: int = 0, predictor: LengthPredictor | None = None,
             kv_block_size: int = 1, first_tokens: Sequence[Sequence[int]] = (),
             on_tokens: Callable[[int], None] | None = None,
             turns: Sequence[Sequence[Sequence]] | None = None, step_seconds: float = 0.0,
             **policy_options) -> SamplerStats:
    """One sampler call through the engine loop (the sampler's, `sampler.py`: with `turns`, per
    sample its traced turns, its turn loop too); returns the scheduler's statistics.
    `on_tokens(n)` after each decode step of n samples (progress)."""
    if isinstance(predictor, OraclePredictor):
        predictor.set_lengths(dict(enumerate(lengths)))
    scheduler = SlotScheduler(samples, policy, micro_group, max_kv_tokens, predictor,
                              kv_block_size, **policy_options)
    engine = TraceEngine(lengths, first_tokens)
    loop = None
    if turns is not None:
        handler = TraceTurns(turns, engine, step_seconds)
        loop = TurnLoop(handler, scheduler, scheduler.stats, max_turns=MAX_TRACE_TOKENS)
        engine.turn_ends = loop.continues
    while not scheduler.done:
        if loop is not None:
            loop.resume_answered()
        for slot, sample in scheduler.admit():
            engine.start(slot, sample)
        active = scheduler.active()
        if not active:  # every sample left waits on a tool call
            loop.wait_for_answer()
            continue
        finished = engine.decode_step(active)
        scheduler.step([s for s in finished if s.finish_reason != "tool_call"])
        if loop is not None:
            loop.park_calls(finished)
            handler.tick()
        if on_tokens is not None:
            on_tokens(len(active))
    return scheduler.stats


def simulate(groups: Sequence[TraceGroup], policy: str, micro_group: int | None = None,
             kv_budget: int | None = None, predictor: str = "none", prompts_per_step: int = 1,
             max_new_tokens: int | None = None, warmup_steps: int = 0,
             on_tokens: Callable[[int], None] | None = None, step_seconds: float = 0.0,
             **policy_options) -> SamplerStats:
    """Replay a whole trace, `prompts_per_step` groups per training step; statistics summed
    over the steps after the first `warmup_steps` (those only teach the predictor). Traced
    turns wait `step_seconds` per decode step of tool latency (0: answered at the next step).
    `on_tokens(n)`: n more tokens replayed (the trace's lengths sum to the total)."""
    if prompts_per_step < 1:
        raise SamplingError(f"--prompts-per-step must be >= 1, got {prompts_per_step}")
    num_steps = math.ceil(len(groups) / prompts_per_step)
    if warmup_steps >= num_steps:
        raise SamplingError(f"--warmup-steps {warmup_steps} leaves none of the trace's "
                            f"{num_steps} steps to measure")
    max_new = max_new_tokens or max(max(g.lengths) for g in groups)
    too_long = next((g for g in groups if max(g.lengths) > max_new), None)
    if too_long is not None:
        raise SamplingError(f"prompt {too_long.prompt_id} has a length {max(too_long.lengths)} "
                            f"> --max-new-tokens {max_new}")
    micro_group = _micro_group(micro_group, kv_budget, groups, max_new, prompts_per_step)
    if kv_budget is None and policy in WIDE_POLICIES:  # they need one: what g whole samples need
        kv_budget = kv_tokens_needed(micro_group, max_new, max(g.prompt_tokens for g in groups),
                                     prompts_per_step)
    wants_predictor = uses_predictor(policy) or predictor != "none"
    length_predictor = make_predictor(predictor) if wants_predictor else None
    calls = []
    for start in range(0, len(groups), prompts_per_step):
        step_groups = groups[start:start + prompts_per_step]
        samples, lengths = _call_samples(step_groups, max_new)
        calls.append(run_call(samples, lengths, policy, micro_group, kv_budget, length_predictor,
                              first_tokens=_call_first_tokens(step_groups), on_tokens=on_tokens,
                              turns=_call_turns(step_groups), step_seconds=step_seconds,
                              **policy_options))
    return SamplerStats.merge(calls[warmup_steps:])


def _micro_group(micro_group, kv_budget, groups, max_new, prompts_per_step) -> int:
    """g: the one given, capped at what the budget holds, as the sampler computes it
    (`micro_group_within`)."""
    if micro_group is None and kv_budget is None:
        raise SamplingError("give --micro-group or --kv-budget (or both)")
    sizes = [] if micro_group is None else [micro_group]
    if kv_budget is not None:
        largest_prompt = max(g.prompt_tokens for g in groups)
        if max_new_tokens_within(kv_budget, largest_prompt, max_new) < max_new:
            raise SamplingError(f"--kv-budget {kv_budget} is too small for one prompt "
                                f"({largest_prompt} tokens) plus max_new_tokens {max_new}")
        most_samples = max(len(g.lengths) for g in groups) * prompts_per_step
        sizes.append(micro_group_within(kv_budget, max_new, largest_prompt, prompts_per_step,
                                        most_samples))
    if micro_group is not None and micro_group < 1:
        raise SamplingError(f"--micro-group must be >= 1, got {micro_group}")
    return min(sizes)


def _call_samples(step_groups: Sequence[TraceGroup],
                  max_new: int) -> tuple[list[Sample], list[int]]:
    samples, lengths = [], []
    for group_id, group in enumerate(step_groups):
        for index, length in enumerate(group.lengths):
            samples.append(Sample(len(samples), group_id, index, group.prompt_tokens, max_new,
                                  group.prompt_id, group.prompt_text))
            lengths.append(length)
    return samples, lengths


def _call_first_tokens(step_groups: Sequence[TraceGroup]) -> list[list[int]]:
    """The traced first tokens of a call's samples in sample order ([] per sample without)."""
    if all(group.first_tokens is None for group in step_groups):
        return []
    return [ids for group in step_groups
            for ids in (group.first_tokens or [[] for _ in group.lengths])]


def _call_turns(step_groups: Sequence[TraceGroup]) -> list[list[list]] | None:
    """The traced turns of a call's samples in sample order (one turn per sample without);
    None when no group has any."""
    if all(group.turns is None for group in step_groups):
        return None
    return [episode for group in step_groups
            for episode in (group.turns or [[[length, 0, 0.0]] for length in group.lengths])]
