"""Multi-turn episodes in the sampler (no tools, no template: a scripted `TurnHandler`): a turn
that ends in a tool call waits parked, its answer's tokens are appended as context, decoding
resumes; the same seed gives the same episodes under every policy; budgets and limits hold."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from tiny_sampling import EOS, eos_boost, tiny_llama

from infsamp.config_algorithm import SamplingConfig
from infsamp.sampling.sampler import GroupSampler
from infsamp.sampling.types import model_token_mask

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13], [20, 21, 22, 23, 24, 25, 26]]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(max_positions=128)


EosBoost = eos_boost()

def answer_of(token_ids: list[int]) -> list[int]:
    """A deterministic 'tool': its answer depends on the episode so far."""
    return [40, 41, 42 + sum(token_ids) % 7]


class ScriptedTurns:
    """Every turn of two or more tokens is a tool call; answers come from a thread after
    `delay_s` (or at once)."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.done: list = []
        self.lock = threading.Lock()
        self.submitted = 0

    def continues(self, sample):
        start = sample.context_spans[-1][1] if sample.context_spans else 0
        return sample.num_tokens - start >= 2

    def submit(self, sample):
        self.submitted += 1
        answer = answer_of(sample.token_ids)

        def run():
            time.sleep(self.delay_s)
            with self.lock:
                self.done.append((sample, answer))

        threading.Thread(target=run).start() if self.delay_s else self.done.append(
            (sample, answer))

    def answered(self, timeout_s):
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                if self.done or time.monotonic() >= deadline:
                    ready, self.done = self.done, []
                    return ready
            time.sleep(0.001)


def sampler(model, **overrides) -> GroupSampler:
    options = dict(policy="continuous", micro_group=3, kv_budget="100000", max_new_tokens=24,
                   temperature=1.0, predictor="none", max_turns=3)
    options.update(overrides)
    return GroupSampler(model, None, SamplingConfig(**options))


def episodes(result):
    return [[(c.token_ids, c.context_spans, c.finish_reason) for c in g] for g in result.groups]


def run(model, turns=None, seed=7, **overrides):
    gen = torch.Generator().manual_seed(seed)
    return sampler(model, **overrides).sample(PROMPTS, 4, logits_processor_factory=EosBoost,
                                              generator=gen, turns=turns or ScriptedTurns())


def test_tool_turns_append_context_and_resume(model):
    result = run(model)
    stats = result.stats
    assert stats.num_tool_turns == sum(c.num_turns for c in result.completions) > 0
    assert stats.context_tokens == sum(c.num_context_tokens for c in result.completions)
    for c in result.completions:
        assert c.num_turns == len(c.context_spans) <= 3
        for start, end in c.context_spans:  # the answer, right after a stop token
            assert c.token_ids[start - 1] == EOS
            assert c.token_ids[start:end] == answer_of(c.token_ids[:start])[:end - start]
            if end - start < 3:  # cut to fit: one more token, then the length limit
                assert end == c.length - 1 == 23
        mask = model_token_mask(len(c.token_ids), c.context_spans)
        assert sum(mask) == c.num_model_tokens == c.length - c.num_context_tokens
        assert c.finish_reason in ("eos", "length") and c.length <= 24
    # generated tokens are the model's (decode steps), not the tools'
    assert stats.generated_tokens == sum(c.num_model_tokens for c in result.completions)


@pytest.mark.parametrize("policy, overrides", [
    ("full", {"micro_group": 0}), ("rounds", {"micro_group": 2}), ("continuous", {}),
    ("continuous", {"micro_group": 7}), ("length_aware", {"predictor": "online"}),
    ("probe", {"probe_tokens": 3, "kv_budget": str(3 * 24 + 24)})])
def test_the_same_episodes_under_every_policy(model, policy, overrides):
    """Tools deterministic: the same seed gives the same episodes whatever the schedule, KV kept
    while waiting (continuous) or recomputed (probe)."""
    reference = episodes(run(model))
    assert episodes(run(model, policy=policy, **overrides)) == reference


def test_kv_kept_or_recomputed_while_waiting_gives_the_same_episodes(model):
    """A tight budget drops waiting samples' KV (recomputed at resume); a large one keeps it."""
    kept = run(model, kv_budget="100000")
    dropped = run(model, kv_budget=str(3 * 24 + 16 + 7))  # g reservations, no room to keep
    assert episodes(kept) == episodes(dropped)
    assert dropped.stats.recomputed_tokens > 0 and kept.stats.recomputed_tokens == 0
    assert dropped.stats.peak_kv_tokens_used <= 3 * 24 + 16 + 7


def test_slow_tools_let_the_others_decode(model):
    """While calls run (200 ms each: longer than a decode step even on a loaded machine, where
    20 ms calls could all end inside decode steps) the engine decodes the other samples; it
    idles only when every sample left waits."""
    slow = run(model, turns=ScriptedTurns(delay_s=0.2), micro_group=4)
    assert episodes(slow) == episodes(run(model, micro_group=4))
    stats = slow.stats
    assert 0 < stats.engine_idle_s < stats.wall_time_s


def test_max_turns_and_token_limit_bound_the_episode(model):
    none = run(model, max_turns=0)
    assert none.stats.num_tool_turns == 0 and all(not c.context_spans for c in none.completions)
    one = run(model, max_turns=1)
    assert max(c.num_turns for c in one.completions) == 1
    short = run(model, max_new_tokens=6)
    assert all(c.length <= 6 for c in short.completions)
    cut = [c for c in short.completions if c.context_spans
           and c.context_spans[-1][1] - c.context_spans[-1][0] < 3]
    assert all(c.finish_reason == "length" for c in cut)
