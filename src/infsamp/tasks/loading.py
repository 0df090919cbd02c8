"""Dataset loading: from `data.*` settings to examples (`tasks.prompts` turns them into token ids).

`load_examples(data_cfg, split)` reads one of five sources (`data.dataset`):
- `embedded:<task>`: a generator in `infsamp.tasks` (the default, `embedded:arithmetic`);
- `reasoning_gym:<task>`: a reasoning-gym task, its splits from disjoint seeds
  (`infsamp.tasks.reasoning_gym`);
- a local `.jsonl` / `.json` / `.txt` file (one prompt per line; every split reads the same file),
  or a folder with `<split>.jsonl` / `<split>.json` (else any folder `datasets.load_dataset` reads,
  such as a downloaded hub snapshot with parquet files);
- anything else: a `datasets` hub id, `datasets.load_dataset(name, data.dataset_config, split)`,
  tried only when the hub can be asked (`infsamp.hub`).
Each example is a dict with 'prompt' (the question text, or a list of chat messages when the dataset
stores conversations), 'answer' (reference as a string, parsed by `data.answer_parser`) and every
other column of the row, which reward functions receive as keyword arguments.

`load_splits(data_cfg, num_eval)` gives the training and held-out examples of a run: the eval
split, or with `data.eval_fraction` a seeded share of the training split; a source whose splits
would be the same rows (one file) is refused without it. Its `eval_note` says which rows evaluate.

Deliberately simple: whole datasets are read into memory as lists of dicts (GSM8K is 7.5k rows).
"""

from __future__ import annotations

import importlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from infsamp.config import DataConfig
from infsamp.errors import DataError
from infsamp.hub import hub_offline, hub_unavailable
from infsamp.tasks import reasoning_gym
from infsamp.tasks.gsm8k import extract_hash_answer

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_TASKS = {"arithmetic": "infsamp.tasks.arithmetic"}  # name -> module with generate_problems
Row = tuple[str, dict[str, Any]]  # (where the row comes from, for error messages; the row)


# ---------------------------------------------------------------- sources


def _read_embedded(data_cfg: DataConfig, split: str) -> list[Row]:
    task = data_cfg.dataset[len(EMBEDDED_PREFIX):]
    if task not in EMBEDDED_TASKS:
        raise DataError(f"data.dataset: unknown embedded task {task!r} (known: {', '.join(EMBEDDED_TASKS)})")
    generate = importlib.import_module(EMBEDDED_TASKS[task]).generate_problems
    num = data_cfg.num_eval_examples if split == data_cfg.eval_split else data_cfg.num_train_examples
    try:
        problems = generate(num, data_cfg.seed, split)
    except ValueError as err:
        raise DataError(f"data.dataset: {data_cfg.dataset} split {split!r}: {err}") from None
    return [(f"{data_cfg.dataset} {split} row {i}", row) for i, row in enumerate(problems)]


