"""The sampler's `TurnHandler` for one sampler call: it reads each ended turn's tool calls, runs
them (`running.py`) and renders their answers as the chat template's tool messages
(`tasks/tool_format.py`), as token ids the sampler appends to the episode.

    continues(sample)   at a stop token: the turn's text (its tokens since the last answer,
                        the stop token left out) holds one or more calls -> True
    submit(sample)      each call to its tool (an unknown name or a malformed call is answered
                        at once with a tool error, as TRL answers "Tool X not found.")
    answered(timeout)   samples whose every call answered, with the answer's token ids

`Toolbox` is the run's: its tools (functions and, per episode, an environment's methods), the
runner, the template's format (its own tool support, or the fallback), and the counters logged
per step: `tools/calls`, `tools/errors`, `tools/time_s` (the calls' summed time).

Deliberately simple: a turn's calls run concurrently and are answered together, in the order the
model wrote them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from infsamp.config import DataConfig
from infsamp.sampling.types import Sample
from infsamp.tasks.prompts import uses_chat_template
from infsamp.tasks.tool_format import (
    ToolCall,
    answer_text,
    answer_token_ids,
    parse_tool_calls,
    supports_tools,
)
from infsamp.tools.environments import Environment, public_methods
from infsamp.tools.loading import Tool
from infsamp.tools.running import Answer, ToolRunner


@dataclass
class ToolCounters:
    calls: int = 0
    errors: int = 0
    time_s: float = 0.0
    valid_episodes: int = 0  # episodes with at least one call answered without error

    def metrics(self) -> dict[str, float]:
        return {"tools/calls": self.calls, "tools/errors": self.errors,
                "tools/time_s": round(self.time_s, 4)}


class Toolbox:
    """The run's tools, runner and template format (see the module docstring)."""

    def __init__(self, functions: list[Tool], environment: Environment | None, tokenizer,
                 data_cfg: DataConfig, stop_token_ids: Sequence[int], timeout_s: float,
                 max_workers: int):
        self.functions, self.environment = functions, environment
        self.tokenizer, self.data_cfg = tokenizer, data_cfg
        self.chat = uses_chat_template(tokenizer, data_cfg)
        self.native = self.chat and supports_tools(tokenizer)
        self.stop_texts = [tokenizer.decode([i]) for i in stop_token_ids]
        self.runner = ToolRunner(functions, timeout_s, max_workers)
        self.counters = ToolCounters()

    @property
    def schemas(self) -> list[dict[str, Any]]:
        env_tools = self.environment.tools if self.environment is not None else []
        return [t.schema for t in [*self.functions, *env_tools]]

    def episodes(self, instances: list[Any] | None = None) -> ToolEpisodes:
        """The handler of one sampler call; `instances`: each sample's environment."""
        return ToolEpisodes(self, instances)

    def answer_ids(self, calls: list[ToolCall], contents: list[str]) -> list[int]:
        text = answer_text(self.tokenizer, self.data_cfg, self.chat, self.native, calls,
                           contents, self.stop_texts)
        return answer_token_ids(self.tokenizer, text)

    def take_counters(self) -> ToolCounters:
        """The counters since the last take (reset for the next step or evaluation)."""
        counters, self.counters = self.counters, ToolCounters()
        return counters

    def close(self) -> None:
        self.runner.close()


@dataclass
class _Turn:
    sample: Sample
    calls: list[ToolCall]
    answers: dict[int, Answer] = field(default_factory=dict)


class ToolEpisodes:
    """One sampler call's `TurnHandler` (sampling/turns.py)."""

    def __init__(self, box: Toolbox, instances: list[Any] | None):
        self.box, self.instances = box, instances
        self.turns: dict[int, _Turn] = {}
        self.broken: set[int] = set()  # episodes whose environment call was abandoned
        self.valid: set[int] = set()  # episodes with a call answered without error

    def continues(self, sample: Sample) -> bool:
        start = sample.context_spans[-1][1] if sample.context_spans else 0
        turn = sample.token_ids[start:-1]  # the stop token left out
        text = self.box.tokenizer.decode(turn, skip_special_tokens=False)
        calls = parse_tool_calls(text)
        if calls:
            self.turns[sample.sample_id] = _Turn(sample, calls)
        return bool(calls)

    def submit(self, sample: Sample) -> None:
        turn = self.turns[sample.sample_id]
        tools = self._tools_of(sample)
        for index, call in enumerate(turn.calls):
            key = (sample.sample_id, index)
            self.box.counters.calls += 1
            if call.error or call.name not in tools:
                self.box.runner.answer_now(key, call.error or f"Tool {call.name} not found.")
            elif sample.sample_id in self.broken:
                self.box.runner.answer_now(key, "the environment is unavailable after a call "
                                                "that did not return in time")
            else:
                self.box.runner.submit(key, call.name, tools[call.name], call.arguments)

    def answered(self, timeout_s: float) -> list[tuple[Sample, list[int]]]:
        done = []
        for (sample_id, index), answer in self.box.runner.collect(timeout_s):
            turn = self.turns[sample_id]
            turn.answers[index] = answer
            self.box.counters.errors += answer.failed
            self.box.counters.time_s += answer.seconds
            if not answer.failed and sample_id not in self.valid:
                self.valid.add(sample_id)
                self.box.counters.valid_episodes += 1
            if self.instances is not None and answer.timed_out:
                self.broken.add(sample_id)
            if len(turn.answers) == len(turn.calls):
                del self.turns[sample_id]
                contents = [turn.answers[i].content for i in range(len(turn.calls))]
                done.append((turn.sample, self.box.answer_ids(turn.calls, contents)))
        return done

    def _tools_of(self, sample: Sample) -> dict[str, Callable[..., Any]]:
        tools = {t.name: t.func for t in self.box.functions}
        if self.instances is not None:
            tools.update(public_methods(self.instances[sample.sample_id]))
        return tools
