"""Tools as TRL users write them: references and schemas (refused in one line), the template's
format or the fallback, calls read back from a turn, a tool's answer tokens exactly the chat
template's, and every failure (raises, hangs, 10 MB, not text) a tool error, never the end."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from infsamp.config import DataConfig, ToolsConfig
from infsamp.errors import ToolError
from infsamp.options import ConfigError
from infsamp.tasks.prompts import build_prompt, encode_prompt
from infsamp.tasks.tool_format import (
    ToolCall,
    answer_text,
    parse_tool_calls,
    supports_tools,
)
from infsamp.tools.loading import load_tool, load_tools
from infsamp.tools.running import MAX_ANSWER_BYTES, ToolRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chat_models import qwen3_tokenizer  # noqa: E402

FUNCTIONS = str(Path(__file__).with_name("tool_functions.py"))

# SmolLM2-135M-Instruct's template (ChatML, no tool support)
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")
# a Qwen2.5-style template that renders tools, tool calls and tool messages itself
TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}{%- for tool in tools %}"
    "{{- tool | tojson }}{{- '\\n' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant\\n' }}"
    "{%- for c in m.tool_calls %}{{- '<tool_call>\\n{\"name\": \"' + c.function.name + "
    "'\", \"arguments\": ' + (c.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def tokenizer(template: str):
    tok = qwen3_tokenizer()
    tok.chat_template = template
    return tok


# ---------------------------------------------------------------- references and schemas


def test_tools_load_by_reference_with_their_schema():
    (tool,) = load_tools([f"{FUNCTIONS}:add"])
    assert tool.name == "add" and tool.func(2, 3) == 5
    assert tool.schema["function"]["parameters"]["required"] == ["a", "b"]
    assert load_tool(tool.func).schema == tool.schema  # the Python API takes callables


@pytest.mark.parametrize("spec, words", [
    ("no_such_module_xyz:add", "cannot import module"),
    (f"{FUNCTIONS}:nothing", "has no function 'nothing'"),
    ("missing_file.py:add", "does not exist"),
    (f"{FUNCTIONS}:undocumented", "cannot describe it to the model"),
])
def test_a_bad_tool_is_refused_in_one_line(spec, words):
    with pytest.raises(ToolError) as caught:
        load_tools([spec])
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_config_refuses_a_tool_without_a_function_name():
    with pytest.raises(ConfigError, match="tools.functions: give 'module:name'"):
        ToolsConfig(functions=["calculator"]).validate()
    with pytest.raises(ConfigError, match="tools.max_workers"):
        ToolsConfig(max_workers=0).validate()


# ---------------------------------------------------------------- calls in the model's text


def test_calls_are_read_from_tags_or_bare_json():
    calls = parse_tool_calls('think <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'
                             '</tool_call><tool_call>{"name": "add", "arguments": "{\\"a\\": 3}"}'
                             "</tool_call>")
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("add", {"a": 1, "b": 2}, ""), ("add", {"a": 3}, "")]
    (bare,) = parse_tool_calls('{"name": "add", "parameters": {"a": 1}} done')  # Llama 3.1
    assert (bare.name, bare.arguments) == ("add", {"a": 1})
    assert parse_tool_calls("The answer is 4.") == []
    (broken,) = parse_tool_calls("<tool_call>{name: add}</tool_call>")
    assert "not valid JSON" in broken.error
    assert "closing" in parse_tool_calls('<tool_call>{"name": "add"')[0].error


def test_template_tool_support_is_detected():
    assert supports_tools(tokenizer(TOOL_TEMPLATE))
    assert not supports_tools(tokenizer(SMOLLM2_TEMPLATE))  # SmolLM2 swallows tool calls


# ---------------------------------------------------------------- answers, as the template renders


@pytest.mark.parametrize("template", [TOOL_TEMPLATE, SMOLLM2_TEMPLATE])
def test_answer_tokens_are_the_templates_rendering(template):
    """prompt + the model's turn + its stop token + the answer = the template's rendering of the
    whole conversation (with the next generation prompt), token for token."""
    tok = tokenizer(template)
    data = DataConfig()
    native = supports_tools(tok)
    schema = load_tools([f"{FUNCTIONS}:add"])[0].schema
    example = {"prompt": "What is 2 + 3?"}
    _, prompt_ids = encode_prompt(example, tok, data, tools=[schema])
    calls = [ToolCall("add", {"a": 2, "b": 3})]
    turn = ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' if native
            else '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    answer = answer_text(tok, data, True, native, calls, ["5"], ["<|im_end|>"])
    episode = [*prompt_ids, *tok(turn, add_special_tokens=False)["input_ids"], stop,
               *tok(answer, add_special_tokens=False)["input_ids"]]
    if native:
        messages = [{"role": "user", "content": example["prompt"]},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": "add",
                                                          "arguments": {"a": 2, "b": 3}}}]},
                    {"role": "tool", "name": "add", "content": "5"}]
        rendered = tok.apply_chat_template(messages, tools=[schema], tokenize=False,
                                           add_generation_prompt=True)
    else:
        system = tok.decode(prompt_ids).split("<|im_end|>")[0].removeprefix("<|im_start|>system\n")
        assert "<tool_call>" in system and json.dumps(schema, sort_keys=True) in system
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": example["prompt"]},
                    {"role": "assistant", "content": turn},
                    {"role": "user", "content": "<tool_response>\n5\n</tool_response>"}]
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert episode == tok(rendered, add_special_tokens=False)["input_ids"]
    assert answer.endswith("<|im_start|>assistant\n") and "5" in answer


def test_plain_text_answers_are_response_blocks():
    text = answer_text(None, DataConfig(), False, False, [ToolCall("add")], ["5", "7"], [])
    assert text == "\n<tool_response>\n5\n</tool_response>\n<tool_response>\n7\n</tool_response>\n"


# ---------------------------------------------------------------- failures are answers


def run_calls(timeout_s: float, names: list[str]) -> dict[str, object]:
    tools = load_tools([f"{FUNCTIONS}:{name}" for name in sorted(set(names))])
    by_name = {t.name: t for t in tools}
    runner = ToolRunner(tools, timeout_s, max_workers=2)
    try:
        for index, name in enumerate(names):
            runner.submit(index, name, by_name[name].func, {"a": 2, "b": 3} if name == "add"
                          else {"a": 1})
        answers: dict = {}
        deadline = time.monotonic() + 60
        while len(answers) < len(names) and time.monotonic() < deadline:
            answers.update(runner.collect(1.0))
        return {names[i]: a for i, a in answers.items()}
    finally:
        runner.close()


@pytest.mark.parametrize("timeout_s", [0.5, 0.0], ids=["workers", "in-process"])
def test_every_failure_is_a_tool_error(timeout_s):
    names = ["add", "fails", "huge", "not_text"] + (["hangs"] if timeout_s else [])
    answers = run_calls(timeout_s, names)
    assert answers["add"].content == "5" and not answers["add"].failed
    for name in names[1:]:
        assert answers[name].failed, name
        assert json.loads(answers[name].content)["error"], name  # TRL's {"error": ...}
    assert "ZeroDivisionError: division by zero" in answers["fails"].content
    assert f"at most {MAX_ANSWER_BYTES}" in answers["huge"].content
    if timeout_s:
        assert answers["hangs"].timed_out and answers["hangs"].seconds < 30


def test_a_hung_worker_is_replaced_and_the_tool_answers_again():
    tools = load_tools([f"{FUNCTIONS}:hangs", f"{FUNCTIONS}:add"])
    runner = ToolRunner(tools, 0.5, max_workers=1)
    try:
        runner.submit("h", "hangs", tools[0].func, {"a": 1})
        runner.submit("a", "add", tools[1].func, {"a": 1, "b": 1})
        found = {}
        while len(found) < 2:
            found.update(runner.collect(5.0))
        assert found["h"].timed_out and found["a"].content == "2"
        runner.submit("h2", "hangs", tools[0].func, {"a": 1})  # a fresh worker
        (key, answer), = runner.collect(5.0)
        assert key == "h2" and answer.timed_out
    finally:
        runner.close()


# ---------------------------------------------------------------- a worked example as earlier turns

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
EXAMPLE_TURNS = [{"role": "user", "content": "What is 2 + 3?"},
                 {"role": "assistant", "content": CALL},
                 {"role": "tool", "content": "5"},
                 {"role": "assistant", "content": "2 + 3 = 5"}]


def test_example_turns_come_before_the_question_as_the_sampler_renders_a_call():
    """Fallback format: the example's tool turn is exactly the answer the sampler appends after
    a call (answer_text), and the question follows the example's last assistant turn."""
    tok = tokenizer(SMOLLM2_TEMPLATE)
    data = DataConfig(system_prompt="Be exact.", example_turns=EXAMPLE_TURNS)
    schema = load_tools([f"{FUNCTIONS}:add"])[0].schema
    text, _ = encode_prompt({"prompt": "What is 4 + 4?"}, tok, data, tools=[schema])
    answer = answer_text(tok, data, True, False, [ToolCall("add", {"a": 2, "b": 3})], ["5"],
                         ["<|im_end|>"])
    call_turn = f"<|im_start|>assistant\n{CALL}<|im_end|>"
    assert text.startswith("<|im_start|>system\nBe exact.\n\nYou may call these tools")
    after_call = text.split(call_turn)[1]
    assert after_call.startswith(answer)  # the tool's answer, then the example's last turn
    assert after_call[len(answer):] == ("2 + 3 = 5<|im_end|>\n<|im_start|>user\nWhat is 4 + 4?"
                                        "<|im_end|>\n<|im_start|>assistant\n")


