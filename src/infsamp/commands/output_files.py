"""A command's output files, checked before any work: never over an existing file unless
`--overwrite`, never over one of the command's own inputs (not even with `--overwrite`), never
two outputs into one file, and always into a folder that exists.

Deliberately simple: an input folder (a model, a dataset folder) protects the files it holds; a
new file written into it is allowed.
"""

from __future__ import annotations

import os
from pathlib import Path

from infsamp.options import ConfigError


def _same_or_inside(path: Path, source: Path) -> bool:
    """True when `path` is the file `source`, or a file that exists inside the folder `source`."""
    if source.is_dir():
        return path.exists() and source.resolve() in path.resolve().parents
    if path.exists() and source.exists():
        return os.path.samefile(path, source)
    return path.resolve() == source.resolve()


def check_output_files(outputs: dict[str, str | None], inputs: list[str | None],
                       overwrite: bool) -> None:
    """`outputs`: flag -> path (None: not asked for); `inputs`: the paths the command reads."""
    given = {flag: Path(path) for flag, path in outputs.items() if path}
    sources = [Path(path) for path in inputs if path and Path(path).exists()]
    for flag, path in given.items():
        if not path.resolve().parent.is_dir():
            raise ConfigError(f"{flag}: folder {path.parent} does not exist")
        if path.is_symlink():
            raise ConfigError(f"{flag} {path}: is a symbolic link (nothing was written); infsamp "
                              "never writes through a link: give another file name")
        if path.is_dir():
            raise ConfigError(f"{flag}: {path} is a folder; give a file name")
        source = next((s for s in sources if _same_or_inside(path, s)), None)
        if source is not None:
            raise ConfigError(f"{flag} {path}: is an input of this command ({source}); write the "
                              "output elsewhere")
        other = next((f for f, p in given.items() if f != flag and _same_or_inside(path, p)), None)
        if other is not None:
            raise ConfigError(f"{flag} {path}: the same file as {other}")
        if path.exists() and not overwrite:
            raise ConfigError(f"{flag} {path}: exists (nothing was written); pass --overwrite to "
                              "replace it")


def plot_name(name: str) -> str:
    """A plot's file name as written: `.png` added when it has none (what matplotlib writes)."""
    return name if Path(name).suffix else name + ".png"


def check_plot_format(flag: str, name: str) -> None:
    """An extension matplotlib cannot write is one line, before any work."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(name).suffix[1:]
    if suffix.lower() not in formats:
        raise ConfigError(f"{flag} {name}: matplotlib cannot write .{suffix} files (give one "
                          f"of {', '.join('.' + f for f in sorted(formats))})")
