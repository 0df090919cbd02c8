"""Dynamic sampling: a prompt is sampled until its rewards differ (`sampling.dynamic`).

    round 1     every prompt of the step gets G completions (one sampler call), scored
    round k     a prompt whose rewards all tie (`advantages.group_ties`) gets another chunk
                (`sampling.dynamic_chunk`, default G) in the next sampler call, up to
                `sampling.max_num_generations`; a prompt at that cap still without spread is
                dropped from the update and replaced by the stream's next prompt (at most
                `sampling.max_replaced_prompts` per step), whose first G completions join the
                next round
    the step    trains on the groups with spread, each of its own size; with
                `training.completions_per_step` the step samples at most that many completions
                (every prompt's first G, then chunks to undecided prompts in step order, then
                replacements while a whole first chunk still fits)

Several processes: each rank samples and scores its own whole groups (the step's B shared by
`RankSteps.shares`, as without dynamic sampling), and after each round one gather hands every rank
every group's new rewards (`RankSteps.gather`), so every rank takes the same decisions, draws the
same replacements from its copy of the stream and numbers them alike; a replacement is sampled by
the rank whose dropped group it replaces (in the order they were dropped). Sample keys are by
place in the step, so the completions do not depend on the process count. A rank whose groups
were all dropped trains on nothing that step: it runs one zero backward, so the gradient
reduction still meets the other ranks' (`GRPOStep._padding_backward`).

Memory stays flat: each round is one ordinary sampler call under the run's sizes (`RunSizes`:
the same KV budget and g), so a group of 32 costs no more KV than a group of 8, only more calls.
Every chunk of a prompt draws from the step's one seed with the key global id x
max_num_generations + index in the group, so a group sampled in chunks has exactly the
completions one call of its final size would give (any policy, either engine).

Deliberately simple: decisions are taken at chunk boundaries, each round one sampler call that
runs to its end (continuous refill inside it), not while a call is running; rewards are scored
per round, as the reward functions are called today; a rank sits a round out when none of its
groups needs a chunk (it still joins the round's gather); when no group of the step has spread the
step trains on the dropped groups (all advantages 0), as a step without dynamic sampling would.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from infsamp.algorithm.advantages import group_ties
from infsamp.config_algorithm import SamplingConfig, TrainingConfig
from infsamp.rewards.compute import RewardResult
from infsamp.sampling.types import Completion, SampleResult, SamplerStats
from infsamp.tasks.prompts import EncodedPrompt

# (prompts, completions per prompt, index of each prompt's first one, global ids) -> result
SampleChunks = Callable[[list[EncodedPrompt], list[int], list[int], list[int]], SampleResult]
Score = Callable[[list[Any], list[str], list[list[int]]], RewardResult]


class OneProcess:
    """The rounds' view of the ranks in one process (`RankSteps` offers the same three)."""

    rank = 0

    def shares(self, batch: Sequence[Any]) -> list[list[int]]:
        return [list(range(len(batch)))]

    def gather(self, value: Any) -> list[Any]:
        return [value]


@dataclass
class Group:
    """One prompt of the step and what it has so far."""

    position: int  # its place in the step (its global id: the base of its sample keys)
    index: int  # the example's index in the training split
    prompt: EncodedPrompt
    owner: int = 0  # the rank that samples it (the completions and per-function rewards: there)
    completions: list[Completion] = field(default_factory=list)
    total: list[float] = field(default_factory=list)  # every rank: one per completion so far
    per_function: dict[str, list[float]] = field(default_factory=dict)
    tied_first: bool = False  # no spread after its first chunk
    status: str = "open"  # open, decided (spread), dropped (none at its end)

    def add(self, completions: list[Completion], rewards: RewardResult, rows: slice) -> None:
        """Its chunk's completions and rewards per function (on its owner)."""
        self.completions += completions
        for name, values in rewards.per_function.items():
            self.per_function.setdefault(name, []).extend(values[rows])

    @property
    def size(self) -> int:
        return len(self.total)

    @property
    def tied(self) -> bool:
        return bool(group_ties(torch.tensor([self.total], dtype=torch.float32))[0])


