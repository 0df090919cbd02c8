"""The trainer end to end on a tiny model: metrics, resume after a kill, OOM retries, reward
errors, every loss type with the masks, logged completions with async rewards, timeouts and a
reward model."""

import json

import pytest
import torch

from infsamp.algorithm import grpo_step
from infsamp.algorithm.losses import LOSS_TYPES
from infsamp.errors import RewardError
from infsamp.run.checkpoint import list_checkpoints
from infsamp.run.logs import read_jsonl
from infsamp.run.trainer import GRPOTrainer


class Killed(Exception):
    pass


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)


def test_run_writes_metrics_trace_and_checkpoint(tiny_config):
    cfg = tiny_config(**{"training.max_steps": 2, "logging.plot": True})
    result = GRPOTrainer(cfg).train()
    out = result.output_dir
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for key in ("reward", "reward_std", "rewards/format/mean", "rewards/accuracy/mean", "accuracy",
                "completions/mean_length", "completions/max_length", "frac_reward_zero_std", "loss",
                "kl",
                "clip_ratio/region_mean", "step_time", "sampling/decode_steps",
                "sampling/peak_kv_bytes", "sampling/tokens_per_second"):
        assert key in metrics[0], key
    trace = [json.loads(line) for line in (out / "lengths.jsonl").read_text().splitlines()]
    assert len(trace) == 4 and all(len(t["lengths"]) == 4 for t in trace)
    assert list_checkpoints(out)[-1].name == "checkpoint-2"
    assert (out / "plots" / "training.png").exists()
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2]
    problems = read_jsonl(out / "eval_completions.jsonl")
    num_problems = cfg.eval.num_problems
    assert [row["step"] for row in problems] == [0] * num_problems + [2] * num_problems
    for step, e in ((0, evals[0]), (2, evals[1])):
        rows = [row for row in problems if row["step"] == step]
        assert len({row["prompt_id"] for row in rows}) == num_problems
        assert sum(row["solved"] for row in rows) / num_problems == e["eval/accuracy"]
        for name in rows[0]["rewards"]:
            scores = [row["rewards"][name] for row in rows if row["rewards"][name] is not None]
            assert sum(scores) / len(scores) == pytest.approx(e[f"eval/rewards/{name}/mean"])


def assert_resume_after_kill_matches(tiny_config, tmp_path, **options):
    """A run killed after step 2 (checkpoint-2) and resumed ends with the weights and the log rows
    of a run that was never interrupted."""
    straight = GRPOTrainer(tiny_config(**{"logging.output_dir": str(tmp_path / "a"), **options}))
    straight.train()
    expected = weights(straight.model)

    def kill_after_step_2(step, _metrics):
        if step == 2:
            raise Killed

    cfg = tiny_config(**{"logging.output_dir": str(tmp_path / "b"), "checkpointing.save_every": 2,
                         **options})
    with pytest.raises(Killed):
        GRPOTrainer(cfg, step_callback=kill_after_step_2).train()
    torch.manual_seed(12345)  # the resumed run must not depend on the process's RNG state
    resumed = GRPOTrainer(tiny_config(**{"logging.output_dir": str(tmp_path / "b"),
                                         "checkpointing.resume": "latest", **options}))
    assert resumed.step == 2
    resumed.train()
    assert_same_weights(weights(resumed.model), expected)
    assert [row["step"] for row in read_jsonl(tmp_path / "b" / "metrics.jsonl")] == [1, 2, 3, 4]


def test_resume_after_kill_matches_uninterrupted_run(tiny_config, tmp_path):
    assert_resume_after_kill_matches(tiny_config, tmp_path)


@pytest.mark.parametrize("loss_type", ["gspo", "cispo"])
def test_loss_types_masks_and_logged_completions_resume_exactly(tiny_config, tmp_path, loss_type):
    """Issue 13's options through a checkpoint and a resume: off-policy second pass, both masks,
    completions logged every step (rows after the checkpoint rewound, none lost or doubled)."""
    assert_resume_after_kill_matches(
        tiny_config, tmp_path, **{"training.loss_type": loss_type, "training.num_iterations": 2,
                                  "training.top_entropy_quantile": 0.5,
                                  "training.mask_truncated_completions": True,
                                  "logging.completions_every": 1})
    resumed, straight = (read_jsonl(tmp_path / run / "completions.jsonl") for run in ("b", "a"))
    assert resumed == straight and sorted({r["step"] for r in resumed}) == [1, 2, 3, 4]


