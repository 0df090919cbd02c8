"""Errors the user can fix. The CLI prints them as one line (no traceback) and exits with code 2."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


class InfsampError(Exception):
    """Base of every user-facing error: bad config, dataset row, reward function, model path,
    trace."""


class DataError(InfsampError):
    """A dataset, trace or prompt file that cannot be read; the message names the row or line."""


class RewardError(InfsampError):
    """A reward function that raised, returned the wrong count, or returned NaN."""


class ToolError(InfsampError):
    """A tool or environment that cannot be offered to the model (bad reference, no schema)."""


class ModelError(InfsampError):
    """A model path or checkpoint that cannot be loaded."""


class SamplingError(InfsampError):
    """A sampling request that cannot be served (prompt too long, budget too small, G < 1)."""


class CheckpointError(InfsampError):
    """A checkpoint that cannot be written or used (damaged, incomplete, from another run)."""


class RunFolderError(InfsampError):
    """A run folder that cannot be used as asked (holds other files, nothing to resume)."""


class NonFiniteError(InfsampError):
    """A NaN or inf loss, gradient norm, reward or weight; nothing was applied or saved."""


class RunStopped(InfsampError):
    """The run stopped on a signal after saving what it could; `exit_code`: 128 + signal."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def first_line(err: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (at most `limit` characters), or its type's name:
    what a one-line error quotes of a library's failure."""
    lines = str(err).strip().splitlines()
    return lines[0][:limit] if lines else type(err).__name__


def first_non_finite(values: Mapping[str, Any]) -> str | None:
    """The name of the first value that is NaN or inf (a number, or a floating tensor with any
    such element), else None: the one non-finite check (the step's rewards, advantages, loss and
    gradient norm; a checkpoint's tensors). Tensors are read through their own methods, so this
    module needs no torch."""
    for name, value in values.items():
        if hasattr(value, "isfinite"):
            if value.is_floating_point() and not bool(value.isfinite().all()):
                return name
        elif isinstance(value, (int, float)) and not math.isfinite(value):
            return name
    return None