def test_example_turns_use_the_templates_own_tool_messages():
    tok = tokenizer(TOOL_TEMPLATE)
    data = DataConfig(example_turns=EXAMPLE_TURNS)
    schema = load_tools([f"{FUNCTIONS}:add"])[0].schema
    text, _ = encode_prompt({"prompt": "What is 4 + 4?"}, tok, data, tools=[schema])
    messages = [{"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "add",
                                                      "arguments": {"a": 2, "b": 3}}}]},
                {"role": "tool", "name": "add", "content": "5"},
                {"role": "assistant", "content": "2 + 3 = 5"},
                {"role": "user", "content": "What is 4 + 4?"}]
    assert text == tok.apply_chat_template(messages, tools=[schema], tokenize=False,
                                           add_generation_prompt=True)


def test_example_turns_in_plain_text_and_two_tool_answers_in_one_turn():
    turns = [*EXAMPLE_TURNS[:3], {"role": "tool", "content": "7"}, EXAMPLE_TURNS[3]]
    data = DataConfig(use_chat_template="never", system_prompt="Be exact.", example_turns=turns)
    text = build_prompt({"prompt": "What is 4 + 4?"}, data, chat=False)
    assert text == (f"Be exact.\nWhat is 2 + 3?\n{CALL}\n<tool_response>\n5\n</tool_response>\n"
                    "<tool_response>\n7\n</tool_response>\n2 + 3 = 5\nWhat is 4 + 4?")


@pytest.mark.parametrize("turns, words", [
    ([{"role": "robot", "content": "hi"}], "data.example_turns[0].role: must be one of"),
    ([{"role": "user", "text": "hi"}], "data.example_turns[0]: a turn is {role"),
    ([{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}],
     "data.example_turns[0].content: must be text"),
    ([{"role": "user", "content": "q"}, {"role": "user", "content": "q"},
      {"role": "tool", "content": "5"}], "data.example_turns[2]: a tool turn answers"),
    (EXAMPLE_TURNS[:3], "ends with an assistant turn"),
])
def test_bad_example_turns_are_one_line(turns, words):
    with pytest.raises(ConfigError) as caught:
        DataConfig(example_turns=turns).validate()
    assert words in str(caught.value) and "\n" not in str(caught.value)