@dataclass
class DynamicResult:
    """What a step's rounds sampled and decided; `metrics` are its `sampling/*` lines."""

    groups: list[Group]  # every group begun, step order (the step's B first, then replacements)
    num_prompts: int  # the step's B
    num_generations: int  # G
    calls: list[SamplerStats] = field(default_factory=list)  # this rank's, one per round
    num_rounds: int = 0
    timeouts: dict[str, int] = field(default_factory=dict)  # every rank's
    rewarded: list[float] = field(default_factory=list)  # every sampled completion's reward
    drops: list[Group] = field(default_factory=list)  # in the order they were dropped

    @property
    def trained(self) -> list[Group]:
        """The groups the update uses: those with spread (none: the dropped ones, all 0)."""
        return [g for g in self.groups if g.status == "decided"] or self.dropped

    def drop(self, group: Group) -> None:
        group.status = "dropped"
        self.drops.append(group)

    @property
    def dropped(self) -> list[Group]:
        return [g for g in self.groups if g.status == "dropped"]

    @property
    def num_sampled(self) -> int:
        return sum(g.size for g in self.groups)

    def rewards(self, groups: list[Group], names: Sequence[str]) -> RewardResult:
        """These groups' rewards (this rank's), group-major; `names`: the reward functions."""
        return RewardResult([r for g in groups for r in g.total],
                            {n: [v for g in groups for v in g.per_function[n]] for n in names},
                            dict(self.timeouts))

    def sampler_metrics(self) -> dict[str, float]:
        """This rank's rounds' sampler statistics, merged (`RankSteps.combine` merges ranks)."""
        return SamplerStats.merge(self.calls).to_metrics()

    def metrics(self) -> dict[str, float]:
        """The step's `sampling/*` decisions, the same on every rank."""
        sampled, first = self.num_sampled, self.num_prompts * self.num_generations
        scored = [r for r in self.rewarded if not math.isnan(r)]
        return {"sampling/completions": sampled,
                "sampling/dropped_prompts": len(self.dropped),
                "sampling/trained_groups": len(self.trained),
                "sampling/replaced_prompts": len(self.groups) - self.num_prompts,
                "sampling/zero_std_groups_before":
                    sum(g.tied_first for g in self.groups) / len(self.groups),
                "sampling/extra_completions_frac": max(sampled - first, 0) / max(sampled, 1),
                "sampling/dynamic_rounds": self.num_rounds,
                "sampling/reward_sampled": sum(scored) / len(scored) if scored else math.nan}


