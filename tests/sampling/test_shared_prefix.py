"""A call's common prompt prefix held once (`sample(share_prefix=True)`): the same completions as
unshared (greedy and sampled, every schedule, parked samples recomputed, the joined attention),
the prefix forwarded once, counted once in the books, so the same budget runs more rows."""

from __future__ import annotations

import pytest
import torch
from tiny_sampling import eos_boost, tiny_llama

from infsamp.config_algorithm import SamplingConfig
from infsamp.sampling.engines import slots
from infsamp.sampling.sampler import GroupSampler, shared_prefix_tokens
from infsamp.sampling.scheduler import SlotScheduler
from infsamp.sampling.types import make_samples

pytestmark = pytest.mark.usefixtures("one_thread")
PREFIX = [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]  # a system prompt every problem shares
SUFFIXES = [[5, 6, 7, 8, 9], [10, 11, 12], [13], [20, 21, 22, 23, 24, 25, 26], [14, 15]]
PROMPTS = [PREFIX + suffix for suffix in SUFFIXES]
EosBoost = eos_boost()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def sample(model, share: bool, num_generations: int = 1, temperature: float = 0.0,
           prompts=PROMPTS, engine=None, **overrides):
    """Greedy: lengths forced to differ (a random model's greedy EOS is never or always)."""
    options = dict(policy="continuous", micro_group=3, kv_budget="100000", max_new_tokens=12,
                   temperature=temperature, predictor="none")
    options.update(overrides)
    sampler = GroupSampler(model, None, SamplingConfig(**options), engine=engine)
    lengths = [3 + i % 7 for i in range(len(prompts) * num_generations)]
    return sampler.sample(prompts, num_generations, generator=torch.Generator().manual_seed(5),
                          logits_processor_factory=EosBoost if temperature else None,
                          target_lengths=None if temperature else lengths, share_prefix=share,
                          fill_budget=share)


def token_ids(result):
    return [[c.token_ids for c in group] for group in result.groups]


def test_the_shared_prefix_stops_short_of_every_prompts_last_token():
    assert shared_prefix_tokens([[1, 2, 3], [1, 2, 4, 5]]) == 2
    assert shared_prefix_tokens([[1, 2], [1, 2, 3]]) == 1  # [1, 2]'s last token is decoded
    assert shared_prefix_tokens([[1, 2, 3], [4, 2, 3]]) == 0
    assert shared_prefix_tokens([[1, 2, 3]]) == 0  # one prompt: nothing to share


def test_greedy_completions_equal_unshared_and_the_prefix_is_forwarded_once(model):
    shared, unshared = sample(model, True), sample(model, False)
    assert token_ids(shared) == token_ids(unshared)
    assert unshared.stats.prefill_tokens == sum(len(p) - 1 for p in PROMPTS)
    assert shared.stats.prefill_tokens == len(PREFIX) + sum(len(s) - 1 for s in SUFFIXES)
    assert len({len(c.token_ids) for c in shared.completions}) > 1  # slots refilled


@pytest.mark.parametrize("policy", ["full", "rounds", "continuous", "length_aware"])
def test_sampled_completions_equal_unshared_same_seed(model, policy):
    shared = sample(model, True, 4, 1.0, policy=policy)
    assert token_ids(shared) == token_ids(sample(model, False, 4, 1.0, policy=policy))
    assert len({tuple(t) for t in token_ids(shared)[0]}) > 1  # samples of a group differ


def test_parked_probes_recompute_over_the_prefix(model):
    """probe parks samples and drops their KV: resumed, they are recomputed over prefix + row."""
    overrides = dict(policy="probe", probe_tokens=3, kv_budget=str(len(PREFIX) + 3 * 12 + 20))
    shared = sample(model, True, 4, 1.0, **overrides)
    assert shared.stats.num_preemptions > 0 and shared.stats.recomputed_tokens > 0
    assert token_ids(shared) == token_ids(sample(model, False, 4, 1.0, policy="continuous"))


def test_the_joined_attention_gives_the_same_completions(model, monkeypatch):
    """A model whose attention the split path does not take: cat(prefix, rows, columns)."""
    reference = token_ids(sample(model, False, 3, 1.0))
    monkeypatch.setattr(slots, "supports_split", lambda model: False)
    assert token_ids(sample(model, True, 3, 1.0)) == reference


def test_the_prefix_is_counted_once_so_the_same_budget_runs_more_rows(model):
    """Each sample reserves 12 tokens and each group its prompt; the prefix once in the books."""
    budget = len(PREFIX) + 3 * (12 + 7)  # the prefix and three samples of the longest suffix
    shared = sample(model, True, kv_budget=str(budget), micro_group=0)
    unshared = sample(model, False, kv_budget=str(budget), micro_group=0)
    assert token_ids(shared) == token_ids(unshared)
    assert unshared.stats.micro_group == 2 and shared.stats.micro_group == 3  # 2 x (12 + 18)
    assert shared.stats.peak_kv_tokens_used <= budget and shared.stats.peak_rows == 3


def test_fill_budget_runs_more_rows_than_the_runs_g(model):
    shared = sample(model, True, micro_group=2)
    assert shared.stats.micro_group == len(PROMPTS) and shared.stats.peak_rows == len(PROMPTS)


def test_a_prompt_that_is_all_prefix_gets_a_row_of_zero_width(model):
    prompts = [PREFIX + [41], PREFIX + [42, 43, 44]]  # the first one's KV is the prefix alone
    assert shared_prefix_tokens(prompts) == len(PREFIX)
    assert token_ids(sample(model, True, 2, 1.0, prompts=prompts)) == \
        token_ids(sample(model, False, 2, 1.0, prompts=prompts))


