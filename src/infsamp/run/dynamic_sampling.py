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

Memory stays flat: each round is one ordinary sampler call under the run's sizes (`RunSizes`:
the same KV budget and g), so a group of 32 costs no more KV than a group of 8, only more calls.
Every chunk of a prompt draws from the step's one seed with the key global id x
max_num_generations + index in the group, so a group sampled in chunks has exactly the
completions one call of its final size would give (any policy, either engine).

Deliberately simple: decisions are taken at chunk boundaries, each round one sampler call that
runs to its end (continuous refill inside it), not while a call is running; rewards are scored
per round, as the reward functions are called today; one process only (the trainer refuses
`sampling.dynamic` over several ranks); when no group of the step has spread the step trains on
the dropped groups (all advantages 0), as a step without dynamic sampling would.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from infsamp.algorithm.advantages import group_ties
from infsamp.config import Config, ConfigError, SamplingConfig, TrainingConfig
from infsamp.rewards.compute import RewardResult
from infsamp.sampling.types import Completion, SampleResult, SamplerStats
from infsamp.tasks.prompts import EncodedPrompt

# (prompts, completions per prompt, index of each prompt's first one, global ids) -> result
SampleChunks = Callable[[list[EncodedPrompt], list[int], list[int], list[int]], SampleResult]
Score = Callable[[list[Any], list[str], list[list[int]]], RewardResult]


@dataclass
class Group:
    """One prompt of the step and what it has so far."""

    position: int  # its place in the step (its global id: the base of its sample keys)
    index: int  # the example's index in the training split
    prompt: EncodedPrompt
    completions: list[Completion] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    per_function: dict[str, list[float]] = field(default_factory=dict)
    tied_first: bool = False  # no spread after its first chunk
    status: str = "open"  # open, decided (spread), dropped (none at its end)

    def add(self, completions: list[Completion], rewards: RewardResult, rows: slice) -> None:
        self.completions += completions
        self.total += rewards.total[rows]
        for name, values in rewards.per_function.items():
            self.per_function.setdefault(name, []).extend(values[rows])

    @property
    def tied(self) -> bool:
        return bool(group_ties(torch.tensor([self.total], dtype=torch.float32))[0])


@dataclass
class DynamicResult:
    """What a step's rounds sampled and decided; `metrics` are its `sampling/*` lines."""

    groups: list[Group]  # every group begun, step order (the step's B first, then replacements)
    num_prompts: int  # the step's B
    num_generations: int  # G
    calls: list[SamplerStats] = field(default_factory=list)  # one per round
    timeouts: dict[str, int] = field(default_factory=dict)
    rewarded: list[float] = field(default_factory=list)  # every sampled completion's reward

    @property
    def trained(self) -> list[Group]:
        """The groups the update uses: those with spread (none: the dropped ones, all 0)."""
        return [g for g in self.groups if g.status == "decided"] or self.dropped

    @property
    def dropped(self) -> list[Group]:
        return [g for g in self.groups if g.status == "dropped"]

    @property
    def num_sampled(self) -> int:
        return sum(len(g.completions) for g in self.groups)

    def rewards(self) -> RewardResult:
        """The trained groups' rewards, group-major."""
        trained = self.trained
        names = trained[0].per_function if trained else {}
        return RewardResult([r for g in trained for r in g.total],
                            {n: [v for g in trained for v in g.per_function[n]] for n in names},
                            dict(self.timeouts))

    def metrics(self) -> dict[str, float]:
        sampled, first = self.num_sampled, self.num_prompts * self.num_generations
        scored = [r for r in self.rewarded if not math.isnan(r)]
        return {**SamplerStats.merge(self.calls).to_metrics(),
                "sampling/completions": sampled,
                "sampling/dropped_prompts": len(self.dropped),
                "sampling/trained_groups": len(self.trained),
                "sampling/replaced_prompts": len(self.groups) - self.num_prompts,
                "sampling/zero_std_groups_before":
                    sum(g.tied_first for g in self.groups) / len(self.groups),
                "sampling/extra_completions_frac": max(sampled - first, 0) / max(sampled, 1),
                "sampling/dynamic_rounds": len(self.calls),
                "sampling/reward_sampled": sum(scored) / len(scored) if scored else math.nan}


