"""One training step over several ranks: who samples which prompts, and what is gathered after.

    share(batch)        rank 0 predicts each prompt's sampling cost and assigns the step's prompts
                        to ranks (`rank_assignment.py`: lpt or round_robin); every rank
                        learns its share (one small broadcast)
    combine(...)        after sampling and scoring its own groups, every rank sends what the
                        step's statistics need (lengths, finish reasons, rewards per function,
                        the sampler's statistics): B*G numbers, one gather (groups of any
                        sizes: dynamic sampling, whose rounds also use `shares` and `gather`,
                        and `lines` for the groups it dropped). Every rank then holds
                        the whole step's rewards, so its advantages come from the same function
                        on the same values as in one process (`scale_rewards: batch` included)
                        and its loss normaliser (`BatchTotals`) counts the whole step's tokens.

The cost predictor (an `OnlinePredictor` on rank 0 for the assignment alone, fed every group's
lengths after each step; a group's cost is G x its predicted length: the tokens it decodes) and
the metrics (`sampling/rank_imbalance`, `distributed/wait_s`, ...): docs/distributed.md, "Ranks
finish sampling together".

Deliberately simple: one process keeps the same code path with a share of every prompt; the
sampler's statistics are combined by their one table (`sampling.types.COMBINED`: sums, maxima,
else means).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from infsamp.distributed.rank_assignment import assign, imbalance, rank_loads
from infsamp.distributed.ranks import Ranks
from infsamp.rewards.compute import RewardResult
from infsamp.sampling.length_predictor import OnlinePredictor
from infsamp.sampling.traces import group_turns
from infsamp.sampling.types import COMBINE, COMBINED, Completion, make_samples

LINE_KEYS = ("prompt_id", "prompt_tokens", "lengths",  # a lengths.jsonl line (`infsamp simulate`)
             "first_tokens",  # each completion's first sampling.predictor_prefix_tokens ids
             "turns")  # with tool calls: per completion its turns (`traces.episode_turns`)


@dataclass
class StepData:
    rewards: RewardResult  # the whole step's, prompts in step order
    completions: list[Completion]  # the whole step's, group-major (other ranks': no tokens)
    local_rows: list[int]  # rows of this rank's completions in the step
    sampler_metrics: dict[str, float]
    groups: list[dict[str, Any]]  # lengths.jsonl lines, step order


def combine_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One dict from every rank's, by the statistics' one table (`COMBINED`, its ranks column):
    sums, maxima, else means."""
    out: dict[str, float] = {}
    for key in per_rank[0]:
        values = [m[key] for m in per_rank if key in m]
        name = key.removeprefix("sampling/")
        out[key] = COMBINE[COMBINED.get(name, ("", "mean"))[1]](values)
    return out


