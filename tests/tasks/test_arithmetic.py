"""The embedded arithmetic task: deterministic, correct worked and direct solutions, disjoint
splits, long tail."""

import re

from infsamp.models.tiny import build_tokenizer
from infsamp.tasks.arithmetic import generate_problems, make_problem, worked_solution


def test_deterministic_and_disjoint():
    train = generate_problems(300, seed=7, split="train")
    assert train == generate_problems(300, seed=7, split="train")
    test = generate_problems(100, seed=7, split="test")
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in test}


def test_solution_carries_and_answer():
    text = worked_solution([95, 7])
    assert "95+07 c0: 5+7+0=12 -> 2" in text
    assert "9+0 c1: 9+0+1=10 -> 02" in text
    assert "carry 1 -> 102" in text
    assert re.search(r"<answer>\n102\n</answer>\n$", text)


def test_every_solution_ends_with_the_sum():
    for problem in generate_problems(200, seed=3, split="sft"):
        operands = [int(x) for x in problem["prompt"].rstrip("=?\n").split("+")]
        assert problem["answer"] == str(sum(operands))
        assert problem["solution"].endswith(f"<answer>\n{problem['answer']}\n</answer>\n")


def test_lengths_are_heavy_tailed_and_prompt_dependent():
    tokenizer = build_tokenizer()
    problems = generate_problems(2000, seed=1, split="train")
    lengths = sorted(len(tokenizer(p["solution"]).input_ids) for p in problems)
    median, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    assert p99 > 1.4 * median  # measured: median 139, p99 202 tokens
    assert lengths[-1] > 5 * lengths[0]  # measured: 31 .. 230 tokens
    short = make_problem([3, 4])["solution"]
    long = make_problem([12345, 54321])["solution"]
    assert len(long) > 2.5 * len(short)


def test_sft_targets_mix_direct_and_worked_answers():
    from infsamp.rewards.builtin import accuracy_reward, format_reward
    from infsamp.tasks.arithmetic import DIRECT_SHARE, sft_completions

    problems = generate_problems(1000, seed=5, split="sft")
    targets = sft_completions(problems, seed=0)
    assert targets == sft_completions(problems, seed=0)
    direct = [t == p["direct_solution"] for t, p in zip(targets, problems)]
    assert abs(sum(direct) / len(direct) - DIRECT_SHARE) < 0.05
    assert sum(t == p["solution"] for t, p in zip(targets, problems)) == len(problems) - sum(direct)
    # both styles are well formatted and correct, so only the model's errors separate them in GRPO
    answers = [p["answer"] for p in problems]
    assert format_reward(targets) == [0.5] * len(targets)
    assert accuracy_reward(targets, answer=answers) == [2.0] * len(targets)
    assert len(problems[0]["direct_solution"]) < len(problems[0]["solution"])
    assert not any(sft_completions(problems, seed=0, direct_share=0.0)[i]
                   == problems[i]["direct_solution"]
                   for i in range(len(problems)))
