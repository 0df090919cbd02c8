"""`infsamp plan` on the command line: text, --json, and one error line per mistake."""

import json
from pathlib import Path

import pytest

from infsamp.cli import main

SEED = ["plan", "--model", "llama-3.2-1b", "--gpu-memory", "16GiB", "--max-prompt", "256",
        "--max-completion", "786", "--beta", "0.04", "--prompts-per-step", "1", "--micro-group",
        "0",
        "--engine", "slots"]  # the second seed's case: one prompt, the largest g, the slot engine


def test_text_report_names_parts_verdict_and_advice(capsys):
    assert main(SEED + ["--num-generations", "4", "--gpu-memory", "15GiB"]) == 0
    out = capsys.readouterr().out
    for word in ("weights", "reference", "gradients", "optimizer", "activations", "logits",
                 "kv_cache",
                 "overhead", "peak", "micro-group g = 4", "DOES NOT FIT", "--optimizer adamw8bit"):
        assert word in out


def test_json_output(capsys):
    assert main(SEED + ["--num-generations", "64", "--optimizer", "adamw8bit", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["fits"] is True and data["micro_group"] == 64
            and data["train_micro_batch_tokens"] == 2084)
    assert data["advice"] == [] and data["peak_bytes"] > 0


def test_config_json_path(tmp_path, capsys):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2,
              "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", "--model", str(tmp_path), "--gpu-memory", "1GiB", "--json"]) == 0
    assert (json.loads(capsys.readouterr().out)["num_parameters"]
            == 2 * 100 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 128) + 64)


@pytest.mark.parametrize("args, message", [
    (["--model", "nope-7b"], "model 'nope-7b': not a preset"),
    (["--model", "qwen3-0.6b", "--gpu-memory", "24XB"], "--gpu-memory: cannot read size '24XB'"),
    (["--model", "qwen3-0.6b", "--gpu-memory", "24"], "--gpu-memory: give a unit"),
    (["--model", "qwen3-0.6b", "--max-completion", "0"], "--max-completion: must be >= 1"),
    (["--model", "qwen3-0.6b", "--max-prompt", "-5"], "--max-prompt: must be >= 1"),
    (["--model", "qwen3-0.6b", "--num-generations", "many"],
     "--num-generations: expected an integer"),
    (["--model", "qwen3-0.6b", "--optimizer", "adam"], "--optimizer: must be one of"),
    (["--model", "qwen3-0.6b", "--beta", "-1"], "--beta: must be >= 0"),
    (["--model", "qwen3-0.6b", "--num-generations", "4", "--prompts-per-step", "1", "--micro-group",
      "8"],
     "--micro-group: must be <="),
    (["--model", "qwen3-0.6b", "--engine", "vllm", "--temperature", "3"],
     "sampling.temperature: must be <= 2 with sampling.engine vllm"),  # as train refuses it
])
def test_errors_are_one_line(args, message, capsys):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_unreadable_config_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{broken")
    assert main(["plan", "--model", str(tmp_path / "config.json")]) == 2
    err = capsys.readouterr().err
    assert "cannot read JSON" in err and err.count("\n") == 1


def test_precision_and_4bit_flags_shown_in_text_and_json(capsys):
    base = ["plan", "--model", "qwen3-1.7b", "--gpu-memory", "24GiB", "--lora-rank", "16"]
    assert main(base + ["--precision", "mixed", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["precision"] == "mixed" and data["settings"]["precision"] == "mixed"
    assert data["settings"]["load_in_4bit"] is False and data["bytes_per_parameter"]["total"] > 2
    assert main(base + ["--load-in-4bit"]) == 0
    out = capsys.readouterr().out
    assert ("precision bf16: bf16 weights and states, stochastically rounded updates (torchao); "
            "base in 4-bit NF4; bytes per parameter:") in out
    assert main(["plan", "--model", "qwen3-1.7b", "--device", "cpu", "--gpu-memory", "64GiB"]) == 0
    assert ("precision fp32: fp32 weights, gradients, optimizer states and compute; bytes per "
            "parameter: weights 4 + gradients 4 + optimizer 8 = 16") in capsys.readouterr().out


def test_small_models_print_a_unit_that_fits(capsys):
    embedded = Path(__file__).resolve().parents[2] / "src" / "infsamp" / "models" / "embedded"
    assert main(["plan", "--model", str(embedded), "--gpu-memory", "1GiB", "--device", "cpu",
                 "--lora-rank", "4"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "800.9K parameters, 38.9K trainable (LoRA rank 4)" in first and "0.000B" not in first


@pytest.mark.parametrize("args, message", [
    (["--precision", "fp16"],
     "--precision: must be one of auto, fp32, mixed, bf16, bf16_lossy (got 'fp16')"),
    (["--load-in-4bit"],
     "--load-in-4bit: trains LoRA adapters over the 4-bit base: add --lora-rank 16"),
    (["--load-in-4bit", "--lora-rank", "8", "--device", "cpu"],
     "--load-in-4bit: bitsandbytes 4-bit needs"),
])
def test_precision_errors_are_one_line(args, message, capsys):
    assert main(["plan", "--model", "qwen3-0.6b", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
