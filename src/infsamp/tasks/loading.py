"""Dataset loading: from `data.*` settings to examples (`tasks.prompts` turns them into token ids).

`load_examples(data_cfg, split)` reads the rows of one split of `data.dataset` (the sources:
`tasks.sources`). Each example is a dict with 'prompt' (the question text, or a list of chat
messages when the dataset stores conversations), 'answer' (reference as a string, parsed by
`data.answer_parser`) and every other column of the row, which reward functions receive as
keyword arguments.

`load_splits(data_cfg, num_eval)` gives the training and held-out examples of a run: the eval
split, or with `data.eval_fraction` a seeded share of the training split; a source whose splits
would be the same rows (one file) is refused without it. Its `eval_note` says which rows evaluate.
Rows that cannot train or evaluate are named before training (`data_notes`): an answer
`data.answer_parser` cannot read ('#### seventy-two') is skipped, and refused when none or most
are; an evaluation row whose prompt is a training prompt is skipped, and refused when all are.

Deliberately simple: whole datasets are read into memory as lists of dicts (GSM8K is 7.5k rows).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from infsamp.config import DataConfig
from infsamp.errors import DataError
from infsamp.tasks import reasoning_gym
from infsamp.tasks.gsm8k import extract_hash_answer, read_hash_answer
from infsamp.tasks.sources import Row, same_rows, source_reader

# ---------------------------------------------------------------- rows -> examples


ANSWER_PARSERS: dict[str, Callable[[str], str | None]] = {
    "none": lambda text: text.strip(),
    "gsm8k": read_hash_answer,  # None unless '####' is followed by a number
}


class UnreadableAnswer(DataError):
    """A row whose answer `data.answer_parser` cannot read."""


def _column(row: dict[str, Any], key: str, option: str, where: str) -> Any:
    if key not in row:
        raise DataError(f"{where}: no column {key!r} ({option}); available: "
                        f"{', '.join(map(str, row)) or 'none'}")
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
    text = "" if raw_answer is None else str(raw_answer)
    answer = ANSWER_PARSERS[data_cfg.answer_parser](text)
    if answer is None and need_answer:
        hashed = extract_hash_answer(text)
        why = "answer has no '#### <answer>'" if hashed is None else \
            f"answer {hashed[:40]!r} after '####' is not a number"
        raise UnreadableAnswer(f"{where}: {why} (data.answer_parser: {data_cfg.answer_parser})")
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
    rows = source_reader(data_cfg.dataset)(data_cfg, split)
    if not rows:
        raise DataError(f"data.dataset: {data_cfg.dataset} split {split!r} has no rows")
    return rows


def load_examples(data_cfg: DataConfig, split: str,
                  need_answer: bool = True) -> list[dict[str, Any]]:
    """All examples of `split` from `data.dataset`; raises DataError naming the row on bad data
    (rows whose answer the parser cannot read are skipped and named, as in `readable_rows`)."""
    rows = _load_rows(data_cfg, split)
    if need_answer:
        rows, note = readable_rows(rows, data_cfg, f"{data_cfg.dataset} split {split!r}")
        if note:
            print(note)
    return [to_example(row, data_cfg, where, need_answer) for where, row in rows]


def readable_rows(rows: list[Row], data_cfg: DataConfig, what: str) -> tuple[list[Row], str]:
    """The rows whose answer `data.answer_parser` can read, and a note naming the others (skipped);
    DataError when none can be read, or most cannot (a wrong column or parser, not a few typos)."""
    kept, unreadable = [], []
    for where, row in rows:
        try:
            if isinstance(row, dict) and data_cfg.answer_column in row:
                _answer(row, data_cfg, where, need_answer=True)
            kept.append((where, row))
        except UnreadableAnswer as err:
            unreadable.append((where, str(err)))
    if not unreadable:
        return kept, ""
    count, total, first = len(unreadable), len(rows), unreadable[0][1]
    advice = "check data.answer_column and data.answer_parser"
    if not kept:
        raise DataError(f"{first}; none of the {total} rows of {what} has an answer it can read: "
                        f"{advice}")
    parser = f"data.answer_parser {data_cfg.answer_parser}"
    if 2 * count > total:
        raise DataError(f"{parser}: {count} of the {total} rows of {what} have an answer it cannot "
                        f"read ({_row_names(unreadable)}; first: {first}): {advice}")
    return kept, (f"data: skipped {count} of the {total} rows of {what} whose answer {parser} "
                  f"cannot read: {_row_names(unreadable)} (first: {first})")


def _prompt_key(row: Any, data_cfg: DataConfig) -> str:
    prompt = row.get(data_cfg.prompt_column) if isinstance(row, dict) else row
    return json.dumps(prompt, sort_keys=True, default=str)


def without_training_prompts(held: list[Row], train: list[Row], data_cfg: DataConfig,
                             what: str) -> tuple[list[Row], str]:
    """Evaluation rows whose prompt is not a training prompt, and a note naming the others
    (skipped: they would score memory); DataError when every one is a training row."""
    seen = {_prompt_key(row, data_cfg) for _, row in train}
    kept = [(where, row) for where, row in held if _prompt_key(row, data_cfg) not in seen]
    overlap = [(where, row) for where, row in held if _prompt_key(row, data_cfg) in seen]
    if not overlap:
        return kept, ""
    if not kept:
        raise DataError(f"data.dataset {data_cfg.dataset}: all {len(held)} rows of {what} are "
                        f"training rows too (the same prompts): evaluating on them would score "
                        "memory, not learning; use another data.eval_split, data.eval_fraction, "
                        "or eval.num_problems 0")
    return kept, (f"evaluation: skipped {len(overlap)} of the {len(held)} rows of {what} whose "
                  f"prompt is also a training prompt: {_row_names(overlap)}")


# ---------------------------------------------------------------- training and held-out splits


@dataclass
class Splits:
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    eval_note: str  # which rows evaluate, for the run log
    data_notes: list[str] = field(default_factory=list)  # rows skipped, and why


def _row_names(rows: list[Row], limit: int = 12) -> str:
    names = [where.rsplit(" ", 2)[-2:] for where, _ in rows[:limit]]
    text = ", ".join(" ".join(n) for n in names)
    return text + (f", ... ({len(rows) - limit} more)" if len(rows) > limit else "")


def _held_out(data_cfg: DataConfig, rows: list[Row]) -> tuple[list[Row], list[Row], str]:
    """(training rows, held-out rows, how they were chosen) with `data.eval_fraction`."""
    order = list(range(len(rows)))
    random.Random(data_cfg.seed).shuffle(order)
    num_held = max(1, round(len(rows) * data_cfg.eval_fraction))
    if num_held >= len(rows):
        raise DataError(f"data.eval_fraction {data_cfg.eval_fraction}: holds out all "
                        f"{len(rows)} rows of {data_cfg.dataset} split {data_cfg.train_split!r}; "
                        "nothing is left to train on")
    train = [rows[i] for i in sorted(order[num_held:])]
    held = [rows[i] for i in sorted(order[:num_held])]
    how = (f"data.eval_fraction {data_cfg.eval_fraction} holds out of {data_cfg.dataset} (seed "
           f"{data_cfg.seed}; the other {len(train)} train)")
    return train, held, how


def _evaluation_rows(data_cfg: DataConfig, rows: list[Row],
                     num_eval: int) -> tuple[list[Row], list[Row], str, list[str]]:
    """(training rows, up to `num_eval` evaluation rows, which ones, what was skipped): never a
    training prompt, never an answer the parser cannot read."""
    if data_cfg.eval_fraction > 0:
        rows, held, how = _held_out(data_cfg, rows)
        held, overlap = without_training_prompts(held, rows, data_cfg, "the held-out rows")
        evaluated = held[:num_eval]
        note = f"evaluation: {len(evaluated)} of the {len(held)} rows that {how}: " \
               f"{_row_names(evaluated)}"
        return rows, evaluated, note, [overlap]
    if num_eval == 0:
        return rows, [], "evaluation: off (eval.num_problems 0)", []
    if same_rows(data_cfg):
        splits = f"split {data_cfg.train_split!r} and {data_cfg.eval_split!r}"
        raise DataError(f"data.dataset {data_cfg.dataset}: training and evaluation would read the "
                        f"same rows ({splits}); set data.eval_fraction (e.g. 0.1) to hold some "
                        "out, or eval.num_problems 0")
    what = f"split {data_cfg.eval_split!r} of {data_cfg.dataset}"
    held, skipped = readable_rows(_load_rows(data_cfg, data_cfg.eval_split), data_cfg, what)
    held, overlap = without_training_prompts(held, rows, data_cfg, what)
    evaluated = held[:num_eval]
    note = f"evaluation: the first {len(evaluated)} row(s) of {what}: {_row_names(evaluated, 3)}"
    if data_cfg.dataset.startswith(reasoning_gym.PREFIX):
        note = reasoning_gym.split_note(data_cfg, num_eval)
    return rows, evaluated, note, [skipped, overlap]


def load_splits(data_cfg: DataConfig, num_eval: int) -> Splits:
    """Training examples and up to `num_eval` held-out ones; DataError when they would overlap
    whole, or when the answers cannot be read (a few such rows are skipped and named)."""
    what = f"{data_cfg.dataset} split {data_cfg.train_split!r}"
    rows, skipped = readable_rows(_load_rows(data_cfg, data_cfg.train_split), data_cfg, what)
    rows, eval_rows, note, eval_notes = _evaluation_rows(data_cfg, rows, num_eval)
    train, held_out = ([to_example(row, data_cfg, where) for where, row in part]
                       for part in (rows, eval_rows))
    return Splits(train, held_out, note, [n for n in [skipped, *eval_notes] if n])
