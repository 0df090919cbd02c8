"""What the GPU suite's parts share: the two size profiles, random-weight models, memory, cells.

`PROFILES` holds the sizes of each part twice: `h200` (the real run, public shapes) and `cpu-smoke`
(the same plan at toy sizes, to know the script works before a GPU is lent). A part is a list of
cells in order of value; `Part.run_cells` runs them until the part's time cap, records a failing
cell as one line and goes on, and writes every row to the part's JSON file as soon as it exists (so
a part killed at its hard cap still returns what it measured). `sample_until` runs infsamp's own
sampler and stops a call at its cell cap from the sampler's progress callback, keeping the
statistics so far (`complete: false`).

Models: the public shapes of `infsamp.planner.presets` with random weights (memory and speed do not
depend on the weights' values), built on the device in the precision mode's dtype as the trainer
loads them (`weight_kwargs`, `apply_lora`, `apply_compute`); the cpu-smoke profile shrinks every
width and keeps each family's layout (qk-norm, biases, tied head). EOS is disabled (the model
config has none and no tokenizer is given), so completions run to their maximum length.

Deliberately simple: one process per part (the driver, `gpu_suite.py`, isolates parts); peaks are
`torch.cuda.max_memory_allocated` on CUDA and the resident set (benchmarks/memory.py's meter) on
the CPU, where the smoke profile's figures only show that the code runs.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infsamp.planner import ModelShape, load_shape
from infsamp.planner.estimate import DEVICES

GIB = 2**30
MIB = 2**20


# ---------------------------------------------------------------- profiles


@dataclass(frozen=True)
class Profile:
    name: str
    device: str
    toy: bool  # shrink every shape (cpu-smoke)
    budget_s: float  # the whole run: install, every part, the report
    caps_s: dict[int, float]  # part -> time cap (seconds), in the order the parts run
    cell_cap_s: float  # one sampler call at most this long (stopped, `complete: false`)
    # part 1: the paper's memory table
    memory_model: str = "qwen3-1.7b"
    memory_prompt: int = 128
    memory_completion: int = 1024
    memory_groups: tuple[int, ...] = (8, 16, 32, 64, 512)
    plan_gib: float = 24.0  # part 1: the GPU the planner sizes g for
    # part 2: the planner against the device
    planner_cases: tuple[tuple[str, int], ...] = (("qwen3-1.7b", 0), ("qwen3-0.6b", 0),
                                                  ("qwen3-1.7b", 16), ("qwen3-0.6b", 16),
                                                  ("llama-3.2-1b", 0))
    planner_gib: float = 24.0  # part 2: the GPU the planner sizes g and the micro-batch for
    planner_group: int = 32
    planner_prompt: int = 128
    planner_completion: int = 256
    precision: str = "bf16"
    # part 3: against TRL
    trl_model: str = "qwen3-0.6b"
    trl_groups: tuple[int, ...] = (64, 32, 8)
    trl_completion: int = 128
    trl_micro_group: int = 8  # infsamp's g and TRL's training micro-batch (sequences)
    trl_steps: int = 1  # measured steps after one warm-up step
    # part 4: precision
    precision_steps: tuple[int, ...] = (10, 100, 300)
    precision_modes: tuple[str, ...] = ("fp32", "bf16", "mixed", "bf16_lossy", "bf16_kahan")
    step_time_modes: tuple[str, ...] = ("fp32", "mixed", "bf16", "bf16_lossy", "bf16_kahan")
    step_time_model: str = "qwen3-0.6b"
    step_time_rollout: tuple[int, int, int] = (8, 128, 256)  # sequences, prompt, completion
    step_time_steps: int = 3
    # part 5: engine speed
    speed_model: str = "qwen3-0.6b"
    speed_slots: tuple[int, ...] = (64, 256, 8)
    speed_prompt: int = 128
    speed_completion: int = 128
    lm_head_tokens: int = 8192  # one training micro-batch for the chunked-LM-head row
    extra: dict[str, Any] = field(default_factory=dict)


# The H200's caps are estimates (no GPU had run the suite when they were set): about 25 ms per
# decode step of the slot engine (a launch-bound eager forward), so a 1024-token call takes ~30 s;
# the budget leaves room for a second run in a 15-minute lease. The smoke caps are about 1.5x each
# part's CPU time on a 2-core machine (a quiet machine runs every cell; a loaded one is cut).
CPU_RUNTIME_GIB = DEVICES["cpu"].default_runtime_bytes / 2**30  # in every CPU plan (issue 20)
H200 = Profile("h200", "cuda", toy=False, budget_s=465, cell_cap_s=45,
               caps_s={1: 150, 2: 70, 3: 120, 4: 45, 5: 40})
CPU_SMOKE = Profile(
    "cpu-smoke", "cpu", toy=True, budget_s=285, cell_cap_s=15,
    caps_s={1: 30, 2: 25, 3: 60, 4: 60, 5: 45},
    # the toy GPUs the planner sizes for: a few MiB of tensors beside the CPU plan's runtime
    memory_prompt=16, memory_completion=16, memory_groups=(2, 4, 8, 16, 64),
    plan_gib=1.5 / 1024 + CPU_RUNTIME_GIB, planner_gib=3 / 1024 + CPU_RUNTIME_GIB,
    planner_group=4, planner_prompt=16, planner_completion=8,
    precision="fp32",
    trl_groups=(4,), trl_completion=8, trl_micro_group=2,
    precision_steps=(2, 4), precision_modes=("fp32", "bf16", "mixed"),
    step_time_modes=("fp32", "mixed"),  # bf16 compiles torchao's step per shape: slow on a CPU
    step_time_rollout=(2, 16, 8), step_time_steps=1,
    speed_slots=(4, 16, 2), speed_prompt=16, speed_completion=8, lm_head_tokens=256)
PROFILES = {p.name: p for p in (H200, CPU_SMOKE)}
SETTABLE = {f.name: f for f in dataclasses.fields(Profile)
            if f.name not in ("name", "device", "toy", "caps_s", "extra")}


def with_settings(profile: Profile, settings: list[str]) -> Profile:
    """The profile with FIELD=VALUE settings (`--set plan_gib=12 --set memory_groups=32,64`),
    each value parsed as its field's type; one clear error line for an unknown field or value."""
    changes = {}
    for item in settings:
        name, _, text = item.partition("=")
        if name not in SETTABLE:
            raise SystemExit(f"gpu_suite: --set {item!r}: no such setting (settable: "
                             f"{', '.join(SETTABLE)})")
        current = getattr(profile, name)
        try:
            if isinstance(current, tuple):
                kind = type(current[0]) if current and not isinstance(current[0], tuple) else None
                if kind is None:
                    raise ValueError("set it in gpu_suite_common.py")
                changes[name] = tuple(kind(v) for v in text.split(",") if v)
            else:
                changes[name] = type(current)(text)
        except ValueError as err:
            raise SystemExit(f"gpu_suite: --set {item!r}: {err}") from None
    return dataclasses.replace(profile, **changes)


