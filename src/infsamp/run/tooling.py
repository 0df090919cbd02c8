"""The run's tools and environment (`tools.*`), as the trainer uses them: loaded and checked at
start-up before the model loads (a bad reference, a function transformers cannot describe: one
line), offered in every prompt (their schemas), and per sampler call a `TurnHandler` for the
sampler (`tools/episodes.py`), with one environment instance per episode when there is an
`environment_factory`.

With an environment each episode is `reset` with its dataset row first; its observation ends
the prompt's last user turn, so the prompt is encoded again (the G episodes of a prompt must
agree on it: they share its KV); its `get_reward()` scores the episode once it ended, as an extra
reward function named after the class (weight 1).

Deliberately simple: instances are made anew for each sampler call (an out-of-memory retry of a
step starts its episodes again from `reset`); their rewards are read in this process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from infsamp.config import Config
from infsamp.errors import ToolError
from infsamp.sampling.turns import TurnHandler
from infsamp.sampling.types import Completion
from infsamp.tasks.prompts import encode_prompt
from infsamp.tools.environments import load_environment, with_observation
from infsamp.tools.episodes import Toolbox
from infsamp.tools.loading import load_tools


class EnvironmentReward:
    """The environment's own reward, as a reward function over the episodes just scored."""

    runs_in_process = True  # reads the step's instances (never sent to a worker process)

    def __init__(self) -> None:
        self.instances: list[Any] = []

    def __call__(self, **_: Any) -> list[float | None]:
        return [instance.get_reward() for instance in self.instances]


class RunTools:
    """`tools` / `environment_factory` (Python API: callables or references) instead of the
    config's `tools.functions` / `tools.environment_factory`."""

    def __init__(self, cfg: Config, tools: Sequence[str | Callable] | None = None,
                 environment_factory: str | Callable | None = None):
        self.cfg = cfg
        self.functions = load_tools(list(cfg.tools.functions if tools is None else tools))
        factory = environment_factory or cfg.tools.environment_factory
        self.environment = load_environment(factory) if factory else None
        self.reward = EnvironmentReward() if self.environment is not None and \
            self.environment.owns_reward else None
        self.box: Toolbox | None = None
        if self.enabled and cfg.sampling.max_turns < 1:
            raise ToolError("tools are given but sampling.max_turns is 0: the model could never "
                            "call one (set it to 1 or more)")

    @property
    def enabled(self) -> bool:
        return bool(self.functions or self.environment is not None)

    @property
    def schemas(self) -> list[dict[str, Any]] | None:
        env_tools = self.environment.tools if self.environment is not None else []
        return [t.schema for t in [*self.functions, *env_tools]] or None

    def reward_functions(self) -> list[tuple[str, Callable]]:
        """The environment's reward as an extra reward function (none without one)."""
        return [(self.environment.reward_name, self.reward)] if self.reward is not None else []

    def start(self, tokenizer, stop_token_ids: Sequence[int]) -> None:
        """Once the tokenizer and the model's stop tokens are known."""
        tools = self.cfg.tools
        self.box = Toolbox(self.functions, self.environment, tokenizer, self.cfg.data,
                           stop_token_ids, tools.timeout_s, tools.max_workers)

    def episodes(self, examples: Sequence[dict[str, Any]], prompt_ids: list[list[int]],
                 num_generations: int) -> tuple[list[list[int]], TurnHandler]:
        """One sampler call's prompts (with an environment: each group's first observation in
        its prompt) and its turn handler (G episodes per example, group-major)."""
        if self.environment is None:
            return prompt_ids, self.box.episodes()
        instances, prompts = [], []
        for example, ids in zip(examples, prompt_ids):
            started = [self.environment.start(example) for _ in range(num_generations)]
            observations = {observation for _, observation in started}
            if len(observations) > 1:
                raise ToolError(f"environment {self.environment.reward_name}: reset(**row) gave "
                                "different observations to the episodes of one prompt; they "
                                "share its prompt (make reset depend on the row only)")
            instances += [instance for instance, _ in started]
            observation = observations.pop()
            prompts.append(encode_prompt(with_observation(example, observation),
                                         self.box.tokenizer, self.cfg.data, self.schemas)[1]
                           if observation else ids)
        if self.reward is not None:
            self.reward.instances = instances
        return prompts, self.box.episodes(instances)

    def metrics(self, completions: Sequence[Completion]) -> dict[str, float]:
        """This step's tool metrics: calls, errors, time, turns per episode, episodes that
        called a tool, and those with a call answered without error."""
        if self.box is None:
            return {}
        count = max(len(completions), 1)
        counters = self.box.take_counters()
        return {**counters.metrics(),
                "tools/turns_per_episode": sum(c.num_turns + 1 for c in completions) / count,
                "tools/episodes_with_calls": sum(c.num_turns > 0 for c in completions) / count,
                "tools/valid_call_share": counters.valid_episodes / count}

    def eval_metrics(self, num_episodes: int) -> dict[str, float]:
        """The held-out evaluation's tool use (this rank's share): calls and errors per episode,
        the share of episodes with a call that answered without error."""
        counters = self.box.take_counters()
        count = max(num_episodes, 1)
        return {"eval/tools/calls_per_episode": counters.calls / count,
                "eval/tools/errors_per_episode": counters.errors / count,
                "eval/tools/valid_call_share": counters.valid_episodes / count}

    def close(self) -> None:
        if self.box is not None:
            self.box.close()
