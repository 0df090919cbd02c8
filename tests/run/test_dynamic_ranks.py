"""Dynamic sampling over several ranks, without processes: two ranks as two threads of this
process whose collectives meet at a barrier (`ThreadRanks`), values sent through JSON as the
wire sends them. Each rank samples only its own groups, yet both take one process's decisions:
the same groups, sizes, statuses, replacements and metrics; a replacement goes to the rank whose
group it replaces; and `RankSteps` gathers groups of unequal sizes in step order."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from infsamp.distributed.rank_step import RankSteps
from infsamp.distributed.ranks import ProcessRanks
from infsamp.rewards.compute import RewardResult
from infsamp.run.dynamic_sampling import DynamicSampler
from infsamp.sampling.types import Completion

from test_dynamic_sampling import Prompt, fake_sample, score, stream_of


class Hub:
    """Where the ranks' values meet: a slot per rank and a barrier."""

    def __init__(self, world_size: int):
        self.slots: list = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=30)


class ThreadRanks(ProcessRanks):
    """Rank `rank` of `hub`: gather_json hands every rank every rank's value (JSON round trip);
    broadcast_json is ProcessRanks' own (a gather of rank 0's value)."""

    def __init__(self, hub: Hub, rank: int):
        self.hub, self.rank, self.world_size = hub, rank, len(hub.slots)

    def gather_json(self, value):
        self.hub.slots[self.rank] = json.loads(json.dumps(value))
        self.hub.barrier.wait()
        everyone = list(self.hub.slots)
        self.hub.barrier.wait()  # nobody writes the next value before every rank has read
        return everyone


def on_ranks(world_size: int, work):
    """`work(rank_steps)` on each rank (a thread each); the results in rank order."""
    hub, results, errors = Hub(world_size), [None] * world_size, []

    def run(rank: int) -> None:
        try:
            results[rank] = work(RankSteps(ThreadRanks(hub, rank), 4, 8, "round_robin"))
        except BaseException as err:  # noqa: BLE001 - re-raised below
            errors.append(err)
            hub.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


SPREAD_AT = {0: 2, 1: 6, 2: None, 3: None, 4: 3, 5: None, 6: None, 7: 5, 8: 1, 9: None}
BATCH, STREAM = [0, 1, 2, 3], [4, 5, 1, 6, 7, 8, 9]


def rounds(load_config, rank_steps=None, in_call=False, **overrides):
    cfg = load_config(overrides={"sampling.dynamic": True, "sampling.num_generations": 4,
                                 "sampling.max_num_generations": 12,
                                 "training.prompts_per_step": len(BATCH), **overrides})
    sample, calls = fake_sample(lambda p, j: [int(SPREAD_AT[p.index] is not None
                                                  and j >= SPREAD_AT[p.index])])
    step = DynamicSampler(cfg.sampling, cfg.training, in_call).run(
        [(i, Prompt(i)) for i in BATCH], stream_of(STREAM), sample, score, len(SPREAD_AT),
        rank_steps)
    return step, calls


def decisions(step):
    return [(g.position, g.index, g.size, g.status, g.tied_first) for g in step.groups]


@pytest.mark.parametrize("overrides", [{}, {"training.completions_per_step": 40},
                                       {"sampling.max_replaced_prompts": 1}])
def test_two_ranks_take_one_process_decisions_sampling_their_own_groups(overrides):
    from infsamp.config_io import load_config

    one, one_calls = rounds(load_config, **overrides)
    in_call, _ = rounds(load_config, in_call=True, **overrides)  # one call, where it applies
    assert decisions(in_call) == decisions(one) and in_call.metrics() == one.metrics()
    two = on_ranks(2, lambda rank_steps: rounds(load_config, rank_steps, **overrides))
    assert len(one.groups) > len(BATCH) and one.dropped  # replacements were needed
    for step, _ in two:
        assert decisions(step) == decisions(one)
        assert step.metrics() == one.metrics()
        assert step.rewarded == one.rewarded
    owners = [g.owner for g in two[0][0].groups]
    assert owners[:4] == [0, 1, 0, 1]  # round_robin's share of the step's B
    for replacement, dropped in zip(two[0][0].groups[4:], two[0][0].drops):
        assert replacement.owner == dropped.owner  # sampled where the prompt it replaces was
    sampled = {}
    for rank, (step, calls) in enumerate(two):
        mine = {g.position for g in step.groups if g.owner == rank}
        assert all(set(positions) <= mine for positions, _, _ in calls)  # its own groups only
        for g in step.groups:
            assert bool(g.completions) == (g.owner == rank)  # completions stay on their rank
            sampled.update({(g.position, c.index_in_group): c.token_ids for c in g.completions})
    expected = {(g.position, c.index_in_group): c.token_ids for g in one.groups
                for c in g.completions}
    assert sampled == expected  # every completion drawn once, where one process draws it
    assert all(step.num_rounds == len(one_calls) for step, _ in two)
    assert min(len(calls) for _, calls in two) < len(one_calls)  # a rank sat a round out


def group(position: int, size: int) -> list[Completion]:
    return [Completion([position, j], "", 2 + j, "eos", position, j) for j in range(size)]


def test_combine_and_records_gather_groups_of_unequal_sizes_in_step_order():
    sizes = [3, 1, 4, 2, 5]  # rank 0 holds 0, 2, 4; rank 1 holds 1, 3 (round_robin)
    batch = [(p, Prompt(p)) for p in range(len(sizes))]

    def work(rank_steps):
        share = rank_steps.share(batch)
        groups = [group(p, sizes[p]) for p in share]
        totals = [float(10 * p + j) for p in share for j in range(sizes[p])]
        step = rank_steps.combine(batch, share, groups, RewardResult(totals, {"r": totals}), {})
        records = [{"p": p, "j": j} for p in share for j in range(sizes[p])]
        gathered = rank_steps.gather_records(share, records, [sizes[p] for p in share])
        lines = rank_steps.lines(batch, share, groups)
        return step, gathered, lines, totals

    results = on_ranks(2, work)
    rows = [(p, j) for p in range(len(sizes)) for j in range(sizes[p])]
    for step, gathered, lines, _ in results:
        assert step.rewards.total == [float(10 * p + j) for p, j in rows]
        assert [c.length for c in step.completions] == [2 + j for _, j in rows]
        assert [(r["p"], r["j"]) for r in gathered] == rows
        assert [len(line["lengths"]) for line in lines] == sizes
    for step, _, _, totals in results:  # each rank's rows pick its own rewards out of the step's
        assert [step.rewards.total[r] for r in step.local_rows] == totals
    torch.testing.assert_close(torch.tensor(results[0][0].rewards.per_function["r"]),
                               torch.tensor(results[0][0].rewards.total))