def test_training_oom_splits_micro_batch_and_keeps_gradient(tiny_config, tmp_path, monkeypatch):
    # num_iterations 2: every sequence is forwarded (none skipped), so micro-batches hold several
    clean = GRPOTrainer(tiny_config(**{"logging.output_dir": str(tmp_path / "a"),
                                       "training.max_steps": 2,
                                       "training.num_iterations": 2}))
    clean.train()
    original = grpo_step.GRPOStep._micro_batch_backward
    calls = {"n": 0}

    def flaky(self, mb, *args):  # the first micro-batch of several sequences fails once
        if calls["n"] == 0 and len(mb.indices) > 1:
            calls["n"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return original(self, mb, *args)

    monkeypatch.setattr(grpo_step.GRPOStep, "_micro_batch_backward", flaky)
    retried = GRPOTrainer(tiny_config(**{"logging.output_dir": str(tmp_path / "b"),
                                         "training.max_steps": 2,
                                       "training.num_iterations": 2}))
    retried.train()
    assert retried.grpo.num_oom_retries == 1
    assert_same_weights(weights(retried.model), weights(clean.model))


def test_sampling_oom_halves_micro_group(tiny_config, monkeypatch):
    trainer = GRPOTrainer(tiny_config(**{"training.max_steps": 1, "eval.num_problems": 0}))
    original = trainer.sampler.sample
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer.sampler, "sample", flaky)
    trainer.train()
    assert trainer.sizes.oom_retries["sampling"] == 1
    assert trainer.sizes.micro_group == 2  # halved in the run's sizes, not in the config


def test_bad_reward_function_names_function_and_row(tiny_config):
    def broken(prompts, completions, **kwargs):
        return [1.0] * (len(completions) - 1)

    trainer = GRPOTrainer(tiny_config(**{"eval.num_problems": 0}),
                          reward_funcs=[("broken", broken)])
    with pytest.raises(RewardError, match="broken"):
        trainer.train()


def test_lora_with_kl_and_checkpointing_trains_only_adapters(tiny_config):
    cfg = tiny_config(**{"training.max_steps": 1, "eval.num_problems": 0, "model.lora_rank": 4,
                         "model.gradient_checkpointing": True, "training.beta": 0.04})
    trainer = GRPOTrainer(cfg)
    assert trainer.ref_model is None  # the reference is the base with adapters disabled
    base_before = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_" not in k}
    trainer.train()
    base_after = {k: v for k, v in trainer.model.state_dict().items() if "lora_" not in k}
    assert_same_weights(base_after, base_before)
    assert (trainer.output_dir / "checkpoint-1" / "model" / "adapter_model.safetensors").exists()



# ---------------------------------------------------------------- data checked before the weights


@pytest.fixture
def no_weights(monkeypatch):
    """Fails the test if the trainer gets as far as loading the weights."""
    import infsamp.run.trainer as trainer_module

    def refuse(*args, **kwargs):
        raise AssertionError("the weights were loaded before the data was checked")

    monkeypatch.setattr(trainer_module, "load_model_and_tokenizer", refuse)


