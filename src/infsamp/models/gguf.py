"""GGUF models: a `.gguf` file (or a folder holding one) as `model.name_or_path`.

transformers reads a GGUF file with `from_pretrained(folder, gguf_file=NAME)`, dequantising every
tensor (SmolLM2-135M's 272 tensors: ~15 s on 2 cores). Doing that at every start would be slow, and
the loaded model refuses `save_pretrained` (it is marked GGUF-quantised), so a checkpoint could not
be written. Instead the file is converted once per machine into a plain transformers folder:

    <cache>/gguf/<file stem>-<key>/   config.json (no quantization_config), model.safetensors,
                                      generation_config.json, the tokenizer with the file's chat
                                      template and special tokens, gguf_source.json (written last)

`<cache>` is `$INFSAMP_CACHE_DIR`, else `$XDG_CACHE_HOME/infsamp`, else `~/.cache/infsamp`. `<key>`
hashes the file's size, modification time and its first and last MiB, so a changed or replaced file
converts again, and no file is ever hashed whole. The folder is written under a temporary name and
renamed when complete (two processes converting at once: the first rename wins, the other's copy
is dropped). Runs then load the folder as any checkpoint, in the run's dtype.

`check_gguf_file` reads the header alone (transformers' own reader: no tensor data, well under a
second) and gives one `ModelError` line for a file transformers cannot load: not a GGUF file, a
truncated one, an architecture transformers does not read from GGUF, or the `gguf` package missing.

Deliberately simple: the cache is never pruned (`rm -r ~/.cache/infsamp/gguf` frees it); the
converted weights are fp32 whatever the run's precision (the cast happens when a run loads them).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

from infsamp.errors import ModelError, first_line
from infsamp.files import fsync

GGUF_SUFFIX = ".gguf"
SOURCE_FILE = "gguf_source.json"  # written last: a folder without it is not a complete conversion
_EDGE_BYTES = 1 << 20
NOT_ARCHITECTURES = ("general", "tokenizer")  # keys of transformers' mapping that are not models


def cache_root() -> Path:
    """Where infsamp keeps what it derives once per machine (INFSAMP_CACHE_DIR overrides)."""
    if os.environ.get("INFSAMP_CACHE_DIR"):
        return Path(os.environ["INFSAMP_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "infsamp"


def gguf_in_folder(folder: Path) -> Path | None:
    """The one `.gguf` file of a folder without a config.json; None when it has none; ModelError
    when it has several (which one is meant cannot be guessed)."""
    if (folder / "config.json").exists():
        return None
    found = sorted(folder.glob(f"*{GGUF_SUFFIX}"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:4])
        raise ModelError(f"model.name_or_path {str(folder)!r}: holds several GGUF files ({names}); "
                         "name the file")
    return found[0] if found else None


def file_key(path: Path) -> str:
    """16 hex digits naming this version of the file: size, mtime and its first and last MiB."""
    stat = path.stat()
    digest = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    with path.open("rb") as handle:
        digest.update(handle.read(_EDGE_BYTES))
        handle.seek(max(0, stat.st_size - _EDGE_BYTES))
        digest.update(handle.read(_EDGE_BYTES))
    return digest.hexdigest()[:16]


def converted_dir(path: Path) -> Path:
    """The cache folder that holds (or will hold) `path` converted."""
    return cache_root() / "gguf" / f"{path.stem}-{file_key(path)}"


def is_converted(folder: Path) -> bool:
    return (folder / SOURCE_FILE).is_file()


def check_gguf_file(path: Path) -> None:
    """One ModelError line for a GGUF file transformers cannot load (see module docstring)."""
    where = f"model.name_or_path {str(path)!r}"
    if importlib.util.find_spec("gguf") is None:
        raise ModelError(f"{where}: loading a GGUF file needs the gguf package "
                         "(pip install gguf==0.19.0, or pip install 'infsamp[real]')")
    from transformers.integrations.gguf.reader import GgufHeader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        header = GgufHeader.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - struct, unicode, value errors of a damaged header
        raise ModelError(f"{where}: not a readable GGUF file ({first_line(err)})") from None
    supported = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - set(NOT_ARCHITECTURES))
    if header.architecture not in supported:
        raise ModelError(f"{where}: architecture {header.architecture!r}, which transformers "
                         f"cannot read from GGUF (it reads {', '.join(supported)})")
    end = header.data_start + max((t.offset + t.nbytes for t in header.tensors), default=0)
    size = path.stat().st_size
    if size < end:
        raise ModelError(f"{where}: truncated ({size} bytes; its tensors end at byte {end}): "
                         "copy or download it again")


def ensure_converted(path: Path) -> Path:
    """The converted folder of GGUF file `path`, converting it first when the cache has none."""
    target = converted_dir(path)
    if is_converted(target):
        return target
    check_gguf_file(path)
    print(f"converting {path.name} to a transformers folder, once per machine: {target}",
          flush=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _convert(path, tmp)
        _publish(tmp, target)
    except OSError as err:
        raise ModelError(f"model.name_or_path {str(path)!r}: cannot write the converted model to "
                         f"{target.parent} ({err.strerror or err}); set INFSAMP_CACHE_DIR to a "
                         "writable folder") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(path: Path, out: Path) -> None:
    """Dequantise `path` (fp32) and save it, its tokenizer and generation config to `out`."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = f"model.name_or_path {str(path)!r}"
    try:
        with _no_dequantising_bar():
            loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          dtype=torch.float32,
                                                          trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - transformers raises many types for a bad file
        raise ModelError(f"{where}: cannot load the GGUF file ({first_line(err)})") from None
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are plain fp32: nothing is quantised
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    model.generation_config = loaded.generation_config
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    stat = path.stat()
    source = {"file": str(path.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
              "key": file_key(path)}
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=1))
    for file in [*out.iterdir(), out]:
        fsync(file)


@contextlib.contextmanager
def _no_dequantising_bar():
    """transformers draws its own tqdm bar per GGUF tensor, outside its progress-bar switch: off
    (the 'converting' line says what happens)."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def _publish(tmp: Path, target: Path) -> None:
    """Rename the finished folder into place; a complete one already there (another process's)
    wins."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if is_converted(target):
        return
    shutil.rmtree(target, ignore_errors=True)  # an incomplete one from a crash
    try:
        os.replace(tmp, target)
    except OSError:
        if not is_converted(target):
            raise