@pytest.mark.parametrize("budget, admitted", [(11 + 2 * (7 + 12), 2), (11 + 2 * (7 + 12) - 1, 1)])
def test_the_books_hold_the_prefix_once_and_each_group_the_rest(budget, admitted):
    """Prompts of 18 tokens, 11 of them shared, 12 new tokens each: the prefix and 19 a sample."""
    samples = make_samples([18] * 4, [1] * 4, 12)
    sched = SlotScheduler(samples, "continuous", 4, max_kv_tokens=budget, shared_prefix_tokens=11)
    assert len(sched.admit()) == admitted


LONG = [PREFIX[:2] + [5 + i] * 10 for i in range(4)]  # suffixes of 9: one packed per step


@pytest.mark.parametrize("prompts, num_generations, apart", [(PROMPTS, 1, False), (LONG, 4, True)])
def test_suffixes_computed_inside_the_decode_step_equal_a_prefill_apart(model, monkeypatch,
                                                                        prompts, num_generations,
                                                                        apart):
    """Packed steps (new rows' suffixes, then one token per slot, as one sequence, at most the
    longest prompt in tokens: the rest prefilled before the step) against every suffix prefilled
    in its own batched forward, and against unshared."""
    calls = []
    original = slots.SlotEngine._prefill_batch
    monkeypatch.setattr(slots.SlotEngine, "_prefill_batch",
                        lambda self, groups: calls.append(groups) or original(self, groups))
    packed = token_ids(sample(model, True, num_generations, 1.0, prompts=prompts))
    assert bool(calls) == apart  # with PROMPTS every row was computed inside a decode step
    assert packed == token_ids(sample(model, False, num_generations, 1.0, prompts=prompts))
    calls.clear()
    monkeypatch.setattr(slots, "supports_packed", lambda model: False)
    assert token_ids(sample(model, True, num_generations, 1.0, prompts=prompts)) == packed and calls


def test_a_run_that_plans_longer_prompts_packs_every_suffix_into_the_decode_step(model,
                                                                                 monkeypatch):
    """The engine told the run's longest prompt (`RunSizes.max_prompt_tokens`, what the planner
    counts a forward's working set at) packs up to that many tokens per step: LONG's suffixes of
    9, which beside the call's own longest prompt (12) go one per step, are all computed inside
    the first step, with the same completions."""
    from infsamp.planner.sizes import RunSizes

    calls = []
    original = slots.SlotEngine._prefill_batch
    monkeypatch.setattr(slots.SlotEngine, "_prefill_batch",
                        lambda self, groups: calls.append(groups) or original(self, groups))
    apart = token_ids(sample(model, True, 4, 1.0, prompts=LONG))
    assert calls
    calls.clear()
    sizes = RunSizes(kv_budget_tokens=100000, micro_group=3, max_micro_group=0,
                     max_prompt_tokens=64, max_new_tokens=12)
    engine = slots.SlotEngine(model, sizes=sizes)
    assert token_ids(sample(model, True, 4, 1.0, prompts=LONG, engine=engine)) == apart
    assert not calls


def _logits_by_token(model, monkeypatch, share: bool, prompts) -> dict:
    """(sample id, tokens generated) -> the logits it was drawn from, greedy, the run's g."""
    seen = {}
    original = slots.SlotEngine._select

    def select(self, logits, sample_ids, num_generated):
        for row, key in enumerate(zip(sample_ids.tolist(), num_generated.tolist())):
            seen[key] = logits[row].clone()
        return original(self, logits, sample_ids, num_generated)

    with monkeypatch.context() as patch:
        patch.setattr(slots.SlotEngine, "_select", select)
        sampler = GroupSampler(model, None, SamplingConfig(
            policy="continuous", micro_group=3, kv_budget="100000", max_new_tokens=8,
            temperature=0.0, predictor="none"))
        sampler.sample(prompts, 2, share_prefix=share,
                       target_lengths=[3 + i % 6 for i in range(2 * len(prompts))])
    return seen


@pytest.mark.parametrize("packs", [True, False])
def test_every_logit_equals_unshared_within_float_rounding(model, monkeypatch, packs):
    """Stronger than equal tokens: the logits of every draw, packed suffixes or prefilled apart."""
    monkeypatch.setattr(slots, "supports_packed", lambda model: packs)
    unshared = _logits_by_token(model, monkeypatch, False, PROMPTS)
    shared = _logits_by_token(model, monkeypatch, True, PROMPTS)
    assert shared.keys() == unshared.keys()
    for key, logits in unshared.items():
        torch.testing.assert_close(shared[key], logits, rtol=1e-5, atol=1e-5, msg=str(key))


def test_packed_steps_through_the_lean_forward_give_the_models_logits_bit_for_bit(model,
                                                                                   monkeypatch):
    """A packed step (new rows' suffixes, then one token per slot) goes through `lean_decode`
    too: every draw's logits equal the model's own forward's."""
    from infsamp.sampling.engines.lean_decode import LeanLlamaDecode

    packed_calls = []
    original = LeanLlamaDecode.__call__
    monkeypatch.setattr(LeanLlamaDecode, "__call__", lambda self, *args: packed_calls.append(
        args[4] if len(args) > 4 else 0) or original(self, *args))  # keep: S when packed
    lean = _logits_by_token(model, monkeypatch, True, PROMPTS)
    assert any(packed_calls)  # some steps were packed, through the lean forward
    monkeypatch.setattr(slots, "lean_decode", lambda model: None)  # the model's own forward
    own = _logits_by_token(model, monkeypatch, True, PROMPTS)
    assert lean.keys() == own.keys()
    assert all(torch.equal(lean[key], own[key]) for key in own)
