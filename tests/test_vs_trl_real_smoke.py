"""benchmarks/vs_trl_real.py: the shared-settings mapping (infsamp config -> GRPOConfig), what TRL
cannot match (one line before any work), argument checks, the prompt order TRL is given, the reward
wrapper, and the noise statistics; no model is loaded (slow: GRPOConfig takes the mapping)."""

import json

import pytest


@pytest.fixture
def bench(load_benchmark):
    return load_benchmark("vs_trl_real")


def recipe(bench, tmp_path, *extra):
    return bench.recipe_config(bench.parse_args(["--out", str(tmp_path), *extra]))


def test_grpo_config_keywords_follow_the_infsamp_config(bench, tmp_path):
    cfg = recipe(bench, tmp_path, "--steps", "6", "--set", "training.beta=0.04",
                 "--set", "training.epsilon_high=0.28")
    kw = bench.trl_settings(cfg, 0)
    assert (kw["num_generations"], kw["per_device_train_batch_size"]) == (8, 8)
    # 4 prompts x G=8 = 32 completions: 4 micro-batches of 8, one optimizer step per generation
    assert kw["gradient_accumulation_steps"] == kw["steps_per_generation"] == 4
    assert kw["loss_type"] == cfg.training.loss_type == "dapo"
    assert (kw["beta"], kw["epsilon"], kw["epsilon_high"]) == (0.04, 0.2, 0.28)
    assert kw["learning_rate"] == 2e-4 and kw["lr_scheduler_type"] == "constant_with_warmup"
    assert kw["warmup_steps"] == 1 and kw["max_steps"] == 6  # round(0.1 x 6), as infsamp's
    assert (kw["adam_beta1"], kw["adam_beta2"], kw["adam_epsilon"]) == (0.9, 0.99, 1e-8)
    assert (kw["temperature"], kw["top_p"], kw["top_k"]) == (0.7, 1.0, 0)
    assert kw["max_completion_length"] == 32 and kw["shuffle_dataset"] is False
    assert kw["gradient_checkpointing"] is False and kw["max_grad_norm"] == 1.0
    assert bench.trl_settings(cfg, 16)["gradient_accumulation_steps"] == 2


@pytest.mark.parametrize("argv, trl_batch, message", [
    (["--set", "training.loss_type=gspo"], 0, "training.loss_type gspo: TRL names it"),
    (["--set", "sampling.temperature=0", "--set", "sampling.engine=slots"], 0,
     "TRL always samples"),
    ([], 12, "--trl-batch 12 does not divide the step's 32 completions"),
    (["--set", "training.optimizer=sgd"], 0, "training.optimizer sgd")])
def test_what_trl_cannot_match_is_one_line(bench, tmp_path, argv, trl_batch, message):
    cfg = recipe(bench, tmp_path, *argv)
    with pytest.raises(SystemExit) as raised:
        bench.trl_settings(cfg, trl_batch)
    assert message in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("argv, message", [
    (["--frameworks", "trl"], "infsamp included"),
    (["--frameworks", "infsamp,verl"], "choose from infsamp, trl"),
    (["--steps", "1"], ">= 2 steps")])
def test_bad_arguments_are_one_line(bench, tmp_path, argv, message):
    with pytest.raises(SystemExit) as raised:
        bench.parse_args(["--out", str(tmp_path), *argv])
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_used_output_folder_is_refused_before_any_work(bench, tmp_path):
    (tmp_path / "old.txt").write_text("x")
    with pytest.raises(SystemExit, match="is not empty"):
        bench.main(["--out", str(tmp_path)])
    assert [p.name for p in tmp_path.iterdir()] == ["old.txt"]


def test_trl_gets_infsamp_rows_in_the_order_its_stream_serves_them(bench):
    from infsamp.run.prompt_stream import PromptStream

    examples = list(range(10))
    rows = bench.training_rows((examples, 3, 7), 4)
    stream = PromptStream(examples, 3, 7)  # what the trainer builds
    assert rows == [p for _ in range(4) for _, p in stream.next_batch()]
    assert len(rows) == 12 and rows[:10] != examples  # shuffled, then the next epoch