class DynamicSampler:
    """The step's rounds (module docstring), over the sampler and the reward functions the step
    hands it (`run`)."""

    def __init__(self, sampling: SamplingConfig, training: TrainingConfig):
        self.G, self.cap, self.chunk = (sampling.num_generations, sampling.generations_cap,
                                        sampling.chunk_generations)
        self.max_replaced = (training.prompts_per_step if sampling.max_replaced_prompts < 0
                             else sampling.max_replaced_prompts)
        self.budget = training.completions_per_step or math.inf  # completions per step

    def run(self, batch: Sequence[tuple[int, EncodedPrompt]],
            next_prompt: Callable[[], tuple[int, EncodedPrompt]], sample: SampleChunks,
            score: Score, num_examples: int) -> DynamicResult:
        """Sample, score and decide until every group of the step is decided or dropped
        (`num_examples`: the stream's, the most draws a replacement takes)."""
        step = DynamicResult([Group(k, index, prompt) for k, (index, prompt) in enumerate(batch)],
                             len(batch), self.G)
        requests = [(g, self.G) for g in step.groups]
        while requests:
            self._round(requests, sample, score, step)
            requests = self._within_budget(self._next_chunks(requests), step.num_sampled)
            reserved = step.num_sampled + sum(n for _, n in requests)
            requests += self._replacements(step, next_prompt, reserved, num_examples)
        return step

    def _round(self, requests: list[tuple[Group, int]], sample: SampleChunks, score: Score,
               step: DynamicResult) -> None:
        """One sampler call over the requests, scored; each group gets its chunk."""
        chosen = [g for g, _ in requests]
        sampled = sample([g.prompt for g in chosen], [n for _, n in requests],
                         [len(g.completions) for g in chosen], [g.position for g in chosen])
        completions = [c for group in sampled.groups for c in group]
        rewards = score([g.prompt.example for g, n in requests for _ in range(n)],
                        [c.text for c in completions], [c.token_ids for c in completions])
        start = 0
        for group, chunk in zip(chosen, sampled.groups):
            first = not group.completions
            group.add(chunk, rewards, slice(start, start + len(chunk)))
            start += len(chunk)
            group.tied_first = group.tied if first else group.tied_first
        for name, count in rewards.timeouts.items():
            step.timeouts[name] = step.timeouts.get(name, 0) + count
        step.rewarded += rewards.total
        step.calls.append(sampled.stats)

    def _next_chunks(self, requests: list[tuple[Group, int]]) -> list[tuple[Group, int]]:
        """Decide the groups just sampled: spread (decided), at the cap (dropped) or another
        chunk."""
        more = []
        for group, _ in requests:
            size = len(group.completions)
            if not group.tied:
                group.status = "decided"
            elif size >= self.cap:
                group.status = "dropped"
            else:
                more.append((group, min(self.chunk, self.cap - size)))
        return more

    def _within_budget(self, requests: list[tuple[Group, int]],
                       spent: int) -> list[tuple[Group, int]]:
        """`training.completions_per_step`: chunks in step order while the budget lasts; a group
        left without any is dropped."""
        left, kept = self.budget - spent, []
        for group, count in requests:
            count = int(min(count, left))
            if count < 1:
                group.status = "dropped"
                continue
            kept.append((group, count))
            left -= count
        return kept

    def _replacements(self, step: DynamicResult, next_prompt, reserved: int,
                      num_examples: int) -> list[tuple[Group, int]]:
        """A new prompt of the stream for each dropped group not yet replaced, while the step's
        limit and the budget (a whole first chunk, beyond the `reserved` completions) allow;
        never one already in the step."""
        added: list[tuple[Group, int]] = []
        in_step = {g.index for g in step.groups}

        def replaced() -> int:
            return len(step.groups) - step.num_prompts

        while (len(step.dropped) > replaced() and replaced() < self.max_replaced
               and self.budget - reserved >= self.G):
            found = self._fresh_prompt(next_prompt, in_step, num_examples)
            if found is None:
                break
            group = Group(len(step.groups), *found)
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


def check_dynamic_sampling(cfg: Config, world_size: int) -> None:
    """`sampling.dynamic` runs in one process (ConfigError, one line, before anything loads)."""
    if cfg.sampling.dynamic and world_size > 1:
        raise ConfigError(f"sampling.dynamic: runs in one process only (this launch has "
                          f"{world_size}); set sampling.dynamic false or launch one process")


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
