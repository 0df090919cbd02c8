"""A small environment for `tools.environment_factory` (TRL's semantics):
`examples/tools/guess_number.py:GuessNumber`.

Each episode is a new instance: `reset(**row)` reads the number to find from the row's answer
column (the embedded arithmetic task's answer, so any arithmetic dataset works) and returns the
first observation (appended to the prompt). The model calls `guess(number)`, which answers
"higher", "lower" or "correct"; `get_reward()` is 1.0 for a found number, less for each extra
guess, 0.0 if it was never found.
"""

from __future__ import annotations


class GuessNumber:
    def __init__(self) -> None:
        self.target, self.guesses, self.found = 0, 0, False

    def reset(self, answer: str = "0", **row) -> str:
        self.target, self.guesses, self.found = int(str(answer).strip() or 0), 0, False
        return "\nA number is hidden; call guess to find it."

    def guess(self, number: int) -> str:
        """Guess the hidden number.

        Args:
            number: the guess
        """
        self.guesses += 1
        if number == self.target:
            self.found = True
            return "correct"
        return "higher" if number < self.target else "lower"

    def get_reward(self) -> float:
        return max(0.0, 1.0 - 0.1 * (self.guesses - 1)) if self.found else 0.0
