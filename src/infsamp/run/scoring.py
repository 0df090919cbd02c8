"""The run's reward functions as the trainer calls them: loaded and checked once at start-up, their
weights and runner kept for the run, each completion shown to them as TRL does (the prompt and the
completion as text or chat messages, the dataset's other columns as keyword arguments).

Deliberately simple: one object per run; its runner (worker processes, if any) closes with the run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from infsamp.config import Config
from infsamp.rewards.calling import check_async_allowed
from infsamp.rewards.compute import RewardResult, compute_rewards
from infsamp.rewards.workers import reward_runner
from infsamp.run.setup import load_rewards
from infsamp.tasks.prompts import completion_for_rewards, prompt_for_rewards, uses_chat_template


class RunRewards:
    """`reward_funcs` (name, callable) pairs instead of the config's `rewards.functions`."""

    def __init__(self, cfg: Config, reward_funcs: list[tuple[str, Callable]] | None = None,
                 extra: list[tuple[str, Callable]] | None = None):
        """`extra`: rewards owned by an environment (weight 1), after the functions."""
        self.data_cfg = cfg.data
        own = reward_funcs or load_rewards(cfg)
        self.funcs = [*own, *(extra or [])]
        check_async_allowed(self.funcs, cfg.rewards.allow_async)
        self.runner = reward_runner(self.funcs, cfg.rewards.timeout_s)  # lazy
        self.names = [name for name, _ in self.funcs]
        self.weights = [*(cfg.rewards.weights or [1.0] * len(own)), *[1.0] * len(extra or [])]

    def score(self, tokenizer, examples: list[dict[str, Any]], texts: list[str],
              completion_ids: list[list[int]]) -> RewardResult:
        """Every reward function on these completions (one per example); a `RewardError` names
        the function and the row."""
        chat = uses_chat_template(tokenizer, self.data_cfg)
        prompts = [prompt_for_rewards(ex, tokenizer, self.data_cfg) for ex in examples]
        completions = [completion_for_rewards(text, chat) for text in texts]
        columns = {k: [ex[k] for ex in examples] for k in examples[0] if k != "prompt"}
        return compute_rewards(self.funcs, self.weights, prompts, completions, columns,
                               runner=self.runner, completion_ids=completion_ids)

    def close(self) -> None:
        self.runner.close()
