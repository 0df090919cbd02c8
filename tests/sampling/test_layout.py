"""The shape of `sampling/`: no import circles, torch only in the engines and the sampler, one
budget-to-concurrency function, the engine registry."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import infsamp.sampling
from infsamp.errors import SamplingError
from infsamp.planner.kv_budget import (
    kv_tokens_needed,
    micro_group_within,
    reserved_tokens,
    shared_prompt_tokens,
)
from infsamp.planner.sizes import ENGINE_CHOICES
from infsamp.sampling.engines.base import ENGINES, resolve_engine_name

ROOT = Path(infsamp.sampling.__file__).parent
PURE = ("types", "scheduler", "policies", "length_predictor", "hidden_predictor", "predictors",
        "grouping", "simulator")


def _imports(path: Path) -> set[str]:
    """infsamp.sampling modules a file imports, at any depth (lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        module = getattr(node, "module", None) or ""
        if isinstance(node, ast.ImportFrom) and module.startswith("infsamp.sampling."):
            found.add(node.module.removeprefix("infsamp.sampling."))
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("infsamp.sampling.") for a in node.names
                      if a.name.startswith("infsamp.sampling.")}
    return found


def test_no_import_circles():
    modules = {str(p.relative_to(ROOT).with_suffix("")).replace("/", "."): p
               for p in ROOT.rglob("*.py") if p.name != "__init__.py"}
    graph = {name: _imports(path) & set(modules) for name, path in modules.items()}
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        if state.get(name) == 1:
            raise AssertionError("import circle: " + " -> ".join(trail + [name]))
        if state.get(name) == 2:
            return
        state[name] = 1
        for other in graph[name]:
            visit(other, trail + [name])
        state[name] = 2

    for name in graph:
        visit(name, [])


def test_scheduler_side_holds_no_torch():
    code = ("import sys\n" + "".join(f"import infsamp.sampling.{m}\n" for m in PURE)
            + "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_budget_rule_is_the_slot_rule_for_unit_blocks():
    assert kv_tokens_needed(3, 12, 5, num_prompts=1) == 3 * 12 + 5
    assert kv_tokens_needed(3, 12, 5, num_prompts=2) == 3 * 12 + 2 * 5
    assert micro_group_within(3 * 12 + 5, 12, 5, 1, num_samples=16) == 3
    assert micro_group_within(3 * 12 + 5, 12, 5, 1, num_samples=2) == 2
    assert micro_group_within(10, 12, 5, 1, 16) == 0


def test_paged_budget_counts_whole_blocks():
    # prompt 40, blocks of 16: 32 tokens (2 full blocks) shared; the block with the last prompt
    # token and the completion's blocks are the sample's own: ceil((40 + 10) / 16) = 4 -> 64 - 32
    assert shared_prompt_tokens(40, 16) == 32 and reserved_tokens(40, 10, 16) == 32
    assert shared_prompt_tokens(32, 16) == 16  # vLLM recomputes the block with the prompt's end
    for prompt in range(1, 50):
        for max_new in (1, 7, 16, 33):
            blocks = -(-(prompt + max_new) // 16)  # what one sequence alone can occupy
            own = reserved_tokens(prompt, max_new, 16)
            assert shared_prompt_tokens(prompt, 16) + own == 16 * blocks
    worst = kv_tokens_needed(4, 10, 40, num_prompts=1, block_size=16)
    assert worst >= max(4 * reserved_tokens(p, 10, 16) + shared_prompt_tokens(p, 16)
                        for p in range(1, 41))


def test_engine_registry_and_auto():
    assert set(ENGINE_CHOICES) == {"auto", "slots", "vllm"} and set(ENGINES) == {"slots", "vllm"}
    assert resolve_engine_name("auto", torch.device("cpu")) == "slots"
    assert resolve_engine_name("vllm", torch.device("cpu")) == "vllm"
    with pytest.raises(SamplingError, match="unknown engine 'hf'"):
        resolve_engine_name("hf", torch.device("cpu"))
