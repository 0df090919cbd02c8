"""One test per reported failure of issue 9 that the other fault tests do not already reproduce."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
import torch

from infsamp import cli
from infsamp.errors import RewardError
from infsamp.rewards.compute import compute_rewards
from infsamp.run import logs as run_log

from fault_runs import run_args
from test_config_property import assert_one_line_naming, run_train
from test_kill_resume import assert_same_run


def main(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(argv)
    return code, err.getvalue()


# ---- item 7: a one-token prompt in a step of two or more prompts


def test_one_token_prompts_sample_in_one_step(tiny_model_dir, tmp_path):
    prompts = tmp_path / "t.txt"
    prompts.write_text("x\ny\n")
    code, stderr = main(["sample", "--model", str(tiny_model_dir), "--prompts", str(prompts),
                         "-G", "2", "--max-new-tokens", "8", "--quiet"])
    assert code == 0, stderr


def test_one_token_prompt_completions_match_alone_and_together(tiny_model_dir):
    from infsamp.config_algorithm import SamplingConfig
    from infsamp.models.loading import ModelConfig, load_model_and_tokenizer
    from infsamp.sampling.sampler import GroupSampler

    model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    cfg = SamplingConfig(max_new_tokens=8, micro_group=3, kv_budget="512")
    sampler = GroupSampler(model, tokenizer, cfg)
    together = sampler.sample([[9], [6, 7, 8], [5]], 2, generator=torch.Generator().manual_seed(0))
    alone = sampler.sample([[9]], 2, generator=torch.Generator().manual_seed(0))  # ids 0, 1 too
    assert [c.token_ids for c in together.groups[0]] == [c.token_ids for c in alone.groups[0]]


# ---- item 8: options that failed with a traceback after the model had loaded


@pytest.mark.parametrize("key, value", [
    ("model.device", "bogus"), ("training.adam_beta1", "2"), ("training.weight_decay", "-1"),
    ("model.lora_dropout", "2"), ("eval.max_new_tokens", "-5"),
    ("training.lr_scheduler", "warmup_stable_decay"),
    ("sampling.predictor", "oracle"),
])
def test_bad_options_are_one_line_before_the_model_loads(tmp_path, key, value):
    extra = ["--sampling.policy", "length_aware"] if key == "sampling.predictor" else []
    assert_one_line_naming(key, *run_train(key, "flag", value, tmp_path, *extra))


def test_lora_target_that_is_not_a_layer(tmp_path):
    code, stderr = run_train("model.lora_target_modules", "flag", "bogus", tmp_path,
                             "--model.lora_rank", "4")
    assert_one_line_naming("model.lora_target_modules", code, stderr)
    assert "names no layer LoRA can adapt" in stderr and "q_proj" in stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu(tmp_path):
    code, stderr = run_train("model.device", "flag", "cuda", tmp_path)
    assert_one_line_naming("model.device", code, stderr)
    assert "needs a CUDA GPU" in stderr


def test_output_dir_naming_a_file(tmp_path):
    file = tmp_path / "file.txt"
    file.write_text("mine")
    code, stderr = run_train("logging.output_dir", "flag", str(file), tmp_path)
    assert_one_line_naming("logging.output_dir", code, stderr)
    assert file.read_text() == "mine"


@pytest.mark.parametrize("kind, words", [("folder", "is a folder"), ("empty", "is empty"),
                                         ("binary", "not a text file")])
def test_config_file_that_is_a_folder_empty_or_binary(tmp_path, kind, words):
    path = tmp_path / "c.yaml"
    if kind == "folder":
        path.mkdir()
    else:
        path.write_bytes(b"" if kind == "empty" else bytes(range(256)))
    code, stderr = main(["train", str(path), "--logging.output_dir", str(tmp_path / "run")])
    assert code == 2 and words in stderr and len(stderr.strip().splitlines()) == 1, stderr


# ---- items 8 and 10: infsamp simulate


@pytest.mark.parametrize("case", ["binary trace", "plot folder", "epsilon 0", "epsilon -1",
                                  "length 1e11"])
def test_simulate_refuses_in_one_line(tmp_path, case):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"prompt_id": "a", "prompt_tokens": 3, "lengths": [4, 9]}) + "\n")
    argv = ["simulate", "--trace", str(trace), "--micro-group", "2", "--policy", "length_aware"]
    if case == "binary trace":
        trace.write_bytes(bytes(range(256)) * 4)
    elif case == "plot folder":
        argv += ["--plot", str(tmp_path / "missing" / "q.png")]
    elif case.startswith("epsilon"):
        argv += ["--epsilon", case.split()[1]]
    else:
        row = {"prompt_id": "a", "prompt_tokens": 3, "lengths": [int(1e11)]}
        trace.write_text(json.dumps(row) + "\n")
    code, stderr = main(argv)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "Traceback" not in stderr


# ---- item 10: silently accepted values


def test_reward_beyond_float32_is_refused():
    def huge(prompts, completions, **kwargs):
        return [1e308] * len(completions)

    with pytest.raises(RewardError, match="beyond float32 range"):
        compute_rewards([("huge", huge)], None, ["p", "p"], ["a", "b"], {})


def test_zero_temperature_training_warns(runner, tiny_model_dir, tmp_path):
    code, output = runner.run(run_args(tiny_model_dir, tmp_path / "run",
                                       "--sampling.temperature", "0", "--training.max_steps", "1",
                                       "--eval.num_problems", "0"))
    assert code == 0 and "warning: sampling.temperature 0 decodes greedily" in output, output


def test_micro_batch_does_not_follow_free_memory(runner, reference, tiny_model_dir, tmp_path,
                                                 monkeypatch):
    """The same command under memory pressure (free RAM faked to 1 MiB) gives the same weights;
    `training.micro_batch_memory auto` follows free memory: with 1 MiB free its plan cannot fit,
    and the run is refused in one line before the weights load (issue 32 item 3)."""
    page = os.sysconf("SC_PAGE_SIZE")
    real = os.sysconf
    monkeypatch.setattr(os, "sysconf",
                        lambda name: 2**20 // page if name == "SC_AVPHYS_PAGES" else real(name))
    from infsamp.sampling.sizes import device_memory_bytes

    assert device_memory_bytes(torch.device("cpu"), torch.nn.Linear(1, 1), "auto") < 2**21
    monkeypatch.undo()
    code, output = runner.run(run_args(tiny_model_dir, tmp_path / "run"), kill_at="lowmem@0")
    assert code == 0, output
    assert_same_run(tmp_path / "run", reference("continuous"))
    auto = run_args(tiny_model_dir, tmp_path / "auto", "--training.micro_batch_memory", "auto")
    code, low = runner.run(auto, kill_at="lowmem@0")
    assert code == 2 and "the run does not fit this machine's" in low, low[-2000:]
    assert not (tmp_path / "auto" / "checkpoint-1").exists()


# ---- item 9: a torn last line of a run log


def test_torn_last_line_is_skipped_then_trimmed(tmp_path):
    path = tmp_path / "metrics.jsonl"
    run_log.append_jsonl(path, [{"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.25}])
    with path.open("a") as fh:
        fh.write('{"step": 3, "rew')
    assert [r["step"] for r in run_log.read_jsonl(path)] == [1, 2]
    assert run_log.rewind(path, 2) == 1
    assert path.read_text() == '{"step": 1, "reward": 0.5}\n{"step": 2, "reward": 0.25}\n'
    run_log.append_jsonl(path, {"step": 3, "reward": float("nan")})
    assert run_log.read_jsonl(path)[-1] == {"step": 3, "reward": None}
    assert run_log.rewind(path, 1) == 2 and run_log.rewind(path, 1) == 0
