"""Tools inside the TRL rollout: `infsamp_rollout(tools=[...])` runs multi-turn episodes with
infsamp's sampler and returns TRL's `env_mask` (why the tools go to the rollout and not to the
trainer, and what TRL does with the mask: docs/usage.md, "Tools and environments").

infsamp's turn loop runs the calls (as in `infsamp train`: worker processes, timeout, errors as
the model's tool error message), appends the chat template's tool messages (or the fallback
format for a template without tool support) and decodes on, every turn inside the KV budget.
`env_mask` is per completion 1 on the model's tokens, 0 on the tools' answers; the log-probs
returned are 0 on the answers' tokens.

Deliberately simple: tools only, no `environment_factory` (TRL resets an environment with the
dataset row, which a rollout_func never receives); the tools are offered in every prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from infsamp.config import DataConfig, ToolsConfig
from infsamp.errors import InfsampError


class RolloutError(InfsampError):
    """A TRL setting the infsamp rollout cannot honour."""


class RolloutTools:
    """The rollout's tools: loaded at once (a bad reference: one line), started at the first
    call (the tokenizer and the model's stop tokens known then)."""

    def __init__(self, tools: Sequence[str | Callable[..., Any]], timeout_s: float,
                 max_workers: int):
        from infsamp.tools.loading import load_tools

        ToolsConfig(timeout_s=timeout_s, max_workers=max_workers).validate()
        self.functions = load_tools(list(tools))
        self.timeout_s, self.max_workers = timeout_s, max_workers
        self.box = None

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.functions]

    def start(self, model, tokenizer, conversational: bool) -> None:
        from infsamp.models.loading import require_stop_tokens
        from infsamp.tools.episodes import Toolbox

        data = DataConfig(use_chat_template="always" if conversational else "never")
        stops = require_stop_tokens(model, tokenizer, "the trainer's model")
        self.box = Toolbox(self.functions, None, tokenizer, data, stops, self.timeout_s,
                           self.max_workers)

    def offered(self, prompts: list[Any]) -> tuple[list[Any], dict[str, Any]]:
        """The prompts with the tools offered: (prompts, extra chat-template keywords). A
        template with tool support renders them itself; else the fallback instructions."""
        from infsamp.tasks.prompts import with_fallback_tools

        if self.box.native:
            return prompts, {"tools": self.schemas}
        return [with_fallback_tools(p, self.schemas) for p in prompts], {}

    def metrics(self) -> dict[str, float]:
        return self.box.take_counters().metrics() if self.box is not None else {}

    def close(self) -> None:
        if self.box is not None:
            self.box.close()
            self.box = None


def env_mask(completions) -> list[list[int]]:
    """TRL's `env_mask`: per completion 1 on the model's tokens, 0 on the tools' answers."""
    return [[int(own) for own in c.model_mask()] for c in completions]


def load_rollout_tools(tools, timeout_s: float, max_workers: int,
                       max_turns: int) -> RolloutTools | None:
    """None without tools; a bad tool, or max_turns 0, is one `RolloutError` line."""
    if not tools:
        return None
    if max_turns < 1:
        raise RolloutError("infsamp_rollout: tools are given but max_turns is 0: the model "
                           "could never call one (set it to 1 or more)")
    try:
        return RolloutTools(tools, timeout_s, max_workers)
    except InfsampError as err:
        raise RolloutError(f"infsamp_rollout: {err}") from None
