"""Dynamic sampling (issue 34): chunks of a group draw what one call of its final size draws, the
rounds' decisions (no prompt twice, dropped ones logged, the budget kept), the trainer with it on
the tiny model, and a resume in the middle of a dynamic run."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from tiny_sampling import eos_boost, tiny_llama

from infsamp.config_algorithm import SamplingConfig
from infsamp.config_io import load_config
from infsamp.options import ConfigError
from infsamp.rewards.compute import RewardResult
from infsamp.run.dynamic_groups import ChunkRules, DynamicResult, Group, tied
from infsamp.run.dynamic_in_call import ChunkGate
from infsamp.run.dynamic_sampling import DynamicSampler
from infsamp.run.logs import read_jsonl
from infsamp.run.trainer import GRPOTrainer
from infsamp.sampling.predictors import make_predictor
from infsamp.sampling.sampler import GroupSampler
from infsamp.sampling.types import Completion, SampleResult, SamplerStats, make_samples

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13], [20, 21, 22, 23, 24, 25, 26]]
POLICIES = ("full", "rounds", "continuous", "length_aware", "probe")


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


EosBoost = eos_boost()  # lengths vary, so the schedules differ between calls

def sampler(model, policy: str) -> GroupSampler:
    cfg = SamplingConfig(policy=policy, micro_group=3, max_new_tokens=10, temperature=1.0,
                         predictor="online", probe_tokens=3,
                         kv_budget=str(3 * 10 + 8) if policy == "probe" else "100000")
    predictor = make_predictor("online") if policy in ("length_aware", "probe") else None
    return GroupSampler(model, None, cfg, predictor=predictor)


def by_index(result: SampleResult, positions: list[int]) -> dict[tuple[int, int], list[int]]:
    return {(positions[g], c.index_in_group): c.token_ids
            for g, group in enumerate(result.groups) for c in group}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("policy", POLICIES)
def test_chunks_draw_the_completions_of_one_call_of_the_final_size(model, policy):
    """Group sizes 12, 8, 10, 12 (cap 16) in one call, or as chunks: 8 each, then 4, 2, 4 for
    three of them (mixed sizes in one call, positions kept): the same completions."""
    final = [12, 8, 10, 12]
    keyed = dict(seed=1234, key_stride=16, logits_processor_factory=EosBoost)
    whole = sampler(model, policy).sample(PROMPTS, final, global_group_ids=[0, 1, 2, 3], **keyed)
    chunks = sampler(model, policy)
    first = chunks.sample(PROMPTS, 8, global_group_ids=[0, 1, 2, 3], first_index=[0] * 4,
                          **keyed)
    more = [0, 2, 3]
    second = chunks.sample([PROMPTS[i] for i in more], [4, 2, 4], global_group_ids=more,
                           first_index=[8, 8, 8], **keyed)
    expected = by_index(whole, [0, 1, 2, 3])
    got = {**by_index(first, [0, 1, 2, 3]), **by_index(second, more)}
    assert got == expected and len(got) == sum(final)
    assert len({tuple(t) for t in expected.values()}) > 20  # samples differ
    unstrided = sampler(model, policy).sample([PROMPTS[i] for i in more], [4, 2, 4],
                                              global_group_ids=more, first_index=[8, 8, 8],
                                              seed=1234, logits_processor_factory=EosBoost)
    assert by_index(unstrided, more) != by_index(second, more)  # the key stride matters


class TokenPrompt:  # a prompt of the step with real token ids
    def __init__(self, index):
        self.index, self.example, self.text = index, {"i": index}, ""
        self.token_ids = PROMPTS[index % len(PROMPTS)] + [30 + index]


class TokenStream:
    def __init__(self):
        self.position = 0

    def next_prompt(self):
        self.position += 1
        return 3 + self.position, TokenPrompt(3 + self.position)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def length_score(examples, texts, ids):
    """Ties for every third prompt; else the completion's length mod 3 (EosBoost varies it)."""
    values = [0.0 if e["i"] % 3 == 0 else float(len(t) % 3) for e, t in zip(examples, ids)]
    return RewardResult(values, {"r": values})


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("policy", POLICIES)
def test_one_call_deciding_inside_samples_what_the_rounds_sample(model, policy):
    """On the tiny model, each policy: one gated call gives the rounds' groups, completions and
    decisions, in fewer decode steps."""
    cfg = load_config(overrides={"sampling.dynamic": True, "sampling.num_generations": 4,
                                 "sampling.max_num_generations": 12,
                                 "training.prompts_per_step": 4})
    steps = []
    for in_call in (False, True):
        chunks, stats = sampler(model, policy), []

        def sample(prompts, counts, first_index, positions, gate=None, chunks=chunks, stats=stats):
            result = chunks.sample([p.token_ids for p in prompts], counts, first_index=first_index,
                                   global_group_ids=positions, seed=99, key_stride=12, gate=gate,
                                   logits_processor_factory=EosBoost)
            stats.append(result.stats)
            return result
        stream = TokenStream()
        steps.append((DynamicSampler(cfg.sampling, cfg.training, in_call).run(
            [(i, TokenPrompt(i)) for i in range(4)], stream, sample, length_score, 1000),
            stream.position, stats))
    (rounds_step, rounds_position, rounds_stats), (step, position, stats) = steps
    assert decided(step) == decided(rounds_step) and position == rounds_position
    assert rounds_step.dropped and len(rounds_step.groups) > 4  # chunks and replacements ran
    assert step.metrics() == rounds_step.metrics() and len(stats) == 1
    assert stats[0].num_samples >= rounds_step.num_sampled  # later chunks ran ahead...
    if policy == "continuous":  # the default (length_aware plans, probe sizes for all declared)
        assert stats[0].decode_steps < sum(s.decode_steps for s in rounds_stats)
        assert stats[0].num_samples > rounds_step.num_sampled  # ...and some were not used


