"""`infsamp export RUN_OR_CHECKPOINT --out DIR`: a model folder that transformers and vLLM load.

    infsamp export runs/demo --out models/demo               # the run's newest complete checkpoint
    infsamp export runs/lora/checkpoint-90 --out models/lora  # LoRA merged into its base model
    infsamp export runs/lora --out adapters/lora --adapters-only
    infsamp export runs/real --best --out models/best         # the best evaluation's checkpoint

The folder holds the weights (safetensors), `config.json`, `generation_config.json` and the
tokenizer: `AutoModelForCausalLM.from_pretrained(DIR)` and `vllm.LLM(DIR)` load it as is. A LoRA
checkpoint is merged into its base model (the run's `model.name_or_path`) unless
`--adapters-only`, which writes a peft adapter folder whose `base_model_name_or_path` is that base.

`--best` takes, of the run's checkpoints that verify, the one whose evaluation (eval.jsonl) scored
highest on the run's `checkpointing.keep_best` metric (else eval/accuracy); the earliest wins a
tie. With keep_best set, the run saved a checkpoint at every new best and pruning kept it.

Checks before any work, each one line: the target exists and is not empty, or is (or is inside)
the folder of a run that is still going (its lock: `run/ownership.py`); the checkpoint is
incomplete or damaged (`run/checkpoint.py`'s `verify_checkpoint`: its manifest, every file's size
and sha256); the run has no checkpoint that verifies (newer damaged ones are named and skipped);
`--adapters-only` on full weights; a checkpoint that vanishes during the export (a live run
pruned it) is named as such; LoRA trained over a 4-bit (QLoRA) base without
`--adapters-only`: the trained policy is the adapters on the *quantised* base, so merging them into
the full-precision base would serve another model (dequantising needs bitsandbytes on CUDA; not
done). The export is written under a temporary name beside DIR and renamed when complete, so
nothing half-written is left and nothing existing is overwritten.

Weights: the dtype the checkpoint holds (`training.precision` fp32 or mixed: fp32; bf16: bf16),
or `--dtype`; a LoRA is merged in fp32 and cast to the base's dtype. `generation_config.json`
lists every stop token the run sampled with (`models.loading.stop_token_ids`) as `eos_token_id`.

Deliberately simple: the whole model is loaded in CPU memory (merging needs the base weights).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

from infsamp.errors import CheckpointError, InfsampError, ModelError
from infsamp.models.source import load_error, resolve_model_source
from infsamp.run.logs import read_jsonl
from infsamp.run.ownership import describe, live_run_around

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
DTYPE_CHOICES = ("auto", "fp32", "bf16")
_CHECKPOINT_NAME = re.compile(r"^checkpoint-\d+")


class ExportError(InfsampError):
    """An export that cannot be done (target not empty, checkpoint incomplete or missing)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="RUN_OR_CHECKPOINT",
                        help="run folder (its newest complete checkpoint) or checkpoint-N folder")
    parser.add_argument("--out", required=True, help="new (or empty) folder for the model")
    parser.add_argument("--adapters-only", action="store_true",
                        help="LoRA runs: write the peft adapters instead of merging them")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="weights dtype (auto: the dtype the model was trained in)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="load a model whose folder ships its own Python code (runs it with "
                             "your permissions; as model.trust_remote_code)")
    parser.add_argument("--best", action="store_true",
                        help="the run's checkpoint with the best evaluation (its "
                             "checkpointing.keep_best metric, else eval/accuracy)")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    check_target(out)
    checkpoint = (best_checkpoint if args.best else resolve_checkpoint)(Path(args.source))
    from infsamp.models.loading import quiet_transformers

    quiet_transformers()
    print(export_checkpoint(checkpoint, out, adapters_only=args.adapters_only, dtype=args.dtype,
                            trust_remote_code=args.trust_remote_code))
    return 0


# ---------------------------------------------------------------- checks, before any work


def check_target(out: Path) -> None:
    """`out` is new or empty, and not inside a run folder that a live run holds (its lock)."""
    around = live_run_around(out)
    if around is not None:
        folder, holder = around
        where = "is" if folder == out else f"is inside {folder}, which is"
        raise ExportError(f"--out {out}: {where} the run folder of a live run: "
                          f"{describe(holder)} (nothing was written); export to a folder "
                          "outside it")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out}: exists and is not empty (nothing was written)")


