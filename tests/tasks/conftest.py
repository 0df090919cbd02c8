"""Shared by the task tests: a tiny real tokenizer (no download) with or without a chat template."""

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture
def make_tokenizer():
    """make_tokenizer(chat=True) -> a fast tokenizer whose template renders '<|role|>content'
    lines."""

    def make(chat: bool):
        word_level = models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(word_level))
        tokenizer.chat_template = CHAT_TEMPLATE if chat else None
        return tokenizer

    return make