class RankSteps:
    """The trainer's multi-rank step; with one process `share` is every prompt and `combine` keeps
    the rank's own values."""

    def __init__(self, ranks: Ranks, num_generations: int, max_new_tokens: int, method: str,
                 trace_prefix_tokens: int = 0):
        self.ranks, self.G, self.method = ranks, num_generations, method
        self.max_new = max_new_tokens
        self.trace_prefix_tokens = trace_prefix_tokens  # first tokens kept in lengths.jsonl
        self.costs = OnlinePredictor() if ranks.distributed and ranks.is_main else None
        self.wait_s = 0.0
        self._predicted = 1.0

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def distributed(self) -> bool:  # dynamic sampling reads it (as OneProcess's)
        return self.ranks.distributed

    # ---- before sampling
    def share(self, batch: list[tuple[int, Any]]) -> list[int]:
        """This rank's prompts: indices into `batch`, ascending."""
        return self.shares(batch)[self.ranks.rank]

    def shares(self, batch: list[tuple[int, Any]]) -> list[list[int]]:
        """Every rank's prompts (indices into `batch`, ascending), the same on every rank."""
        if not self.ranks.distributed:
            return [list(range(len(batch)))]
        plan = None
        if self.ranks.is_main:
            costs = [self.G * self.costs.predict(s) for s in self._samples(batch, 1)]
            shares = assign(costs, self.ranks.world_size, self.method)
            plan = {"shares": shares, "predicted": imbalance(rank_loads(shares, costs))}
        plan = self._timed(self.ranks.broadcast_json, plan)
        self._predicted = plan["predicted"]
        return plan["shares"]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's JSON-able `value`, in rank order (one process: its own); timed as a wait."""
        return self._timed(self.ranks.gather_json, value)

    def _samples(self, batch: list[tuple[int, Any]], group_size: int | list[int]) -> list:
        """The step's samples as the sampler lays them out (group_size 1: one per prompt; a list:
        each prompt's own)."""
        return make_samples([len(p.token_ids) for _, p in batch], group_size, self.max_new,
                            [str(p.index) for _, p in batch], [p.text for _, p in batch])

    # ---- after sampling and scoring
    def combine(self, batch, share: list[int], groups, rewards: RewardResult,
                sampler_metrics: dict[str, float]) -> StepData:
        """The whole step's data on every rank (see the module docstring)."""
        mine = _records(batch, share, groups, rewards, sampler_metrics, self.trace_prefix_tokens)
        if not self.ranks.distributed:
            completions = [c for group in groups for c in group]
            return StepData(rewards, completions, list(range(len(completions))),
                            sampler_metrics, [_line(r) for r in mine["groups"]])
        everyone = self.gather(mine)
        data = self._merge(everyone, len(batch), share)
        if self.costs is not None:
            lengths = [length for g in data.groups for length in g["lengths"]]
            self.costs.update(self._samples(batch, [len(g["lengths"]) for g in data.groups]),
                              lengths)
        return data

    def lines(self, batch, share: list[int], groups) -> list[dict[str, Any]]:
        """The lengths.jsonl lines of `batch`'s groups (this rank's: `share`, `groups`), step
        order, on every rank: one gather (dynamic sampling's dropped groups)."""
        mine = _records(batch, share, groups, RewardResult([], {}), {}, self.trace_prefix_tokens)
        everyone = self.gather(mine)  # one process: [mine]
        return [_line(g) for g in _in_step_order(everyone, len(batch))]

    def _merge(self, everyone: list[dict[str, Any]], num_prompts: int,
               share: list[int]) -> StepData:
        groups = _in_step_order(everyone, num_prompts)
        completions = [Completion([], "", n, why, i, j, num_context_tokens=context)
                       for i, g in enumerate(groups)
                       for j, (n, why, context) in enumerate(zip(
                           g["lengths"], g["finish"], g["context_tokens"]))]
        total = [r for g in groups for r in g["total"]]
        per_function = {name: [v for g in groups for v in g["per_function"][name]]
                        for name in everyone[0]["functions"]}
        starts = list(accumulate((len(g["lengths"]) for g in groups), initial=0))  # first rows
        rows = [starts[i] + j for i in share for j in range(len(groups[i]["lengths"]))]
        return StepData(RewardResult(total, per_function), completions, rows,
                        self._sampler_metrics(everyone), [_line(g) for g in groups])

    def _sampler_metrics(self, everyone: list[dict[str, Any]]) -> dict[str, float]:
        per_rank = [record["metrics"] for record in everyone]
        metrics = combine_metrics(per_rank)
        times = [m.get("sampling/wall_time_s", 0.0) for m in per_rank]
        steps = [m.get("sampling/decode_steps", 0.0) for m in per_rank]
        metrics["sampling/rank_imbalance"] = imbalance(times)
        metrics["sampling/rank_imbalance_steps"] = imbalance(steps)
        metrics["sampling/predicted_imbalance"] = self._predicted
        return metrics

    def _timed(self, collective, value):
        start = time.perf_counter()
        try:
            return collective(value)
        finally:
            self.wait_s += time.perf_counter() - start

    def gather_records(self, share: list[int], records: list[Any],
                       sizes: list[int] | None = None) -> list[Any]:
        """Every rank's completion records (`sizes[k]` for prompt `share[k]`, default G each) in
        step order, on every rank (one process: its own); rank 0 writes them."""
        if not self.ranks.distributed:
            return records
        sizes = [self.G] * len(share) if sizes is None else sizes
        by_prompt: dict[int, list[Any]] = {}
        for their_share, theirs, counts in self.gather([share, records, sizes]):
            for position, start, count in zip(their_share, accumulate(counts, initial=0), counts):
                by_prompt[position] = theirs[start:start + count]
        return [r for position in sorted(by_prompt) for r in by_prompt[position]]

    # ---- after the update
    def finish_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Counters that differ per rank summed; this rank's waiting time; on CUDA the busiest
        device's peak memory so far (`memory/peak_gib`); reset for the next step."""
        import torch

        if torch.cuda.is_available():
            metrics["memory/peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if self.ranks.distributed:
            # one sum for both (the same collectives on every rank, whichever keys it has)
            oom, wait = self.ranks.sum([metrics.get("train/oom_retries", 0), self.wait_s])
            if "train/oom_retries" in metrics:
                metrics["train/oom_retries"] = oom
            if "memory/peak_gib" in metrics:
                metrics["memory/peak_gib"] = self.ranks.max([metrics["memory/peak_gib"]])[0]
            wait /= self.ranks.world_size
            metrics["distributed/wait_s"] = round(wait, 3)  # mean over ranks
            metrics["distributed/wait_fraction"] = round(wait / max(metrics["step_time"], 1e-9), 4)
            metrics["distributed/num_ranks"] = self.ranks.world_size
        self.wait_s = 0.0
        return metrics

    # ---- checkpoints
    def state_dict(self) -> dict[str, Any] | None:
        return self.costs.state_dict() if self.costs is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.costs is not None and state is not None:
            self.costs.load_state_dict(state)


def _records(batch, share: list[int], groups, rewards: RewardResult,
             sampler_metrics: dict[str, float], prefix_tokens: int) -> dict[str, Any]:
    """This rank's groups as JSON-able records (a lengths.jsonl line + what the metrics need)."""
    records, start = [], 0
    for position, group in zip(share, groups):  # groups of any sizes (dynamic sampling)
        _, prompt = batch[position]
        rows = slice(start, start + len(group))
        start += len(group)
        extra = {"first_tokens": [list(c.token_ids[:prefix_tokens]) for c in group]} \
            if prefix_tokens else {}
        turns = group_turns(group)
        if turns is not None:
            extra["turns"] = turns
        records.append({"prompt_id": str(prompt.index), "prompt_tokens": len(prompt.token_ids),
                        "lengths": [c.length for c in group], **extra,
                        "finish": [c.finish_reason for c in group],
                        "context_tokens": [c.num_context_tokens for c in group],
                        "total": rewards.total[rows],
                        "per_function": {n: v[rows] for n, v in rewards.per_function.items()}})
    return {"share": share, "groups": records, "functions": list(rewards.per_function),
            "metrics": sampler_metrics}


def _in_step_order(everyone: list[dict[str, Any]], num_prompts: int) -> list[dict[str, Any]]:
    """Every rank's group records (`_records`) by their place in the step."""
    by_prompt: dict[int, dict[str, Any]] = {}
    for record in everyone:
        for position, group in zip(record["share"], record["groups"]):
            by_prompt[position] = group
    return [by_prompt[i] for i in range(num_prompts)]


def _line(record: dict[str, Any]) -> dict[str, Any]:
    return {key: record[key] for key in LINE_KEYS if key in record}
