"""Dataset sources: the rows of one split of `data.dataset`, each named for error messages.

`source_reader(dataset)` picks the reader: `embedded:<task>` (a generator in `infsamp.tasks`),
`reasoning_gym:<task>` (`infsamp.tasks.reasoning_gym`), a local `.jsonl` / `.json` / `.txt`
file or a folder of `<split>.jsonl` / `<split>.json` (read here), a `.csv` / `.tsv` / `.parquet`
file or another folder (read by `datasets`), else a `datasets` hub id, asked only when the hub can
be (`check_dataset_source`: one line before any long work otherwise). Each reader returns
`(where, row)` pairs; `infsamp.tasks.loading` turns rows into checked examples and splits.

Deliberately simple: a whole split is read into memory; text files must be UTF-8 (a byte that is
not is named with its line).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infsamp.config import DataConfig
from infsamp.errors import DataError
from infsamp.hub import hub_offline, hub_unavailable
from infsamp.tasks import reasoning_gym

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_TASKS = {"arithmetic": "infsamp.tasks.arithmetic"}  # name -> module with generate_problems
Row = tuple[str, dict[str, Any]]  # (where the row comes from, for error messages; the row)


def _read_embedded(data_cfg: DataConfig, split: str) -> list[Row]:
    task = data_cfg.dataset[len(EMBEDDED_PREFIX):]
    if task not in EMBEDDED_TASKS:
        raise DataError(f"data.dataset: unknown embedded task {task!r} (known: "
                        f"{', '.join(EMBEDDED_TASKS)})")
    generate = importlib.import_module(EMBEDDED_TASKS[task]).generate_problems
    num = (data_cfg.num_eval_examples if split == data_cfg.eval_split
           else data_cfg.num_train_examples)
    try:
        problems = generate(num, data_cfg.seed, split)
    except ValueError as err:
        raise DataError(f"data.dataset: {data_cfg.dataset} split {split!r}: {err}") from None
    return [(f"{data_cfg.dataset} {split} row {i}", row) for i, row in enumerate(problems)]


def read_text(path: Path) -> str:
    """A local dataset file's text; bytes that are not UTF-8 are one line naming file and line."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DataError(f"data.dataset: cannot read {path} ({err.strerror or err})") from None
    try:
        return data.decode("utf-8-sig")  # a byte-order mark is not text
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise DataError(f"{path} line {line}: not UTF-8 text (byte 0x{data[err.start]:02x}); "
                        "save the file as UTF-8") from None


def _read_jsonl(path: Path) -> list[Row]:
    rows: list[Row] = []
    for line_number, line in enumerate(read_text(path).splitlines(), start=1):
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
        tree = json.loads(read_text(path))
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
    lines = read_text(path).splitlines()
    return [(f"{path} line {number}", {column: line.replace("\\n", "\n")})
            for number, line in enumerate(lines, start=1) if line.strip()]


DATASETS_FORMATS = {".csv": ("csv", {}), ".tsv": ("csv", {"delimiter": "\t"}),
                    ".parquet": ("parquet", {})}  # suffix -> `datasets` builder and its options
LOCAL_SUFFIXES = (".jsonl", ".json", ".txt", *DATASETS_FORMATS)


def _read_table_file(path: Path) -> list[Row]:
    """A .csv / .tsv / .parquet file, read by `datasets` (one split: every split reads it)."""
    builder, options = DATASETS_FORMATS[path.suffix]
    if builder == "csv":
        read_text(path)  # a byte that is not UTF-8 is named with its line
    table = _load_dataset(f"cannot read {path}", builder, data_files=str(path), split="train",
                          **options)
    first = 2 if builder == "csv" else 0  # a csv's line 1 is its header
    where = "line" if builder == "csv" else "row"
    return [(f"{path} {where} {i + first}", row) for i, row in enumerate(table.to_list())]


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
    if path.suffix not in LOCAL_SUFFIXES:
        raise DataError(f"data.dataset: {path}: cannot read {path.suffix or 'extension-less'} "
                        f"files (give {', '.join(LOCAL_SUFFIXES)}, or a folder)")
    if path.suffix in DATASETS_FORMATS:
        return _read_table_file(path)
    if path.suffix == ".txt":
        return _read_txt(path, data_cfg.prompt_column)
    return _read_jsonl(path) if path.suffix == ".jsonl" else _read_json(path, split)


def _load_dataset(failure: str, *args: Any, **options: Any) -> Any:
    """`datasets.load_dataset(*args, **options)`; whatever it raises is one DataError line."""
    try:
        import datasets

        datasets.disable_progress_bars()  # no bars between the run's own log lines
        return datasets.load_dataset(*args, **options)
    except Exception as err:  # noqa: BLE001 - network, missing split, unknown id, pandas, pyarrow
        why = f"{type(err).__name__}: {err}".splitlines()[0]
        raise DataError(f"data.dataset: {failure} ({why})") from None


def _read_with_datasets(data_cfg: DataConfig, split: str) -> list[Row]:
    name = data_cfg.dataset
    table = _load_dataset(f"could not load {name!r} split {split!r}", name,
                          data_cfg.dataset_config or None, split=split)
    return [(f"{name} {split} row {i}", row) for i, row in enumerate(table.to_list())]


def check_dataset_source(data_cfg: DataConfig) -> None:
    """A hub id while the hub cannot be asked is one DataError at once (not ~50 s of retries);
    an unknown reasoning-gym task or option too."""
    if data_cfg.dataset.startswith(reasoning_gym.PREFIX):
        reasoning_gym.check_task(data_cfg)
    if source_reader(data_cfg.dataset) is not _read_hub:
        return
    why = hub_unavailable()
    if why is not None and not hub_offline():  # offline mode: `datasets` answers from its cache
        raise DataError(f"data.dataset {data_cfg.dataset!r}: not a local file or folder, and "
                        f"{why}: give a local copy, or HF_HUB_OFFLINE=1 to use the datasets cache")


def _read_hub(data_cfg: DataConfig, split: str) -> list[Row]:
    check_dataset_source(data_cfg)
    return _read_with_datasets(data_cfg, split)


def source_reader(dataset: str) -> Callable[[DataConfig, str], list[Row]]:
    if dataset.startswith(EMBEDDED_PREFIX):
        return _read_embedded
    if dataset.startswith(reasoning_gym.PREFIX):
        return reasoning_gym.read_split
    local = Path(dataset).expanduser()
    if dataset.endswith(LOCAL_SUFFIXES) or local.is_dir() or local.is_file():
        return _read_local
    return _read_hub


def same_rows(data_cfg: DataConfig) -> bool:
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
            return not isinstance(json.loads(read_text(path)), dict)
        except (ValueError, DataError):
            return False  # reading the split reports it
    return True
