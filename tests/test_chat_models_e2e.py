"""Issue 15 end to end: the shipped GSM8K recipe on two tiny local chat models (Llama-3, Qwen3).

For each model: `infsamp train examples/gsm8k.yaml` with only paths and sizes overridden runs two
steps and checkpoints; the sampler (training), evaluation and `infsamp sample` see the same prompt
token ids for the same example (exactly one BOS for the Llama-style model, as its own chat template
renders it); the over-long prompt is skipped and counted; generation stops on each stop token.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from infsamp.cli import main
from infsamp.config import ModelConfig
from infsamp.config_algorithm import SamplingConfig
from infsamp.config_io import load_config
from infsamp.models.loading import load_model_and_tokenizer, stop_token_ids
from infsamp.rewards.builtin import format_reward
from infsamp.run import evaluation
from infsamp.run.checkpoint import list_checkpoints
from infsamp.sampling.sampler import GroupSampler
from infsamp.tasks.gsm8k import SYSTEM_PROMPT
from infsamp.tasks.prompts import encode_prompt

from chat_models import stop_tokens_of

pytestmark = pytest.mark.usefixtures("one_thread")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SHORT = [{"question": "Tom has 3 apples and buys 4 more. How many apples?",
          "answer": "3 + 4 = 7\n#### 7"},
         {"question": "A box holds 6 pens. How many pens are in 2 boxes?",
          "answer": "6 * 2 = 12\n#### 12"}]
HELD_OUT = [{"question": "Ann has 5 apples and buys 2 more. How many apples?",
             "answer": "5 + 2 = 7\n#### 7"},
            {"question": "A box holds 4 pens. How many pens are in 3 boxes?",
             "answer": "4 * 3 = 12\n#### 12"}]
LONG = {"question": "How many? " + "Count the apples in the basket carefully. " * 12,
        "answer": "#### 1"}


@pytest.fixture
def gsm8k_folder(tmp_path):
    """A GSM8K-format folder (train.jsonl / test.jsonl, as in the grade-school-math repository): two
    short questions and a long one in each split, the test split's its own (a held-out
    split made of training rows is refused)."""
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    long_held_out = {**LONG, "question": "How many pears? " + LONG["question"]}
    for split, rows in (("train", [*SHORT, LONG]), ("test", [*HELD_OUT, long_held_out])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture
def seen_prompts(monkeypatch):
    """Records the prompt ids every sampler call and every evaluation batch receives."""
    seen = {"sampler": [], "eval": []}
    sample, evaluate = GroupSampler.sample, evaluation.engine_completions
    evaluating = []

    def spy_sample(self, prompt_ids, *args, **kwargs):
        if not evaluating:  # evaluation's own sampler call is recorded as "eval"
            seen["sampler"].extend(tuple(p) for p in prompt_ids)
        return sample(self, prompt_ids, *args, **kwargs)

    def spy_evaluate(sampler, prompt_ids, **kwargs):
        seen["eval"].extend(tuple(p) for p in prompt_ids)
        evaluating.append(True)
        try:
            return evaluate(sampler, prompt_ids, **kwargs)
        finally:
            evaluating.pop()

    monkeypatch.setattr(GroupSampler, "sample", spy_sample)
    monkeypatch.setattr(evaluation, "engine_completions", spy_evaluate)
    return seen


def template_ids(tokenizer, question: str) -> tuple[int, ...]:
    """What the model's own chat template gives (transformers' apply_chat_template)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    return tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False))


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("style", ["llama3", "qwen3"])
def test_shipped_recipe_trains_and_every_consumer_sees_the_same_prompt_ids(
        style, chat_model_dirs, gsm8k_folder, tmp_path, seen_prompts, capsys):
    model_dir, out = chat_model_dirs[style], tmp_path / "run"
    paths = ["--model.name_or_path", str(model_dir), "--data.dataset", str(gsm8k_folder)]
    tiny = ["--training.max_steps", "2", "--sampling.max_new_tokens", "6",
            "--eval.max_new_tokens", "6", "--eval.num_problems", "3", "--logging.output_dir",
            str(out), "--logging.progress_bar", "false", "--logging.plot", "false"]
    assert main(["train", str(EXAMPLES / "gsm8k.yaml"), *paths, *tiny]) == 0
    train_log = capsys.readouterr().out
    assert list_checkpoints(out)[-1].name == "checkpoint-2"
    assert "training: skipped 1 of 3 prompts longer than data.max_prompt_length=256" in train_log
    assert [row["data/dropped_prompts"] for row in jsonl(out / "metrics.jsonl")] == [1, 1]
    assert {row["eval/dropped_prompts"] for row in jsonl(out / "eval.jsonl")} == {1}

    _, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=str(model_dir)))
    expected = {template_ids(tokenizer, row["question"]) for row in SHORT}
    held_out = {template_ids(tokenizer, row["question"]) for row in HELD_OUT}
    assert set(seen_prompts["sampler"]) == expected  # two steps of one prompt: both short ones
    assert set(seen_prompts["eval"]) == held_out
    assert all(len(ids) <= 256 for ids in seen_prompts["sampler"] + seen_prompts["eval"])
    if style == "llama3":
        bos = tokenizer.bos_token_id
        assert all(ids[0] == bos and ids.count(bos) == 1 for ids in expected | held_out)

    seen_prompts["sampler"].clear()
    assert main(["sample", str(EXAMPLES / "gsm8k.yaml"), *paths, "--split", "test", "-G", "2",
                 "--max-new-tokens", "4", "--quiet"]) == 0
    assert set(seen_prompts["sampler"]) == held_out
    assert "skipped 1 of 3 prompts longer than data.max_prompt_length=256" in capsys.readouterr()[0]