def test_reward_wrapper_feeds_the_rows_own_columns_in_trl_shape(bench):
    class Row:
        def __init__(self, question, metadata):
            self.example = {"prompt": question, "question": question, "answer": "3",
                            "metadata": metadata, "task": "t"}

    rows = [Row("1+2", {"depth": (1, 2)}), Row("2+2", {})]
    seen, questions = {}, []

    def infsamp_reward(prompts, completions, completion_ids=None, **columns):
        seen.update(columns, prompts=prompts)
        return [1.0 if "3" in c[0]["content"] else 0.0 for c in completions]

    reward = bench.trl_reward("reasoning_gym", infsamp_reward, rows, questions)
    completions = [[{"role": "assistant", "content": t}] for t in ("3", "4", "5", "3")]
    assert reward.__name__ == "reasoning_gym"
    assert reward(prompts=["p"] * 4, completions=completions, row=[0, 0, 1, 1],
                  completion_ids=[[1]] * 4, trainer_state=None) == [1.0, 0.0, 0.0, 1.0]
    assert seen["metadata"] == [{"depth": (1, 2)}] * 2 + [{}] * 2  # not through Arrow or JSON
    assert seen["question"] == ["1+2", "1+2", "2+2", "2+2"] and "prompt" not in seen
    assert questions == [["1+2", "2+2"]]


def test_noise_statistics(bench):
    low, high = bench.wilson_interval(30, 200)
    assert 0.107 < low < 0.108 and 0.206 < high < 0.207
    assert bench.wilson_interval(0, 6)[0] == 0.0
    issue = bench.mcnemar([0] * 25 + [1] * 7 + [0] * 10, [1] * 25 + [0] * 7 + [0] * 10)
    assert (issue["gained"], issue["lost"]) == (25, 7) and issue["p_value"] == 0.0021
    assert bench.mcnemar([1, 0], [1, 0]) == {"gained": 0, "lost": 0, "p_value": 1.0}


def fake_result(solved_after, peak=100 * 2**20):
    evaluation = lambda solved: {"solved": solved, "eval/reward": sum(solved) / len(solved),  # noqa: E731
                                 "mean_length": 12.0, "seconds": 1.0, "cpu_seconds": 1.0}
    return {"eval_before": evaluation([0, 0, 1, 0]), "eval_after": evaluation(solved_after),
            "peak_bytes": peak, "generation_peak_bytes": peak // 4,
            "step_seconds": [3.0, 1.0, 2.0], "step_cpu_seconds": [1.0, 1.0, 1.0],
            "load_before_after": [1.0, 2.0], "worker_wall_s": 9.0, "initial_checksum": 5.0,
            "questions": [["a"]], "steps": [{"reward": 0.5, "frac_reward_zero_std": 0.25,
                                             "completions/mean_length": 12.0}]}


def test_report_pairs_the_sides_on_the_same_problems(bench, tmp_path):
    results = {"infsamp": fake_result([1, 1, 1, 0]), "trl": fake_result([0, 1, 1, 1])}
    report = bench.compare(results)
    assert [r["accuracy"] for r in report["accuracy"]] == [0.25, 0.75, 0.75]
    tests = report["paired_tests"]
    assert tests["infsamp: before -> after"] == {"gained": 2, "lost": 0, "p_value": 0.5}
    assert tests["trl after -> infsamp after"]["gained"] == 1
    args = bench.parse_args(["--out", str(tmp_path)])
    full = bench.build_report(args, bench.recipe_config(args), results)
    assert full["same_start"] and full["same_prompt_order"]
    assert full["timing"][0]["seconds_per_step"] == 2.0
    text = bench.markdown(full)
    assert "| infsamp after | 0.750 |" in text and "| trl | 100 | 25 | 2.0 | 1.0 | 1.0 -> 2.0 |" \
        in text and "| 1 | 0.50 / 0.25 / 12.00 | 0.50 / 0.25 / 12.00 |" in text
    json.dumps(full)


@pytest.mark.slow
def test_trl_takes_every_mapped_keyword(bench, tmp_path):
    cfg = recipe(bench, tmp_path)
    config = bench.grpo_config(cfg, 0, tmp_path / "trl")
    assert config.generation_batch_size == 32 and config.num_generations == 8
    assert config.loss_type == "dapo" and config.adam_beta2 == 0.99
