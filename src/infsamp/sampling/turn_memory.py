"""What finished multi-turn episodes teach the length predictor about the turns still to come.
Pure Python, no torch.

An episode's tokens are its model turns with the tools' answers between them
(`Sample.context_spans`): turn 0 up to the first answer, turn 1 up to the next, ... The decode
work a sample still has is its model tokens, never the answers' (those are prefilled). A sample
resumed after k tool answers is at the start of turn k; what it still decodes is best told by
what episodes of the same prompt decoded from their turn k on (the final turn after a
calculator's answer is short and steady even when the first turn's reasoning was not).

`TurnMemory` keeps, per prompt and for the whole run, per turn number k: the mean model tokens
that episodes which reached turn k decoded from turn k to their end (exponentially forgotten,
so it follows the policy). `remaining(key, k, tokens_in_turn)` is that mean less what the
current turn already decoded; the prompt's own memory first, else the run's, else None.

Deliberately simple: one mean per turn number (no features of the tool's answer); a sample that
outlived the mean is predicted to run as long again (as `PrefixMemory.remaining_after`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

RUN_KEY = ""  # the whole run's memory, next to each prompt's
DECAY = 0.98  # weight of an entry's past per new episode that reached its turn


def model_turn_lengths(length: int, context_spans: Sequence[tuple[int, int]]) -> list[int]:
    """The model's tokens in each turn of an episode of `length` tokens (turn 0 first): the
    tokens between one tool answer (a context span, maybe empty) and the next."""
    turns, position = [], 0
    for start, end in context_spans:
        turns.append(start - position)
        position = end
    turns.append(length - position)
    return turns


class TurnMemory:
    """Per prompt key (and the run, `RUN_KEY`): per turn number, [weighted sum of the model
    tokens decoded from that turn to the end, weight]."""

    def __init__(self):
        self._entries: dict[str, list[list[float]]] = defaultdict(list)

    def add(self, key: str, turn_lengths: Sequence[int]) -> None:
        """A finished episode's model tokens per turn (one turn: nothing to learn)."""
        if len(turn_lengths) < 2:
            return
        for name in {key, RUN_KEY}:
            entries = self._entries[name]
            remaining = sum(turn_lengths)
            for turn, tokens in enumerate(turn_lengths):
                if turn == len(entries):
                    entries.append([0.0, 0.0])
                total = entries[turn]
                total[0] = DECAY * total[0] + remaining
                total[1] = DECAY * total[1] + 1.0
                remaining -= tokens

    def remaining(self, key: str, turn: int, tokens_in_turn: int) -> float | None:
        """Model tokens still to decode by a sample at turn `turn` that has decoded
        `tokens_in_turn` of it; None when no episode (of this prompt, else of the run) reached
        that turn."""
        for name in (key, RUN_KEY):
            entries = self._entries.get(name, ())
            if turn < len(entries) and entries[turn][1] > 0:
                mean = entries[turn][0] / entries[turn][1]
                return mean - tokens_in_turn if mean > tokens_in_turn else \
                    float(max(1, tokens_in_turn))
        return None

    def state_dict(self) -> dict:
        return {key: [list(total) for total in entries] for key, entries in self._entries.items()}

    def load_state_dict(self, state: dict) -> None:
        self._entries.clear()
        for key, entries in state.items():
            self._entries[key] = [list(map(float, total)) for total in entries]
