"""`infsamp plan` on the command line: text, --json, and one error line per mistake."""

import json

import pytest

from infsamp.cli import main

SEED = ["plan", "--model", "llama-3.2-1b", "--gpu-memory", "16GiB", "--max-prompt", "256",
        "--max-completion", "786", "--beta", "0.04"]


def test_text_report_names_parts_verdict_and_advice(capsys):
    assert main(SEED + ["--group-size", "4"]) == 0
    out = capsys.readouterr().out
    for word in ("weights", "reference", "gradients", "optimizer", "activations", "logits", "kv_cache",
                 "overhead", "peak", "micro-group g = 4", "DOES NOT FIT", "--optimizer adamw8bit"):
        assert word in out


def test_json_output(capsys):
    assert main(SEED + ["--group-size", "64", "--optimizer", "adamw8bit", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is True and data["micro_group"] == 64 and data["train_micro_batch_tokens"] == 1042
    assert data["advice"] == [] and data["peak_bytes"] > 0


def test_config_json_path(tmp_path, capsys):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", "--model", str(tmp_path), "--gpu-memory", "1GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_parameters"] == 2 * 100 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 128) + 64


@pytest.mark.parametrize("args, message", [
    (["--model", "nope-7b"], "model 'nope-7b': not a preset"),
    (["--model", "qwen3-0.6b", "--gpu-memory", "24XB"], "--gpu-memory: cannot read size '24XB'"),
    (["--model", "qwen3-0.6b", "--gpu-memory", "24"], "--gpu-memory: give a unit"),
    (["--model", "qwen3-0.6b", "--max-completion", "0"], "--max-completion: must be >= 1"),
    (["--model", "qwen3-0.6b", "--max-prompt", "-5"], "--max-prompt: must be >= 1"),
    (["--model", "qwen3-0.6b", "--group-size", "many"], "--group-size: expected an integer"),
    (["--model", "qwen3-0.6b", "--optimizer", "adam"], "--optimizer: must be one of"),
    (["--model", "qwen3-0.6b", "--beta", "-1"], "--beta: must be >= 0"),
    (["--model", "qwen3-0.6b", "--group-size", "4", "--micro-group", "8"], "--micro-group: must be <="),
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
