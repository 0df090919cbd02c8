"""`infsamp sample` and the pieces of `infsamp bench sampling` on a tiny char-level checkpoint."""

from __future__ import annotations

import argparse
import json

import pytest

from infsamp.cli import main
from infsamp.commands import bench_sampling as bench
from infsamp.commands import bench_sampling_report as bench_report
from infsamp.config_algorithm import SamplingConfig
from infsamp.sampling.engines.base import vllm_installed
from infsamp.sampling.sampler import GroupSampler

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir):
    return tiny_model_dir


def test_sample_command_writes_completions_and_trace(checkpoint, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 2+3?\n\nHello\n")
    out, trace = tmp_path / "out.jsonl", tmp_path / "trace.jsonl"
    code = main(["sample", "--model", str(checkpoint), "--prompts", str(prompts), "-G", "3",
                 "--max-new-tokens", "5", "--kv-budget", "40", "--out", str(out), "--trace",
                 str(trace)])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and {r["prompt"] for r in rows} == {"What is 2+3?", "Hello"}
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert lines[0]["prompt_tokens"] == 12 and len(lines[0]["lengths"]) == 3
    assert "decode steps" in capsys.readouterr().out


def test_sample_command_reports_bad_budget(checkpoint, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 2+3?\n")
    code = main(["sample", "--model", str(checkpoint), "--prompts", str(prompts), "--kv-budget",
                 "5"])
    assert code == 2 and "kv_budget='5'" in capsys.readouterr().err


def test_forced_lengths_are_exact(checkpoint):
    from infsamp.config import ModelConfig
    from infsamp.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=str(checkpoint)))
    workload = bench.Workload("controlled", (8,), 40, median=12, min_length=2, controlled=True)
    targets = bench.target_lengths(workload, 8, 0, seed=0)
    cfg = SamplingConfig(policy="continuous", micro_group=3, kv_budget="1000", max_new_tokens=40)
    result = GroupSampler(model, tokenizer, cfg).sample([[5, 6, 7]], 8, target_lengths=targets)
    assert [c.length for c in result.groups[0]] == targets
    assert all(c.finish_reason == "eos" for c in result.completions)


def test_bench_cells_and_targets(checkpoint):
    from infsamp.config import ModelConfig
    from infsamp.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=str(checkpoint)))
    workload = bench.Workload("controlled", (4, 8), 24, {4: 1, 8: 1}, median=8, min_length=2,
                              controlled=True)
    args = argparse.Namespace(micro_group=2, seed=0)
    prompts = bench.bench_prompts(tokenizer, 1, 0)
    rows = [bench.run_cell(model, tokenizer, workload, prompts, size, policy, args)
            for size in (4, 8) for policy in bench_report.POLICIES]
    targets = bench_report.check_targets(rows)
    assert targets["controlled/continuous: peak KV G=8 / G=4"] == 1.0
    assert targets["controlled: peak KV full / continuous at G=8"] > 3
    assert all(r["decode_steps"] >= r["lower_bound"] for r in rows)


def test_bench_bound_replays_the_cells_steps(checkpoint):
    """--bound: the cell's decode steps beside the model's own forward of the same rows over a
    ready cache and their matrix products alone, each a positive time, in the targets."""
    from infsamp.config import ModelConfig
    from infsamp.models.loading import load_model_and_tokenizer
    from infsamp.sampling.engines.decode_bound import BOUND_STEPS
    from infsamp.sampling.engines.slots import SlotEngine

    model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=str(checkpoint)))
    workload = bench.Workload("embedded", (4,), 12, {4: 1})
    args = argparse.Namespace(micro_group=2, seed=0, bound=True)
    engine = SlotEngine(model)
    row = bench.run_cell(model, tokenizer, workload, bench.bench_prompts(tokenizer, 1, 0), 4,
                         "continuous", args, engine, 2)
    assert engine.step_log is None and 0 < row["bound_steps"] <= min(row["decode_steps"],
                                                                     BOUND_STEPS)
    assert all(row[f"{name}_cpu_ms"] > 0 for name in ("step", "forward", "matmul"))
    assert row["forward_ms"] > row["matmul_ms"]  # the forward does its matrix products and more
    targets = bench_report.check_targets([row])
    assert targets["embedded G=4 g=2 continuous: decode step / its matrix products alone (CPU)"] \
        == row["step_over_matmul_cpu"]
    assert "step ms" in bench_report.BOUND_HEADER and bench_report.format_row(row).endswith("x")


