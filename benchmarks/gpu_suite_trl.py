"""Part 3 of the GPU suite: infsamp's trainer against TRL's GRPOTrainer on the device.

Both train the same random-weight model of the `Profile.trl_model` shape (saved once with the
embedded character tokenizer: the model keeps the shape's vocabulary, so its logits cost what the
public model's do) on `benchmarks/vs_trl.py`'s prompts and rewards (the embedded arithmetic task,
format + accuracy), one prompt per step, temperature 1, beta 0, DAPO loss, gradient checkpointing
on (TRL 1.16's default), the profile's precision (bf16 on the GPU: TRL's model loaded in bf16 with
`bf16=True`, infsamp's `training.precision bf16`). Three frameworks per G:

- `infsamp`: continuous policy, g = `Profile.trl_micro_group` slots, a KV budget of g x (prompt +
  completion) tokens, training micro-batches of the same g sequences' tokens;
- `trl`: TRL's default layout (all G generated with `generate`, one forward/backward over all G);
- `trl_cb`: TRL with training micro-batches of g sequences (`per_device_train_batch_size` g,
  `steps_per_generation` G/g) and transformers' continuous batching with the same KV budget as
  infsamp (`num_blocks` x `page_size` tokens, page size 16).

Per cell: one warm-up step, then `Profile.trl_steps` measured steps: the whole-step peak and the
generation peak (TRL's `_generate`, infsamp's `sampler.sample`) above the memory in use after the
warm-up (`max_memory_allocated` on CUDA, vs_trl's resident-set meter on the CPU), seconds per
step (median) and completion tokens per step-second. vs_trl.py's `summarise` shapes the rows.

Deliberately simple: all cells in one process (peaks are taken after each cell's own warm-up);
the largest G first, infsamp first within a G.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from pathlib import Path

from gpu_suite_common import Part, free_device_memory, shape_of

FRAMEWORKS = ("infsamp", "trl", "trl_cb")
PAGE_SIZE = 16  # transformers' continuous batching page (vLLM's default block size)


class CudaPeak:
    """vs_trl.PeakRss's interface on CUDA: `start()` sets the baseline, `phase(fn)` measures each
    call's own peak above the memory allocated at its start, `peak_bytes()` the run-wide peak."""

    def __init__(self):
        self.baseline = None
        self.earlier_peak = 0
        self.phase_peaks: list[int] = []

    def start(self) -> None:
        import torch

        free_device_memory()
        self.baseline = torch.cuda.memory_allocated()
        self.earlier_peak = 0
        torch.cuda.reset_peak_memory_stats()

    def peak_bytes(self) -> int:
        import torch

        torch.cuda.synchronize()
        return max(self.earlier_peak, torch.cuda.max_memory_allocated()) - self.baseline

    def phase(self, fn):
        import torch

        def measured(*args, **kwargs):
            if self.baseline is None:  # the warm-up step
                return fn(*args, **kwargs)
            torch.cuda.synchronize()
            self.earlier_peak = max(self.earlier_peak, torch.cuda.max_memory_allocated())
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            result = fn(*args, **kwargs)
            torch.cuda.synchronize()
            self.phase_peaks.append(torch.cuda.max_memory_allocated() - before)
            return result
        return measured


def make_meter(device: str):
    from vs_trl import PeakRss

    return CudaPeak() if device == "cuda" else PeakRss()


