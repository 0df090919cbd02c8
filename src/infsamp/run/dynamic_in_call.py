"""Dynamic sampling's decisions inside one sampler call (one process, no completions budget).

The rounds (`dynamic_sampling.py`) decide between sampler calls: each round lasts until its
longest completion ends while the rows of the finished ones stand empty (a recipe step ran ~140
decode steps for ~80 completions). Here the step is one call that declares every sample the
step could need, each prompt's cap and the cap of each replacement the step may take (peeked
from the stream), and a gate (`sampling.types.SampleGate`) holds all but each prompt's first G.
As soon as a group's chunk has ended its rewards are scored and it is decided as a round would
decide it:

    spread             decided; the rest of its samples cancelled
    tied, below cap    its next chunk (`sampling.dynamic_chunk`) released into the running call
    tied, at the cap   dropped, the rest cancelled; while the drops outnumber the replacements
                       (and the limit allows) the next replacement's first G released

Once no group is open whatever is still held is cancelled and the call ends.

The result is the rounds' exactly: a completion is drawn by its key (place in the step x cap +
index in the group) whatever runs beside it, so every chunk has the rounds' completions and
rewards and every group the rounds' decisions; in one process only the number of drops says
which replacements start, and the i-th is the stream's i-th fresh prompt either way (peeked,
then the stream rewound and the ones used drawn again, as the rounds draw them). The rounds a
step would have taken are recomputed from the groups (`sampling/dynamic_rounds`).

Deliberately simple: one process (with several, the drops of every rank decide the replacements:
the rounds, one gather each); no `training.completions_per_step` (its chunks go in step order:
the rounds); the planner's bound on g counts every declared prompt as if all were open at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from infsamp.rewards.compute import RewardResult
from infsamp.run.dynamic_groups import (
    ChunkRules,
    DynamicResult,
    Group,
    PromptSource,
    SampleChunks,
    Score,
    fresh_prompt,
    tied,
)
from infsamp.sampling.types import Completion, Sample

# a chunk with at least this share of its samples ended, every reward so far tied: what the
# group likely needs next starts (measured on the recipe: docs/training_step.md)
RUN_AHEAD_ENDED = 0.5


class ChunkGate:
    """The step's decisions inside its one sampler call (`SampleGate`); call group k of the
    call is `groups[k]`: the step's prompts, then the replacements it may take, in order."""

    def __init__(self, rules: ChunkRules, step: DynamicResult, candidates: list[Group],
                 score: Score):
        self.rules, self.step, self.score = rules, step, score
        self.declared = step.groups + candidates

    def begin(self, samples: Sequence[Sample]) -> set[int]:
        self.groups = [Group(g.position, g.index, g.prompt, g.owner) for g in self.declared]
        self.ids: list[list[int]] = [[] for _ in self.groups]  # call group -> ids by index
        for sample in samples:
            self.ids[sample.group_id].append(sample.sample_id)
        # call group -> index -> its completion and (total, reward per function), once ended
        self.ended: list[dict[int, tuple[Completion, float, dict]]] = [{} for _ in self.groups]
        self.released = [0] * len(self.groups)  # each group's samples released, by index
        self.held = {s.sample_id for s in samples}
        self.num_started, self.drops = self.step.num_prompts, []
        self.rewarded: list[float] = []
        self.timeouts: dict[str, int] = {}
        self.to_release: list[int] = []
        self.to_cancel: list[int] = []
        for k in range(self.num_started):
            self._release_to(k, self.rules.G)
        return set(self.held)

    def after_step(self, finished: Sequence[Completion]) -> tuple[list[int], list[int], bool]:
        self.to_release, self.to_cancel = [], []
        if finished:
            self._score(finished)
        for k in sorted({c.group_id for c in finished if c.group_id < self.num_started}):
            self._settle(k)
        stop = not any(g.status == "open" for g in self.groups[:self.num_started])
        if not stop:
            self._run_ahead()
        return self.to_release, self.to_cancel, stop

    def _score(self, finished: Sequence[Completion]) -> None:
        """The step's ended completions scored at once (one reward call), kept by index."""
        rewards = self.score([self.groups[c.group_id].prompt.example for c in finished],
                             [c.text for c in finished], [c.token_ids for c in finished])
        for row, c in enumerate(finished):
            values = {name: column[row] for name, column in rewards.per_function.items()}
            self.ended[c.group_id][c.index_in_group] = (c, rewards.total[row], values)
        for name, count in rewards.timeouts.items():
            self.timeouts[name] = self.timeouts.get(name, 0) + count

    def _chunk(self, k: int) -> range:
        """Group k's chunk now undecided: its first G, else the next up to the cap."""
        size = self.groups[k].size
        return range(size, size + self.rules.next_chunk(size))

    def _settle(self, k: int) -> None:
        """Group k's chunks that have ended, decided in order (module docstring)."""
        group = self.groups[k]
        while group.status == "open":
            chunk = self._chunk(k)
            if any(i not in self.ended[k] for i in chunk):
                return
            self._add(k, chunk)
            if not group.tied:
                group.status = "decided"
            elif group.size >= self.rules.cap:
                group.status = "dropped"
                self.drops.append(group)
                self._replace()
            else:
                self._release_to(k, self._chunk(k).stop)
        self._cancel(self.ids[k][group.size:])

    def _add(self, k: int, chunk: range) -> None:
        """Group k's ended chunk added to it, in index order, with its rewards."""
        group, rows = self.groups[k], [self.ended[k][i] for i in chunk]
        totals = [total for _, total, _ in rows]
        per_function = {name: [values[name] for _, _, values in rows] for name in rows[0][2]}
        group.add([c for c, _, _ in rows], RewardResult(totals, per_function), slice(0, len(rows)))
        group.add_totals(totals)
        self.rewarded += totals

    def _replace(self) -> None:
        """A replacement started for each drop not yet replaced, while there are any left."""
        while len(self.drops) > self.num_started - self.step.num_prompts and \
                self.num_started < len(self.groups):
            self.num_started += 1
            self._release_to(self.num_started - 1, self.rules.G)
            self._settle(self.num_started - 1)  # it may have run ahead

    def _run_ahead(self) -> None:
        """An open group whose undecided chunk has `RUN_AHEAD_ENDED` of its samples ended,
        every reward so far tied, likely needs more: its next chunk starts now, or, at the cap,
        the next replacement's first G (as many as such groups). Used only if the decision asks
        for them; else cancelled if not started, or dropped with the call when it stops."""
        likely_drops = 0
        for k in range(self.num_started):
            chunk = self._chunk(k)
            if self.groups[k].status != "open" or not self._tied_so_far(k, chunk):
                continue
            if chunk.stop < self.rules.cap:
                self._release_to(k, chunk.stop + self.rules.next_chunk(chunk.stop))
            else:
                likely_drops += 1
        replaced = self.num_started - self.step.num_prompts
        wanted = min(len(self.drops) + likely_drops - replaced, len(self.groups) - self.num_started)
        for k in range(self.num_started, self.num_started + max(wanted, 0)):
            self._release_to(k, self.rules.G)

    def _tied_so_far(self, k: int, chunk: range) -> bool:
        """`RUN_AHEAD_ENDED` of the chunk ended, and every reward so far tied (`tied`)."""
        ended = [self.ended[k][i][1] for i in chunk if i in self.ended[k]]
        return len(ended) >= RUN_AHEAD_ENDED * len(chunk) and tied(self.groups[k].total + ended)

    def _release_to(self, k: int, end: int) -> None:
        """Group k's samples up to index `end` released."""
        ids = self.ids[k][self.released[k]:end]
        self.released[k] = max(self.released[k], end)
        self.to_release += ids
        self.held.difference_update(ids)

    def _cancel(self, ids: list[int]) -> None:
        """The samples a decided or dropped group will not use: those not started are
        cancelled (a running one runs on, ignored)."""
        self.held.difference_update(ids)
        self.to_cancel += ids


