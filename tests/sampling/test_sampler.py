"""GroupSampler end to end on a random tiny Llama: policies agree, budgets hold, bad requests fail
early."""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny_sampling import EOS, eos_boost, tiny_llama

from infsamp.config_algorithm import SamplingConfig
from infsamp.errors import SamplingError
from infsamp.models.device import model_kv_bytes_per_token
from infsamp.sampling import sizes as run_sizes
from infsamp.sampling.engines.slots import SlotEngine
from infsamp.sampling.predictors import make_predictor
from infsamp.sampling.sampler import GroupSampler

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13], [20, 21, 22, 23, 24, 25, 26]]


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def sampler(model, **overrides) -> GroupSampler:
    options = dict(policy="continuous", micro_group=3, kv_budget="100000", max_new_tokens=12,
                   temperature=0.0, predictor="none")
    options.update(overrides)
    return GroupSampler(model, None, SamplingConfig(**options))


EosBoost = eos_boost()

def token_ids(result):
    return [[c.token_ids for c in group] for group in result.groups]


def test_greedy_policies_agree_with_generate(model):
    results = {p: sampler(model, policy=p).sample(PROMPTS, 5)
               for p in ("full", "rounds", "continuous", "probe")}
    reference = token_ids(results["full"])
    for policy, result in results.items():
        assert token_ids(result) == reference, policy
    for prompt, group in zip(PROMPTS, reference):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                             eos_token_id=EOS, pad_token_id=0)
        expected = out[0, len(prompt):].tolist()
        assert group[0] == expected[: expected.index(EOS) + 1] if EOS in expected else expected


def test_sampling_is_independent_of_schedule(model):
    runs = []
    for policy, g in (("full", 0), ("rounds", 2), ("continuous", 3), ("continuous", 7),
                      ("probe", 3)):
        gen = torch.Generator().manual_seed(123)
        # probe: a budget of 3 whole samples, so 3-token probes run 12 at once and park
        result = sampler(model, policy=policy, micro_group=g, temperature=1.0, probe_tokens=3,
                         kv_budget=str(3 * 12 + 8) if policy == "probe" else "100000").sample(
            PROMPTS, 6, logits_processor_factory=EosBoost, generator=gen)
        runs.append(token_ids(result))
        if policy == "probe":
            assert result.stats.peak_rows > 3 and result.stats.num_preemptions > 0
    assert all(run == runs[0] for run in runs[1:])
    group = runs[0][0]
    assert len({tuple(t) for t in group}) > 1  # samples of a group differ


def test_sampled_length_distributions_agree(model):
    lengths = {}
    for policy in ("full", "rounds", "continuous"):
        gen = torch.Generator().manual_seed(7)
        result = sampler(model, policy=policy, temperature=1.0, top_k=20).sample(
            PROMPTS, 16, logits_processor_factory=EosBoost, generator=gen)
        lengths[policy] = [sorted(c.length for c in group) for group in result.groups]
    for policy in ("rounds", "continuous"):
        for ref, got in zip(lengths["full"], lengths[policy]):
            ks = max(abs(sum(x <= t for x in ref) - sum(x <= t for x in got))
                     for t in range(13)) / 16
            assert ks < 0.3, (policy, ref, got)  # two-sample KS statistic; identical draws give 0
    assert len({length for group in lengths["full"] for length in group}) > 3


def test_statistics(model):
    result = sampler(model, policy="rounds").sample(PROMPTS, 5)
    stats = result.stats
    assert stats.prefill_tokens == sum(len(p) - 1 for p in PROMPTS)  # once per group
    assert stats.generated_tokens == sum(c.length for c in result.completions)
    assert stats.decode_steps >= stats.lower_bound > 0
    assert stats.micro_group == 3 and stats.num_preemptions == 0
    metrics = stats.to_metrics()
    assert (metrics["sampling/decode_steps"] == stats.decode_steps
            and "sampling/peak_kv_bytes" in metrics)
    for c in result.completions:
        assert c.finish_reason == ("eos" if c.token_ids[-1] == EOS else "length")
        assert c.length == len(c.token_ids) <= 12


def test_peak_kv_flat_in_group_size_and_within_budget(model):
    per_token = model_kv_bytes_per_token(model)
    assert per_token == 2 * 2 * 2 * 16 * 4
    budget = 3 * 12 + 8
    peaks = {}
    for policy in ("full", "rounds", "continuous", "probe"):
        for group_size in (4, 16):
            stats = sampler(model, policy=policy, micro_group=0, kv_budget=str(budget),
                            probe_tokens=4).sample([PROMPTS[0]], group_size).stats
            peaks[policy, group_size] = stats.peak_kv_bytes
            if policy != "full":
                assert stats.micro_group == 3 and stats.peak_kv_tokens <= budget
    assert peaks["rounds", 16] == peaks["rounds", 4] == peaks["continuous", 16]
    assert peaks["probe", 16] == peaks["probe", 4]  # its pool: the whole budget beside the prompt
    assert peaks["full", 16] > 3.5 * peaks["full", 4]  # 16 vs 4 slots, one shared prompt