def force_token(model, token_id: int) -> dict[str, int]:
    """Every next-token distribution puts all its mass on `token_id`; counts the forward passes."""
    calls = {"n": 0}

    def hook(_module, _inputs, logits):
        calls["n"] += 1
        forced = torch.full_like(logits, -1e4)
        forced[..., token_id] = 1e4
        return forced

    model.get_output_embeddings().register_forward_hook(hook)
    return calls


@pytest.mark.parametrize("style", ["llama3", "qwen3"])
def test_generation_stops_on_each_of_the_models_stop_tokens(style, chat_model_dirs):
    cfg = load_config(EXAMPLES / "gsm8k.yaml", {"model.name_or_path": str(chat_model_dirs[style])})
    names = stop_tokens_of(style)
    for name in [*names, "x"]:  # 'x' is no stop token: the control that runs to the length limit
        model_cfg = ModelConfig(name_or_path=cfg.model.name_or_path, dtype="fp32")
        model, tokenizer = load_model_and_tokenizer(model_cfg)
        token = tokenizer.convert_tokens_to_ids(name)
        _, ids = encode_prompt({"prompt": "What is 2+2?"}, tokenizer, cfg.data)
        calls = force_token(model, token)
        sampling = SamplingConfig(max_new_tokens=5, kv_budget="4096", micro_group=2,
                                  temperature=0.9)
        result = GroupSampler(model, tokenizer, sampling).sample([ids], 2)
        stops = stop_token_ids(model, tokenizer)
        calls["n"] = 0
        completions = evaluation.generate_completions(
            model, [ids], pad_token_id=tokenizer.pad_token_id, stop_token_ids=stops,
            max_new_tokens=5)
        if name == "x":
            assert [c.finish_reason for c in result.completions] == ["length", "length"]
            assert completions == [[token] * 5] and calls["n"] == 5
        else:
            ends = [(c.length, c.finish_reason, c.text) for c in result.completions]
            assert ends == [(1, "eos", "")] * 2
            assert completions == [[]] and calls["n"] == 1  # one forward pass: stopped at once
    assert set(stops) == {tokenizer.convert_tokens_to_ids(n) for n in names}


@pytest.mark.parametrize("recipe, think_block", [("qwen3_gsm8k_think_off.yaml", "forbid"),
                                                 ("qwen3_gsm8k_think_on.yaml", "require")])
def test_qwen3_recipes_switch_thinking_in_the_template_and_the_format_reward(
        recipe, think_block, chat_model_dirs, gsm8k_folder, tmp_path):
    overrides = {"model.name_or_path": str(chat_model_dirs["qwen3"]),
                 "data.dataset": str(gsm8k_folder)}
    cfg = load_config(EXAMPLES / recipe, overrides)
    assert cfg.rewards.format_think_block == think_block
    _, tokenizer = load_model_and_tokenizer(cfg.model)
    text, _ = encode_prompt({"prompt": SHORT[0]["question"]}, tokenizer, cfg.data)
    thinking_off = cfg.data.chat_template_kwargs == {"enable_thinking": False}
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") == thinking_off
    answer = "<reasoning>\nadd\n</reasoning>\n<answer>\n7\n</answer>\n"
    scores = format_reward([answer, f"<think>\nhmm\n</think>\n\n{answer}"],
                           think_block=cfg.rewards.format_think_block)
    assert scores == ([0.5, 0.0] if thinking_off else [0.0, 0.5])
    tiny = ["--training.max_steps", "1", "--sampling.max_new_tokens", "4",
            "--eval.num_problems", "1", "--eval.max_new_tokens", "4",
            "--logging.output_dir", str(tmp_path / "run"), "--logging.progress_bar", "false",
            "--logging.plot", "false"]
    flags = [f"--{key}={value}" for key, value in overrides.items()]
    assert main(["train", str(EXAMPLES / recipe), *flags, *tiny]) == 0
    assert list_checkpoints(tmp_path / "run")[-1].name == "checkpoint-1"