# ---- the rounds, on a fake sampler (no model)


def fake_sample(tokens_of, seed=0):
    """A sampler stand-in: completion j of prompt p is `tokens_of(p, j)`. With a gate, the
    released samples end one per decode step, in an order drawn from `seed`."""
    calls = []

    def completion(p, k, j):
        return Completion(tokens_of(p, j), str(tokens_of(p, j)), 1, "eos", k, j)

    def sample(prompts, counts, first_index, positions, gate=None):
        calls.append((list(positions), list(counts), list(first_index)))
        if gate is None:
            groups = [[completion(p, k, j) for j in range(start, start + n)]
                      for k, (p, n, start) in enumerate(zip(prompts, counts, first_index))]
            return SampleResult(groups, SamplerStats(num_samples=sum(counts)))
        samples = make_samples([1] * len(prompts), counts, 1, first_index=first_index)
        running = [s for s in samples if s.sample_id not in gate.begin(samples)]
        order, ended = random.Random(seed), []
        while running:
            s = running.pop(order.randrange(len(running)))
            ended.append(completion(prompts[s.group_id], s.group_id, s.index_in_group))
            released, cancelled, stop = gate.after_step([ended[-1]])
            if stop:
                break
            running = [r for r in running if r.sample_id not in cancelled]  # none started yet
            running += [samples[i] for i in released]
        groups = [sorted((c for c in ended if c.group_id == k), key=lambda c: c.index_in_group)
                  for k in range(len(prompts))]
        return SampleResult(groups, SamplerStats(num_samples=len(ended)))
    return sample, calls


class Prompt:
    def __init__(self, index):
        self.index, self.example, self.token_ids, self.text = index, {"i": index}, [index], ""


class stream_of:  # noqa: N801 (a prompt stream over these indices, with a resumable position)
    def __init__(self, indices):
        self.indices, self.position = list(indices), 0

    def next_prompt(self):
        self.position += 1
        index = self.indices[(self.position - 1) % len(self.indices)]  # cyclic, as epochs
        return index, Prompt(index)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def score(examples, texts, ids):
    return RewardResult([float(t[0]) for t in ids], {"r": [float(t[0]) for t in ids]})