def write_rows(path, num):
    rows = [{"prompt": f"{i}+1=?", "answer": str(i + 1)} for i in range(num)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_more_prompts_per_step_than_the_dataset_holds_is_refused_before_loading(
        tiny_config, tmp_path, no_weights):
    from infsamp.options import ConfigError

    data = write_rows(tmp_path / "d.jsonl", 3)
    cfg = tiny_config(**{"data.dataset": data, "eval.num_problems": 0,
                         "training.prompts_per_step": 4})
    with pytest.raises(ConfigError, match=r"^training.prompts_per_step: 4 is more than the 3 "):
        GRPOTrainer(cfg)


def test_one_jsonl_for_train_and_eval_is_refused_before_loading(tiny_config, tmp_path, no_weights):
    from infsamp.errors import DataError

    with pytest.raises(DataError, match="training and evaluation would read the same rows"):
        GRPOTrainer(tiny_config(**{"data.dataset": write_rows(tmp_path / "d.jsonl", 10)}))


def test_eval_fraction_splits_one_file_and_the_run_log_names_the_held_out_rows(
        tiny_config, tmp_path, capsys):
    data = write_rows(tmp_path / "d.jsonl", 10)
    trainer = GRPOTrainer(tiny_config(**{"data.dataset": data, "data.eval_fraction": 0.2,
                                         "eval.num_problems": 2}))
    log = capsys.readouterr().out
    held = [p.example["prompt"] for p in trainer.eval_prompts.prompts]
    trained = {p.example["prompt"] for p in trainer.train_prompts.prompts}
    assert len(held) == 2 and not set(held) & trained
    assert "evaluation: 2 of the 2 rows that data.eval_fraction 0.2 holds out of" in log
    assert all(f"line {int(prompt.split('+')[0]) + 1}" in log for prompt in held)


# ---------------------------------------------------------------- a new run from a LoRA checkpoint


def test_new_run_from_a_lora_checkpoint_trains_its_adapters_or_merges_them(tiny_config, tmp_path):
    from infsamp.errors import ModelError

    first = GRPOTrainer(tiny_config(**{"training.max_steps": 1, "eval.num_problems": 0,
                                       "model.lora_rank": 4,
                                       "logging.output_dir": str(tmp_path / "first")}))
    first.train()
    adapters = tmp_path / "first" / "checkpoint-1" / "model"
    trained = {k: v.clone() for k, v in first.model.state_dict().items()}

    again = GRPOTrainer(tiny_config(**{"model.name_or_path": str(adapters), "model.lora_rank": 4,
                                       "eval.num_problems": 0,
                                       "logging.output_dir": str(tmp_path / "again")}))
    assert_same_weights(weights(again.model), trained)  # the base plus the saved adapters
    assert all("lora_" in name for name, p in again.model.named_parameters() if p.requires_grad)
    again.train()  # the adapters train further (before: "optimizer got an empty parameter list")

    merged = GRPOTrainer(tiny_config(**{"model.name_or_path": str(adapters), "model.lora_rank": 0,
                                        "eval.num_problems": 0, "training.max_steps": 1,
                                        "logging.output_dir": str(tmp_path / "merged")}))
    assert not any("lora_" in name for name in merged.model.state_dict())
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(merged.model(ids).logits, first.model(ids).logits,
                                   rtol=1e-4, atol=1e-5)

    with pytest.raises(ModelError, match=r"lora_rank 8: the adapters in .* have rank 4; use --mo"):
        GRPOTrainer(tiny_config(**{"model.name_or_path": str(adapters), "model.lora_rank": 8,
                                   "eval.num_problems": 0,
                                   "logging.output_dir": str(tmp_path / "bad")}))


def varied(prompts, completions, **kwargs):
    """Rewards that differ within a group even for a random model (format, accuracy: all 0)."""
    return [float(sum(map(ord, c)) % 5) for c in completions]


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_every_loss_type_trains_with_the_entropy_mask(tiny_config, loss_type):
    cfg = tiny_config(**{"training.max_steps": 1, "eval.num_problems": 0,
                         "training.loss_type": loss_type, "training.top_entropy_quantile": 0.5})
    trainer = GRPOTrainer(cfg, reward_funcs=[("varied", varied)])
    before = weights(trainer.model)
    trainer.train()
    metrics = json.loads((trainer.output_dir / "metrics.jsonl").read_text())
    assert metrics["entropy"] > 0 and metrics["grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in weights(trainer.model).items())


def test_truncated_completions_carry_no_loss_through_the_trainer(tiny_config):
    cfg = tiny_config(**{"training.max_steps": 1, "eval.num_problems": 0,
                         "training.mask_truncated_completions": True})
    trainer = GRPOTrainer(cfg, reward_funcs=[("varied", varied)])
    before = weights(trainer.model)
    trainer.train()
    metrics = json.loads((trainer.output_dir / "metrics.jsonl").read_text())
    assert metrics["completions/clipped_ratio"] == 1.0  # the random tiny model never stops
    assert metrics["grad_norm"] == 0.0 and metrics["reward_std"] > 0
    assert_same_weights(weights(trainer.model), before)


REWARD_FILE = '''
import asyncio

async def judge(prompts, completions, **kwargs):
    await asyncio.sleep(0.01)
    return [float(len(c) % 3) for c in completions]

async def hangs(prompts, completions, **kwargs):
    await asyncio.sleep(60)
'''


def test_logged_completions_with_async_rewards_a_timeout_and_a_reward_model(tiny_config, tmp_path):
    from reward_models import save_reward_model

    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    rm_dir = save_reward_model(tmp_path / "rm")
    functions = f"accuracy,{tmp_path}/my_rewards.py:judge,{tmp_path}/my_rewards.py:hangs,{rm_dir}"
    cfg = tiny_config(**{"training.max_steps": 3, "eval.num_problems": 0,
                         "rewards.functions": functions, "rewards.timeout_s": 0.3,
                         "logging.completions_every": 2})
    GRPOTrainer(cfg).train()
    records = read_jsonl(tmp_path / "run" / "completions.jsonl")
    assert len(records) == 2 * 4 and {r["step"] for r in records} == {2}
    assert set(records[0]["rewards"]) == {"accuracy", "judge", "hangs", "rm"}
    assert all(r["rewards"]["hangs"] is None for r in records)
    assert all(isinstance(r["rewards"]["rm"], float) for r in records)
    for key in ("prompt_id", "prompt", "completion", "length", "finish_reason", "reward",
                "advantage"):
        assert key in records[0], key
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["rewards/hangs/timeouts"] for m in metrics] == [1, 1, 1]
    assert all(m["rewards/judge/timeouts"] == 0 and m["rewards/rm/std"] > 0 for m in metrics)


def test_async_reward_refused_when_the_config_forbids_it(tiny_config, tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    cfg = tiny_config(**{"rewards.functions": f"format,{tmp_path}/my_rewards.py:judge",
                         "rewards.allow_async": False})
    with pytest.raises(RewardError, match="^rewards.allow_async: false, but reward function "
                                          "'judge' is async"):
        GRPOTrainer(cfg)


def test_resume_at_its_last_step_runs_the_missing_closing_evaluation(tiny_config, tmp_path,
                                                                     capsys):
    """Resumed from a periodic checkpoint with max_steps lowered to its step: the closing
    evaluation runs once and is saved with the checkpoint; the next resume has nothing to do."""
    options = {"logging.output_dir": str(tmp_path / "run"), "checkpointing.save_every": 2}

    def kill_after_step_2(step, _metrics):
        if step == 2:
            raise Killed

    with pytest.raises(Killed):
        GRPOTrainer(tiny_config(**options), step_callback=kill_after_step_2).train()
    lowered = {**options, "checkpointing.resume": "latest", "training.max_steps": 2}
    result = GRPOTrainer(tiny_config(**lowered)).train()
    evals = read_jsonl(tmp_path / "run" / "eval.jsonl")
    assert [row["step"] for row in evals] == [0, 2]
    assert result.eval_after == evals[-1]["eval/accuracy"]
    capsys.readouterr()
    again = GRPOTrainer(tiny_config(**lowered)).train()
    assert "nothing to do" in capsys.readouterr().out
    assert again.eval_after == result.eval_after
    assert [row["step"] for row in read_jsonl(tmp_path / "run" / "eval.jsonl")] == [0, 2]


def test_eval_on_start_false_skips_only_the_evaluation_before_training(tiny_config, tmp_path):
    out = tmp_path / "run"
    cfg = tiny_config(**{"training.max_steps": 2, "eval.on_start": False,
                         "logging.output_dir": str(out)})
    result = GRPOTrainer(cfg).train()
    assert [row["step"] for row in read_jsonl(out / "eval.jsonl")] == [2]
    assert result.eval_before is None and result.eval_after is not None