def _read_jsonl(path: Path) -> list[Row]:
    rows: list[Row] = []
    for line_number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {line_number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: not valid JSON ({err.msg})") from None
        rows.append((where, row))
    return rows


def _read_json(path: Path, split: str) -> list[Row]:
    try:
        tree = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataError(f"{path} line {err.lineno}: not valid JSON ({err.msg})") from None
    if isinstance(tree, dict):  # {"train": [...], "test": [...]}
        if split not in tree:
            raise DataError(f"{path}: no split {split!r} (found: {', '.join(map(str, tree))})")
        tree = tree[split]
    if not isinstance(tree, list):
        raise DataError(f"{path}: expected a list of rows or a mapping of split -> rows")
    return [(f"{path} row {i}", row) for i, row in enumerate(tree)]


def _read_txt(path: Path, column: str) -> list[Row]:
    """One prompt per non-empty line; a literal \\n in a line is a newline."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [(f"{path} line {number}", {column: line.replace("\\n", "\n")})
            for number, line in enumerate(lines, start=1) if line.strip()]


def _split_file(data_cfg: DataConfig, split: str) -> Path | None:
    """The file a local source reads for `split`; None for a folder without <split>.jsonl/.json."""
    path = Path(data_cfg.dataset).expanduser()
    if path.is_dir():
        candidates = (path / f"{split}.jsonl", path / f"{split}.json")
        return next((p for p in candidates if p.exists()), None)
    return path


def _read_local(data_cfg: DataConfig, split: str) -> list[Row]:
    path = _split_file(data_cfg, split)
    if path is None:
        return _read_with_datasets(data_cfg, split)
    if not path.exists():
        raise DataError(f"data.dataset: {path} does not exist")
    if path.suffix == ".txt":
        return _read_txt(path, data_cfg.prompt_column)
    return _read_jsonl(path) if path.suffix == ".jsonl" else _read_json(path, split)


def _read_with_datasets(data_cfg: DataConfig, split: str) -> list[Row]:
    name = data_cfg.dataset
    try:
        import datasets

        datasets.disable_progress_bars()  # no bars between the run's own log lines
        table = datasets.load_dataset(name, data_cfg.dataset_config or None, split=split)
    except Exception as err:  # noqa: BLE001 - network, missing split, unknown id: all one line
        why = f"{type(err).__name__}: {err}".splitlines()[0]
        raise DataError(f"data.dataset: could not load {name!r} split {split!r} ({why})") from None
    return [(f"{name} {split} row {i}", row) for i, row in enumerate(table.to_list())]


def check_dataset_source(data_cfg: DataConfig) -> None:
    """A hub id while the hub cannot be asked is one DataError at once (not ~50 s of retries);
    an unknown reasoning-gym task or option too."""
    if data_cfg.dataset.startswith(reasoning_gym.PREFIX):
        reasoning_gym.check_task(data_cfg)
    if _source_reader(data_cfg.dataset) is not _read_hub:
        return
    why = hub_unavailable()
    if why is not None and not hub_offline():  # offline mode: `datasets` answers from its cache
        raise DataError(f"data.dataset {data_cfg.dataset!r}: not a local file or folder, and "
                        f"{why}: give a local copy, or HF_HUB_OFFLINE=1 to use the datasets cache")


def _read_hub(data_cfg: DataConfig, split: str) -> list[Row]:
    check_dataset_source(data_cfg)
    return _read_with_datasets(data_cfg, split)


def _source_reader(dataset: str) -> Callable[[DataConfig, str], list[Row]]:
    if dataset.startswith(EMBEDDED_PREFIX):
        return _read_embedded
    if dataset.startswith(reasoning_gym.PREFIX):
        return reasoning_gym.read_split
    if dataset.endswith((".jsonl", ".json", ".txt")) or Path(dataset).expanduser().is_dir():
        return _read_local
    return _read_hub


# ---------------------------------------------------------------- rows -> examples


ANSWER_PARSERS: dict[str, Callable[[str], str | None]] = {
    "none": lambda text: text.strip(),
    "gsm8k": extract_hash_answer,
}


def _column(row: dict[str, Any], key: str, option: str, where: str) -> Any:
    if key not in row:
        raise DataError(f"{where}: no column {key!r} ({option}); available: {', '.join(map(str, row)) or 'none'}")
    return row[key]


def _is_message(item: Any) -> bool:
    return isinstance(item, dict) and isinstance(item.get("role"), str) and "content" in item


def _check_prompt(prompt: Any, column: str, where: str) -> None:
    """Text, or a non-empty list of chat messages {'role', 'content'}."""
    is_list = isinstance(prompt, list)
    if (isinstance(prompt, str) and not prompt.strip()) or (is_list and not prompt):
        raise DataError(f"{where}: empty prompt in column {column!r}")
    if isinstance(prompt, str) or (is_list and all(map(_is_message, prompt))):
        return
    kind = f"a {type(prompt).__name__}"
    if is_list:
        all_strings = all(isinstance(p, str) for p in prompt)
        kind = "a list of strings" if all_strings else "a list of non-messages"
    raise DataError(f"{where}: the prompt in column {column!r} is {kind}; expected text or a list "
                    "of chat messages like {'role': 'user', 'content': '...'}")


def _answer(row: dict[str, Any], data_cfg: DataConfig, where: str,
            need_answer: bool) -> dict[str, Any]:
    if not need_answer and data_cfg.answer_column not in row:
        return {}
    raw_answer = _column(row, data_cfg.answer_column, "data.answer_column", where)
    answer = ANSWER_PARSERS[data_cfg.answer_parser]("" if raw_answer is None else str(raw_answer))
    if answer is None and need_answer:
        raise DataError(f"{where}: answer has no '#### <answer>' (data.answer_parser: {data_cfg.answer_parser})")
    return {"answer": answer}


def to_example(row: Any, data_cfg: DataConfig, where: str,
               need_answer: bool = True) -> dict[str, Any]:
    """One dataset row -> {'prompt', 'answer', **other columns}, checked. Without `need_answer`
    (just sampling) a row may lack the answer column."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object with columns, got {type(row).__name__}")
    prompt = _column(row, data_cfg.prompt_column, "data.prompt_column", where)
    _check_prompt(prompt, data_cfg.prompt_column, where)
    return {**row, "prompt": prompt, **_answer(row, data_cfg, where, need_answer)}


