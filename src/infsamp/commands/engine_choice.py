"""`--engine` for the benchmarks: parse the names, start each engine once (warm, its start-up
timed apart from the measurements) and close them at the end.

Deliberately simple: vLLM keeps one engine per process, so a benchmark runs at most one vLLM
engine, sized (`sampling.sizes.sampler_run_sizes`, the planner's `plan_run_sizes`) for every cell it
will serve.
"""

from __future__ import annotations

import time

from infsamp.errors import SamplingError
from infsamp.planner.sizes import ENGINE_CHOICES

ENGINE_HELP = "sampling engine(s), comma-separated: slots, vllm, auto"


def parse_engines(text: str) -> list[str]:
    """`slots,vllm` -> ['slots', 'vllm']; an unknown or repeated name is one error line."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    bad = next((n for n in names if n not in ENGINE_CHOICES), None)
    if bad is not None or not names:
        raise SamplingError(f"--engine: unknown engine {bad!r}; choose from "
                            f"{', '.join(ENGINE_CHOICES)}")
    if len(set(names)) != len(names):
        raise SamplingError(f"--engine: give each engine once, got {text!r}")
    return names


def engine_to_size(names: list[str]) -> str:
    """The `sampling.engine` the shared sizes are planned for: vLLM's when it is one of them (the
    slot engine allocates per call and reads no sizes)."""
    return "vllm" if "vllm" in names else "auto" if "auto" in names else "slots"


def start_engines(names: list[str], model, cfg, sizes,
                  warmup_prompt: list[int]) -> tuple[dict, dict[str, float]]:
    """{name: engine} started for `sizes` (`engine_to_size`'s) and warmed up now (one call of g
    samples, not measured), and {name: start-up seconds}."""
    import torch

    from infsamp.sampling.engines.base import make_engine
    from infsamp.sampling.sampler import GroupSampler

    engines, startup = {}, {}
    for name in names:
        began = time.perf_counter()
        engines[name] = make_engine(name, model, cfg, sizes)
        startup[name] = time.perf_counter() - began
        warm_up = min(sizes.max_micro_group, 64)  # every batch size up to g meets its kernels once
        GroupSampler(model, None, cfg, engine=engines[name]).sample(
            [warmup_prompt], warm_up, max_new_tokens=min(32, sizes.max_new_tokens),
            generator=torch.Generator().manual_seed(0))
    return engines, startup


def close_engines(engines: dict) -> None:
    for engine in engines.values():
        engine.close()


def print_startup(startup_s: dict[str, float]) -> None:
    """Each engine's start-up time, measured apart from the bench's figures."""
    for engine, seconds in startup_s.items():
        print(f"engine start-up (not in the figures above): {engine} {seconds:.1f} s")
