"""render_prompt / encode_prompt (chat template or plain text, exactly one BOS) and encode_examples."""

import pytest

from infsamp.config import DataConfig
from infsamp.errors import DataError
from infsamp.tasks.prompts import (build_prompt, completion_for_rewards, encode_examples, encode_prompt,
                                   prompt_for_rewards, render_prompt, uses_chat_template)


EXAMPLE = {"prompt": "What is 2+2?", "answer": "4"}


def test_plain_text_prompt_with_and_without_system_prompt(make_tokenizer):
    tokenizer = make_tokenizer(chat=False)
    assert render_prompt(EXAMPLE, tokenizer, DataConfig()) == "What is 2+2?"
    assert render_prompt(EXAMPLE, tokenizer, DataConfig(system_prompt="Be brief.")) == "Be brief.\nWhat is 2+2?"
    assert prompt_for_rewards(EXAMPLE, tokenizer, DataConfig()) == "What is 2+2?"
    assert completion_for_rewards("4", chat=False) == "4"


def test_chat_template_auto_always_never(make_tokenizer):
    with_template, without = make_tokenizer(chat=True), make_tokenizer(chat=False)
    cfg = DataConfig(system_prompt="Be brief.")
    assert uses_chat_template(with_template, cfg) and not uses_chat_template(without, cfg)
    assert not uses_chat_template(with_template, DataConfig(use_chat_template="never"))
    assert render_prompt(EXAMPLE, with_template, cfg) == "<|system|>Be brief.\n<|user|>What is 2+2?\n<|assistant|>"
    assert prompt_for_rewards(EXAMPLE, with_template, cfg) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert completion_for_rewards("4", chat=True) == [{"role": "assistant", "content": "4"}]
    with pytest.raises(DataError, match="'always' but the tokenizer has no chat template"):
        render_prompt(EXAMPLE, without, DataConfig(use_chat_template="always"))


def test_conversational_dataset_prompt_keeps_its_own_system_message():
    example = {"prompt": [{"role": "system", "content": "Own."}, {"role": "user", "content": "Hi"}], "answer": ""}
    assert build_prompt(example, DataConfig(system_prompt="Other."), chat=True) == example["prompt"]
    assert build_prompt(example, DataConfig(), chat=False) == "Own.\nHi"