def resolve_checkpoint(source: Path) -> Path:
    """The checkpoint to export: `source` if it verifies, or a run folder's newest that does."""
    from infsamp.run.checkpoint import MANIFEST, MODEL_DIR, newest_verified, verify_checkpoint

    if not source.is_dir():
        raise ExportError(f"{source}: not a run folder or checkpoint folder")
    is_checkpoint = any((_CHECKPOINT_NAME.match(source.name), (source / MODEL_DIR).is_dir(),
                         (source / MANIFEST).exists()))
    if is_checkpoint:
        try:
            verify_checkpoint(source)
        except CheckpointError as err:
            raise ExportError(f"{err}; nothing exported (export the run folder to take its newest "
                              "complete checkpoint)") from None
        return source
    skipped: list[str] = []
    found = newest_verified(source, lambda path, why: skipped.append(why))
    if found is None:
        newest = f" (newest: {skipped[0]})" if skipped else ""
        raise ExportError(f"{source}: no complete checkpoint-N folder in this run folder{newest}")
    for why in skipped:
        print(f"skipping {why}", file=sys.stderr)
    return found


def best_checkpoint(run_dir: Path) -> Path:
    """The run's verified checkpoint whose evaluation scored highest (see module docstring)."""
    from infsamp.run.checkpoint import checkpoint_step, list_checkpoints, verify_checkpoint

    if not (run_dir / "eval.jsonl").is_file():
        raise ExportError(f"--best: {run_dir} is not a run folder with evaluations (no eval.jsonl)")
    metric = _run_section(run_dir, "checkpointing").get("keep_best") or "eval/accuracy"
    scores = {row["step"]: row[metric] for row in read_jsonl(run_dir / "eval.jsonl")
              if isinstance(row.get(metric), (int, float))}
    ranked = sorted((-scores[step], step, path) for path in list_checkpoints(run_dir)
                     if (step := checkpoint_step(path)) in scores)
    for _, step, path in ranked:
        try:
            verify_checkpoint(path)
        except CheckpointError as err:
            print(f"skipping {err}", file=sys.stderr)
            continue
        print(f"--best: {path.name}, {metric} {scores[step]:.4g} (the best of "
              f"{len(ranked)} evaluated checkpoint(s))")
        return path
    raise ExportError(f"--best: no checkpoint of {run_dir} that verifies was evaluated ({metric} "
                      "in eval.jsonl); set checkpointing.keep_best to keep the best one")


# ---------------------------------------------------------------- the export


def export_checkpoint(checkpoint: Path, out: Path, *, adapters_only: bool = False,
                      dtype: str = "auto", trust_remote_code: bool = False) -> str:
    """Write `checkpoint` as a standalone model folder at `out`; returns a one-line summary."""
    check_target(out)
    model_dir = checkpoint / "model"
    is_lora = (model_dir / "adapter_config.json").exists()
    if adapters_only and not is_lora:
        raise ExportError(f"--adapters-only: {checkpoint} holds full weights, not LoRA adapters")
    quantized_base = _run_section(checkpoint.parent, "model").get("load_in_4bit")
    if is_lora and not adapters_only and quantized_base:
        raise ExportError(f"{checkpoint}: LoRA trained over a 4-bit base: merging it into the "
                          "full-precision base is not the trained policy; use --adapters-only "
                          "and load the adapters on the 4-bit base")
    base = base_model_path(checkpoint) if is_lora else None
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if adapters_only:
            what = write_adapters(model_dir, base, tmp)
        else:
            what = write_model(model_dir, base, tmp, dtype, trust_remote_code)
        write_tokenizer_and_generation_config(model_dir, base, tmp, trust_remote_code)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except Exception:
        from infsamp.run.checkpoint import MANIFEST, MODEL_DIR

        if not ((checkpoint / MANIFEST).is_file() and (checkpoint / MODEL_DIR).is_dir()):
            raise ExportError(f"{checkpoint}: the checkpoint vanished while it was being exported "
                              "(a live run's checkpointing.keep_last pruned it); nothing was "
                              f"written to {out}: export again, or once the run has "
                              "ended") from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return (f"exported {checkpoint} ({what}) to {out}: load it with "
            f"AutoModelForCausalLM.from_pretrained({str(out)!r}) or vllm.LLM({str(out)!r})")