def rounds(overrides, batch, stream, spread_at, in_call=False, seed=0):
    """`spread_at[i]`: the completion index from which prompt i's rewards differ (None: never).
    `in_call`: the decisions inside one call (their fake call ends samples in `seed`'s order)."""
    cfg = load_config(overrides={"sampling.dynamic": True, "sampling.num_generations": 4,
                                 "training.prompts_per_step": len(batch), **overrides})
    sample, calls = fake_sample(lambda p, j: [int(spread_at[p.index] is not None
                                                  and j >= spread_at[p.index])], seed)
    source = stream_of(stream)
    step = DynamicSampler(cfg.sampling, cfg.training, in_call).run(
        [(i, Prompt(i)) for i in batch], source, sample, score, len(spread_at))
    return step, calls, source.position


def test_undecided_prompts_get_chunks_and_dropped_ones_are_replaced_and_logged():
    spread_at = {0: 2, 1: 6, 2: None, 3: None, 4: 3, 5: None}
    step, calls, _ = rounds({"sampling.max_num_generations": 12}, [0, 1, 2], [0, 1, 3, 3, 4, 5],
                         spread_at)
    # round 1: G each; 1 and 2 tie -> +4; 1 decided at 8; 2 needs 12 -> dropped -> replaced by
    # 3 (0 and 1 are in the step already: skipped); 3 dropped -> the next fresh one, 4
    assert calls[0] == ([0, 1, 2], [4, 4, 4], [0, 0, 0])
    assert calls[1] == ([1, 2], [4, 4], [4, 4])
    assert calls[2] == ([2], [4], [8])
    assert [g.index for g in step.groups] == [0, 1, 2, 3, 4]
    assert len({g.index for g in step.groups}) == len(step.groups)  # never one twice
    assert [g.index for g in step.trained] == [0, 1, 4]
    assert [len(g.completions) for g in step.trained] == [4, 8, 4]
    assert [g.index for g in step.dropped] == [2, 3]
    metrics = step.metrics()
    assert metrics["sampling/dropped_prompts"] == 2
    assert metrics["sampling/replaced_prompts"] == 2 and metrics["sampling/trained_groups"] == 3
    assert metrics["sampling/completions"] == 4 + 8 + 12 + 12 + 4
    assert metrics["sampling/zero_std_groups_before"] == pytest.approx(3 / 5)  # 1, 2, 3
    assert metrics["sampling/extra_completions_frac"] == pytest.approx((40 - 12) / 40)
    assert metrics["sampling/dynamic_rounds"] == len(calls) == 7


def test_replacements_stop_at_the_limit_and_at_an_epoch_of_repeats():
    spread_at = {0: None, 1: None, 2: None}
    step, _, _ = rounds({"sampling.max_replaced_prompts": 1}, [0, 1], [2, 0, 1], spread_at)
    assert [g.index for g in step.groups] == [0, 1, 2]  # one replacement only
    step, _, _ = rounds({}, [0, 1], [0, 1, 0], spread_at | {2: 0})  # only repeats left
    assert [g.index for g in step.groups] == [0, 1]
    assert step.trained == step.dropped  # nothing with spread: the dropped groups, all tied


def test_a_fixed_budget_spreads_chunks_to_undecided_prompts_only():
    spread_at = {0: 2, 1: None, 2: None, 3: 1}
    step, calls, _ = rounds({"training.completions_per_step": 22, "sampling.dynamic_chunk": 2},
                         [0, 1, 2], [3], spread_at)
    assert calls[0][1] == [4, 4, 4] and calls[1] == ([1, 2], [2, 2], [4, 4])
    assert sum(n for _, counts, _ in calls for n in counts) <= 22
    assert step.metrics()["sampling/completions"] == 22
    assert len(step.groups[0].completions) == 4  # decided after its first chunk: nothing more


