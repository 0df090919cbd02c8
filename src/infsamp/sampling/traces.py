"""Length traces: what a run or a bench sampled, one JSON line per group, read, checked and
written here; synthetic workloads drawn to the same format. Pure Python, no torch.

A trace is JSON lines, one per group sampled, in the order the run met them:
`{"prompt_id": "...", "prompt_tokens": 57, "lengths": [312, 288, ...]}`; a prompt_id seen again is a
later epoch of the same prompt. A line may also hold `"first_tokens": [[ids], ...]`, each
completion's first token ids (a run's lengths.jsonl keeps `sampling.predictor_prefix_tokens` of
them), `"prompt_text"`, and `"turns"`: per completion a list of its turns `[model_tokens,
context_tokens, tool_latency_s]` (`episode_turns` builds them from a completion); every turn but the
last ended in a tool call, whose answer added `context_tokens` tokens, and the last one has none; a
completion's turns sum to its length. Readers take lines with or without the optional fields.
`synthetic_trace` draws the paper's length-controlled workload (log-normal medians per prompt,
log-normal lengths around them), `arithmetic_trace` the embedded task's.

Deliberately simple: a bad line is an error naming file and line, never skipped.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from infsamp.errors import DataError
from infsamp.files import create_text
from infsamp.sampling.types import Completion
from infsamp.tasks.arithmetic import generate_problems


@dataclass
class TraceGroup:
    prompt_id: str
    prompt_tokens: int
    lengths: list[int]
    prompt_text: str = ""  # optional in a trace; gives the online predictor its prompt features
    first_tokens: list[list[int]] | None = None  # optional: each completion's first token ids
    # optional: per completion its turns [model_tokens, context_tokens, tool_latency_s]
    turns: list[list[list]] | None = None


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

