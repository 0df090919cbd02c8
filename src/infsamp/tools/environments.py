"""Environments, TRL's `environment_factory`: a class (or any callable returning an instance)
instantiated once per episode. `reset(**row)` starts the episode and may return the first
observation, the public methods are the episode's tools and `get_reward()` an extra reward of
the finished episode (docs/usage.md, "Environments").

One instance is probed at start-up (its methods and schemas, before the model loads). The
methods run in the trainer's process (the instance lives there) on a thread per call, with
`tools.timeout_s`: a call past it is abandoned (its answer is a tool error) and its episode's
later calls are refused, since a thread cannot be stopped and the instance may be half-changed.

Deliberately simple: the G episodes of a prompt share its KV, so their `reset` observations must
be equal (a reset that draws something at random per episode is refused in one line); instances
are made anew each step (TRL pools them).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from infsamp.errors import ToolError
from infsamp.tools.loading import Tool, load_callable, tool_schema

NOT_TOOLS = ("reset", "get_reward")


def public_methods(instance: Any) -> dict[str, Callable[..., Any]]:
    return {name: member for name, member in inspect.getmembers(instance, inspect.ismethod)
            if name not in NOT_TOOLS and not name.startswith("_")}


class Environment:
    """The factory, checked once on a probe instance (its tools' schemas, whether it rewards)."""

    def __init__(self, factory: Callable[[], Any], name: str):
        self.factory, self.name = factory, name
        probe = self.new()
        if not callable(getattr(probe, "reset", None)):
            raise ToolError(f"tools.environment_factory {name!r}: its instances have no reset() "
                            "method (TRL's environments start each episode with reset(**row))")
        methods = public_methods(probe)
        self.tools = [Tool(n, m, tool_schema(n, m, f"environment {name} method")) for n, m in
                      methods.items()]
        self.owns_reward = callable(getattr(probe, "get_reward", None))
        self.reward_name = type(probe).__name__

    def new(self) -> Any:
        try:
            return self.factory()
        except Exception as err:  # noqa: BLE001 - user code
            raise ToolError(f"tools.environment_factory {self.name!r}: making an instance "
                            f"raised {type(err).__name__}: {err}".splitlines()[0]) from None

    def start(self, row: dict[str, Any]) -> tuple[Any, str]:
        """A new episode's instance and its first observation ('' for none)."""
        instance = self.new()
        try:
            observation = instance.reset(**row)
        except Exception as err:  # noqa: BLE001 - user code
            raise ToolError(f"environment {self.reward_name}: reset(**row) raised "
                            f"{type(err).__name__}: {err}".splitlines()[0]) from None
        return instance, "" if observation is None else str(observation)

    def reward(self, instances: list[Any], **_: Any) -> list[float | None]:
        """The episodes' own rewards (a reward function over the step's instances)."""
        return [instance.get_reward() for instance in instances]


def load_environment(spec: str | Callable[[], Any]) -> Environment:
    name, factory = load_callable(spec, "tools.environment_factory")
    return Environment(factory, name)


def with_observation(example: dict[str, Any], observation: str) -> dict[str, Any]:
    """The row with `observation` appended to its prompt's last user turn (TRL's rule)."""
    if not observation:
        return example
    prompt = example["prompt"]
    if isinstance(prompt, str):
        return {**example, "prompt": prompt + observation}
    last = max((i for i, m in enumerate(prompt) if m.get("role") == "user"), default=len(prompt))
    if last == len(prompt):
        return {**example, "prompt": [*prompt, {"role": "user", "content": observation}]}
    turn = dict(prompt[last], content=str(prompt[last]["content"]) + observation)
    return {**example, "prompt": [*prompt[:last], turn, *prompt[last + 1:]]}
