"""Replay completion lengths through a scheduling policy, without a model. Pure Python, no torch.

A trace is JSON lines, one per group sampled, in the order the run met them:
`{"prompt_id": "...", "prompt_tokens": 57, "lengths": [312, 288, ...]}`; a prompt_id seen again is a
later epoch of the same prompt. Each `prompts_per_step` consecutive lines form one training step
(one sampler call): every sample of a step finishes before the next step starts. The replay runs the
very loop the real engine runs (`SlotScheduler.admit / active / step`) with `TraceEngine` standing
in for the model, so decode steps agree with the real engine by construction.

A line may also hold `"first_tokens": [[ids], ...]`, each completion's first token ids (a run's
lengths.jsonl keeps `sampling.predictor_prefix_tokens` of them): the replay decodes those ids, so a
token-conditioned predictor sees the prefixes the model wrote. Past them, or in a trace without
them, a sample's tokens are placeholder ids (0): the predictor learns only that it survived k
tokens. Readers take lines with or without the field. `synthetic_trace` draws the paper's
length-controlled workload (log-normal medians per prompt, log-normal lengths around them).

Multi-turn episodes (tool calls, `turns.py`): a line may hold `"turns"`, per completion a list of
its turns `[model_tokens, context_tokens, tool_latency_s]` (`episode_turns` builds them from a
completion); every turn but the last ended in a tool call, whose answer added `context_tokens`
tokens, and the last one has none; a completion's turns sum to its length. The replay drives
`turns.TurnLoop` (the sampler's own turn loop) with `TraceTurns`: a turn ends with finish reason
"tool_call" after its model tokens, the sample waits (parked) while the call "runs", and resumes
with its context tokens appended. The rule for the wait: a call made in decode step n is answered
before decode step n + 1 + ceil(latency_s / step_seconds); `step_seconds` 0 (the default) is a
zero-latency replay, the answer there at the next step, as a tool that answers at once in the
real loop. When every sample left waits, the clock jumps to the first answer (idle time is not
decode steps). A line without turns replays as single-turn samples.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from infsamp.choices import WIDE_POLICIES
from infsamp.errors import DataError, SamplingError
from infsamp.files import create_text
from infsamp.planner.kv_budget import kv_tokens_needed, max_new_tokens_within, micro_group_within
from infsamp.sampling.length_predictor import LengthPredictor, OraclePredictor
from infsamp.sampling.policies import uses_predictor
from infsamp.sampling.predictors import make_predictor
from infsamp.sampling.scheduler import SlotScheduler
from infsamp.sampling.turns import TurnLoop
from infsamp.sampling.types import Completion, Sample, SamplerStats


@dataclass
class TraceGroup:
    prompt_id: str
    prompt_tokens: int
    lengths: list[int]
    prompt_text: str = ""  # optional in a trace; gives the online predictor its prompt features
    first_tokens: list[list[int]] | None = None  # optional: each completion's first token ids
    # optional: per completion its turns [model_tokens, context_tokens, tool_latency_s]
    turns: list[list[list]] | None = None


# ---- traces -------------------------------------------------------------------------------------
MAX_TRACE_TOKENS = 10_000_000  # beyond any context: a longer length is damage (and would hang)


def read_trace(path: str | Path) -> list[TraceGroup]:
    """Parse and validate a JSONL trace; any bad line raises DataError naming file and line."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise DataError(f"{path}: cannot read trace ({err.strerror})") from None
    except UnicodeDecodeError:
        raise DataError(f"{path}: not a text file (a trace is JSON lines)") from None
    groups = [_parse_line(path, number, line) for number, line in enumerate(lines, 1)
              if line.strip()]
    if not groups:
        raise DataError(f"{path}: trace is empty")
    return groups


def _parse_line(path: Path, number: int, line: str) -> TraceGroup:
    where = f"{path}:{number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not valid JSON ({err.msg})") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in ("prompt_id", "prompt_tokens", "lengths"):
        if key not in row:
            raise DataError(f"{where}: missing field {key!r}")
    if not isinstance(row["prompt_id"], (str, int)) or isinstance(row["prompt_id"], bool):
        raise DataError(f"{where}: prompt_id must be a string, got {row['prompt_id']!r}")
    if not _is_int(row["prompt_tokens"]) or not 0 <= row["prompt_tokens"] <= MAX_TRACE_TOKENS:
        raise DataError(f"{where}: prompt_tokens must be an integer in [0, {MAX_TRACE_TOKENS}], "
                        f"got {row['prompt_tokens']!r}")
    lengths = row["lengths"]
    if not isinstance(lengths, list) or not lengths:
        raise DataError(f"{where}: lengths must be a non-empty list of integers")
    for position, length in enumerate(lengths):
        if not _is_int(length) or length < 1:
            raise DataError(f"{where}: lengths[{position}] must be an integer >= 1, got {length!r}")
        if length > MAX_TRACE_TOKENS:
            raise DataError(f"{where}: lengths[{position}] is {length}, above "
                            f"{MAX_TRACE_TOKENS} tokens")
    text = row.get("prompt_text", "")
    if not isinstance(text, str):
        raise DataError(f"{where}: prompt_text must be a string, got {type(text).__name__}")
    first = row.get("first_tokens")
    if first is not None:
        _check_first_tokens(where, first, lengths)
    turns = row.get("turns")
    if turns is not None:
        _check_turns(where, turns, lengths)
    return TraceGroup(str(row["prompt_id"]), row["prompt_tokens"], list(lengths), text,
                      [list(ids) for ids in first] if first is not None else None,
                      [[list(turn) for turn in episode] for episode in turns]
                      if turns is not None else None)