def toy(shape: ModelShape) -> ModelShape:
    """The shape's family at CPU-smoke widths (2 layers, hidden 64, a 512-token vocabulary)."""
    return dataclasses.replace(shape, name=f"{shape.name}@toy", hidden_size=64,
                               intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, vocab_size=512,
                               max_position_embeddings=4096)


def shape_of(profile: Profile, preset: str) -> ModelShape:
    shape = load_shape(preset)
    return toy(shape) if profile.toy else shape


# ---------------------------------------------------------------- models


def random_model(shape: ModelShape, device: str, precision: str = "bf16", lora_rank: int = 0,
                 seed: int = 0):
    """Random weights of `shape` on `device`, in the mode's dtype, with LoRA and the compute
    context as the trainer loads them."""
    import torch
    from transformers import AutoModelForCausalLM

    from infsamp.config import ModelConfig
    from infsamp.models.loading import apply_lora, weight_kwargs
    from infsamp.models.precision import apply_compute
    from infsamp.planner import PRECISIONS

    from memory import hf_config  # benchmarks/memory.py: a config of the shape's family

    mode = PRECISIONS[precision]
    model_cfg = ModelConfig(lora_rank=lora_rank)
    dtype = weight_kwargs(model_cfg, torch.device(device), mode)["dtype"]
    config = hf_config(shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs (no host copy of a 1.7B model)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to(device)
    model.config.eos_token_id = None  # completions run to their maximum length
    model.generation_config.eos_token_id = None
    if lora_rank:
        model = apply_lora(model, model_cfg)
    return apply_compute(model, mode)


def random_prompt(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (length,), generator=generator).tolist()


def free_device_memory() -> None:
    gc.collect()
    torch = sys.modules.get("torch")  # a part that never imported torch has nothing to free
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def device_name(device: str) -> str:
    import platform

    import torch

    return torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"


class Peak:
    """Peak memory above the memory in use at construction (CUDA: allocated; CPU: resident set);
    on CUDA also the absolute peaks (allocated and reserved) since the last `reset`."""

    def __init__(self, device: str):
        from peak_meter import PeakMeter  # benchmarks/peak_meter.py

        synchronize(device)
        self.device = device
        self.meter = PeakMeter(device)

    def reset(self) -> None:
        synchronize(self.device)
        self.meter.reset()

    def above_start(self) -> int:
        synchronize(self.device)
        return self.meter.peak()

    def absolute(self) -> dict[str, int]:
        """CUDA: {'allocated', 'reserved'} peaks since reset (empty on the CPU)."""
        if self.device != "cuda":
            return {}
        import torch

        synchronize(self.device)
        return {"allocated": torch.cuda.max_memory_allocated(),
                "reserved": torch.cuda.max_memory_reserved()}


# ---------------------------------------------------------------- the sampler under a cap


class CellCapReached(Exception):
    """Raised from the sampler's progress callback when a call reaches its cell cap."""


def sample_until(sampler, prompt: list[int], group_size: int, deadline: float, seed: int = 0):
    """(SamplerStats, complete) of one `GroupSampler.sample` call, stopped at `deadline`
    (time.monotonic) with the statistics so far."""
    import torch

    latest = {}

    def progress(stats, num_finished: int, num_running: int) -> None:
        latest["stats"] = stats
        if time.monotonic() > deadline:
            raise CellCapReached

    try:
        result = sampler.sample([prompt], group_size, progress=progress,
                                generator=torch.Generator().manual_seed(seed))
    except CellCapReached:
        return latest["stats"], False
    return result.stats, True


def sampler_for(model, policy: str, g: int, kv_budget_tokens: int, max_new_tokens: int,
                engine=None):
    """infsamp's GroupSampler with the benchmark's cell settings (bench_sampling.cell_config)."""
    from infsamp.commands.bench_sampling import cell_config
    from infsamp.sampling.sampler import GroupSampler

    cfg = cell_config(policy, g, kv_budget_tokens, max_new_tokens)
    return GroupSampler(model, None, cfg, engine=engine)


def plan(shape: ModelShape, group_size: int, **settings):
    """`plan_memory` for one prompt x G."""
    from infsamp.planner import plan_memory

    return plan_memory(shape, num_generations=group_size, **settings)


def slots_used(stats) -> int:
    """g of a sampler call (`SamplerStats.micro_group`)."""
    return stats.micro_group


def kv_tokens(g: int, max_new_tokens: int, prompt_tokens: int) -> int:
    """KV budget of exactly g samples of one prompt on the slot engine (kv_tokens_needed)."""
    from infsamp.planner.kv_budget import kv_tokens_needed

    return kv_tokens_needed(g, max_new_tokens, prompt_tokens, 1, 1)


# ---------------------------------------------------------------- a part and its cells


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


@dataclass
class Part:
    """One part of the plan, run in its own process: rows, notes and skipped cells -> JSON."""

    number: int
    title: str
    profile: Profile
    cap_s: float
    result_path: Path
    started: float = field(default_factory=time.monotonic)
    rows: list[dict] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    @property
    def deadline(self) -> float:
        return self.started + self.cap_s

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    def cell_deadline(self) -> float:
        return min(self.deadline, time.monotonic() + self.profile.cell_cap_s)

    def note(self, key: str, value: Any) -> None:
        self.notes[key] = value
        self.save()

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.save()

    def save(self) -> None:
        data = {"part": self.number, "title": self.title, "rows": self.rows, "notes": self.notes,
                "skipped": self.skipped, "elapsed_s": round(time.monotonic() - self.started, 1)}
        tmp = self.result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        tmp.replace(self.result_path)

    def run_cells(self, cells: list[tuple[str, Callable[[], dict | None]]]) -> None:
        """Each cell in order until the cap; a failing cell is one row with its error line."""
        for index, (name, cell) in enumerate(cells):
            if self.remaining_s() <= 0:
                self.skipped.extend(n for n, _ in cells[index:])
                self.note("cap_reached", f"part cap {self.cap_s:.0f} s reached: "
                          f"{len(cells) - index} cell(s) skipped")
                return
            began = time.monotonic()
            try:
                row = cell()
            except Exception as err:  # noqa: BLE001 - every failure is reported, the rest runs
                traceback.print_exc()
                row = {"error": one_line(err)}
            if row is not None:
                self.add({"cell": name, **row, "cell_s": round(time.monotonic() - began, 1)})
            print(f"part {self.number} {name}: {json.dumps(self.rows[-1], default=str)[:400]}",
                  flush=True)
            free_device_memory()
