"""Tools by reference, as TRL users write them: plain Python functions with type hints and a
Google-style docstring, named 'module:function' or 'file.py:function' (the reward functions'
references, `rewards/loading.py`), or passed as callables through the Python API.

Each tool's JSON schema comes from transformers' `get_json_schema` (what
`apply_chat_template(tools=...)` renders); a function it cannot describe (no docstring, an
argument without a type hint or without a line in `Args:`) is refused in one line at start-up,
before the model loads, as a bad reference is.

Deliberately simple: a tool's name is its function's name (two tools of one name are refused).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from infsamp.errors import RewardError, ToolError
from infsamp.rewards.loading import load_reference


@dataclass(frozen=True)
class Tool:
    name: str
    func: Callable[..., Any]
    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", ...}}


def tool_schema(name: str, func: Callable[..., Any], what: str = "tool") -> dict[str, Any]:
    """`func`'s JSON schema (transformers' get_json_schema), or ToolError in one line."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(func)
    except Exception as err:  # noqa: BLE001 - DocstringParsing / TypeHintParsing exceptions
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ToolError(f"{what} {name!r}: transformers cannot describe it to the model ({why}); "
                        "give it type hints and a docstring with an Args: section") from None


def load_callable(spec: str | Callable[..., Any], kind: str) -> tuple[str, Callable[..., Any]]:
    """A reference ('module:name', 'file.py:name') or a callable -> (its name, the callable);
    ToolError (one line, naming `kind` and the spec) for a bad reference."""
    if callable(spec):
        return getattr(spec, "__name__", type(spec).__name__), spec
    try:
        return load_reference(spec, kind=kind)
    except RewardError as err:
        raise ToolError(str(err)) from None


def load_tool(spec: str | Callable[..., Any]) -> Tool:
    """A reference ('module:function', 'file.py:function') or a callable -> Tool."""
    name, func = load_callable(spec, "tool")
    return Tool(name, func, tool_schema(name, func))


def load_tools(specs: list[str | Callable[..., Any]]) -> list[Tool]:
    tools = [load_tool(spec) for spec in specs]
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ToolError(f"tools: two tools are named {twice[0]!r} (a tool's name is its "
                        "function's; rename one)")
    return tools
