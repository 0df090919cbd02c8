"""From an example to the exact token ids the model is fed: the one path for training, evaluation,
`infsamp sample` and the benches.

`encode_prompt(example, tokenizer, data_cfg)` renders the prompt and tokenizes it:
- chat mode (`data.use_chat_template`): system prompt (`data.system_prompt`) + the question as chat
  messages, through the tokenizer's chat template with `add_generation_prompt` and
  `data.chat_template_kwargs` (e.g. `enable_thinking: false` for Qwen3). The rendered text is
  tokenized without the tokenizer's own special tokens: the template writes what the model expects
  (a Llama-3 template writes BOS itself, so a tokenizer that also adds BOS would double it).
- plain-text mode: `system prompt\\nquestion`, tokenized with the tokenizer's special tokens (BOS
  where the model expects one).
Either way a leading BOS appears at most once.

`encode_examples` encodes a split and skips prompts longer than `data.max_prompt_length` tokens (a
prompt is never cut through its template): the count is reported (`data/dropped_prompts`).
`prompt_for_rewards` / `completion_for_rewards` give reward functions TRL's shapes: chat messages in
chat mode, strings otherwise.

Tools (`tools=` schemas) and `data.example_turns` (a worked example between the system prompt
and the question) are rendered in the prompt's tool format (`tasks/tool_format.py`).

Deliberately simple: a prompt is one turn (system + user) unless the dataset stores conversations;
the example turns are the same for every question.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infsamp.config import DataConfig
from infsamp.errors import DataError
from infsamp.tasks.tool_format import example_messages, fallback_instructions, supports_tools

Schemas = list[dict[str, Any]] | None  # tools' JSON schemas (transformers' get_json_schema)


@dataclass(frozen=True)
class EncodedPrompt:
    index: int  # the example's row in its split: the prompt's key in logs and traces
    example: dict[str, Any]
    text: str  # the rendered prompt (what `token_ids` spell)
    token_ids: list[int]


@dataclass
class EncodedSplit:
    prompts: list[EncodedPrompt]
    num_dropped: int  # longer than data.max_prompt_length
    longest_dropped: int = 0  # tokens of the longest dropped prompt

    def note(self, what: str, max_prompt_length: int) -> str:
        """One line for the run log about the dropped prompts ('' when none were)."""
        if not self.num_dropped:
            return ""
        total = len(self.prompts) + self.num_dropped
        return (f"{what}: skipped {self.num_dropped} of {total} prompts longer than "
                f"data.max_prompt_length={max_prompt_length} tokens "
                f"(longest {self.longest_dropped})")


def uses_chat_template(tokenizer: Any, data_cfg: DataConfig) -> bool:
    """'always', or 'auto' with a tokenizer that has a chat template."""
    if data_cfg.use_chat_template == "always":
        return True
    return data_cfg.use_chat_template == "auto" and bool(getattr(tokenizer, "chat_template", None))


def _messages_text(messages: list[dict[str, Any]]) -> str:
    return "\n".join(str(m.get("content") or "") for m in messages)


def _with_instruction(prompt: str | list[dict[str, Any]],
                      instruction: str) -> str | list[dict[str, Any]]:
    """`data.answer_instruction` after the question (a conversation: after its last user turn)."""
    if not instruction:
        return prompt
    if isinstance(prompt, str):
        return f"{prompt.rstrip()}\n\n{instruction}"
    last = max((i for i, m in enumerate(prompt) if m.get("role") == "user"), default=None)
    if last is None:
        return prompt
    turn = dict(prompt[last], content=f"{str(prompt[last]['content']).rstrip()}\n\n{instruction}")
    return [*prompt[:last], turn, *prompt[last + 1:]]


def build_prompt(example: dict[str, Any], data_cfg: DataConfig, chat: bool,
                 native_tools: bool = False) -> str | list[dict[str, str]]:
    """The prompt as rewards see it: chat messages (system, `data.example_turns`, the question)
    when `chat`, else plain text; the question ends with `data.answer_instruction` when one is
    set. The example turns are in the fallback format unless `native_tools` (the template
    renders tool calls itself)."""
    prompt = _with_instruction(example["prompt"], data_cfg.answer_instruction)
    system = data_cfg.system_prompt
    examples = example_messages(data_cfg.example_turns, native_tools and chat)
    if not chat:
        text = prompt if isinstance(prompt, str) else _messages_text(prompt)
        return "\n".join(filter(None, [system, _messages_text(examples), text]))
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if messages[0].get("role") == "system":  # the dataset's own system turn wins
        head, rest = messages[:1], messages[1:]
    else:
        head, rest = ([{"role": "system", "content": system}] if system else []), messages
    return [*head, *examples, *rest]


def with_fallback_tools(prompt: str | list[dict[str, Any]],
                        schemas: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """The fallback format's tool instructions at the end of the system prompt (a new system
    turn if there is none; plain text: before the question)."""
    note = fallback_instructions(schemas)
    if isinstance(prompt, str):
        return f"{note}\n\n{prompt}"
    if prompt and prompt[0].get("role") == "system":
        return [dict(prompt[0], content=f"{prompt[0]['content']}\n\n{note}"), *prompt[1:]]
    return [{"role": "system", "content": note}, *prompt]


def render_prompt(example: dict[str, Any], tokenizer: Any, data_cfg: DataConfig,
                  tools: Schemas = None) -> str:
    """The text of the prompt fed to the model for `example` (its tokens: `encode_prompt`),
    offering `tools` (JSON schemas) when given."""
    chat = uses_chat_template(tokenizer, data_cfg)
    native = bool(tools) and chat and supports_tools(tokenizer)
    prompt = build_prompt(example, data_cfg, chat, native)
    if tools and not native:
        prompt = with_fallback_tools(prompt, tools)
    if not chat:
        return prompt  # type: ignore[return-value]
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("data.use_chat_template: 'always' but the tokenizer has no chat template")
    extra = {"tools": tools} if native else {}
    try:
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                             **extra, **data_cfg.chat_template_kwargs)
    except Exception as err:  # noqa: BLE001 - jinja errors of a model's template: one line
        why = f"{type(err).__name__}: {err}".splitlines()[0]
        raise DataError(f"the tokenizer's chat template failed on {prompt!r:.80} ({why})") from None


def _without_repeated_bos(ids: list[int], bos_token_id: int | None) -> list[int]:
    start = 0
    while bos_token_id is not None and ids[start: start + 2] == [bos_token_id, bos_token_id]:
        start += 1
    return ids[start:]


def encode_prompt(example: dict[str, Any], tokenizer: Any, data_cfg: DataConfig,
                  tools: Schemas = None) -> tuple[str, list[int]]:
    """(rendered text, token ids) of `example`'s prompt, exactly as every consumer feeds it."""
    text = render_prompt(example, tokenizer, data_cfg, tools)
    add_special = not uses_chat_template(tokenizer, data_cfg)
    ids = list(tokenizer(text, add_special_tokens=add_special)["input_ids"])
    return text, _without_repeated_bos(ids, getattr(tokenizer, "bos_token_id", None))


