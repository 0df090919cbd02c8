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

Several processes: each rank samples and scores its own whole groups, and after each round one
gather hands every rank every group's new rewards (`RankSteps.gather`), so every rank takes the
same decisions and draws the same replacements; a replacement is sampled by the rank whose
dropped group it replaces. Each round is one ordinary sampler call under the run's `RunSizes`
(memory stays flat), and every chunk of a prompt draws from the step's one seed with the key
global id x max_num_generations + index in the group, so a group sampled in chunks has exactly
the completions one call of its final size would give (docs/training_step.md, "Dynamic
sampling").

In one process without `training.completions_per_step` the rounds are not run as calls: one
sampler call takes the same decisions as its samples end, each chunk scored as soon as it has
ended, to the rounds' very result (`dynamic_in_call.py`), so freed rows take the next chunk at
once instead of waiting for the round's longest completion.

Deliberately simple: with several processes (or a completions budget) decisions are taken at
chunk boundaries, each round one sampler call that runs to its end (continuous refill inside
it); rewards are scored per round; a rank sits a round out when none of its
groups needs a chunk (it still joins the round's gather); when no group of the step has spread the
step trains on the dropped groups (all advantages 0), as a step without dynamic sampling would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from infsamp.config_algorithm import SamplingConfig, TrainingConfig
from infsamp.run.dynamic_groups import (
    ChunkRules,
    DynamicResult,
    Group,
    OneProcess,
    PromptSource,
    SampleChunks,
    Score,
    fresh_prompt,
)
from infsamp.run.dynamic_in_call import sample_in_call
from infsamp.tasks.prompts import EncodedPrompt


class DynamicSampler:
    """The step's rounds (module docstring), over the sampler and the reward functions the step
    hands it (`run`)."""

    def __init__(self, sampling: SamplingConfig, training: TrainingConfig, in_call: bool = True):
        self.rules = ChunkRules(sampling.num_generations, sampling.generations_cap,
                                sampling.chunk_generations,
                                max_replaced_prompts(sampling, training))
        self.budget = training.completions_per_step or math.inf  # completions per step
        # the decisions inside one sampler call, where they are the rounds' (`dynamic_in_call`)
        self.in_call = in_call and self.budget == math.inf

    def run(self, batch: Sequence[tuple[int, EncodedPrompt]], stream: PromptSource,
            sample: SampleChunks, score: Score, num_examples: int, ranks=None) -> DynamicResult:
        """Sample, score and decide until every group of the step is decided or dropped
        (`stream`: the prompt stream, replacements drawn from it; `num_examples`: the stream's,
        the most draws a replacement takes; `ranks`: the step's `RankSteps`, None in one
        process)."""
        ranks = ranks or OneProcess()
        owners = {i: rank for rank, share in enumerate(ranks.shares(batch)) for i in share}
        step = DynamicResult([Group(k, index, prompt, owners[k])
                              for k, (index, prompt) in enumerate(batch)], len(batch),
                             self.rules.G)
        if self.in_call and not ranks.distributed:
            return sample_in_call(self.rules, step, stream, sample, score, num_examples)
        requests = [(g, self.rules.G) for g in step.groups]
        while requests:
            self._round(requests, sample, score, step, ranks)
            requests = self._within_budget(self._next_chunks(requests, step), step)
            reserved = step.num_sampled + sum(n for _, n in requests)
            requests += self._replacements(step, stream.next_prompt, reserved, num_examples)
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
            group.add_totals(found[group.position])
            step.rewarded += found[group.position]
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
            elif group.size >= self.rules.cap:
                step.drop(group)
            else:
                more.append((group, self.rules.next_chunk(group.size)))
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

        while (len(step.drops) > replaced() and replaced() < self.rules.max_replaced
               and self.budget - reserved >= self.rules.G):
            found = fresh_prompt(next_prompt, in_step, num_examples)
            if found is None:
                break
            group = Group(len(step.groups), *found, owner=step.drops[replaced()].owner)
            step.groups.append(group)
            in_step.add(group.index)
            added.append((group, self.rules.G))
            reserved += self.rules.G
        return added


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
    calls = ("rounds of sampler calls" if training.completions_per_step else
             "decided inside one sampler call (rounds of calls with several processes)")
    return (f"; dynamic sampling: up to {sampling.generations_cap} completions per prompt in "
            f"chunks of {sampling.chunk_generations}{budget}, {calls}, under the same KV budget "
            "and g (memory unchanged)")
