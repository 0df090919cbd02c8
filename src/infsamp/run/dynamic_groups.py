"""Dynamic sampling's plain data: one prompt's group as the step's rounds grow it, the step's
result, and the rounds' view of one process. Used by the rounds (`dynamic_sampling.py`) and by
the decisions inside one call (`dynamic_in_call.py`).

Deliberately simple: a group's rewards live on every rank (`total`), its completions and
per-function rewards on its owner only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from infsamp.algorithm.advantages import group_ties
from infsamp.rewards.compute import RewardResult
from infsamp.sampling.types import Completion, SampleResult, SamplerStats
from infsamp.tasks.prompts import EncodedPrompt

# (prompts, completions per prompt, index of each prompt's first one, global ids) -> result;
# with `gate=` (a `SampleGate`), one call whose decisions are taken inside it
SampleChunks = Callable[[list[EncodedPrompt], list[int], list[int], list[int]], SampleResult]
Score = Callable[[list[Any], list[str], list[list[int]]], RewardResult]


class PromptSource(Protocol):
    """The prompt stream as dynamic sampling draws from it (`run/prompt_stream.PromptStream`);
    its state lets one call peek at the replacements it may need."""

    def next_prompt(self) -> tuple[int, EncodedPrompt]: ...

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: dict[str, int]) -> None: ...


@dataclass(frozen=True)
class ChunkRules:
    """What a step's groups may get: G completions first, then chunks of `chunk` up to `cap`;
    at most `max_replaced` dropped prompts replaced per step."""

    G: int
    cap: int
    chunk: int
    max_replaced: int

    def next_chunk(self, size: int) -> int:
        """How many completions a group of `size` gets next: G first, then a chunk, up to the
        cap (0 at the cap)."""
        return self.G if size == 0 else min(self.chunk, self.cap - size)


def tied(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards so far have no spread (`group_ties`: NaN rewards left out)."""
    return bool(group_ties(torch.tensor([list(rewards)], dtype=torch.float32))[0])


def fresh_prompt(next_prompt: Callable[[], tuple[int, EncodedPrompt]], in_step: set[int],
                 num_examples: int) -> tuple[int, EncodedPrompt] | None:
    """The stream's next prompt not yet in the step (None after a whole epoch of them)."""
    for _ in range(num_examples):
        index, prompt = next_prompt()
        if index not in in_step:
            return index, prompt
    return None


class OneProcess:
    """The rounds' view of the ranks in one process (`RankSteps` offers the same four)."""

    rank = 0
    distributed = False

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

    def add_totals(self, totals: list[float]) -> None:
        """Its chunk's total rewards (on every rank); its first chunk's decide `tied_first`."""
        first = self.size == 0
        self.total += totals
        if first:
            self.tied_first = self.tied

    @property
    def size(self) -> int:
        return len(self.total)

    @property
    def tied(self) -> bool:
        return tied(self.total)


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
