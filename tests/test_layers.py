"""The layout is the architecture: lower layers never import higher ones, and no module imports
itself back through others. Every import counts, including those inside functions (they run
later, but they are still a dependency).

    errors, hub, files, console, timing, checkpoint_folders, options < choices
      < config, config_algorithm
      < config_io, planner, tasks, models < sampling, rewards < tools < distributed < algorithm
      < run
      < commands, integrations, cli

A module of a lower layer importing one of a higher layer, or any import cycle, fails here with
the offending import named.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "infsamp"

LAYERS = [
    {"errors", "hub", "files", "console", "timing", "checkpoint_folders", "options",
     "__init__"},
    {"choices"},
    {"config", "config_algorithm"},
    {"config_io", "planner", "tasks", "models"},
    {"sampling", "rewards"},
    {"tools"},
    {"distributed"},
    {"algorithm"},
    {"run"},
    {"commands", "integrations", "cli", "__main__"},
]
LEVEL = {room: level for level, rooms in enumerate(LAYERS) for room in rooms}

# imports being removed by work in flight (issue 23); this set must be empty when it lands
PENDING: set[str] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Every infsamp module `path` imports, at any depth of its code."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in known)
    return found


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(path, set(known)) - {name} for name, path in known.items()}


def test_every_room_has_a_layer():
    assert {room(m) for m in modules()} <= set(LEVEL), set(map(room, modules())) - set(LEVEL)


def test_lower_layers_never_import_higher_ones():
    wrong = [f"{a} imports {b}" for a, deps in graph().items() for b in deps
             if LEVEL[room(b)] > LEVEL[room(a)]]
    wrong = [line for line in wrong if line not in PENDING]
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycles():
    edges = graph()
    cycles: list[str] = []

    def visit(node: str, path: list[str], on_path: set[str], done: set[str]) -> None:
        for dep in sorted(edges[node]):
            if dep in on_path:
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in done:
                visit(dep, path + [dep], on_path | {dep}, done)
        done.add(node)

    done: set[str] = set()
    for start in sorted(edges):
        if start not in done:
            visit(start, [start], {start}, done)
    cycles = [cycle for cycle in cycles if cycle not in PENDING]
    assert not cycles, "\n".join(cycles)
