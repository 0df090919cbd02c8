"""A local sequence-classification model as a reward: loading by directory, the texts it scores,
batched scores equal one-by-one scores, and one-line errors for a directory that does not load."""

import pytest
import torch
from transformers import AutoTokenizer, LlamaForSequenceClassification

from infsamp.errors import RewardError
from infsamp.rewards.compute import compute_rewards
from infsamp.rewards.loading import load_reward_functions
from infsamp.rewards.reward_model import RewardModel

from reward_models import save_reward_model

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    return save_reward_model(tmp_path_factory.mktemp("my_reward_model"))


def one_by_one(path, texts):
    model = LlamaForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
        return [model(torch.tensor([i])).logits[0, 0].item() for i in ids]


def test_directory_loads_as_a_reward_named_after_it(reward_model_dir):
    ((name, scorer),) = load_reward_functions([str(reward_model_dir)])
    assert name == reward_model_dir.name and isinstance(scorer, RewardModel)
    assert not any(p.requires_grad for p in scorer.model.parameters())


@pytest.mark.parametrize("max_tokens", [16, 100_000])  # many small batches / one padded batch
def test_batched_scores_equal_one_by_one_scores_of_prompt_plus_completion(reward_model_dir,
                                                                          max_tokens):
    ((_, scorer),) = load_reward_functions([str(reward_model_dir)], max_tokens=max_tokens)
    prompts, completions = ["2+3=", "10+20=", "7+1="], ["5", "30 and some more text", ""]
    scores = scorer(prompts=prompts, completions=completions)
    expected = one_by_one(reward_model_dir, [p + c for p, c in zip(prompts, completions)])
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(scores)) == 3


def test_chat_template_of_the_reward_tokenizer_is_used(tmp_path):
    path = save_reward_model(tmp_path / "chat_rm", CHAT_TEMPLATE)
    ((_, scorer),) = load_reward_functions([str(path)])
    assert scorer.text("2+3=", "5") == "<user>2+3=<assistant>5"
    conversation = [{"role": "system", "content": "add"}, {"role": "user", "content": "2+3="}]
    answer = [{"role": "assistant", "content": "5"}]
    assert scorer.text(conversation, answer) == "<system>add<user>2+3=<assistant>5"
    scores = scorer(prompts=["2+3="], completions=["5"])
    assert scores == pytest.approx(one_by_one(path, ["<user>2+3=<assistant>5"]), abs=1e-5)


def test_reward_model_goes_through_compute_rewards_with_functions(reward_model_dir):
    funcs = load_reward_functions(["format", str(reward_model_dir)])
    result = compute_rewards(funcs, [1.0, 0.5], ["1+1="], ["2"], {"answer": ["2"]})
    assert result.total == pytest.approx([0.5 * result.per_function[reward_model_dir.name][0]])


@pytest.mark.parametrize("files, fragment", [
    ({}, "a directory without config.json is not a reward model"),
    ({"config.json": "{not json"}, "cannot load a sequence-classification reward model"),
])
def test_directory_that_does_not_load_is_one_line_naming_the_option(tmp_path, files, fragment):
    (tmp_path / "not_a_model").mkdir()
    for name, text in files.items():
        (tmp_path / "not_a_model" / name).write_text(text)
    with pytest.raises(RewardError) as info:
        load_reward_functions([str(tmp_path / "not_a_model")])
    message = str(info.value)
    assert message.startswith(f"rewards.functions '{tmp_path / 'not_a_model'}': {fragment}")
    assert "\n" not in message
