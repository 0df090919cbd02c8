"""reasoning-gym tasks: rows from disjoint seeds (checked against reasoning-gym itself), repeated
questions kept out of training, one line for a bad task or option; the answer extractors and the
reasoning_gym reward; data.answer_instruction in the prompt."""

import pytest
import reasoning_gym

from infsamp.config_io import load_config
from infsamp.errors import DataError
from infsamp.options import ConfigError
from infsamp.rewards.builtin import reasoning_gym_reward
from infsamp.rewards.compute import compute_rewards
from infsamp.rewards.loading import load_reward_functions
from infsamp.tasks.answers import ANSWER_EXTRACTORS
from infsamp.tasks.loading import load_examples, load_splits
from infsamp.tasks.prompts import build_prompt
from infsamp.tasks.sources import check_dataset_source

TASK = "reasoning_gym:basic_arithmetic"


def data(**overrides):
    base = {"data.dataset": TASK, "data.num_train_examples": 30, "data.num_eval_examples": 12,
            "data.seed": 40}
    return load_config(overrides={**base, **overrides}).data


def test_held_out_seeds_come_first_and_training_seeds_follow(monkeypatch):
    cfg = data(**{"data.dataset_config": "{min_terms: 2, max_terms: 3}"})
    held_out, train = load_examples(cfg, "test"), load_examples(cfg, "train")
    options = {"min_terms": 2, "max_terms": 3, "size": 1}
    for seed, row in [*zip(range(40, 52), held_out), *zip(range(52, 82), train)]:
        assert row["question"] == reasoning_gym.create_dataset(
            "basic_arithmetic", seed=seed, **options)[0]["question"]  # item 0 of seed s+i
    assert len(held_out) == 12 and len(train) == 30  # no repeats at this difficulty
    naive = reasoning_gym.create_dataset("basic_arithmetic", seed=41, size=30, min_terms=2,
                                         max_terms=3)
    assert len({r["question"] for r in held_out} & {r["question"] for r in naive}) >= 11


def test_a_small_task_space_keeps_held_out_questions_out_of_training():
    cfg = data(**{"data.dataset_config": {"min_terms": 2, "max_terms": 2, "max_digits": 1,
                                          "operators": ["+"]},
                  "data.num_train_examples": 300, "data.num_eval_examples": 40})
    splits = load_splits(cfg, 40)
    asked = {row["question"] for row in splits.eval}
    assert len(splits.eval) == 40 and not asked & {row["question"] for row in splits.train}
    assert 0 < 300 - len(splits.train) and "dropped: their question is held out" in \
        splits.eval_note
    assert "seeds 40..79; training:" in splits.eval_note


@pytest.mark.parametrize("overrides, message", [
    ({"data.dataset": "reasoning_gym:basic_arithmetc"},
     "'basic_arithmetc' is not a reasoning-gym task \\(did you mean basic_arithmetic"),
    ({"data.dataset_config": "{min_term: 2}"},
     "'min_term' is not an option of reasoning-gym task basic_arithmetic \\(its options: "
     "min_terms"),
    ({"data.dataset_config": "{min_terms: 5, max_terms: 2}"},
     "rejects \\{'min_terms': 5, 'max_terms': 2\\} \\(max_terms must be >= min_terms\\)$"),
])
def test_an_unknown_task_or_option_is_one_line_before_loading(overrides, message):
    with pytest.raises(DataError, match=message):
        check_dataset_source(data(**overrides))


def test_options_must_be_a_mapping_and_splits_are_the_two_configured():
    with pytest.raises(ConfigError, match="data.dataset_config: reasoning_gym tasks take a "
                                          "mapping"):
        data(**{"data.dataset_config": "main"})
    with pytest.raises(ConfigError, match="a mapping is for reasoning_gym:NAME tasks"):
        load_config(overrides={"data.dataset": "org/set", "data.dataset_config": "{a: 1}"})
    with pytest.raises(DataError, match="has two splits, 'train' .* not 'validation'"):
        load_examples(data(), "validation")


@pytest.mark.parametrize("name, text, expected", [
    ("answer_tag", "so <answer> 12 </answer> or <answer>-4</answer>", "-4"),
    ("answer_tag", "no tags, 12", None),
    ("boxed", "x \\boxed{\\frac{1}{2}} then \\boxed{\\frac{3}{4}}.", "\\frac{3}{4}"),
    ("boxed", "\\boxed{12", None),
    ("last_number", "23 + 45 = 68, so 1,068.", "1068"),
    ("last_number", "-3.5 and then -7", "-7"),
    ("last_number", "none", None),
    ("last_line", "work\n 68 \n\n", "68"),
    ("whole", "  68 ", "68"),
])
def test_answer_extractors(name, text, expected):
    assert ANSWER_EXTRACTORS[name](text) == expected