def _check_turns(where: str, turns, lengths: list[int]) -> None:
    """Per completion a list of [model_tokens >= 1, context_tokens >= 0, latency_s >= 0] turns,
    the last without context, summing to its length."""
    if not isinstance(turns, list) or len(turns) != len(lengths):
        raise DataError(f"{where}: turns must hold one list of turns per length ({len(lengths)})")
    for position, (episode, length) in enumerate(zip(turns, lengths)):
        name = f"{where}: turns[{position}]"
        if not isinstance(episode, list) or not episode:
            raise DataError(f"{name} must be a non-empty list of turns")
        for turn in episode:
            if not (isinstance(turn, list) and len(turn) == 3 and _is_int(turn[0]) and turn[0] >= 1
                    and _is_int(turn[1]) and turn[1] >= 0 and _is_seconds(turn[2])):
                raise DataError(f"{name}: a turn is [model_tokens >= 1, context_tokens >= 0, "
                                f"tool_latency_s >= 0], got {turn!r}")
        if episode[-1][1]:
            raise DataError(f"{name}: the last turn has context tokens (it made no tool call)")
        total = sum(turn[0] + turn[1] for turn in episode)
        if total != length:
            raise DataError(f"{name}: its turns hold {total} tokens, its length is {length}")


def _is_seconds(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0 <= value < math.inf)