def sample_in_call(rules: ChunkRules, step: DynamicResult, stream: PromptSource,
                   sample: SampleChunks, score: Score, num_examples: int) -> DynamicResult:
    """The step's groups sampled, scored and decided in one sampler call; `step` holds its
    prompts (positions 0..B-1) and gets every group begun, as the rounds leave it."""
    before = stream.state_dict()
    candidates = _peek_replacements(rules, step, stream, num_examples)
    gate = ChunkGate(rules, step, candidates, score)
    declared = gate.declared
    result = sample([g.prompt for g in declared], [rules.cap] * len(declared),
                    [0] * len(declared), [g.position for g in declared], gate=gate)
    step.groups = gate.groups[:gate.num_started]
    step.calls.append(result.stats)
    step.rewarded, step.timeouts = gate.rewarded, gate.timeouts
    stream.load_state_dict(before)  # the stream as the rounds leave it: the same draws
    _peek_replacements(rules, step, stream, num_examples, len(gate.drops))
    step.num_rounds, step.drops = _rounds_of(step, rules)
    return step


def _peek_replacements(rules: ChunkRules, step: DynamicResult, stream: PromptSource,
                       num_examples: int, num_drops: int | None = None) -> list[Group]:
    """The replacements the step may take (`num_drops` given: as many as the rounds try for
    that many drops, so the stream ends where theirs does), positions after the step's."""
    wanted = rules.max_replaced if num_drops is None else min(num_drops, rules.max_replaced)
    in_step = {g.index for g in step.groups[:step.num_prompts]}
    found: list[Group] = []
    while len(found) < wanted:
        drawn = fresh_prompt(stream.next_prompt, in_step, num_examples)
        if drawn is None:
            break
        found.append(Group(step.num_prompts + len(found), *drawn))
        in_step.add(drawn[0])
    return found


def _rounds_of(step: DynamicResult, rules: ChunkRules) -> tuple[int, list[Group]]:
    """The rounds the step would have taken, and its drops in the rounds' order (by round, then
    place in the step): the step's prompts start in round 1, the i-th replacement in the round
    after the one of the (i+1)-th drop; a group's chunks run in consecutive rounds."""
    first_round = {g.position: 1 for g in step.groups[:step.num_prompts]}
    chunks = {g.position: 1 + -(-max(g.size - rules.G, 0) // rules.chunk) for g in step.groups}

    def last_round(g: Group) -> int:
        return first_round[g.position] + chunks[g.position] - 1

    for replacement in step.groups[step.num_prompts:]:
        known = [g for g in step.groups if g.position in first_round and g.status == "dropped"]
        trigger = sorted(known, key=lambda g: (last_round(g), g.position))[
            replacement.position - step.num_prompts]
        first_round[replacement.position] = last_round(trigger) + 1
    drops = sorted((g for g in step.groups if g.status == "dropped"),
                   key=lambda g: (last_round(g), g.position))
    return max(last_round(g) for g in step.groups), drops