def save_model(profile, folder: Path) -> Path:
    """The shape with random weights and the embedded tokenizer, as an HF checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    from infsamp.models.tiny import build_tokenizer

    from memory import hf_config

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


def kv_budget_tokens(profile) -> int:
    from vs_trl import MAX_PROMPT_TOKENS

    return profile.trl_micro_group * (MAX_PROMPT_TOKENS + profile.trl_completion)


def continuous_batching_config(budget_tokens: int) -> dict:
    """transformers' ContinuousBatchingConfig holding `budget_tokens` of KV (page_size since
    5.17, block_size before)."""
    from transformers.generation import ContinuousBatchingConfig

    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    page = "page_size" if "page_size" in names else "block_size"
    return {page: PAGE_SIZE, "num_blocks": math.ceil(budget_tokens / PAGE_SIZE),
            "max_batch_tokens": budget_tokens}


def trl_arguments(profile, G: int, out_dir: Path, framework: str):
    from trl import GRPOConfig

    micro = framework == "trl_cb"
    batch = min(profile.trl_micro_group, G) if micro else G
    cuda = profile.device == "cuda"
    extra = {}
    if micro:
        extra = {"use_transformers_continuous_batching": True,
                 "transformers_continuous_batching_config":
                     continuous_batching_config(kv_budget_tokens(profile))}
    return GRPOConfig(
        output_dir=str(out_dir), num_generations=G, per_device_train_batch_size=batch,
        gradient_accumulation_steps=G // batch, steps_per_generation=G // batch,
        max_completion_length=profile.trl_completion, learning_rate=1e-5, temperature=1.0,
        beta=0.0, use_vllm=False, bf16=cuda and profile.precision.startswith("bf16"),
        use_cpu=not cuda, report_to=[], logging_steps=1, save_strategy="no",
        max_steps=1 + profile.trl_steps, lr_scheduler_type="constant", disable_tqdm=True,
        dataloader_num_workers=0, seed=0, loss_type="dapo", gradient_checkpointing=True, **extra)


def run_trl(profile, G: int, model_dir: Path, tmp: Path, framework: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    from infsamp.models.loading import load_tokenizer

    from vs_trl import NUM_PROMPTS, make_step_callback, reward_functions, train_problems

    dtype = torch.bfloat16 if profile.precision.startswith("bf16") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    meter, times, lengths = make_meter(profile.device), [], []
    trainer = GRPOTrainer(model=model, reward_funcs=reward_functions(),
                          args=trl_arguments(profile, G, tmp / "trl", framework),
                          train_dataset=Dataset.from_list(train_problems(NUM_PROMPTS)),
                          processing_class=load_tokenizer(str(model_dir)),
                          callbacks=[make_step_callback(meter, times, lengths)])
    trainer._generate = meter.phase(trainer._generate)  # TRL's generation (as vs_trl.py)
    trainer.train()
    return {"peak_bytes": meter.peak_bytes(), "generation_peak_bytes": max(meter.phase_peaks),
            "step_seconds": times[1:], "mean_lengths": lengths[1:]}


def infsamp_config(profile, G: int, model_dir: Path, out_dir: Path):
    from infsamp.config_io import load_config

    from vs_trl import MAX_PROMPT_TOKENS, NUM_PROMPTS

    g = min(profile.trl_micro_group, G)
    return load_config(overrides={
        "model.name_or_path": str(model_dir), "model.device": profile.device,
        "model.gradient_checkpointing": True, "training.precision": profile.precision,
        "data.num_train_examples": NUM_PROMPTS, "data.max_prompt_length": MAX_PROMPT_TOKENS,
        "sampling.num_generations": G, "sampling.policy": "continuous", "sampling.micro_group": g,
        "sampling.kv_budget": str(kv_budget_tokens(profile)),
        "sampling.max_new_tokens": profile.trl_completion, "sampling.temperature": 1.0,
        "sampling.engine": "slots", "training.prompts_per_step": 1, "training.learning_rate": 1e-5,
        "training.lr_scheduler": "constant", "training.warmup_ratio": 0.0, "training.beta": 0.0,
        "training.loss_type": "dapo",
        "training.train_micro_batch_tokens": g * (MAX_PROMPT_TOKENS + profile.trl_completion),
        "training.max_steps": 1 + profile.trl_steps, "eval.num_problems": 0,
        "logging.output_dir": str(out_dir), "logging.plot": False,
        "logging.progress_bar": False})


def run_infsamp(profile, G: int, model_dir: Path, tmp: Path) -> dict:
    from infsamp.run.trainer import GRPOTrainer

    from vs_trl import reward_functions, timed_step

    trainer = GRPOTrainer(infsamp_config(profile, G, model_dir, tmp / "infsamp"),
                          reward_funcs=[(f.__name__, f) for f in reward_functions()])
    meter = make_meter(profile.device)
    trainer.sampler.sample = meter.phase(trainer.sampler.sample)  # the step's generation
    timed_step(trainer)  # warm-up: optimizer states, lazy imports, compiled steps
    meter.start()
    measured = [timed_step(trainer) for _ in range(profile.trl_steps)]
    trainer.close()
    return {"peak_bytes": meter.peak_bytes(), "generation_peak_bytes": max(meter.phase_peaks),
            "step_seconds": [t for t, _ in measured], "mean_lengths": [n for _, n in measured]}


def framework_row(profile, framework: str, G: int, model_dir: Path) -> dict:
    from vs_trl import summarise

    with tempfile.TemporaryDirectory() as tmp:
        if framework == "infsamp":
            raw = run_infsamp(profile, G, model_dir, Path(tmp))
        else:
            raw = run_trl(profile, G, model_dir, Path(tmp), framework)
    row = summarise(framework, G, raw)
    row["completion_tokens_per_step_s"] = (G * row["mean_completion_length"]
                                           / max(row["seconds_per_step"], 1e-9))
    return row


def add_ratios(rows: list[dict]) -> None:
    """infsamp's whole-step peak / TRL's, generation peak / trl_cb's, tokens per step-second /
    the faster peer's (issue 20's goals: <= 1.0, <= 0.5, >= 1.2)."""
    by = {(r.get("framework"), r.get("G")): r for r in rows if "peak_mib" in r}
    for (framework, G), row in by.items():
        trl, cb = by.get(("trl", G)), by.get(("trl_cb", G))
        if framework != "infsamp":
            continue
        if trl:
            row["peak_ratio_trl"] = round(row["peak_mib"] / max(trl["peak_mib"], 1e-9), 3)
        if cb:
            row["generation_peak_ratio_trl_cb"] = round(
                row["generation_peak_mib"] / max(cb["generation_peak_mib"], 1e-9), 3)
        peers = [p["completion_tokens_per_step_s"] for p in (trl, cb) if p]
        if peers:
            row["tokens_per_s_ratio_best_peer"] = round(
                row["completion_tokens_per_step_s"] / max(peers), 3)


def part_vs_trl(part: Part) -> None:
    from importlib.metadata import version

    profile = part.profile
    part.note("setting", {"model": shape_of(profile, profile.trl_model).name,
                          "completion": profile.trl_completion, "g": profile.trl_micro_group,
                          "kv_budget_tokens": kv_budget_tokens(profile),
                          "trl": version("trl"), "precision": profile.precision})
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        model_dir = save_model(profile, Path(tmp) / "model")
        part.note("model_saved_s", round(time.perf_counter() - started, 1))
        free_device_memory()

        def cell(framework: str, G: int):
            return lambda: framework_row(profile, framework, G, model_dir)

        part.run_cells([(f"{framework} G={G}", cell(framework, G))
                        for G in profile.trl_groups for framework in FRAMEWORKS])
    add_ratios(part.rows)
    part.save()
