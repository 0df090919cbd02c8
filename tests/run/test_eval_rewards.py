"""Evaluation with the run's reward functions (eval.reward, each function's mean in eval.jsonl), a
reasoning-gym task through the trainer, and checkpointing.keep_best through pruning, resume and
`infsamp export --best`."""

import pytest

from infsamp.options import ConfigError
from infsamp.rewards.compute import RewardResult
from infsamp.run import trainer as trainer_module
from infsamp.run.checkpoint import list_checkpoints
from infsamp.run.evaluation import BestEvaluation, eval_metrics, eval_reward_name, tally
from infsamp.run.logs import read_jsonl
from infsamp.run.trainer import GRPOTrainer


def test_eval_reward_auto_is_the_accuracy_like_function_else_the_first():
    assert eval_reward_name("auto", ["format", "reasoning_gym"]) == "reasoning_gym"
    assert eval_reward_name("auto", ["format", "length"]) == "format"
    assert eval_reward_name("format", ["format", "accuracy"]) == "format"
    with pytest.raises(ConfigError, match="eval.reward: 'math_verify' is not one of the run's "
                                          "reward functions \\(format, accuracy\\)"):
        eval_reward_name("math_verify", ["format", "accuracy"])


def test_tallies_of_two_ranks_add_up_to_the_whole():
    nan = float("nan")
    one = RewardResult([], {"format": [0.5, 0.0], "accuracy": [2.0, 0.0]})
    two = RewardResult([], {"format": [0.5], "accuracy": [nan]})
    names = ["format", "accuracy"]
    sums = [a + b + c for a, b, c in zip(tally(one, names, "accuracy", 1.0),
                                         tally(two, names, "accuracy", 1.0),
                                         tally(None, names, "accuracy", 1.0))]  # an idle rank
    assert sums == [1, 3, 1.0, 3, 2.0, 2]
    metrics = eval_metrics(sums, names, "accuracy")
    assert metrics == {"eval/accuracy": 1 / 3, "eval/reward": 1.0,
                       "eval/rewards/format/mean": 1 / 3, "eval/rewards/accuracy/mean": 1.0}


def test_a_reasoning_gym_task_trains_and_evaluates_with_its_own_reward(tiny_config):
    cfg = tiny_config(**{"data.dataset": "reasoning_gym:basic_arithmetic",
                         "data.dataset_config": "{max_terms: 2, max_digits: 2}",
                         "data.max_prompt_length": 64, "rewards.functions": "format,reasoning_gym",
                         "rewards.answer_extraction": "last_number", "training.max_steps": 1})
    result = GRPOTrainer(cfg).train()
    assert result.eval_reward == "reasoning_gym"
    rows = read_jsonl(result.output_dir / "eval.jsonl")
    assert [row["step"] for row in rows] == [0, 1]
    assert {"eval/accuracy", "eval/reward", "eval/rewards/format/mean",
            "eval/rewards/reasoning_gym/mean"} <= rows[0].keys()
    step = read_jsonl(result.output_dir / "metrics.jsonl")[0]
    assert "rewards/reasoning_gym/mean" in step


def test_an_eval_reward_or_best_metric_the_run_does_not_have_is_one_line(tiny_config):
    with pytest.raises(ConfigError, match="eval.reward: 'reasoning_gym' is not one"):
        GRPOTrainer(tiny_config(**{"eval.reward": "reasoning_gym"}))
    with pytest.raises(ConfigError, match="checkpointing.keep_best: 'eval/rewards/x/mean' is not "
                                          "logged by evaluation"):
        GRPOTrainer(tiny_config(**{"checkpointing.keep_best": "eval/rewards/x/mean"}))
    with pytest.raises(ConfigError, match="needs evaluations"):
        tiny_config(**{"checkpointing.keep_best": "eval/accuracy", "eval.num_problems": 0})


def test_best_evaluation_counts_only_trained_steps_and_the_earliest_tie():
    best = BestEvaluation("eval/accuracy")
    assert not best.offer(0, {"eval/accuracy": 0.9})  # the base model has no checkpoint
    assert best.offer(1, {"eval/accuracy": 0.2}) and best.kept_step == 1
    assert not best.offer(2, {"eval/accuracy": 0.2}) and best.offer(3, {"eval/accuracy": 0.3})
    assert not BestEvaluation("").offer(1, {"eval/accuracy": 1.0})


class Killed(Exception):
    pass


def scripted_accuracy(monkeypatch, by_call):
    """eval/accuracy of the n-th evaluation in this process is by_call[n]."""
    calls = iter(by_call)

    def metrics(*args):
        return {**eval_metrics(*args), "eval/accuracy": next(calls)}

    monkeypatch.setattr(trainer_module, "eval_metrics", metrics)


def test_keep_best_survives_pruning_and_resume_and_export_picks_it(tiny_config, tmp_path,
                                                                   monkeypatch, capsys):
    from infsamp.commands.export import best_checkpoint

    options = {"training.max_steps": 5, "eval.every_steps": 1, "checkpointing.save_every": 2,
               "checkpointing.keep_last": 1, "checkpointing.keep_best": "eval/accuracy"}

    def kill_after_step_3(step, _metrics):
        if step == 3:
            raise Killed

    scripted_accuracy(monkeypatch, [0.9, 0.1, 0.5, 0.2])  # steps 0..3: step 2 is the best
    with pytest.raises(Killed):
        GRPOTrainer(tiny_config(**options), step_callback=kill_after_step_3).train()
    out = tmp_path / "run"
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2"]
    scripted_accuracy(monkeypatch, [0.3, 0.4, 0.1])  # steps 3..5, resumed from checkpoint-2
    resumed = GRPOTrainer(tiny_config(**options, **{"checkpointing.resume": "latest"}))
    assert resumed.best.step == 2 and resumed.best.value == 0.5
    resumed.train()
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2", "checkpoint-5"]
    assert best_checkpoint(out).name == "checkpoint-2"
    assert "--best: checkpoint-2, eval/accuracy 0.5 (the best of 2" in capsys.readouterr().out
