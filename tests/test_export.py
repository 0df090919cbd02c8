"""`infsamp export`: after short runs on the embedded model (full weights, LoRA), the export
loads with transformers and with vLLM and decodes greedily exactly as the trained policy; bad input
is one line and overwrites nothing."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from infsamp.cli import main
from infsamp.config_io import load_config
from infsamp.models.loading import EMBEDDED_DIR
from infsamp.run.trainer import GRPOTrainer
from infsamp.tasks.arithmetic import generate_problems

MAX_NEW = 40
VLLM_SCRIPT = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
prompts, results = json.loads(sys.argv[1]), {}
for path in sys.argv[2:]:
    llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
              kv_cache_memory_bytes=64 * 2**20)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=%d), use_tqdm=False)
    results[path] = [list(o.outputs[0].token_ids) for o in outs]
    del llm
print("VLLM_RESULT " + json.dumps(results))
""" % MAX_NEW  # noqa: UP031  (the script has literal braces)


def length_reward(prompts, completions, **kwargs):
    """Varies within every group, so every step moves the weights."""
    return [float(len(c)) / 50 for c in completions]


def train(out: Path, **overrides) -> GRPOTrainer:
    cfg = load_config(overrides={
        "data.num_train_examples": 40, "eval.num_problems": 0, "sampling.num_generations": 4,
        "sampling.max_new_tokens": 32, "sampling.micro_group": 4, "training.max_steps": 2,
        "training.prompts_per_step": 2, "training.learning_rate": 1e-3,
        "training.warmup_ratio": 0.0, "logging.output_dir": str(out),
        "logging.progress_bar": False, "logging.plot": False, **overrides})
    trainer = GRPOTrainer(cfg, reward_funcs=[("length", length_reward)])
    trainer.train()
    return trainer


def greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    model.eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                 pad_token_id=0)
            outs.append(out[0, len(ids):].tolist())
    return outs