def encode_examples(examples: list[dict[str, Any]], tokenizer: Any, data_cfg: DataConfig,
                    what: str = "prompts", tools: Schemas = None) -> EncodedSplit:
    """Every example's prompt ids; prompts over `data.max_prompt_length` tokens are skipped and
    counted. Raises DataError when none is left."""
    kept, dropped, longest = [], 0, 0
    for index, example in enumerate(examples):
        text, ids = encode_prompt(example, tokenizer, data_cfg, tools)
        if len(ids) > data_cfg.max_prompt_length:
            dropped, longest = dropped + 1, max(longest, len(ids))
            continue
        kept.append(EncodedPrompt(index, example, text, ids))
    if not kept:
        raise DataError(f"{what}: all {dropped} prompts are longer than data.max_prompt_length="
                        f"{data_cfg.max_prompt_length} tokens (longest {longest}); raise it")
    return EncodedSplit(kept, dropped, longest)


def prompt_for_rewards(example: dict[str, Any], tokenizer: Any,
                       data_cfg: DataConfig) -> str | list[dict[str, str]]:
    """What reward functions receive as a prompt: messages in chat mode (as TRL), else the text."""
    return build_prompt(example, data_cfg, uses_chat_template(tokenizer, data_cfg))


def completion_for_rewards(text: str, chat: bool) -> str | list[dict[str, str]]:
    """What reward functions receive as a completion: [{'role': 'assistant', ...}] in chat mode."""
    return [{"role": "assistant", "content": text}] if chat else text