IN_CALL_CASES = [  # (overrides, batch, stream, spread_at)
    ({"sampling.max_num_generations": 12}, [0, 1, 2], [0, 1, 3, 3, 4, 5],
     {0: 2, 1: 6, 2: None, 3: None, 4: 3, 5: None}),
    ({"sampling.max_replaced_prompts": 1}, [0, 1], [2, 0, 1], {0: None, 1: None, 2: None}),
    ({}, [0, 1], [0, 1, 0], {0: None, 1: None, 2: 0}),  # only repeats left to replace with
    ({"sampling.dynamic_chunk": 2, "sampling.max_replaced_prompts": 3}, [0, 1, 2, 3],
     [4, 5, 6, 7, 8, 9], {0: None, 1: 5, 2: 9, 3: None, 4: None, 5: 13, 6: None, 7: 1, 8: None,
                          9: None}),  # a replacement dropped and replaced in turn
]


def decided(step):
    return [(g.position, g.index, g.size, g.status, g.tied_first, g.total,
             [c.token_ids for c in g.completions]) for g in step.groups]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", range(len(IN_CALL_CASES)))
def test_decisions_inside_one_call_are_the_rounds(case, seed):
    """One call deciding as its samples end (in three orders) leaves the step as the rounds do:
    the same groups, completions, rewards, decisions, drops, metrics and stream position."""
    expected, round_calls, position = rounds(*IN_CALL_CASES[case])
    got, calls, got_position = rounds(*IN_CALL_CASES[case], in_call=True, seed=seed)
    assert len(calls) == 1 and len(round_calls) > 1
    assert decided(got) == decided(expected)
    assert [g.position for g in got.drops] == [g.position for g in expected.drops]
    assert got.metrics() == expected.metrics()  # sampling/dynamic_rounds too
    assert sorted(got.rewarded) == sorted(expected.rewarded)
    assert got_position == position


def test_a_nan_reward_is_no_spread_for_the_decisions_and_the_run_ahead_alike():
    """A reward function's None (NaN) is left out of a tie: a group's decision and the in-call
    run-ahead read the one rule (`dynamic_groups.tied`, `group_ties`)."""
    assert tied([1.0, math.nan, 1.0]) and tied([math.nan]) and not tied([1.0, math.nan, 0.0])
    assert Group(0, 0, None, total=[1.0, math.nan]).tied
    gate = ChunkGate(ChunkRules(G=4, cap=8, chunk=4, max_replaced=0),
                     DynamicResult([Group(0, 0, None)], 1, 4), [], score)
    gate.groups = [Group(0, 0, None)]
    gate.ended = [{0: (None, 1.0, {}), 1: (None, math.nan, {})}]  # half the first chunk ended
    assert gate._tied_so_far(0, range(0, 4))
    gate.ended = [{0: (None, 1.0, {}), 1: (None, 0.0, {})}]
    assert not gate._tied_so_far(0, range(0, 4))


def test_a_budget_keeps_the_rounds():
    spread_at = {0: 2, 1: None, 2: None, 3: 1}
    _, calls, _ = rounds({"training.completions_per_step": 22}, [0, 1, 2], [3], spread_at,
                         in_call=True)
    assert len(calls) > 1  # its chunks go in step order: round by round


def test_budget_and_cap_are_validated_in_one_line():
    for overrides, key in (({"training.completions_per_step": 40}, "completions_per_step"),
                           ({"sampling.dynamic": True, "training.completions_per_step": 8},
                            "completions_per_step"),
                           ({"sampling.dynamic": True, "sampling.max_num_generations": 4},
                            "max_num_generations")):
        with pytest.raises(ConfigError, match=key):
            load_config(overrides=overrides)


# ---- the trainer


def some_tie(prompts, completions, **kwargs):
    """Rewards that tie for about half the prompts (by the prompt's text) and differ within the
    group for the others, even on a random model."""
    return [0.0 if sum(map(ord, str(p))) % 2 else float(sum(map(ord, c)) % 3)
            for p, c in zip(prompts, completions)]


def dynamic_config(tiny_config, **overrides):
    return tiny_config(**{"sampling.dynamic": True, "sampling.max_num_generations": 8,
                          "eval.num_problems": 0, "logging.completions_every": 1, **overrides})


