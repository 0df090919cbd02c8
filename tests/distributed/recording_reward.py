"""A reward that spreads within every group (longer scores higher) and records what it scored.

Each call appends one line to $INFSAMP_TEST_RECORD/rank-<RANK>.jsonl: the prompts and completion
token ids it saw, in order, so a test can compare every completion of a run with another run's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def length_reward(prompts, completions, completion_ids=None, **kwargs):
    folder = os.environ.get("INFSAMP_TEST_RECORD")
    if folder:
        path = Path(folder) / f"rank-{os.environ.get('RANK', '0')}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as fh:
            fh.write(json.dumps({"prompts": list(prompts), "ids": completion_ids}) + "\n")
    return [len(c) / 10 for c in completions]


def completions_by_call(folder: Path) -> list[dict[str, list]]:
    """For each reward call (one per step and rank): prompt -> its completions, ranks merged."""
    calls: list[dict[str, list]] = []
    for path in sorted(folder.glob("rank-*.jsonl")):
        for k, line in enumerate(path.read_text().splitlines()):
            record = json.loads(line)
            while len(calls) <= k:
                calls.append({})
            for prompt, ids in zip(record["prompts"], record["ids"]):
                calls[k].setdefault(prompt, []).append(ids)
    return calls


_calls = {"n": 0}


def fails_on_rank_1(prompts, completions, **kwargs):
    """Raises on rank 1 at its second call (step 2); elsewhere a length reward."""
    _calls["n"] += 1
    if os.environ.get("RANK") == "1" and _calls["n"] == 2:
        raise ValueError("a reward server that went away")
    return [len(c) / 10 for c in completions]


def first_token_reward(prompts, completions, completion_ids=None, **kwargs):
    """Records as `length_reward`; 1 where a completion's first token id is a multiple of 7,
    else 0, and 0 throughout for a quarter of the prompts (by their text): many groups tie, so
    dynamic sampling gives them more completions, or drops and replaces them."""
    length_reward(prompts, completions, completion_ids)
    return [float(sum(map(ord, str(p))) % 4 != 0 and ids[0] % 7 == 0)
            for p, ids in zip(prompts, completion_ids)]