def vllm_greedy(prompts: list[list[int]], paths: list[Path]) -> dict[str, list[list[int]]]:
    """vLLM in a child process (its CPU worker pins threads and memory: not in this process)."""
    argv = [sys.executable, "-c", VLLM_SCRIPT, json.dumps(prompts), *map(str, paths)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("VLLM_RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(lines[0].removeprefix("VLLM_RESULT "))


def weights_differ(model_a, model_b) -> bool:
    b = model_b.state_dict()
    return any(not torch.equal(v, b[k]) for k, v in model_a.state_dict().items() if k in b)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    full = train(root / "full")
    lora = train(root / "lora", **{"model.lora_rank": 4, "model.lora_alpha": 8,
                                   "training.learning_rate": 1e-2})
    tokenizer = full.tokenizer
    prompts = [tokenizer(p["prompt"], add_special_tokens=False).input_ids
               for p in generate_problems(3, 7, "test")]
    return {"root": root, "full": full, "lora": lora, "prompts": prompts}


@pytest.mark.slow
def test_export_loads_in_transformers_and_vllm_and_decodes_as_the_policy(trained):
    root, prompts = trained["root"], trained["prompts"]
    exports = {}
    for name in ("full", "lora"):
        exports[name] = root / f"export-{name}"
        assert main(["export", str(root / name), "--out", str(exports[name])]) == 0
        written = {p.name for p in exports[name].iterdir()}
        assert {"config.json", "generation_config.json", "model.safetensors",
                "tokenizer.json"} <= written
    base = AutoModelForCausalLM.from_pretrained(EMBEDDED_DIR)
    expected = {}
    for name, path in exports.items():
        loaded = AutoModelForCausalLM.from_pretrained(path)
        assert weights_differ(loaded, base), f"{name}: training did not change the weights"
        assert type(loaded).__name__ == "LlamaForCausalLM"  # LoRA merged: a plain model
        expected[name] = greedy(trained[name].model, prompts)
        assert greedy(loaded, prompts) == expected[name], name
    from_vllm = vllm_greedy(prompts, list(exports.values()))
    for name, path in exports.items():
        assert from_vllm[str(path)] == expected[name], name


@pytest.mark.slow
def test_adapters_only_export_is_a_peft_folder_on_the_trained_base(trained):
    out = trained["root"] / "adapters"
    argv = ["export", str(trained["root"] / "lora"), "--out", str(out), "--adapters-only"]
    assert main(argv) == 0
    assert {p.name for p in out.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors",
                                                 "tokenizer.json", "generation_config.json"}
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(EMBEDDED_DIR)
    loaded = AutoModelForCausalLM.from_pretrained(out)  # transformers reads adapter and base
    prompts = trained["prompts"]
    assert greedy(loaded, prompts) == greedy(trained["lora"].model, prompts)


# ---------------------------------------------------------------- bad input: one line


@pytest.fixture(scope="module")
def tiny_run(tiny_model_dir, tmp_path_factory):
    """A real 1-step run (full weights, complete checkpoint-1) on the shared tiny model."""
    out = tmp_path_factory.mktemp("tiny") / "run"
    train(out, **{"model.name_or_path": str(tiny_model_dir), "training.max_steps": 1,
                  "sampling.max_new_tokens": 8})
    return out


def incomplete_checkpoint(run: Path, name: str) -> Path:
    """What a kill in the middle of a save leaves: weights, no completion marker."""
    (run / name / "model").mkdir(parents=True)
    (run / name / "model" / "config.json").write_text("{}")
    return run / name


def export_error(capsys, *argv) -> str:
    assert main(["export", *map(str, argv)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    return err


def test_target_that_exists_and_is_not_empty_is_left_alone(tiny_run, tmp_path, capsys):
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    err = export_error(capsys, tiny_run, "--out", target)
    assert err == (f"infsamp export: error: --out {target}: exists and is not empty "
                   "(nothing was written)")
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    assert (target / "keep.txt").read_text() == "mine"


def test_incomplete_checkpoint_is_refused(tmp_path, capsys):
    for name in ("checkpoint-4", "checkpoint-6.tmp"):
        incomplete = incomplete_checkpoint(tmp_path / "run", name)
        err = export_error(capsys, incomplete, "--out", tmp_path / "out")
        assert err.startswith(f"infsamp export: error: {incomplete}: no manifest.json, the "
                              "checkpoint is incomplete; nothing exported")
    assert not (tmp_path / "out").exists()


def damaged_copy(checkpoint: Path, target: Path) -> Path:
    """A copy of a complete checkpoint with one byte of its weights changed."""
    shutil.copytree(checkpoint, target)
    weights = target / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    return target


def test_damaged_checkpoint_is_refused_and_skipped_in_a_run_folder(tiny_run, tmp_path, capsys):
    damaged = damaged_copy(tiny_run / "checkpoint-1", tmp_path / "run" / "checkpoint-1")
    err = export_error(capsys, damaged, "--out", tmp_path / "out")
    assert err.startswith(f"infsamp export: error: {damaged}: model/model.safetensors differs "
                          "from its sha256 in the manifest")
    newer = damaged_copy(tiny_run / "checkpoint-1", tiny_run / "checkpoint-5")
    try:
        from infsamp.commands.export import resolve_checkpoint

        assert os.path.samefile(resolve_checkpoint(tiny_run), tiny_run / "checkpoint-1")
        # a copy of checkpoint-1 named checkpoint-5: its manifest's step is found first
        assert capsys.readouterr().err.startswith(f"skipping {newer}: its manifest is step 1's")
    finally:
        shutil.rmtree(newer)
    assert not (tmp_path / "out").exists()


def test_lora_over_a_4bit_base_is_not_merged(tmp_path):
    from infsamp.commands.export import ExportError, export_checkpoint

    checkpoint = tmp_path / "run" / "checkpoint-3"
    (checkpoint / "model").mkdir(parents=True)
    (checkpoint / "model" / "adapter_config.json").write_text("{}")
    (tmp_path / "run" / "config.yaml").write_text(
        "model: {name_or_path: embedded, lora_rank: 4, load_in_4bit: true}\n")
    with pytest.raises(ExportError, match="LoRA trained over a 4-bit base: .* use --adapters-only"):
        export_checkpoint(checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_run_without_a_complete_checkpoint_is_refused(tmp_path, capsys):
    incomplete_checkpoint(tmp_path / "run", "checkpoint-4")
    err = export_error(capsys, tmp_path / "run", "--out", tmp_path / "out")
    assert err.endswith("no complete checkpoint-N folder in this run folder (newest: "
                        f"{tmp_path / 'run' / 'checkpoint-4'}: no manifest.json, the checkpoint "
                        "is incomplete)")
    err = export_error(capsys, tmp_path / "missing", "--out", tmp_path / "out")
    assert "not a run folder" in err


def test_adapters_only_needs_a_lora_checkpoint(tiny_run, tmp_path, capsys):
    checkpoint = tiny_run / "checkpoint-1"
    err = export_error(capsys, checkpoint, "--out", tmp_path / "out", "--adapters-only")
    assert err.endswith(f"--adapters-only: {checkpoint} holds full weights, not LoRA adapters")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_run_folder_exports_its_newest_complete_checkpoint(tiny_run, tmp_path):
    from infsamp.commands.export import resolve_checkpoint

    newer_but_incomplete = incomplete_checkpoint(tiny_run, "checkpoint-3")
    try:
        assert os.path.samefile(resolve_checkpoint(tiny_run), tiny_run / "checkpoint-1")
    finally:
        shutil.rmtree(newer_but_incomplete)
    out = tmp_path / "empty-target"
    out.mkdir()  # an empty folder is a valid target
    assert main(["export", str(tiny_run / "checkpoint-1"), "--out", str(out)]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "LlamaForCausalLM"


def test_generation_config_lists_the_runs_stop_tokens(tmp_path):
    """A model whose generation config names two stop tokens: both in the export (vLLM and
    transformers stop where the run's sampler stopped)."""
    from transformers import AutoTokenizer, GenerationConfig

    from infsamp.commands.export import write_tokenizer_and_generation_config

    model_dir = tmp_path / "model"
    shutil.copytree(EMBEDDED_DIR, model_dir)
    GenerationConfig(eos_token_id=[2, 5], bos_token_id=1).save_pretrained(model_dir)
    out = tmp_path / "out"
    out.mkdir()
    write_tokenizer_and_generation_config(model_dir, None, out)
    generation = GenerationConfig.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert generation.eos_token_id[:2] == [2,
                                           5] and tokenizer.eos_token_id in generation.eos_token_id


@pytest.mark.slow
def test_bf16_run_exports_bf16_weights_that_decode_as_the_policy(tiny_model_dir, tmp_path):
    trainer = train(tmp_path / "run", **{"model.name_or_path": str(tiny_model_dir),
                                         "training.max_steps": 1, "sampling.max_new_tokens": 8,
                                         "training.precision": "bf16"})
    out = tmp_path / "export"
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert next(loaded.parameters()).dtype == torch.bfloat16
    prompts = [[1, 5, 6, 7], [1, 8, 9]]
    assert greedy(loaded, prompts) == greedy(trainer.model, prompts)
