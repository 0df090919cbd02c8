"""Durable writes: `fsync` of a file, or of a folder's entries (so a rename into it survives a
power cut). Checkpoints and the GGUF cache write a folder, fsync it and rename it into place.

Deliberately simple: POSIX only (a folder is opened read-only to be synced).
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync(path: Path) -> None:
    """Flush a file (or a folder's entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