def test_the_builtin_rewards_score_alike_in_worker_processes():
    """rewards.timeout_s sends the built-ins (partials among them) and the rows' metadata to
    worker processes as JSON: the scores are those of the trainer's process."""
    rows = load_examples(data(), "test")[:3]
    columns = {key: [row[key] for row in rows] for key in ("answer", "question", "metadata",
                                                           "task")}
    funcs = load_reward_functions(["reasoning_gym", "math_verify", "format"],
                                  answer_extraction="last_number", format_think_block="allow")
    completions = [f"I think {row['answer']}" for row in rows]
    scored = [compute_rewards(funcs, None, ["p"] * 3, completions, columns,
                              timeout_s=timeout_s).per_function for timeout_s in (0.0, 60.0)]
    assert scored[0] == scored[1]
    assert scored[0]["reasoning_gym"] == scored[0]["math_verify"] == [1.0, 1.0, 1.0]


def test_the_reward_scores_with_the_tasks_own_score_answer():
    rows = load_examples(data(), "test")[:3]
    columns = {key: [row[key] for row in rows] for key in ("answer", "question", "metadata",
                                                           "task")}
    right = [f"It is <answer>{row['answer']}</answer>" for row in rows]
    assert reasoning_gym_reward(right, **columns) == [1.0, 1.0, 1.0]
    assert reasoning_gym_reward(["no answer"] * 3, **columns) == [0.0, 0.0, 0.0]
    [(name, func)] = load_reward_functions(["reasoning_gym"], answer_extraction="last_number")
    numbers = [f"I think {row['answer']}" for row in rows]
    assert name == "reasoning_gym" and func(numbers, **columns) == [1.0, 1.0, 1.0]
    entry = {"question": rows[0]["question"], "answer": rows[0]["answer"],
             "metadata": rows[0]["metadata"]}
    dataset = reasoning_gym.create_dataset("basic_arithmetic")
    wrong = rows[0]["answer"] + "0"
    assert func([wrong], **{k: v[:1] for k, v in columns.items()}) == \
        [dataset.score_answer(wrong, entry)]


def test_the_reward_refuses_rows_of_another_dataset():
    from infsamp.errors import RewardError

    with pytest.raises(RewardError, match="scores rows of a reasoning_gym:NAME dataset"):
        reasoning_gym_reward(["4"], answer=["4"])


def test_the_answer_instruction_follows_the_question():
    cfg = data(**{"data.answer_instruction": "Answer with <answer>N</answer>."})
    example = {"prompt": "Calculate 2 + 2.\n"}
    assert build_prompt(example, cfg, chat=False) == \
        "Calculate 2 + 2.\n\nAnswer with <answer>N</answer>."
    chat = build_prompt({"prompt": [{"role": "user", "content": "2+2?"},
                                    {"role": "assistant", "content": "ok"}]}, cfg, chat=True)
    assert chat[0]["content"] == "2+2?\n\nAnswer with <answer>N</answer>."
    assert chat[1]["content"] == "ok"


def test_a_slow_generation_says_how_far_it_got(monkeypatch, capsys):
    """A task that generates slowly (huge operands: `min_digits: 500` took minutes) prints its
    progress on stderr instead of being silent."""
    import time

    from infsamp.tasks import reasoning_gym as rg

    def slow(num):
        for index in range(num):
            time.sleep(0.02)
            yield {"question": f"q{index}", "answer": "1", "metadata": {}}

    monkeypatch.setattr(rg, "PROGRESS_EVERY_S", 0.05)
    assert len(list(rg._with_progress(slow(10), "basic_arithmetic", 10))) == 10
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith("generating reasoning_gym:basic_arithmetic: ")
                         for line in lines)
    assert "of 10 problems" in lines[-1] and "s left)" in lines[-1]
    monkeypatch.setattr(rg, "PROGRESS_EVERY_S", 60.0)  # a fast generation prints nothing
    list(rg._with_progress(slow(3), "basic_arithmetic", 3))
    assert capsys.readouterr().err == ""
