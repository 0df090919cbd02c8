"""reasoning-gym tasks as a data source: `data.dataset: reasoning_gym:NAME`.

reasoning-gym (`pip install reasoning-gym`) generates ~100 procedural tasks with verifiers:
`reasoning_gym.create_dataset(NAME, **options)` gives entries `{question, answer, metadata}` and
`dataset.score_answer(answer, entry)` scores an extracted answer in [0, 1]. The task's options
(difficulty ranges, operators, ...) come from `data.dataset_config`, a mapping; an unknown task or
option, or values the task rejects, is one `DataError` line (`check_task`, before anything loads).

Disjoint splits by construction. reasoning-gym generates item i from `Random(seed + i)`, so two
datasets whose seeds are a few apart share almost all their items. With seed s (`seed` in
`data.dataset_config`, else `data.seed`), M = `data.num_eval_examples` and N = `size` in
`data.dataset_config` (else `data.num_train_examples`):

    held-out split (data.eval_split):   seeds s     .. s+M-1
    training split (data.train_split):  seeds s+M   .. s+M+N-1

The held-out problems come first, so they stay the same when the training set grows. A task with
few distinct problems repeats questions under different seeds: training rows whose question is
also a held-out question are dropped (`Generated.num_overlapping`, said in the run log).

Each row: `prompt` (the question), `question`, `answer`, `metadata` (reasoning-gym's entry) and
`task` (name and options as JSON), which the `reasoning_gym` reward uses to score with the task's
own `score_answer` (`score`).

Deliberately simple: the rows are generated in full at start (4000 `basic_arithmetic` rows:
~0.5 s); curricula and composite weighting are reasoning-gym's, through its options.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

from infsamp.config import REASONING_GYM_PREFIX as PREFIX
from infsamp.config import DataConfig
from infsamp.errors import DataError
from infsamp.options import MAX_GENERATED_EXAMPLES, MAX_INTEGER

INSTALL = "pip install reasoning-gym==0.1.25, or pip install 'infsamp[real]'"
SPLIT_KEYS = ("seed", "size")  # decided here per split, from data.* when not given
PROGRESS_EVERY_S = 5.0  # a generation this slow says how far it got


@dataclass(frozen=True)
class Generated:
    train: list[dict[str, Any]]
    held_out: list[dict[str, Any]]
    num_overlapping: int  # training rows dropped: their question is a held-out one
    train_seeds: tuple[int, int]  # [first, last] seed of each split
    held_out_seeds: tuple[int, int]


def task_name(data_cfg: DataConfig) -> str:
    return data_cfg.dataset[len(PREFIX):]


def _registry():
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise DataError(f"data.dataset: reasoning-gym tasks need the reasoning-gym package "
                        f"({INSTALL})") from None
    return DATASETS


def task_options(data_cfg: DataConfig) -> dict[str, Any]:
    """The task's options from data.dataset_config (a mapping; '' is none)."""
    options = data_cfg.dataset_config or {}
    if not isinstance(options, dict):
        raise DataError(f"data.dataset_config: {data_cfg.dataset} takes a mapping of the task's "
                        f"options, e.g. {{min_terms: 2, max_terms: 2}} (got {options!r})")
    return dict(options)


def check_task(data_cfg: DataConfig) -> None:
    """The task exists and takes these options (its config built and validated, nothing made)."""
    name, options = task_name(data_cfg), task_options(data_cfg)
    registry = _registry()
    if name not in registry:
        close = difflib.get_close_matches(name, registry, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise DataError(f"data.dataset: {name!r} is not a reasoning-gym task ({hint}it has "
                        f"{len(registry)}: {', '.join(sorted(registry)[:8])}, ...)")
    _config(name, {**options, **_split_options(data_cfg, options, "check")}, shown=options)


def _config(name: str, options: dict[str, Any], shown: dict[str, Any] | None = None):
    """reasoning-gym's config object of task `name`, validated; DataError names a bad option
    (quoting `shown`, the options as the user gave them)."""
    config_cls = _registry()[name][1]
    known = [f.name for f in dataclasses.fields(config_cls)]
    for key in options:
        if key not in known:
            raise DataError(f"data.dataset_config: {key!r} is not an option of reasoning-gym task "
                            f"{name} (its options: {', '.join(known)})")
    try:
        config = config_cls(**options)
        if hasattr(config, "validate"):
            config.validate()
    except (AssertionError, ValueError, TypeError) as err:
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"data.dataset_config: reasoning-gym task {name} rejects "
                        f"{options if shown is None else shown} ({why})") from None
    return config


