"""The GSM8K recipe: seed helpers, examples/gsm8k.yaml, and loading + rewards on GSM8K-format
rows."""

from pathlib import Path

import pytest

from infsamp.config_io import load_config
from infsamp.options import ConfigError
from infsamp.rewards.compute import compute_rewards
from infsamp.rewards.loading import load_reward_functions
from infsamp.tasks.gsm8k import (
    SYSTEM_PROMPT,
    extract_hash_answer,
    extract_xml_answer,
    has_xml_format,
)
from infsamp.tasks.loading import load_examples
from infsamp.tasks.prompts import completion_for_rewards, prompt_for_rewards, render_prompt

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "gsm8k.yaml"
SAMPLE = ROOT / "tests" / "data" / "gsm8k_sample.jsonl"
SAMPLE_ANSWERS = ["7", "168", "1275", "32", "800"]


def answer_in_format(answer, reasoning="Let me think.\nStep two."):
    return f"<reasoning>\n{reasoning}\n</reasoning>\n<answer>\n{answer}\n</answer>\n"


def test_seed_helpers():
    assert SYSTEM_PROMPT == ("Respond in the following format:\n"
                             "<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>\n")
    assert extract_hash_answer("work\n#### 72") == "72"
    assert extract_hash_answer("no marker") is None
    assert extract_xml_answer("<reasoning>\nr\n</reasoning>\n<answer>\n 18 \n</answer>\n") == "18"
    assert extract_xml_answer("<answer>1</answer> then <answer>2</answer>") == "2"
    assert extract_xml_answer("  42 ") == "42"  # like the seed: no tags -> the whole text
    assert has_xml_format(answer_in_format("5")) and not has_xml_format("<answer>\n5\n</answer>\n")


def test_recipe_matches_the_seed():
    cfg = load_config(RECIPE)
    assert cfg.model.name_or_path == "meta-llama/Llama-3.2-1B-Instruct"
    # the seed's bf16=True (plain AdamW on bf16 weights) is training.precision auto: bf16 with
    # stochastically rounded updates on a GPU, fp32 on a CPU
    assert cfg.model.dtype == "auto" and cfg.training.precision == "auto"
    assert (cfg.data.dataset, cfg.data.dataset_config,
            cfg.data.answer_parser) == ("openai/gsm8k", "main", "gsm8k")
    assert cfg.data.prompt_column == "question" and cfg.data.system_prompt == SYSTEM_PROMPT
    assert cfg.data.max_prompt_length == 256
    assert cfg.rewards.functions == ["format", "accuracy"]
    assert cfg.sampling.num_generations == 4 and cfg.sampling.max_new_tokens == 786
    t = cfg.training
    assert (t.learning_rate, t.adam_beta2, t.weight_decay, t.warmup_ratio, t.lr_scheduler,
            t.max_grad_norm) == (
        5e-6, 0.99, 0.1, 0.1, "cosine", 0.1)


def test_recipe_rejects_a_missing_local_file():
    with pytest.raises(ConfigError, match="data.dataset: path does not exist"):
        load_config(RECIPE, overrides={"data.dataset": "/no/such/gsm8k.jsonl"})


def recipe_on_sample():
    return load_config(RECIPE, overrides={"data.dataset": str(SAMPLE)})


def test_sample_rows_load_with_recipe_settings():
    examples = load_examples(recipe_on_sample().data, "train")
    assert [e["answer"] for e in examples] == SAMPLE_ANSWERS
    assert examples[0]["prompt"].startswith("A baker makes 12 muffins")
    # other columns stay for reward functions
    assert examples[0]["question"] == examples[0]["prompt"]


@pytest.mark.parametrize("chat", [True, False])
def test_recipe_loading_and_rewards_end_to_end(make_tokenizer, chat):
    cfg = recipe_on_sample()
    tokenizer = make_tokenizer(chat=chat)
    examples = load_examples(cfg.data, "test")
    rendered = render_prompt(examples[2], tokenizer, cfg.data)
    assert SYSTEM_PROMPT in rendered and examples[2]["prompt"] in rendered
    assert rendered.endswith("<|assistant|>") == chat

    texts = [answer_in_format("7"),                # right answer, right format: 2.5
             answer_in_format("1,275"),            # right after normalisation: 2.5
             "<answer>32</answer>",                # right answer, wrong format: 2.0
             answer_in_format("799"),              # wrong answer, right format: 0.5
             "I don't know"]                       # neither: 0.0
    prompts = [prompt_for_rewards(e, tokenizer, cfg.data) for e in examples]
    completions = [completion_for_rewards(t, chat) for t in texts]
    columns = {key: [e[key] for e in examples] for key in examples[0] if key != "prompt"}
    examples_for = [0, 2, 3, 4, 1]  # completion i answers example examples_for[i]
    prompts = [prompts[i] for i in examples_for]
    columns = {key: [values[i] for i in examples_for] for key, values in columns.items()}
    funcs = load_reward_functions(cfg.rewards.functions)
    result = compute_rewards(funcs, cfg.rewards.weights, prompts, completions, columns)
    assert result.total == [2.5, 2.5, 2.0, 0.5, 0.0]
    assert result.metrics()["rewards/format/mean"] == pytest.approx(0.3)
