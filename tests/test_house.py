"""The house's size rules, checked on every module of src/infsamp: each module with code opens
with a docstring (an empty package `__init__.py` aside), no function is over 60 lines,
and no file is far past the ~400 lines a module is meant to hold (450 here, so a file at the
edge does not fail on one added line, but one that keeps growing does).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "infsamp"
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 450


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_opens_with_a_docstring():
    missing = [str(p.relative_to(PACKAGE)) for p in _modules()
               if p.read_text().strip() and not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, f"modules without an opening docstring: {missing}"


def test_no_function_is_over_sixty_lines():
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                num_lines = node.end_lineno - node.lineno + 1
                if num_lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} "
                                f"({num_lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_file_is_far_past_four_hundred_lines():
    big = [f"{p.relative_to(PACKAGE)} ({n} lines)" for p in _modules()
           if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not big, f"files over {MAX_FILE_LINES} lines: {big}"