# ---------------------------------------------------------------- bad flags: one line, before work


@pytest.mark.parametrize("flags, message", [
    (["--policy", "length_aware", "--predictor", "oracle"],
     "sampling.predictor: must be online or hidden or none"),
    (["--num-prompts", "-1"], "--num-prompts: must be >= 0"),
    (["--out", "no/such/folder/out.jsonl"], "--out: folder no/such/folder does not exist"),
    (["--trace", "missing_dir/trace.jsonl"], "--trace: folder missing_dir does not exist"),
])
def test_sample_command_bad_flags_fail_before_loading(checkpoint, tmp_path, capsys, monkeypatch,
                                                      flags, message):
    import infsamp.models.loading as model_loading

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(model_loading, "load_tokenizer", lambda *a: pytest.fail("loaded too early"))
    (tmp_path / "p.txt").write_text("x\ny\n")
    code = main(["sample", "--model", str(checkpoint), "--prompts", "p.txt", "-G", "2", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_sample_command_on_the_recipe_renders_txt_and_jsonl_like_training(chat_model_dirs, tmp_path,
                                                                          capsys):
    from pathlib import Path

    recipe = str(Path(__file__).resolve().parents[2] / "examples" / "gsm8k.yaml")
    model = str(chat_model_dirs["llama3"])
    (tmp_path / "p.txt").write_text("What is 2+2?\n")
    out = tmp_path / "out.jsonl"
    assert main(["sample", recipe, "--model", model, "--prompts", str(tmp_path / "p.txt"),
                 "-G", "2", "--max-new-tokens", "3", "--out", str(out)]) == 0
    prompt = json.loads(out.read_text().splitlines()[0])["prompt"]
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    assert prompt.startswith("<|begin_of_text|>" + header.format("system") + "Respond in the")
    assert prompt.endswith("What is 2+2?<|eot_id|>" + header.format("assistant"))
    assert "Loading weights" not in capsys.readouterr().err
    rows = tmp_path / "gsm8k.jsonl"  # one GSM8K file: sampling needs no held-out split, nor answers
    rows.write_text(json.dumps({"question": "What is 2+2?"}) + "\n")
    assert main(["sample", recipe, "--model.name_or_path", model, "--data.dataset", str(rows),
                 "-G", "2", "--max-new-tokens", "3", "--out", str(out), "--overwrite"]) == 0
    assert json.loads(out.read_text().splitlines()[0])["prompt"] == prompt
def test_engine_flag_errors_are_one_line(checkpoint, tmp_path, capsys):
    assert main(["bench", "sampling", "--engine", "slots,hf", "--model", str(checkpoint)]) == 2
    assert "--engine: unknown engine 'hf'" in capsys.readouterr().err
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 2+3?\n")
    code = main(["sample", "--model", str(checkpoint), "--prompts", str(prompts),
                 "--engine", "hf"])
    assert code == 2
    assert "sampling.engine: must be one of auto, slots, vllm" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")
def test_bench_sampling_on_both_engines(tmp_path):
    code = main(["bench", "sampling", "--engine", "slots,vllm", "--model", "embedded",
                 "--workload", "embedded", "--num-generations", "4,8", "--micro-group", "2,4",
                 "--policies", "rounds,continuous", "--quick", "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "sampling.json").read_text())
    rows = report["rows"]
    setups = {(r["engine"], r["micro_group"]) for r in rows}
    assert setups == {(e, g) for e in ("slots", "vllm") for g in (2, 4)}
    assert all(r["g"] == r["micro_group"] and r["num_preemptions"] == 0 for r in rows)
    assert "embedded G=8 g=4 continuous: vllm / slots tokens/s" in report["targets"]
    assert report["engine_startup_s"]["vllm"] > 0


@pytest.mark.slow
@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")
def test_sample_command_on_vllm(tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    code = main(["sample", "--model", "embedded", "--prompts", "embedded:arithmetic",
                 "--num-prompts", "2", "-G", "4", "--max-new-tokens", "32", "--kv-budget", "2048",
                 "--engine", "vllm", "--out", str(out), "--quiet"])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 8 and all(1 <= r["length"] <= 32 for r in rows)
    assert "decode steps" in capsys.readouterr().out
