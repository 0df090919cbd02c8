"""Tool calls in the model's text: how tools are offered, how a call is read back, and the exact
token ids of a tool's answer, through the model's chat template.

A chat template that renders tools itself (`supports_tools`: a conversation user -> assistant
with `tool_calls` -> tool, rendered with `tools=[...]`, shows the call's name, its argument and
the tool's answer, as TRL checks) is used as it is: the prompt is rendered with
`apply_chat_template(..., tools=schemas)` and a tool's answer as its `tool` message. A template
without that support (SmolLM2's ChatML, most small models), or plain-text mode, gets the fallback
format (docs/usage.md, "Formats"): the tools' schemas at the end of the system prompt
(`fallback_instructions`), the answers as `<tool_response>` blocks in a user turn.

Either way a turn ends at the model's stop token; its calls are the `<tool_call>` blocks of the
turn (without any, JSON objects with "name" and "arguments" or "parameters", as Llama 3.1
writes them). The answer's tokens are the difference of two renderings (`answer_text`):
the conversation with a stand-in assistant turn, cut after its last stop token, and the same
with the tool messages and the next generation prompt. The model's own turn, its stop token
included, is what it sampled; everything after that stop token up to the next assistant turn's
first token is the answer.

Deliberately simple: a tool's result is text (TRL renders `str(result)`); images are not passed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from infsamp.config import DataConfig
from infsamp.errors import DataError

CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPEN_CALL = "<tool_call>"
_SENTINELS = ("tool_name_a8f3e2b1", "tool_arg_b9d4f5c2", "tool_content_c4f9a8e2")


@dataclass
class ToolCall:
    """One call read from a turn: its name and arguments, or why it cannot be run."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""  # not empty: the call is malformed (the model gets this as a tool error)


def supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders tools, tool calls and tool messages."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    name, arg, content = _SENTINELS
    schema = {"type": "function", "function": {"name": name, "description": "d", "parameters": {
        "type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}}}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "",
                 "tool_calls": [_call_message(name, {arg: "v"})]},
                {"role": "tool", "name": name, "content": content}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[schema], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses tool messages
        return False
    return all(s in text for s in _SENTINELS)


def fallback_instructions(schemas: list[dict[str, Any]]) -> str:
    """What the fallback format adds to the system prompt: the tools and how to call them."""
    tools = "\n".join(json.dumps(s, sort_keys=True) for s in schemas)
    return ("You may call these tools (JSON schemas):\n" + tools + "\nTo call one, write "
            '<tool_call>{"name": "<tool name>", "arguments": {<its arguments>}}</tool_call> and '
            "end your turn; each answer comes back in <tool_response></tool_response>.")


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The calls of one turn's text: its `<tool_call>` blocks, else bare JSON calls."""
    blocks = CALL_BLOCK.findall(text)
    if blocks:
        return [_read_call(block) for block in blocks]
    if OPEN_CALL in text:  # opened and never closed: the model meant a call
        return [ToolCall("", error="the tool call has no closing </tool_call>")]
    return [_read_call(json.dumps(found)) for found in _json_objects(text) if _is_call(found)]


def _read_call(block: str) -> ToolCall:
    try:
        found = json.loads(block)
    except json.JSONDecodeError as err:
        return ToolCall("", error=f"the tool call is not valid JSON ({err.msg})")
    if not _is_call(found) or not isinstance(found["name"], str):
        return ToolCall("", error='a tool call is {"name": ..., "arguments": {...}}')
    arguments = found.get("arguments", found.get("parameters", {}))
    if isinstance(arguments, str):  # some templates write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(found["name"], error="the tool call's arguments are not an object")
    return ToolCall(found["name"], arguments)


def _is_call(found: Any) -> bool:
    return isinstance(found, dict) and "name" in found and (
        "arguments" in found or "parameters" in found)


def _json_objects(text: str) -> list[Any]:
    decoder, found, start = json.JSONDecoder(), [], text.find("{")
    while start >= 0:
        try:
            value, end = decoder.raw_decode(text, start)
            found.append(value)
            start = text.find("{", end)
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
    return found


def _call_message(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def call_text(calls: list[ToolCall]) -> str:
    """The fallback format's text of these calls (a stand-in assistant turn)."""
    return "".join(f"<tool_call>{json.dumps({'name': c.name, 'arguments': c.arguments})}"
                   "</tool_call>" for c in calls)


def response_block(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def example_messages(turns: list[dict[str, Any]], native: bool) -> list[dict[str, Any]]:
    """`data.example_turns` as the template's messages. Native: an assistant turn's
    `<tool_call>` blocks become its `tool_calls`, a tool turn a `tool` message named after its
    call. Fallback: the turns as written, each run of tool turns one user turn of
    `<tool_response>` blocks (as a tool's answer comes back)."""
    return _native_examples(turns) if native else _fallback_examples(turns)


def _fallback_examples(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for index, turn in enumerate(turns):
        if turn["role"] != "tool":
            messages.append({"role": turn["role"], "content": turn["content"]})
        elif turns[index - 1]["role"] == "tool":  # the same answer: one more block
            messages[-1]["content"] += "\n" + response_block(turn["content"])
        else:
            messages.append({"role": "user", "content": response_block(turn["content"])})
    return messages


def _native_examples(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    calls: list[ToolCall] = []
    for turn in turns:
        role, content = turn["role"], turn["content"]
        if role == "tool":
            name = calls.pop(0).name if calls else ""
            messages.append({"role": "tool", "name": name, "content": content})
            continue
        calls = [c for c in parse_tool_calls(content) if not c.error] if role == "assistant" \
            else []
        message = {"role": role, "content": CALL_BLOCK.sub("", content).strip() if calls
                   else content}
        if calls:
            message["tool_calls"] = [_call_message(c.name, c.arguments) for c in calls]
        messages.append(message)
    return messages


def answer_text(tokenizer: Any, data_cfg: DataConfig, chat: bool, native: bool,
                calls: list[ToolCall], contents: list[str], stop_texts: list[str]) -> str:
    """The text between the model's stop token and the next assistant turn's first token: the
    tool messages of `calls` (answered with `contents`) as the template renders them."""
    if not chat:
        return "\n" + "\n".join(response_block(c) for c in contents) + "\n"
    if native:
        turn = {"role": "assistant", "content": "",
                "tool_calls": [_call_message(c.name, c.arguments) for c in calls]}
        answers = [{"role": "tool", "name": c.name, "content": text}
                   for c, text in zip(calls, contents)]
    else:
        turn = {"role": "assistant", "content": call_text(calls)}
        answers = [{"role": "user", "content": "\n".join(response_block(c) for c in contents)}]
    before = [{"role": "user", "content": "dummy"}, turn]
    kwargs = data_cfg.chat_template_kwargs
    prefix = _render(tokenizer, before, False, kwargs)
    full = _render(tokenizer, before + answers, True, kwargs)
    cut = max((prefix.rfind(s) + len(s) for s in stop_texts if s and s in prefix), default=-1)
    prefix = prefix[:cut] if cut >= 0 else prefix
    if not full.startswith(prefix):
        raise DataError("the chat template renders a conversation differently once a tool "
                        "message follows it (not prefix-preserving); tools cannot be used with it")
    return full[len(prefix):]


def _render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool,
            kwargs: dict[str, Any]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation_prompt, **kwargs)
    except Exception as err:  # noqa: BLE001 - a model's template: one line
        why = f"{type(err).__name__}: {err}".splitlines()[0]
        raise DataError(f"the chat template cannot render a tool message ({why})") from None


def answer_token_ids(tokenizer: Any, text: str) -> list[int]:
    """The answer's token ids (the template writes its special tokens as text)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
