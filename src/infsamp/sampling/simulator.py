"""Replay completion lengths through a scheduling policy, without a model. Pure Python, no torch.

A trace is JSON lines, one per group sampled, in the order the run met them:
`{"prompt_id": "...", "prompt_tokens": 57, "lengths": [312, 288, ...]}`; a prompt_id seen again is a
later epoch of the same prompt. Each `prompts_per_step` consecutive lines form one training step (one
sampler call): every sample of a step finishes before the next step starts. The replay runs the very
loop the real engine runs (`SlotScheduler.admit / active / step`) with `TraceEngine` standing in for
the model, so decode steps agree with the real engine by construction.

Simplifications: a trace holds no token ids, so the prefix a token-conditioned predictor sees is k
placeholder ids (it learns only that the sample survived k tokens); `synthetic_trace` draws the paper's
length-controlled workload (log-normal medians per prompt, log-normal lengths around them).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from infsamp.errors import DataError, SamplingError
from infsamp.sampling.length_predictor import LengthPredictor, OraclePredictor, make_predictor
from infsamp.sampling.scheduler import SampleSpec, SchedulerStats, SlotScheduler


@dataclass
class TraceGroup:
    prompt_id: str
    prompt_tokens: int
    lengths: list[int]
    prompt_text: str = ""  # optional in a trace; gives the online predictor its prompt features


@dataclass
class SimulationResult:
    decode_steps: int = 0
    lower_bound: int = 0
    opt_lower_bound: int = 0  # pigeonhole bound, summed over steps (<= the best schedule)
    peak_kv_tokens: int = 0
    num_samples: int = 0
    generated_tokens: int = 0
    num_steps: int = 0
    num_slots: int = 0
    kendall_tau: float | None = None  # mean over steps
    mae: float | None = None          # mean over samples
    per_step: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "per_step"}


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
    groups = [_parse_line(path, number, line) for number, line in enumerate(lines, 1) if line.strip()]
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
    return TraceGroup(str(row["prompt_id"]), row["prompt_tokens"], list(lengths), text)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def write_trace(groups: Iterable[TraceGroup], path: str | Path) -> None:
    with open(path, "w") as handle:
        for group in groups:
            row = {"prompt_id": group.prompt_id, "prompt_tokens": group.prompt_tokens, "lengths": group.lengths}
            if group.prompt_text:
                row["prompt_text"] = group.prompt_text
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
            lengths = [min(max_length, max(min_length, round(rng.lognormvariate(math.log(prompt_median),
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
            worked, direct = _token_length(problem["solution"]), _token_length(problem["direct_solution"])
            lengths = [min(max_length, max(1, round((direct if direct_share and rng.random() < direct_share
                                                     else worked) * rng.lognormvariate(0.0, sigma_sample))))
                       for _ in range(group_size)]
            groups.append(TraceGroup(f"a{number}", len(problem["prompt"]), lengths, problem["prompt"]))
    return groups


_TAGS = ("<reasoning>", "</reasoning>", "<answer>", "</answer>")


def _token_length(solution: str) -> int:
    """Tokens of a solution under the embedded char-level tokenizer: tags are one token, plus EOS."""
    return len(solution) - sum(solution.count(t) * (len(t) - 1) for t in _TAGS) + 1


# ---- replay -------------------------------------------------------------------------------------
class TraceEngine:
    """Stands in for the model: a sample ends after exactly its traced length of decode steps."""

    def __init__(self, scheduler: SlotScheduler, lengths: Sequence[int]):
        self.scheduler, self.lengths = scheduler, lengths
        self._generated: dict[int, int] = {}

    def start(self, slot: int, spec: SampleSpec) -> None:
        self._generated[spec.sample_id] = 0

    def decode_step(self, active: dict[int, SampleSpec]) -> list[tuple[int, int]]:
        finished, k = [], self.scheduler.prefix_tokens_wanted
        for spec in active.values():
            num = self._generated[spec.sample_id] = self._generated[spec.sample_id] + 1
            if num >= self.lengths[spec.sample_id]:
                finished.append((spec.sample_id, num))
            elif num == k:
                self.scheduler.observe_prefix(spec.sample_id, [0] * k)
        return finished


def run_call(specs: Sequence[SampleSpec], lengths: Sequence[int], policy: str, num_slots: int,
             max_kv_tokens: int | None = None, predictor: LengthPredictor | None = None,
             **policy_options) -> SchedulerStats:
    """One sampler call through the engine loop; returns the scheduler's statistics."""
    if isinstance(predictor, OraclePredictor):
        predictor.set_lengths(dict(enumerate(lengths)))
    scheduler = SlotScheduler(specs, policy, num_slots, max_kv_tokens, predictor, **policy_options)
    engine = TraceEngine(scheduler, lengths)
    while not scheduler.done:
        for slot, spec in scheduler.admit():
            engine.start(slot, spec)
        scheduler.step(engine.decode_step(scheduler.active()))
    return scheduler.stats()


