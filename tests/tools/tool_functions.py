"""Tools for the tests: well-behaved and misbehaving ones (loaded by reference, so the worker
processes find them again)."""

import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def fails(a: int) -> int:
    """Always raises.

    Args:
        a: anything
    """
    raise ZeroDivisionError("division by zero")


def hangs(a: int) -> int:
    """Never returns in time.

    Args:
        a: anything
    """
    time.sleep(3600)
    return a


def huge(a: int) -> str:
    """Returns 10 MB of text.

    Args:
        a: anything
    """
    return "x" * (10 * 1024 * 1024)


def not_text(a: int) -> bytes:
    """Returns bytes.

    Args:
        a: anything
    """
    return b"\x00\x01"


def undocumented(a):
    return a


def empty(a: int) -> str:
    """Answers nothing.

    Args:
        a: anything
    """
    return ""