def _load_rows(data_cfg: DataConfig, split: str) -> list[Row]:
    rows = _source_reader(data_cfg.dataset)(data_cfg, split)
    if not rows:
        raise DataError(f"data.dataset: {data_cfg.dataset} split {split!r} has no rows")
    return rows


def load_examples(data_cfg: DataConfig, split: str,
                  need_answer: bool = True) -> list[dict[str, Any]]:
    """All examples of `split` from `data.dataset`; raises DataError naming the row on bad data."""
    rows = _load_rows(data_cfg, split)
    return [to_example(row, data_cfg, where, need_answer) for where, row in rows]


# ---------------------------------------------------------------- training and held-out splits


@dataclass
class Splits:
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    eval_note: str  # which rows evaluate, for the run log


def _same_rows(data_cfg: DataConfig) -> bool:
    """True when the train and eval splits would read the same rows (one file or one split name)."""
    if data_cfg.train_split == data_cfg.eval_split:
        return True
    if data_cfg.dataset.startswith((EMBEDDED_PREFIX, reasoning_gym.PREFIX)):
        return False
    path = _split_file(data_cfg, data_cfg.train_split)
    if path is None or not path.is_file() or path != _split_file(data_cfg, data_cfg.eval_split):
        return False  # a hub id, a folder read by `datasets`, or one file per split
    if path.suffix == ".json":  # {"train": [...], "test": [...]} holds both splits
        try:
            return not isinstance(json.loads(path.read_text(encoding="utf-8")), dict)
        except ValueError:
            return False  # reading the split reports it
    return True


def _row_names(rows: list[Row], limit: int = 12) -> str:
    names = [where.rsplit(" ", 2)[-2:] for where, _ in rows[:limit]]
    text = ", ".join(" ".join(n) for n in names)
    return text + (f", ... ({len(rows) - limit} more)" if len(rows) > limit else "")


def _held_out(data_cfg: DataConfig, rows: list[Row],
              num_eval: int) -> tuple[list[Row], list[Row], str]:
    order = list(range(len(rows)))
    random.Random(data_cfg.seed).shuffle(order)
    num_held = max(1, round(len(rows) * data_cfg.eval_fraction))
    if num_held >= len(rows):
        raise DataError(f"data.eval_fraction {data_cfg.eval_fraction}: holds out all "
                        f"{len(rows)} rows of {data_cfg.dataset} split {data_cfg.train_split!r}; "
                        "nothing is left to train on")
    held = sorted(order[:num_held])
    train = [rows[i] for i in sorted(order[num_held:])]
    evaluated = [rows[i] for i in held][:num_eval]
    note = (f"evaluation: {len(evaluated)} of the {num_held} rows that data.eval_fraction "
            f"{data_cfg.eval_fraction} holds out of {data_cfg.dataset} (seed {data_cfg.seed}; the "
            f"other {len(train)} train): {_row_names(evaluated)}")
    return train, evaluated, note


def load_splits(data_cfg: DataConfig, num_eval: int) -> Splits:
    """Training examples and up to `num_eval` held-out ones; DataError when they would overlap."""
    rows = _load_rows(data_cfg, data_cfg.train_split)
    if data_cfg.eval_fraction > 0:
        rows, eval_rows, note = _held_out(data_cfg, rows, num_eval)
    elif num_eval == 0:
        eval_rows, note = [], "evaluation: off (eval.num_problems 0)"
    elif _same_rows(data_cfg):
        splits = f"split {data_cfg.train_split!r} and {data_cfg.eval_split!r}"
        raise DataError(f"data.dataset {data_cfg.dataset}: training and evaluation would read the "
                        f"same rows ({splits}); set data.eval_fraction (e.g. 0.1) to hold some "
                        "out, or eval.num_problems 0")
    else:
        eval_rows = _load_rows(data_cfg, data_cfg.eval_split)[:num_eval]
        note = (f"evaluation: the first {len(eval_rows)} row(s) of split {data_cfg.eval_split!r} "
                f"of {data_cfg.dataset}: {_row_names(eval_rows, 3)}")
        if data_cfg.dataset.startswith(reasoning_gym.PREFIX):
            note = reasoning_gym.split_note(data_cfg, num_eval)
    train, held_out = ([to_example(row, data_cfg, where) for where, row in part]
                       for part in (rows, eval_rows))
    return Splits(train, held_out, note)
