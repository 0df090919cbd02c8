"""What earlier samples of the same prompt did after the same first tokens (`PrefixMemory`), the
online length predictor's per-prompt memory (`length_predictor.py`). No torch.

Deliberately simple: token counts and cosine similarity, no embeddings; a bounded queue per
prompt.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict, deque


class PrefixMemory:
    """Per prompt, the first-k-token counts of its finished samples and their log lengths.

    A new sample of that prompt is predicted as the mean log length of its most similar remembered
    prefixes (cosine similarity of token counts): the same prompt answered the same way (a short
    guess, a long derivation) runs about as long. Latest MAX_ENTRIES per prompt, so it follows the
    policy. Silent when nothing similar is remembered, and for a prefix of one repeated token (the
    simulator's placeholder carries no information)."""
    MAX_ENTRIES = 64
    NEIGHBOURS = 4
    MIN_SIMILARITY = 0.7

    def __init__(self):
        self._entries: dict[str, deque] = defaultdict(lambda: deque(maxlen=self.MAX_ENTRIES))

    def add(self, key: str, counts: Counter, log_length: float) -> None:
        if key and len(counts) > 1:
            self._entries[key].append((counts, _norm(counts), log_length))

    def state_dict(self) -> dict:
        return {key: [[[[token, count] for token, count in counts.items()], norm, log_length]
                      for counts, norm, log_length in entries]
                for key, entries in self._entries.items()}

    def load_state_dict(self, state: dict) -> None:
        self._entries.clear()
        for key, entries in state.items():
            self._entries[key].extend((Counter(dict(counts)), norm, log_length)
                                      for counts, norm, log_length in entries)

    def remaining_after(self, key: str, num_tokens: int) -> float:
        """Tokens still to come for a sample of this prompt that has run `num_tokens`: the mean
        of its remembered samples that ran longer, minus `num_tokens` (none: as long again)."""
        longer = [math.exp(y) for _, _, y in self._entries.get(key, ()) if math.exp(y) > num_tokens]
        return sum(longer) / len(longer) - num_tokens if longer else float(max(1, num_tokens))

    def predict(self, key: str, counts: Counter) -> float | None:
        entries = self._entries.get(key) if key and len(counts) > 1 else None
        if not entries:
            return None
        norm = _norm(counts)
        scored = sorted(((_dot(counts, c) / (norm * n), y) for c, n, y in entries), reverse=True)
        close = [y for sim, y in scored[: self.NEIGHBOURS] if sim >= self.MIN_SIMILARITY]
        return sum(close) / len(close) if close else None


def _dot(a: Counter, b: Counter) -> float:
    return float(sum(count * b[token] for token, count in a.items() if token in b))


def _norm(counts: Counter) -> float:
    return math.sqrt(sum(c * c for c in counts.values())) or 1.0
