"""What a configuration option is and how its value is checked, whatever its section.

`opt` declares a field with its help text and bounds (`at_least`, `above`, `at_most`, `below`,
`hint`, `choices`), the one place they live; `require_limits`, `require_bounded` and
`require_finite` check every field of a section against them; `require` and `check_choice` raise
the one-line `ConfigError` that names the key. `parse_size` reads sizes such as '2GiB'.

Deliberately simple: bounds are constants beside each option; anything that depends on another
option is checked by its section's `validate` (`config.py`, `config_algorithm.py`).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
from dataclasses import field
from typing import Any

from infsamp.errors import InfsampError


class ConfigError(InfsampError, ValueError):
    """A configuration problem, reported as one line naming the key."""


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A config field with its help text (the one place the help lives)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def require(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {why} (got {value!r})")


MAX_INTEGER = 2**32 - 1  # every integer option: sizes, counts, steps and seeds fit 32 bits
# problems a task generates per split: 1e5 embedded ones take 1.8 CPU s, 1e4 of reasoning-gym's
# basic_arithmetic 0.9 s (2026-12-02); a million is a minute or two, more never starts
MAX_GENERATED_EXAMPLES = 1_000_000
MAX_DURATION_S = 7 * 24 * 3600.0  # every option in seconds (*_s): the OS's waits take a week


LIMITS = {"at_least": (operator.ge, ">=", "["), "above": (operator.gt, ">", "("),
          "at_most": (operator.le, "<=", "]"), "below": (operator.lt, "<", ")")}


def require_limits(section_name: str, section: Any) -> None:
    """Each option's own bounds, given beside its help (`opt(..., at_least=0, below=1)`): one
    reads 'must be >= 0', two 'must be in [0, 1)'; `hint` says what a bound value means. An
    option with `choices` must be one of them."""
    for f in dataclasses.fields(section):
        names, value = f.metadata.get("choices"), getattr(section, f.name)
        require(not names or value in names, f"{section_name}.{f.name}", value,
                 f"must be one of {', '.join(names or ())}")
        bounds = {name: f.metadata[name] for name in LIMITS if name in f.metadata}
        if not bounds:
            continue
        hint = f.metadata.get("hint")
        if len(bounds) == 2:
            (low_name, low), (high_name, high) = bounds.items()
            why = f"must be in {LIMITS[low_name][2]}{low}, {high}{LIMITS[high_name][2]}"
        else:
            ((name, limit),) = bounds.items()
            why = f"must be {LIMITS[name][1]} {limit}"
        require(all(LIMITS[name][0](value, limit) for name, limit in bounds.items()),
                 f"{section_name}.{f.name}", value, f"{why} ({hint})" if hint else why)


def require_bounded(section_name: str, section: Any) -> None:
    """Every integer option within +-MAX_INTEGER, every duration within MAX_DURATION_S: beyond
    them a value is a typo, and the libraries below would overflow or never end."""
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), f"{section_name}.{f.name}"
        if isinstance(value, int) and not isinstance(value, bool):
            require(abs(value) <= MAX_INTEGER, key, value,
                     f"must be between -{MAX_INTEGER} and {MAX_INTEGER}")
        if f.name.endswith("_s") and isinstance(value, (int, float)):
            require(value <= MAX_DURATION_S, key, value,
                     f"must be at most {MAX_DURATION_S:.0f} seconds (a week)")


def require_finite(section_name: str, section: Any) -> None:
    """Every float option (and float list item) is finite: NaN and inf are never settings."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, float):
                require(math.isfinite(item), f"{section_name}.{f.name}", value,
                         "must be a finite number")


def check_choice(key: str, value: str, names: tuple[str, ...]) -> None:
    require(value in names, key, value, f"must be one of {', '.join(sorted(names))}")


_SIZE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
               "t": 1e12, "tb": 1e12, "p": 1e15, "pb": 1e15, "kib": 2**10, "mib": 2**20,
               "gib": 2**30, "tib": 2**40, "pib": 2**50}


def parse_size(text: str | int) -> int:
    """'2GiB' -> bytes; a bare number stays a number (tokens or bytes, as the caller decides)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot read size {text!r} (use e.g. 8192, 512MiB, 2GiB, 24GB)")
    value = float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    if value <= 0:
        raise ValueError(f"size must be positive (got {text!r})")
    return int(value)


def size_is_bytes(text: str) -> bool:
    """True when a size string carries a unit ('2GiB'), False for a bare token count ('8192')."""
    return bool(re.search(r"[A-Za-z]", str(text)))