def slots_for_budget(kv_budget: int, groups: Sequence[TraceGroup], max_new_tokens: int) -> int:
    """g that a token budget allows with the largest prompt held: (budget - prompt) // max_new_tokens."""
    largest_prompt = max(g.prompt_tokens for g in groups)
    num_slots = (kv_budget - largest_prompt) // max_new_tokens
    if num_slots < 1:
        raise SamplingError(f"--kv-budget {kv_budget} is too small for one prompt ({largest_prompt} tokens) "
                            f"plus max_new_tokens {max_new_tokens}")
    return num_slots


def simulate(groups: Sequence[TraceGroup], policy: str, num_slots: int | None = None,
             kv_budget: int | None = None, predictor: str = "none", prompts_per_step: int = 1,
             max_new_tokens: int | None = None, **policy_options) -> SimulationResult:
    """Replay a whole trace, `prompts_per_step` groups per training step."""
    if prompts_per_step < 1:
        raise SamplingError(f"--prompts-per-step must be >= 1, got {prompts_per_step}")
    max_new = max_new_tokens or max(max(g.lengths) for g in groups)
    too_long = next((g for g in groups if max(g.lengths) > max_new), None)
    if too_long is not None:
        raise SamplingError(f"prompt {too_long.prompt_id} has a length {max(too_long.lengths)} "
                            f"> --max-new-tokens {max_new}")
    slots = _num_slots(num_slots, kv_budget, groups, max_new)
    length_predictor = make_predictor(predictor) if policy == "length_aware" or predictor != "none" else None
    result = SimulationResult(num_slots=slots)
    for start in range(0, len(groups), prompts_per_step):
        step_groups = groups[start:start + prompts_per_step]
        specs, lengths = _call_specs(step_groups, max_new)
        stats = run_call(specs, lengths, policy, slots, kv_budget, length_predictor, **policy_options)
        _accumulate(result, stats)
    return _finish(result)


def _num_slots(num_slots, kv_budget, groups, max_new) -> int:
    if num_slots is None and kv_budget is None:
        raise SamplingError("give --slots or --kv-budget (or both)")
    budget_slots = slots_for_budget(kv_budget, groups, max_new) if kv_budget is not None else None
    if num_slots is not None and num_slots < 1:
        raise SamplingError(f"--slots must be >= 1, got {num_slots}")
    return min(s for s in (num_slots, budget_slots) if s is not None)


def _call_specs(step_groups: Sequence[TraceGroup], max_new: int) -> tuple[list[SampleSpec], list[int]]:
    specs, lengths = [], []
    for group_id, group in enumerate(step_groups):
        for index, length in enumerate(group.lengths):
            specs.append(SampleSpec(len(specs), group_id, index, group.prompt_tokens, max_new,
                                    group.prompt_id, group.prompt_text))
            lengths.append(length)
    return specs, lengths


def _accumulate(result: SimulationResult, stats: SchedulerStats) -> None:
    result.decode_steps += stats.decode_steps
    result.lower_bound += stats.lower_bound
    result.opt_lower_bound += stats.opt_lower_bound
    result.peak_kv_tokens = max(result.peak_kv_tokens, stats.peak_kv_tokens)
    result.num_samples += stats.num_samples
    result.generated_tokens += stats.generated_tokens
    result.num_steps += 1
    result.per_step.append(stats.as_dict())


def _finish(result: SimulationResult) -> SimulationResult:
    rated = [s for s in result.per_step if s["kendall_tau"] is not None]
    if rated:
        result.kendall_tau = sum(s["kendall_tau"] for s in rated) / len(rated)
        result.mae = sum(s["mae"] * s["num_samples"] for s in rated) / sum(s["num_samples"] for s in rated)
    return result
