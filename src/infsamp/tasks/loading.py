"""Dataset loading and prompt rendering: from `data.*` settings to examples and model input text.

`load_examples(data_cfg, split)` reads one of three sources (`data.dataset`):
- `embedded:<task>`: a generator in `infsamp.tasks` (the default, `embedded:arithmetic`);
- a local `.jsonl` / `.json` file (every split reads the same file) or a folder with `<split>.jsonl`;
- anything else: a `datasets` hub id, `datasets.load_dataset(name, data.dataset_config, split=split)`.
Each example is a dict with 'prompt' (the question text, or a list of chat messages when the dataset
stores conversations), 'answer' (reference as a string, parsed by `data.answer_parser`) and every
other column of the row, which reward functions receive as keyword arguments.

`render_prompt` turns an example into the text fed to the model: through the tokenizer's chat template
(with `data.system_prompt` as system message) or as plain text. `prompt_for_rewards` and
`completion_for_rewards` give rewards the same shapes TRL would: messages in chat mode, strings otherwise.

Deliberately simple: whole datasets are read into memory as lists of dicts (GSM8K is 7.5k rows).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Callable

from infsamp.config import DataConfig
from infsamp.errors import DataError
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


def _read_local(data_cfg: DataConfig, split: str) -> list[Row]:
    path = Path(data_cfg.dataset)
    if path.is_dir():
        candidates = [path / f"{split}.jsonl", path / f"{split}.json"]
        path = next((p for p in candidates if p.exists()), candidates[0])
    if not path.exists():
        raise DataError(f"data.dataset: {path} does not exist")
    return _read_jsonl(path) if path.suffix == ".jsonl" else _read_json(path, split)


def _read_hub(data_cfg: DataConfig, split: str) -> list[Row]:
    name = data_cfg.dataset
    try:
        import datasets

        table = datasets.load_dataset(name, data_cfg.dataset_config or None, split=split)
    except Exception as err:  # noqa: BLE001 - network, missing split, unknown id: all one line
        why = f"{type(err).__name__}: {err}".splitlines()[0]
        raise DataError(f"data.dataset: could not load {name!r} split {split!r} ({why})") from None
    return [(f"{name} {split} row {i}", row) for i, row in enumerate(table.to_list())]


def _source_reader(dataset: str) -> Callable[[DataConfig, str], list[Row]]:
    if dataset.startswith(EMBEDDED_PREFIX):
        return _read_embedded
    if dataset.endswith((".jsonl", ".json")) or Path(dataset).is_dir():
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


def _is_empty_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return not prompt.strip()
    return not isinstance(prompt, list) or not prompt


def to_example(row: Any, data_cfg: DataConfig, where: str) -> dict[str, Any]:
    """One dataset row -> {'prompt', 'answer', **other columns}, checked."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object with columns, got {type(row).__name__}")
    prompt = _column(row, data_cfg.prompt_column, "data.prompt_column", where)
    if _is_empty_prompt(prompt):
        raise DataError(f"{where}: empty prompt in column {data_cfg.prompt_column!r}")
    raw_answer = _column(row, data_cfg.answer_column, "data.answer_column", where)
    answer = ANSWER_PARSERS[data_cfg.answer_parser]("" if raw_answer is None else str(raw_answer))
    if answer is None:
        raise DataError(f"{where}: answer has no '#### <answer>' (data.answer_parser: {data_cfg.answer_parser})")
    return {**row, "prompt": prompt, "answer": answer}


def load_examples(data_cfg: DataConfig, split: str) -> list[dict[str, Any]]:
    """All examples of `split` from `data.dataset`; raises DataError naming the row on bad data."""
    rows = _source_reader(data_cfg.dataset)(data_cfg, split)
    if not rows:
        raise DataError(f"data.dataset: {data_cfg.dataset} split {split!r} has no rows")
    return [to_example(row, data_cfg, where) for where, row in rows]


# ---------------------------------------------------------------- prompts and completions


def uses_chat_template(tokenizer: Any, data_cfg: DataConfig) -> bool:
    """'always', or 'auto' with a tokenizer that has a chat template."""
    if data_cfg.use_chat_template == "always":
        return True
    return data_cfg.use_chat_template == "auto" and bool(getattr(tokenizer, "chat_template", None))


def _messages_text(messages: list[dict[str, Any]]) -> str:
    return "\n".join(str(m.get("content") or "") for m in messages)


def build_prompt(example: dict[str, Any], data_cfg: DataConfig, chat: bool) -> str | list[dict[str, str]]:
    """The prompt as rewards see it: chat messages (system + user) when `chat`, else plain text."""
    prompt = example["prompt"]
    system = data_cfg.system_prompt
    if not chat:
        text = prompt if isinstance(prompt, str) else _messages_text(prompt)
        return f"{system}\n{text}" if system else text
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system}, *messages]
    return messages


def render_prompt(example: dict[str, Any], tokenizer: Any, data_cfg: DataConfig) -> str:
    """The exact text fed to the model for `example`."""
    chat = uses_chat_template(tokenizer, data_cfg)
    prompt = build_prompt(example, data_cfg, chat)
    if not chat:
        return prompt  # type: ignore[return-value]
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("data.use_chat_template: 'always' but the tokenizer has no chat template")
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def prompt_for_rewards(example: dict[str, Any], tokenizer: Any, data_cfg: DataConfig) -> str | list[dict[str, str]]:
    """What reward functions receive as a prompt: messages in chat mode (like TRL), else the text."""
    return build_prompt(example, data_cfg, uses_chat_template(tokenizer, data_cfg))


def completion_for_rewards(text: str, chat: bool) -> str | list[dict[str, str]]:
    """What reward functions receive as a completion: [{'role': 'assistant', ...}] in chat mode."""
    return [{"role": "assistant", "content": text}] if chat else text