def _run_section(run_dir: Path, section: str) -> dict:
    """A section of the run folder's config.yaml ({} without one)."""
    import yaml

    config_file = run_dir / "config.yaml"
    if not config_file.exists():
        return {}
    return (yaml.safe_load(config_file.read_text()) or {}).get(section, {}) or {}


def base_model_path(checkpoint: Path) -> str:
    """The LoRA base: the run's model.name_or_path (its config.yaml), else peft's record."""
    name = _run_section(checkpoint.parent, "model").get("name_or_path")
    if not name:
        adapter_config = json.loads((checkpoint / "model" / "adapter_config.json").read_text())
        name = adapter_config.get("base_model_name_or_path")
    if not name:
        raise ModelError(f"{checkpoint}: cannot tell the LoRA base model (the run folder has no "
                         "config.yaml)")
    return resolve_model_source(name).path  # an adapter folder named as the model: its base


def _torch_dtype(dtype: str, config):
    import torch

    from infsamp.models.device import DTYPES

    if dtype != "auto":
        return DTYPES[dtype]
    trained = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    trained = trained or torch.float32
    return getattr(torch, trained) if isinstance(trained, str) else trained


def _load(path: str | Path, trust_remote_code: bool, **kwargs):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=trust_remote_code,
                                                    **kwargs)
    except Exception as err:  # transformers raises many types for a bad folder
        raise load_error(str(path), "model", err) from None


def write_model(model_dir: Path, base: str | None, out: Path, dtype: str,
                trust_remote_code: bool = False) -> str:
    """Full weights (or the base with the LoRA merged in) as safetensors + config in `out`."""
    import torch

    if base is None:
        model = _load(model_dir, trust_remote_code, dtype="auto")
        what = "full weights"
    else:
        from peft import PeftModel

        base_model = _load(base, trust_remote_code, dtype=torch.float32)
        model = PeftModel.from_pretrained(base_model, str(model_dir)).merge_and_unload()
        what = f"LoRA merged into {base}"  # merged in fp32, then cast
    target = _torch_dtype(dtype, _load_config(base or model_dir, trust_remote_code))
    model.to(target).save_pretrained(out, safe_serialization=True)
    return f"{what}, {str(target).removeprefix('torch.')}"


def _load_config(path: str | Path, trust_remote_code: bool):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def write_adapters(model_dir: Path, base: str, out: Path) -> str:
    """The peft adapter files, with base_model_name_or_path set to the base this run trained."""
    for name in ADAPTER_FILES:
        shutil.copy2(model_dir / name, out / name)
    config = json.loads((out / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(Path(base).resolve()) if Path(base).exists() else base
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return f"LoRA adapters for {config['base_model_name_or_path']}"


def write_tokenizer_and_generation_config(model_dir: Path, base: str | None, out: Path,
                                          trust_remote_code: bool = False) -> None:
    """The tokenizer saved with the checkpoint, and a generation config whose `eos_token_id` lists
    every stop token the run sampled with (`models.loading.stop_token_ids`)."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer, GenerationConfig

    from infsamp.models.loading import stop_token_ids

    sources = [model_dir] + ([Path(base)] if base else [])
    tokenizer_dir = next((p for p in sources if (p / "tokenizer_config.json").exists()), None)
    if tokenizer_dir is None:
        raise ModelError(f"{model_dir}: no tokenizer saved with the checkpoint or its base")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir),
                                              trust_remote_code=trust_remote_code)
    tokenizer.save_pretrained(out)
    config = _load_config(base or model_dir, trust_remote_code)
    generation_dir = next((p for p in sources if (p / "generation_config.json").exists()), None)
    generation = (GenerationConfig.from_model_config(config) if generation_dir is None
                  else GenerationConfig.from_pretrained(str(generation_dir)))
    stops = stop_token_ids(SimpleNamespace(generation_config=generation, config=config), tokenizer)
    if stops:
        generation.eos_token_id = list(stops) if len(stops) > 1 else stops[0]
    generation.save_pretrained(out)