def _check_first_tokens(where: str, first, lengths: list[int]) -> None:
    """One list of token ids per completion, none longer than its completion."""
    if not isinstance(first, list) or len(first) != len(lengths):
        raise DataError(f"{where}: first_tokens must hold one list of token ids per length "
                        f"({len(lengths)})")
    for position, (ids, length) in enumerate(zip(first, lengths)):
        if not isinstance(ids, list) or not all(_is_int(i) and i >= 0 for i in ids):
            raise DataError(f"{where}: first_tokens[{position}] must be a list of token ids")
        if len(ids) > length:
            raise DataError(f"{where}: first_tokens[{position}] has {len(ids)} ids, more than "
                            f"its length {length}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def write_trace(groups: Iterable[TraceGroup], path: str | Path) -> None:
    with create_text(path) as handle:
        for group in groups:
            row = {"prompt_id": group.prompt_id, "prompt_tokens": group.prompt_tokens,
                   "lengths": group.lengths}
            if group.prompt_text:
                row["prompt_text"] = group.prompt_text
            if group.first_tokens is not None:
                row["first_tokens"] = group.first_tokens
            if group.turns is not None:
                row["turns"] = group.turns
            handle.write(json.dumps(row) + "\n")


def episode_turns(length: int, context_spans: Sequence[tuple[int, int]],
                  latencies_s: Sequence[float] = ()) -> list[list]:
    """A completion's turns for a trace, from its context spans (`Completion.context_spans`) and
    each tool call's latency in seconds (0 where not given)."""
    turns, position = [], 0
    for number, (start, end) in enumerate(context_spans):
        latency = latencies_s[number] if number < len(latencies_s) else 0.0
        turns.append([start - position, end - start, latency])
        position = end
    turns.append([length - position, 0, 0.0])
    return turns


def group_turns(completions: Sequence[Completion]) -> list[list[list]] | None:
    """A group's `turns` for a trace line: None when none of its completions called a tool.
    Every tool turn has its context span (an answer without tokens: an empty one, traced as
    `[model_tokens, 0, latency_s]`) and its latency (`Completion.tool_latencies_s`)."""
    if not any(c.context_spans for c in completions):
        return None
    return [episode_turns(c.length, c.context_spans, [round(s, 6) for s in c.tool_latencies_s]
                          if len(c.tool_latencies_s) == len(c.context_spans) else ())
            for c in completions]


def synthetic_trace(num_groups: int, group_size: int, epochs: int = 1, seed: int = 0,
                    median: float = 180.0, sigma_prompt: float = 0.7, sigma_sample: float = 0.55,
                    min_length: int = 16, max_length: int = 1024) -> list[TraceGroup]:
    """The paper-like workload: per prompt a log-normal median, per sample log-normal around it."""
    rng = random.Random(seed)
    prompts = [(f"p{i}", rng.randint(24, 160), rng.lognormvariate(math.log(median), sigma_prompt))
               for i in range(num_groups)]
    groups = []
    for _ in range(epochs):
        for prompt_id, prompt_tokens, prompt_median in prompts:
            lengths = [min(max_length,
                           max(min_length, round(rng.lognormvariate(math.log(prompt_median),
                                                                                 sigma_sample))))
                       for _ in range(group_size)]
            groups.append(TraceGroup(prompt_id, prompt_tokens, lengths))
    return groups


def arithmetic_trace(num_groups: int, group_size: int, epochs: int = 1, seed: int = 0,
                     sigma_sample: float = 0.3, max_length: int = 1024,
                     direct_share: float = 0.0) -> list[TraceGroup]:
    """A stand-in for the embedded task: each sample's length is the worked solution's length in
    characters (the embedded tokenizer is character-level, tags are one token, plus EOS) times a
    log-normal error of `sigma_sample` (a policy that is not yet exact); with probability
    `direct_share` a sample is a direct guess instead (the direct solution's length, same error), as
    the shipped model does. Prompts carry their text."""
    from infsamp.tasks.arithmetic import generate_problems

    rng = random.Random(seed)
    problems = generate_problems(num_groups, seed=seed)
    groups = []
    for _ in range(epochs):
        for number, problem in enumerate(problems):
            worked = _token_length(problem["solution"])
            direct = _token_length(problem["direct_solution"])
            lengths = [min(max_length,
                           max(1, round((direct if direct_share and rng.random() < direct_share
                                                     else worked)
                                                     * rng.lognormvariate(0.0, sigma_sample))))
                       for _ in range(group_size)]
            groups.append(TraceGroup(f"a{number}", len(problem["prompt"]), lengths,
                                     problem["prompt"]))
    return groups


_TAGS = ("<reasoning>", "</reasoning>", "<answer>", "</answer>")


def _token_length(solution: str) -> int:
    """Tokens of a solution under the embedded char-level tokenizer: tags are one token, plus
    EOS."""
    return len(solution) - sum(solution.count(t) * (len(t) - 1) for t in _TAGS) + 1


# ---- replay -------------------------------------------------------------------------------------
class TraceEngine:
    """Stands in for the model: a sample ends after exactly its traced length of decode steps.
    Its tokens are the traced first tokens, then placeholders (id 0). A parked sample keeps its
    tokens and resumes where it stopped, as on an engine. With `turns` (a `TraceTurns`), a turn
    ends with finish reason "tool_call" where the trace's did, as an engine's turn ends at a
    stop token when `DecodeOptions.turn_ends` says so."""

    def __init__(self, lengths: Sequence[int], first_tokens: Sequence[Sequence[int]] = (),
                 turns: TraceTurns | None = None,
                 turn_ends: Callable[[Sample], bool] | None = None):
        self.lengths = lengths
        self.first_tokens = first_tokens  # per sample id; () when the trace has none
        self.turns, self.turn_ends = turns, turn_ends

    def start(self, slot: int, sample: Sample) -> None:
        pass

    def decode_step(self, active: dict[int, Sample]) -> list[Sample]:
        finished = []
        for sample in active.values():
            sample.token_ids.append(self.token_at(sample.sample_id, sample.num_tokens))
            if sample.num_tokens >= self.lengths[sample.sample_id]:
                sample.finish_reason = "length"
                finished.append(sample)
            elif (self.turns is not None and self.turns.ends_turn(sample)
                  and self.turn_ends(sample)):
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

    def ends_turn(self, sample: Sample) -> bool:
        return sample.num_tokens in self.calls[sample.sample_id]

    def continues(self, sample: Sample) -> bool:
        return self.ends_turn(sample)

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
        engine.turns, engine.turn_ends = handler, loop.continues
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


def micro_group_for_budget(kv_budget: int, groups: Sequence[TraceGroup], max_new_tokens: int,
                           prompts_per_step: int = 1) -> int:
    """g that a token budget allows, as the sampler computes it (`micro_group_within`)."""
    largest_prompt = max(g.prompt_tokens for g in groups)
    if max_new_tokens_within(kv_budget, largest_prompt, max_new_tokens) < max_new_tokens:
        raise SamplingError(f"--kv-budget {kv_budget} is too small for one prompt "
                            f"({largest_prompt} tokens) "
                            f"plus max_new_tokens {max_new_tokens}")
    most_samples = max(len(g.lengths) for g in groups) * prompts_per_step
    return micro_group_within(kv_budget, max_new_tokens, largest_prompt, prompts_per_step,
                                  most_samples)


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
    """g: the one given, capped at what the budget holds."""
    if micro_group is None and kv_budget is None:
        raise SamplingError("give --micro-group or --kv-budget (or both)")
    budget_holds = (micro_group_for_budget(kv_budget, groups, max_new, prompts_per_step)
                    if kv_budget is not None else None)
    if micro_group is not None and micro_group < 1:
        raise SamplingError(f"--micro-group must be >= 1, got {micro_group}")
    return min(size for size in (micro_group, budget_holds) if size is not None)


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