class DynamicSampler:
    """The step's rounds (module docstring), over the sampler and the reward functions the step
    hands it (`run`)."""

    def __init__(self, sampling: SamplingConfig, training: TrainingConfig):
        self.G, self.cap, self.chunk = (sampling.num_generations, sampling.generations_cap,
                                        sampling.chunk_generations)
        self.max_replaced = max_replaced_prompts(sampling, training)
        self.budget = training.completions_per_step or math.inf  # completions per step

    def run(self, batch: Sequence[tuple[int, EncodedPrompt]],
            next_prompt: Callable[[], tuple[int, EncodedPrompt]], sample: SampleChunks,
            score: Score, num_examples: int, ranks=None) -> DynamicResult:
        """Sample, score and decide until every group of the step is decided or dropped
        (`num_examples`: the stream's, the most draws a replacement takes; `ranks`: the step's
        `RankSteps`, None in one process)."""
        ranks = ranks or OneProcess()
        owners = {i: rank for rank, share in enumerate(ranks.shares(batch)) for i in share}
        step = DynamicResult([Group(k, index, prompt, owners[k])
                              for k, (index, prompt) in enumerate(batch)], len(batch), self.G)
        requests = [(g, self.G) for g in step.groups]
        while requests:
            self._round(requests, sample, score, step, ranks)
            requests = self._within_budget(self._next_chunks(requests, step), step)
            reserved = step.num_sampled + sum(n for _, n in requests)
            requests += self._replacements(step, next_prompt, reserved, num_examples)
        return step

    def _round(self, requests: list[tuple[Group, int]], sample: SampleChunks, score: Score,
               step: DynamicResult, ranks) -> None:
        """One round: this rank's sampler call over its requests, scored; then every rank's
        rewards of the round to every rank (one gather), so each group has its chunk's."""
        mine = [(g, n) for g, n in requests if g.owner == ranks.rank]
        totals, timeouts = self._sample_mine(mine, sample, score, step) if mine else ([], {})
        found: dict[int, list[float]] = {}
        for theirs in ranks.gather({"totals": totals, "timeouts": timeouts}):
            found.update((position, values) for position, values in theirs["totals"])
            for name, count in theirs["timeouts"].items():
                step.timeouts[name] = step.timeouts.get(name, 0) + count
        for group, _ in requests:  # request order: one process's order of the rewards
            first = group.size == 0
            group.total += found[group.position]
            step.rewarded += found[group.position]
            group.tied_first = group.tied if first else group.tied_first
        step.num_rounds += 1

    def _sample_mine(self, mine: list[tuple[Group, int]], sample: SampleChunks, score: Score,
                     step: DynamicResult) -> tuple[list, dict[str, int]]:
        """This rank's sampler call and scoring; returns [position, chunk rewards] per group and
        the reward timeouts."""
        chosen = [g for g, _ in mine]
        sampled = sample([g.prompt for g in chosen], [n for _, n in mine],
                         [g.size for g in chosen], [g.position for g in chosen])
        completions = [c for group in sampled.groups for c in group]
        rewards = score([g.prompt.example for g, n in mine for _ in range(n)],
                        [c.text for c in completions], [c.token_ids for c in completions])
        totals, start = [], 0
        for group, chunk in zip(chosen, sampled.groups):
            rows = slice(start, start + len(chunk))
            group.add(chunk, rewards, rows)
            totals.append([group.position, rewards.total[rows]])
            start += len(chunk)
        step.calls.append(sampled.stats)
        return totals, dict(rewards.timeouts)

    def _next_chunks(self, requests: list[tuple[Group, int]],
                     step: DynamicResult) -> list[tuple[Group, int]]:
        """Decide the groups just sampled: spread (decided), at the cap (dropped) or another
        chunk."""
        more = []
        for group, _ in requests:
            if not group.tied:
                group.status = "decided"
            elif group.size >= self.cap:
                step.drop(group)
            else:
                more.append((group, min(self.chunk, self.cap - group.size)))
        return more

    def _within_budget(self, requests: list[tuple[Group, int]],
                       step: DynamicResult) -> list[tuple[Group, int]]:
        """`training.completions_per_step`: chunks in step order while the budget lasts; a group
        left without any is dropped."""
        left, kept = self.budget - step.num_sampled, []
        for group, count in requests:
            count = int(min(count, left))
            if count < 1:
                step.drop(group)
                continue
            kept.append((group, count))
            left -= count
        return kept

    def _replacements(self, step: DynamicResult, next_prompt, reserved: int,
                      num_examples: int) -> list[tuple[Group, int]]:
        """A new prompt of the stream for each dropped group not yet replaced, while the step's
        limit and the budget (a whole first chunk, beyond the `reserved` completions) allow;
        never one already in the step. It goes to the rank of the group it replaces."""
        added: list[tuple[Group, int]] = []
        in_step = {g.index for g in step.groups}

        def replaced() -> int:
            return len(step.groups) - step.num_prompts

        while (len(step.drops) > replaced() and replaced() < self.max_replaced
               and self.budget - reserved >= self.G):
            found = self._fresh_prompt(next_prompt, in_step, num_examples)
            if found is None:
                break
            group = Group(len(step.groups), *found, owner=step.drops[replaced()].owner)
            step.groups.append(group)
            in_step.add(group.index)
            added.append((group, self.G))
            reserved += self.G
        return added

    @staticmethod
    def _fresh_prompt(next_prompt, in_step: set[int], num_examples: int):
        """The stream's next prompt not yet in the step (None after a whole epoch of them)."""
        for _ in range(num_examples):
            index, prompt = next_prompt()
            if index not in in_step:
                return index, prompt
        return None


def max_replaced_prompts(sampling: SamplingConfig, training: TrainingConfig) -> int:
    """`sampling.max_replaced_prompts` resolved (-1: `training.prompts_per_step`)."""
    limit = sampling.max_replaced_prompts
    return training.prompts_per_step if limit < 0 else limit


def plan_note(sampling: SamplingConfig, training: TrainingConfig) -> str:
    """The start-up line's dynamic-sampling part: memory does not grow with the extra
    completions ('' when off)."""
    if not sampling.dynamic:
        return ""
    budget = (f", at most {training.completions_per_step} per step"
              if training.completions_per_step else "")
    return (f"; dynamic sampling: up to {sampling.generations_cap} completions per prompt in "
            f"chunks of {sampling.chunk_generations}{budget}, each round one sampler call under "
            "the same KV budget and g (memory unchanged)")
