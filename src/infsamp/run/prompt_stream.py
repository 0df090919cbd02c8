"""The stream of training prompts: reshuffled every epoch from a seed, with a resumable position.

Deliberately simple: the whole prompt list lives in memory (fine for GSM8K-sized datasets).
"""

from __future__ import annotations

import random
from typing import Any


class PromptStream:
    def __init__(self, examples: list[Any], prompts_per_step: int, seed: int):
        if not examples:
            raise ValueError("the training split has no examples")
        self.examples = examples
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(self.seed * 100_003 + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[tuple[int, Any]]:
        """(example index, example) for the next step; wraps into a new epoch when needed."""
        return [self.next_prompt() for _ in range(self.prompts_per_step)]

    def next_prompt(self) -> tuple[int, Any]:
        """The stream's next (example index, example): a step's, or a replacement for a prompt
        dynamic sampling dropped (the position counts it either way)."""
        if self.position >= len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._shuffled(self.epoch)
        index = self._order[self.position]
        self.position += 1
        return index, self.examples[index]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._shuffled(self.epoch)
