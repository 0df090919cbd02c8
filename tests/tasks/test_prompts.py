"""render_prompt / encode_prompt (chat template or plain text, one BOS) and encode_examples."""

import pytest

from infsamp.config import DataConfig
from infsamp.errors import DataError
from infsamp.tasks.prompts import (
    build_prompt,
    completion_for_rewards,
    encode_examples,
    encode_prompt,
    prompt_for_rewards,
    render_prompt,
    uses_chat_template,
)

EXAMPLE = {"prompt": "What is 2+2?", "answer": "4"}


def test_plain_text_prompt_with_and_without_system_prompt(make_tokenizer):
    tokenizer = make_tokenizer(chat=False)
    assert render_prompt(EXAMPLE, tokenizer, DataConfig()) == "What is 2+2?"
    with_system = DataConfig(system_prompt="Be brief.")
    assert render_prompt(EXAMPLE, tokenizer, with_system) == "Be brief.\nWhat is 2+2?"
    assert prompt_for_rewards(EXAMPLE, tokenizer, DataConfig()) == "What is 2+2?"
    assert completion_for_rewards("4", chat=False) == "4"


def test_chat_template_auto_always_never(make_tokenizer):
    with_template, without = make_tokenizer(chat=True), make_tokenizer(chat=False)
    cfg = DataConfig(system_prompt="Be brief.")
    assert uses_chat_template(with_template, cfg) and not uses_chat_template(without, cfg)
    assert not uses_chat_template(with_template, DataConfig(use_chat_template="never"))
    expected = "<|system|>Be brief.\n<|user|>What is 2+2?\n<|assistant|>"
    assert render_prompt(EXAMPLE, with_template, cfg) == expected
    assert prompt_for_rewards(EXAMPLE, with_template, cfg) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert completion_for_rewards("4", chat=True) == [{"role": "assistant", "content": "4"}]
    with pytest.raises(DataError, match="'always' but the tokenizer has no chat template"):
        render_prompt(EXAMPLE, without, DataConfig(use_chat_template="always"))


def test_conversational_dataset_prompt_keeps_its_own_system_message():
    messages = [{"role": "system", "content": "Own."}, {"role": "user", "content": "Hi"}]
    example = {"prompt": messages, "answer": ""}
    assert build_prompt(example, DataConfig(system_prompt="Other."), chat=True) == example["prompt"]
    assert build_prompt(example, DataConfig(), chat=False) == "Own.\nHi"


# ---------------------------------------------------------------- token ids (real-model tokenizers)


@pytest.fixture(scope="module")
def llama3():
    from chat_models import llama3_tokenizer

    return llama3_tokenizer()


@pytest.fixture(scope="module")
def qwen3():
    from chat_models import qwen3_tokenizer

    return qwen3_tokenizer()


def test_chat_prompt_ids_are_the_templates_with_exactly_one_bos(llama3):
    cfg = DataConfig(system_prompt="Be brief.")
    text, ids = encode_prompt(EXAMPLE, llama3, cfg)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2+2?"}]
    assert ids == llama3.apply_chat_template(messages, add_generation_prompt=True,
                                             return_dict=False)
    assert ids.count(llama3.bos_token_id) == 1 and ids[0] == llama3.bos_token_id
    assert llama3(text).input_ids[:2] == [llama3.bos_token_id] * 2  # what evaluation used to get


def test_plain_prompt_ids_get_the_tokenizers_bos_once(llama3):
    cfg = DataConfig(use_chat_template="never", system_prompt="Be brief.")
    text, ids = encode_prompt(EXAMPLE, llama3, cfg)
    assert text == "Be brief.\nWhat is 2+2?"
    assert ids[0] == llama3.bos_token_id and ids.count(ids[0]) == 1
    already = {"prompt": "<|begin_of_text|>What is 2+2?"}  # a prompt that writes BOS itself
    _, ids = encode_prompt(already, llama3, DataConfig(use_chat_template="never"))
    assert ids.count(llama3.bos_token_id) == 1


def test_chat_template_kwargs_reach_the_template(qwen3):
    off = DataConfig(chat_template_kwargs={"enable_thinking": False})
    empty_think = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert render_prompt(EXAMPLE, qwen3, off).endswith(empty_think)
    assert render_prompt(EXAMPLE, qwen3, DataConfig()).endswith("<|im_start|>assistant\n")


def test_over_long_prompts_are_skipped_and_counted_never_cut(llama3):
    examples = [{"prompt": "short"}, {"prompt": "long " * 40}, {"prompt": "tiny"}]
    cfg = DataConfig(max_prompt_length=40)
    split = encode_examples(examples, llama3, cfg, "training prompts")
    assert [p.index for p in split.prompts] == [0, 2] and split.num_dropped == 1
    assert all(p.token_ids == encode_prompt(p.example, llama3, cfg)[1] for p in split.prompts)
    assert split.note("training", 40) == (
        "training: skipped 1 of 3 prompts longer than data.max_prompt_length=40 tokens "
        f"(longest {split.longest_dropped})")
    with pytest.raises(DataError, match="training prompts: all 1 prompts are longer than data.max"):
        encode_examples(examples[1:2], llama3, cfg, "training prompts")


def test_a_failing_chat_template_is_one_line():
    from chat_models import qwen3_tokenizer

    broken = qwen3_tokenizer()
    broken.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(DataError) as info:
        render_prompt(EXAMPLE, broken, DataConfig())
    assert "chat template failed" in str(info.value) and "\n" not in str(info.value)
