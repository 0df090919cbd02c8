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
renamed when complete; `gguf_source.json`, written last, lists every file with its size, and a
folder whose files are missing or of another size (a crash, a full disk, a hand edit) is converted
again, saying so. Conversion holds an exclusive lock (`fcntl.flock` on `.<folder>.lock` beside it):
two runs converting one file at once convert it once, the second waits and uses the first's. A
full disk while writing is one line (the partial folder is removed). Runs then load the folder as
any checkpoint, in the run's dtype.

`check_gguf_file` reads the header alone (transformers' own reader: no tensor data, well under a
second) and gives one `ModelError` line for a file transformers cannot load: not a GGUF file, a
truncated one, an architecture transformers does not read from GGUF, metadata that does not
describe the tensors (`check_shape`: hidden size, layers, heads, KV heads, feed-forward size), or
the `gguf` package missing. A mismatch the header check misses is still one line when the
converted model cannot take the file's tensors, and leaves no cache folder.

Deliberately simple: the cache is never pruned (`rm -r ~/.cache/infsamp/gguf` frees it); the
converted weights are fp32 whatever the run's precision (the cast happens when a run loads them).
"""

from __future__ import annotations

import contextlib
import fcntl
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
# what the metadata says (key after "<architecture>.") -> (the tensor that holds it, its dim)
SHAPE_KEYS = {"embedding_length": ("token_embd.weight", -1, "hidden size"),
              "feed_forward_length": ("blk.0.ffn_up.weight", 0, "feed-forward size")}


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
    """Complete: its source record lists every file it wrote, each there at its size."""
    try:
        files = json.loads((folder / SOURCE_FILE).read_text())["files"]
        return bool(files) and all((folder / name).stat().st_size == size
                                   for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def check_gguf_file(path: Path) -> None:
    """One ModelError line for a GGUF file transformers cannot load (see module docstring)."""
    where = f"model.name_or_path {str(path)!r}"
    if importlib.util.find_spec("gguf") is None:
        raise ModelError(f"{where}: loading a GGUF file needs the gguf package "
                         "(pip install gguf==0.19.0, or pip install 'infsamp[real]')")
    from transformers.integrations.gguf.reader import GgufHeader, read_gguf_metadata
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        header = GgufHeader.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - struct, unicode, value errors of a damaged header
        raise ModelError(f"{where}: not a readable GGUF file ({first_line(err)})") from None
    supported = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - set(NOT_ARCHITECTURES))
    if header.architecture not in supported:
        raise ModelError(f"{where}: architecture {header.architecture!r}, which transformers "
                         f"cannot read from GGUF (it reads {', '.join(supported)})")
    metadata, _ = read_gguf_metadata(str(path))
    check_shape(where, metadata, {t.name: tuple(t.shape) for t in header.tensors})
    end = header.data_start + max((t.offset + t.nbytes for t in header.tensors), default=0)
    size = path.stat().st_size
    if size < end:
        raise ModelError(f"{where}: truncated ({size} bytes; its tensors end at byte {end}): "
                         "copy or download it again")


def check_shape(where: str, metadata: dict, shapes: dict[str, tuple[int, ...]]) -> None:
    """One ModelError line when the metadata's sizes are not its tensors' (`shapes`: name ->
    torch-order shape), e.g. 'metadata says hidden size 64, but tensor token_embd.weight is
    [261, 32]'."""
    arch = metadata.get("general.architecture")
    for key, (tensor, dim, what) in SHAPE_KEYS.items():
        said = metadata.get(f"{arch}.{key}")
        if said is not None and tensor in shapes and shapes[tensor][dim] != said:
            raise ModelError(f"{where}: metadata says {what} {said}, but tensor {tensor} is "
                             f"{list(shapes[tensor])}")
    layers = {int(name.split(".")[1]) for name in shapes if name.startswith("blk.")}
    said = metadata.get(f"{arch}.block_count")
    if said is not None and layers != set(range(said)):
        held = f"blk.0 to blk.{max(layers)}" if layers else "none"
        raise ModelError(f"{where}: metadata says {said} layers, but its tensors hold "
                         f"{len(layers)} ({held})")
    _check_heads(where, arch, metadata, shapes)


def _check_heads(where: str, arch: str, metadata: dict, shapes: dict) -> None:
    """Query and key-value heads times the head size are the q and k projections' rows."""
    heads, hidden = metadata.get(f"{arch}.attention.head_count"), \
        metadata.get(f"{arch}.embedding_length")
    if not heads or not hidden:
        return
    head_dim = metadata.get(f"{arch}.attention.key_length") or hidden // heads
    kv_heads = metadata.get(f"{arch}.attention.head_count_kv", heads)
    said = f"{heads} heads and {kv_heads} key-value heads of size {head_dim}"
    for tensor, num_heads in (("blk.0.attn_q.weight", heads), ("blk.0.attn_k.weight", kv_heads)):
        if tensor in shapes and shapes[tensor][0] != num_heads * head_dim:
            raise ModelError(f"{where}: metadata says {said}, but tensor {tensor} is "
                             f"{list(shapes[tensor])}")


def ensure_converted(path: Path) -> Path:
    """The converted folder of GGUF file `path`, converting it first when the cache has none."""
    target = converted_dir(path)
    if is_converted(target):
        return target
    check_gguf_file(path)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with _conversion_lock(target):
            if is_converted(target):  # another process converted it while this one waited
                return target
            what = "again (the cached one is incomplete or damaged)" if target.exists() else \
                "to a transformers folder, once per machine"
            print(f"converting {path.name} {what}: {target}", flush=True)
            shutil.rmtree(tmp, ignore_errors=True)
            _convert(path, tmp)
            shutil.rmtree(target, ignore_errors=True)  # an incomplete or damaged one
            os.replace(tmp, target)
    except Exception as err:  # noqa: BLE001 - safetensors' own error type for a full disk
        if not isinstance(err, OSError) and type(err).__name__ != "SafetensorError":
            raise
        raise ModelError(f"model.name_or_path {str(path)!r}: cannot write the converted model to "
                         f"{target.parent} ({_why(err)}); free space there or set "
                         "INFSAMP_CACHE_DIR to a writable folder") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _why(err: BaseException) -> str:
    """'No space left on device', from an OSError or safetensors' message."""
    if isinstance(err, OSError):
        return err.strerror or str(err)
    return first_line(err).rsplit("I/O error: ", 1)[-1].split(" (os error")[0]


@contextlib.contextmanager
def _conversion_lock(target: Path):
    """Held while converting to `target`: a second process waits (and says so)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target.with_name(f".{target.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process converting to {target}", flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


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
    try:
        model.load_state_dict(loaded.state_dict())
    except RuntimeError as err:  # its metadata does not describe its tensors
        mismatch = next((line.strip() for line in str(err).splitlines()[1:] if line.strip()),
                        first_line(err))
        raise ModelError(f"{where}: its metadata does not describe its tensors "
                         f"({mismatch})") from None
    model.tie_weights()
    model.generation_config = loaded.generation_config
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    stat = path.stat()
    source = {"file": str(path.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
              "key": file_key(path),
              "files": {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}}
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
