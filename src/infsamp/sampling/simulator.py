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
from infsamp.sampling.types import Sample, SamplerStats


@dataclass
class TraceGroup:
    prompt_id: str
    prompt_tokens: int
    lengths: list[int]
    prompt_text: str = ""  # optional in a trace; gives the online predictor its prompt features
    first_tokens: list[list[int]] | None = None  # optional: each completion's first token ids


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
    return TraceGroup(str(row["prompt_id"]), row["prompt_tokens"], list(lengths), text,
                      [list(ids) for ids in first] if first is not None else None)


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
            handle.write(json.dumps(row) + "\n")


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
    tokens and resumes where it stopped, as on an engine."""

    def __init__(self, lengths: Sequence[int], first_tokens: Sequence[Sequence[int]] = ()):
        self.lengths = lengths
        self.first_tokens = first_tokens  # per sample id; () when the trace has none

    def start(self, slot: int, sample: Sample) -> None:
        pass

    def decode_step(self, active: dict[int, Sample]) -> list[Sample]:
        finished = []
        for sample in active.values():
            traced = self.first_tokens[sample.sample_id] if self.first_tokens else ()
            position = sample.num_tokens
            sample.token_ids.append(traced[position] if position < len(traced) else 0)
            if sample.num_tokens >= self.lengths[sample.sample_id]:
                sample.finish_reason = "length"
                finished.append(sample)
        return finished


def run_call(samples: Sequence[Sample], lengths: Sequence[int], policy: str, micro_group: int,
             max_kv_tokens: int = 0, predictor: LengthPredictor | None = None,
             kv_block_size: int = 1, first_tokens: Sequence[Sequence[int]] = (),
             on_tokens: Callable[[int], None] | None = None, **policy_options) -> SamplerStats:
    """One sampler call through the engine loop; returns the scheduler's statistics.
    `on_tokens(n)` after each decode step of n samples (progress)."""
    if isinstance(predictor, OraclePredictor):
        predictor.set_lengths(dict(enumerate(lengths)))
    scheduler = SlotScheduler(samples, policy, micro_group, max_kv_tokens, predictor,
                              kv_block_size, **policy_options)
    engine = TraceEngine(lengths, first_tokens)
    while not scheduler.done:
        for slot, sample in scheduler.admit():
            engine.start(slot, sample)
        active = scheduler.active()
        num_decoded = len(active)
        scheduler.step(engine.decode_step(active))
        if on_tokens is not None:
            on_tokens(num_decoded)
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
             on_tokens: Callable[[int], None] | None = None, **policy_options) -> SamplerStats:
    """Replay a whole trace, `prompts_per_step` groups per training step; statistics summed
    over the steps after the first `warmup_steps` (those only teach the predictor).
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