def test_budget_in_bytes(model):
    per_token = model_kv_bytes_per_token(model)
    prompts = [list(range(2, 18))]
    sizes = {budget: sampler(model, micro_group=8, kv_budget=budget).call_sizes(
        prompts, 8, 16).kv_budget_tokens for budget in ("8192", "1MiB", "auto")}
    assert sizes["8192"] == 8192 and sizes["1MiB"] == 2**20 // per_token
    assert sizes["auto"] == 8 * 16 + 16  # "auto": what g = 8 need beside the prompt


def test_a_sampler_alone_sizes_each_call_through_the_run_path(model, monkeypatch):
    """No sizes given: each call is planned by `plan_run_sizes` (the trainer's path), for an
    engine started apart (no spare block off the budget)."""
    planned = []
    plan_run_sizes = run_sizes.plan_run_sizes
    monkeypatch.setattr(run_sizes, "plan_run_sizes", lambda *args, **kwargs: planned.append(
        kwargs["budget_is_pool"]) or plan_run_sizes(*args, **kwargs))
    alone = sampler(model)
    alone.sample([PROMPTS[0]], 4)
    alone.sample(PROMPTS[:2], 2)
    assert planned == [False, False]


class ExplodingModel(torch.nn.Module):
    """Any forward pass fails: proves the checks run before any work."""

    def __init__(self, model):
        super().__init__()
        self.config = model.config
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, *args, **kwargs):
        raise AssertionError("forward called before the request was checked")


@pytest.mark.parametrize("prompts, group_size, budget, match", [
    ([[5, 6], []], 4, "1000", "prompt 1 is empty"),
    ([list(range(2, 66))], 4, "1000", "prompt 0 has 64 tokens"),
    ([[5, 6]], 0, "1000", "num_generations"),
    ([[5, 6, 7, 8]], 4, "4", "kv_budget='4'"),
])
def test_bad_requests_fail_before_work(model, prompts, group_size, budget, match):
    bad = GroupSampler(ExplodingModel(model), None,
                       SamplingConfig(kv_budget=budget, max_new_tokens=8))
    with pytest.raises(SamplingError, match=match):
        bad.sample(prompts, group_size)


def test_small_budget_lowers_max_new_tokens_and_says_so_once(model, capsys):
    """One plain line on stderr, the first time only: not a Python warning with its source."""
    small = sampler(model, kv_budget="8", max_new_tokens=12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = small.sample([[5, 6, 7, 8, 9]], 2)
        small.sample([[5, 6, 7, 8, 9]], 2)
    assert all(c.length <= 3 for c in result.completions)
    assert result.stats.micro_group == 1
    assert capsys.readouterr().err == ("sampling.kv_budget='8' (8 tokens) holds at most 3 new "
                                       "tokens per sample: max_new_tokens lowered from 12 "
                                       "(said once)\n")


def test_a_hidden_predictor_on_an_engine_without_hidden_states_says_so_in_one_line(model, capsys):
    class NoHidden(SlotEngine):
        hands_hidden_states = False

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GroupSampler(model, None, SamplingConfig(), predictor=make_predictor("hidden"),
                     engine=NoHidden(model))
    assert capsys.readouterr().err == ("sampling.predictor hidden: the slots engine hands out no "
                                       "hidden states; its token-level part (as online) predicts "
                                       "instead\n")


@pytest.mark.parametrize("policy", ["continuous", "length_aware"])
def test_a_share_of_the_step_draws_the_same_completions_as_the_whole_step(model, policy):
    """Ranks sample parts of a step: keyed by their global prompt index, each part's completions
    are those the whole step gives its prompts (what makes N processes match one)."""
    make = dict(temperature=1.0, policy=policy, micro_group=5)
    whole = sampler(model, **make).sample(PROMPTS, 4, generator=torch.Generator().manual_seed(3),
                                          logits_processor_factory=EosBoost)
    for share in ([0, 2], [1, 3], [3]):
        part = sampler(model, **make).sample([PROMPTS[i] for i in share], 4,
                                             generator=torch.Generator().manual_seed(3),
                                             logits_processor_factory=EosBoost,
                                             global_group_ids=share)
        assert token_ids(part) == [token_ids(whole)[i] for i in share]
    unkeyed = sampler(model, **make).sample([PROMPTS[1], PROMPTS[3]], 4,
                                            generator=torch.Generator().manual_seed(3),
                                            logits_processor_factory=EosBoost)
    assert token_ids(unkeyed) != [token_ids(whole)[i] for i in (1, 3)]  # the key matters
