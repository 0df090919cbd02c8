"""Part 3 of the GPU suite: infsamp's trainer against TRL's GRPOTrainer on the device.

The cells are `benchmarks/vs_trl.py`'s frameworks, sizes and rows, run in this process on the
profile's device and precision: both train the same random-weight model of the `Profile.trl_model`
shape (saved once with the embedded character tokenizer: the model keeps the shape's vocabulary,
so its logits cost what the public model's do) on vs_trl's prompts and rewards (the embedded
arithmetic task, format + accuracy), one prompt per step, temperature 1, beta 0, DAPO loss,
gradient checkpointing on (TRL 1.16's default), the profile's precision (bf16 on the GPU: TRL's
model loaded in bf16 with `bf16=True`, infsamp's `training.precision bf16`). Three frameworks per
G, all training in micro-batches of g = `Profile.trl_micro_group` sequences (TRL's
`per_device_train_batch_size` g with `steps_per_generation` G/g; infsamp's
`train_micro_batch_tokens` g x (prompt + completion)) and holding KV within infsamp's budget of
g x (prompt + completion) tokens:

- `infsamp`: continuous policy, g slots;
- `trl`: TRL's own `generate` (all G decoded at once);
- `trl_cb`: TRL with transformers' continuous batching, its KV pool at the budget
  (`vs_trl_frameworks.continuous_batching_config`).

Per cell: one warm-up step, then `Profile.trl_steps` measured steps: the whole-step peak and the
generation peak above the memory in use after the warm-up (`peak_meter.py`:
`max_memory_allocated` on CUDA, the resident set on the CPU), seconds per step (median) and
completion tokens per step-second; vs_trl's `add_ratios` gives the ratios of issue 20's goals.

Deliberately simple: all cells in one process (peaks are taken after each cell's own warm-up);
the largest G first, infsamp first within a G.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from gpu_suite_common import Part, free_device_memory, shape_of

FRAMEWORKS = ("infsamp", "trl", "trl_cb")


def save_model(profile, folder: Path) -> Path:
    """The shape with random weights and the embedded tokenizer, as an HF checkpoint."""
    import torch
    from memory import hf_config
    from transformers import AutoModelForCausalLM

    from infsamp.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    shape = shape_of(profile, profile.trl_model)
    config = hf_config(shape)
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    torch.manual_seed(0)
    dtype = torch.bfloat16 if profile.precision.startswith("bf16") else torch.float32
    with torch.device(profile.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def vs_trl_args(profile):
    """vs_trl.py's arguments for this profile (its sizes rule, in this process)."""
    from vs_trl import parse_args

    return parse_args([
        "--device", profile.device, "--precision", profile.precision,
        "--micro-group", str(profile.trl_micro_group),
        "--max-completion", str(profile.trl_completion), "--steps", str(profile.trl_steps),
        "--groups", ",".join(map(str, profile.trl_groups)), "--frameworks", ",".join(FRAMEWORKS)])


def framework_row(args, framework: str, G: int, model_dir: Path) -> dict:
    from vs_trl import WORKERS, case_sizes, summarise

    with tempfile.TemporaryDirectory() as tmp:
        raw = WORKERS[framework](args, G, model_dir, Path(tmp))
    free_device_memory()
    return summarise(framework, G, raw, case_sizes(args, G))


def part_vs_trl(part: Part) -> None:
    from importlib.metadata import version

    from vs_trl import add_ratios, case_sizes

    profile = part.profile
    args = vs_trl_args(profile)
    part.note("setting", {"model": shape_of(profile, profile.trl_model).name,
                          "completion": profile.trl_completion, "g": profile.trl_micro_group,
                          "kv_budget_tokens": case_sizes(args, max(args.groups)).kv_budget_tokens,
                          "trl": version("trl"), "precision": profile.precision})
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        model_dir = save_model(profile, Path(tmp) / "model")
        part.note("model_saved_s", round(time.perf_counter() - started, 1))
        free_device_memory()

        def cell(framework: str, G: int):
            return lambda: framework_row(args, framework, G, model_dir)

        part.run_cells([(f"{framework} G={G}", cell(framework, G))
                        for G in profile.trl_groups for framework in FRAMEWORKS])
    add_ratios(part.rows)
    part.save()
