"""Issue 32's "not yet tried" cases, tried as an adversarial user would: the real-model path
(GGUF files and their cache, a named model whose package is missing), reasoning-gym settings,
tampered checkpoints, folders that cannot be written, huge timeouts. Each case that misbehaved
names what it did; the others pin what already held."""

from __future__ import annotations

import math

from infsamp.rewards.workers import RewardWorkers

from fault_harness import length_reward


def test_a_reward_timeout_past_what_poll_takes_waits_and_scores():
    """poll(2) takes a C int of milliseconds: a wait of 2,147,484 s or more raised OverflowError
    (a library caller's timeout; the config caps rewards.timeout_s at a week)."""
    for timeout_s in (2_147_484.0, 1e10, math.inf):
        workers = RewardWorkers([("length", length_reward)], timeout_s=timeout_s)
        try:
            outcomes = workers.call_all([("length", length_reward)],
                                        {"prompts": ["p"], "completions": ["abc"]})
        finally:
            workers.close()
        assert not outcomes["length"].timed_out and outcomes["length"].error is None