def test_trainer_trains_on_groups_with_spread_only(tiny_config, monkeypatch):
    seen = []
    run = DynamicSampler.run

    def spy(self, *args, **kwargs):
        seen.append(step := run(self, *args, **kwargs))
        return step

    monkeypatch.setattr(DynamicSampler, "run", spy)
    trainer = GRPOTrainer(dynamic_config(tiny_config, **{"training.max_steps": 3}),
                          reward_funcs=[("some_tie", some_tie)])
    trainer.train()
    metrics = read_jsonl(trainer.output_dir / "metrics.jsonl")
    assert [m["frac_reward_zero_std"] for m in metrics] == [0.0] * 3  # the groups trained on
    assert sum(m["sampling/dropped_prompts"] for m in metrics) > 0
    assert any(m["sampling/zero_std_groups_before"] > 0 for m in metrics)
    for m, step in zip(metrics, seen):
        assert m["sampling/completions"] == step.num_sampled >= 2 * 4
        assert m["sampling/dropped_prompts"] == len(step.dropped)
        assert len({g.index for g in step.groups}) == len(step.groups)  # never one twice
    records = read_jsonl(trainer.output_dir / "completions.jsonl")
    trained = {(s, str(g.prompt.index)) for s, step in enumerate(seen, 1) for g in step.trained}
    dropped = {(s, str(g.prompt.index)) for s, step in enumerate(seen, 1) for g in step.dropped}
    assert {(r["step"], r["prompt_id"]) for r in records if "dropped" not in r} == trained
    assert {(r["step"], r["prompt_id"]) for r in records if r.get("dropped")} == dropped
    assert all(r["advantage"] == 0 for r in records if r.get("dropped"))
    assert len(records) == sum(len(g.completions) for step in seen for g in step.groups)
    lines = read_jsonl(trainer.output_dir / "lengths.jsonl")  # every group sampled, in order
    assert [(r["step"], r["prompt_id"], len(r["lengths"]), r.get("dropped", False))
            for r in lines] == [(s, str(g.prompt.index), g.size, g.status == "dropped")
                                for s, step in enumerate(seen, 1) for g in step.groups]


def test_resume_in_the_middle_of_a_dynamic_run_continues_the_same_stream(tiny_config, tmp_path):
    class Killed(Exception):
        pass

    options = {"training.max_steps": 4}
    straight = GRPOTrainer(dynamic_config(tiny_config, **options,
                                          **{"logging.output_dir": str(tmp_path / "a")}),
                           reward_funcs=[("some_tie", some_tie)])
    straight.train()

    def kill_after_step_2(step, _metrics):
        if step == 2:
            raise Killed

    killed = dynamic_config(tiny_config, **options, **{"logging.output_dir": str(tmp_path / "b"),
                                                       "checkpointing.save_every": 2})
    with pytest.raises(Killed):
        GRPOTrainer(killed, reward_funcs=[("some_tie", some_tie)],
                    step_callback=kill_after_step_2).train()
    resumed = GRPOTrainer(dynamic_config(tiny_config, **options,
                                         **{"logging.output_dir": str(tmp_path / "b"),
                                            "checkpointing.resume": "latest"}),
                          reward_funcs=[("some_tie", some_tie)])
    assert resumed.step == 2
    resumed.train()
    assert resumed.stream.state_dict() == straight.stream.state_dict()
    replaced = sum(m["sampling/replaced_prompts"]
                   for m in read_jsonl(tmp_path / "a" / "metrics.jsonl"))
    assert replaced > 0  # the stream's position counts the replacements
    assert straight.stream.position == 4 * 2 + replaced
    rows = [read_jsonl(tmp_path / run / "completions.jsonl") for run in ("a", "b")]
    assert rows[0] == rows[1] and sorted({r["step"] for r in rows[1]}) == [1, 2, 3, 4]
    for key, value in straight.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[key], value, rtol=0, atol=1e-6)
    metrics = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