def _split_options(data_cfg: DataConfig, options: dict[str, Any], split: str) -> dict[str, int]:
    """seed and size of a split (see the module docstring); 'check' gives the training split's."""
    seed = _integer_option(options, "seed", data_cfg.seed, 0, MAX_INTEGER)
    num_held_out = data_cfg.num_eval_examples
    if split == data_cfg.eval_split:
        return {"seed": seed, "size": max(1, num_held_out)}
    return {"seed": seed + num_held_out,
            "size": _integer_option(options, "size", data_cfg.num_train_examples, 1,
                                    MAX_GENERATED_EXAMPLES)}


def _integer_option(options: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    """`seed` or `size` of data.dataset_config: an integer in [low, high] (a word was a
    traceback, a size of 1e11 generated for ever)."""
    value = options.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise DataError(f"data.dataset_config: {key} must be an integer between {low:,} and "
                        f"{high:,} (got {value!r})")
    return value


def generate(data_cfg: DataConfig) -> Generated:
    """Both splits' rows, the training rows with a held-out question dropped."""
    name, options = task_name(data_cfg), task_options(data_cfg)
    check_task(data_cfg)
    splits = {}
    for split in (data_cfg.eval_split, data_cfg.train_split):
        seed_size = _split_options(data_cfg, options, split)
        splits[split] = (_rows(name, json.dumps({**options, **seed_size}, sort_keys=True)),
                         (seed_size["seed"], seed_size["seed"] + seed_size["size"] - 1))
    held_out, held_out_seeds = splits[data_cfg.eval_split]
    held_out = held_out if data_cfg.num_eval_examples else []
    asked = {row["question"] for row in held_out}
    all_train, train_seeds = splits[data_cfg.train_split]
    train = [row for row in all_train if row["question"] not in asked]
    return Generated(train, held_out, len(all_train) - len(train), train_seeds, held_out_seeds)


@functools.lru_cache(maxsize=8)
def _rows(name: str, options_json: str) -> list[dict[str, Any]]:
    options = json.loads(options_json)
    dataset = _dataset(name, options_json)
    task = json.dumps({"name": name, "options": {k: v for k, v in options.items()
                                                 if k not in SPLIT_KEYS}}, sort_keys=True)
    return [{"prompt": entry["question"], "question": entry["question"],
             "answer": entry["answer"], "metadata": entry["metadata"], "task": task}
            for entry in _with_progress(dataset, name, int(options["size"]))]


def _with_progress(dataset, name: str, size: int):
    """The dataset's entries; a generation slower than PROGRESS_EVERY_S says how far it got
    (one line on stderr each PROGRESS_EVERY_S), so a slow task (huge operands) is never silent."""
    start = last = time.monotonic()
    for index, entry in enumerate(dataset):
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY_S:
            last = now
            done = index / size
            left = (now - start) / done * (1 - done) if done else 0.0
            print(f"generating reasoning_gym:{name}: {index:,} of {size:,} problems "
                  f"({now - start:.0f} s, about {left:.0f} s left)", file=sys.stderr, flush=True)
        yield entry


@functools.lru_cache(maxsize=16)
def _dataset(name: str, options_json: str):
    from reasoning_gym import create_dataset

    options = json.loads(options_json)
    _config(name, options)  # a bad option is one line, not reasoning-gym's traceback
    return create_dataset(name, **options)


def read_split(data_cfg: DataConfig, split: str) -> list[tuple[str, dict[str, Any]]]:
    """The rows of `split` (data.train_split or data.eval_split), each with where it comes from."""
    if split not in (data_cfg.train_split, data_cfg.eval_split):
        raise DataError(f"data.dataset: {data_cfg.dataset} has two splits, "
                        f"{data_cfg.train_split!r} (data.train_split) and {data_cfg.eval_split!r} "
                        f"(data.eval_split), not {split!r}")
    made = generate(data_cfg)
    rows = made.held_out if split == data_cfg.eval_split else made.train
    return [(f"{data_cfg.dataset} {split} row {i}", row) for i, row in enumerate(rows)]


def split_note(data_cfg: DataConfig, num_eval: int) -> str:
    """Which seeds each split comes from, for the run log."""
    made = generate(data_cfg)
    dropped = f", {made.num_overlapping} dropped: their question is held out" \
        if made.num_overlapping else ""
    return (f"evaluation: {min(num_eval, len(made.held_out))} {data_cfg.dataset} problems from "
            f"seeds {made.held_out_seeds[0]}..{made.held_out_seeds[1]}; training: "
            f"{len(made.train)} from seeds {made.train_seeds[0]}..{made.train_seeds[1]}{dropped}")


def score(answer: str | None, task: str, question: str, reference: str,
          metadata: dict[str, Any]) -> float:
    """The task's own `score_answer` of an extracted answer (None: nothing extracted)."""
    spec = json.loads(task)
    dataset = _dataset(spec["name"], json.dumps(spec["options"], sort_keys=True))
    entry = {"question": question, "answer": reference, "metadata": metadata}
    return float(dataset.score_answer(answer, entry))
