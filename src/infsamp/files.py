"""Durable and link-safe writes: `fsync` of a file, or of a folder's entries (so a rename into it
survives a power cut); `open_for_writing` and `replace_with`, which never write through a symbolic
link (a link planted where the run writes is refused or replaced, its target never touched).
Checkpoints and the GGUF cache write a folder, fsync it and rename it into place.

Deliberately simple: POSIX only (a folder is opened read-only to be synced); only the last part of
a path is checked for a link (the folders above it are the user's to choose).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from infsamp.errors import RunFolderError

_NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a FIFO never hangs open


def fsync(path: Path) -> None:
    """Flush a file (or a folder's entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_for_writing(path: str | Path, flags: int, mode: int = 0o644) -> int:
    """os.open for writing that refuses a symbolic link, a folder, a FIFO or a device at `path`
    in one line (RunFolderError); the descriptor of a regular file."""
    try:
        fd = os.open(path, flags | _NO_FOLLOW, mode)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EMLINK):
            raise RunFolderError(_not_a_file(path)) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RunFolderError(_not_a_file(path))
    return fd


def _not_a_file(path: str | Path) -> str:
    kind = "a symbolic link" if os.path.islink(path) else "not a regular file"
    return (f"{path} is {kind}: infsamp writes only regular files it can own (never through a "
            "link); remove it, or choose another folder")


def replace_with(path: str | Path, write: Callable[[str], None]) -> None:
    """`write(tmp)` writes a new file at a fresh temporary name beside `path` (created here, so
    no planted link is followed), then it replaces `path` atomically: a link at `path` is
    replaced, its target never written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    os.close(open_for_writing(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    try:
        write(str(tmp))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> None:
    """`path` replaced atomically by `text` (see `replace_with`)."""
    replace_with(path, lambda tmp: Path(tmp).write_text(text))


def create_text(path: str | Path):
    """A text file opened for writing at `path` (created, or truncated if it is a regular file;
    refused if it is a link or not a file): `with create_text(path) as handle: ...`."""
    return os.fdopen(open_for_writing(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w")


def headless_pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed), imported only when a plot is
    drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
