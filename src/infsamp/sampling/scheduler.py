"""The slot loop's brain: which sample starts in which decode slot, and when. Pure Python, no torch.

Every engine (the slot engine, vLLM) and the simulator run exactly this loop, so they agree by
construction:

    while not sched.done:
        for slot, sample in sched.admit(): engine.start(slot, sample)
        finished = engine.decode_step(sched.active())   # one forward step over all running samples
        sched.step(finished)                             # the samples that ended in it

Conventions. A sample's tokens live on it (`Sample.token_ids`); each decode step adds at most one
token to each running sample (none when an engine had to hold it back, as vLLM does when it
preempts). KV is counted in tokens: a group holds its shared prompt from the start of its first
sample until its last sample finishes (prefilled once per group, never per sample); a running
sample holds its tokens. Admission is conservative: a sample starts only if the held prompts plus
the reservation of every running sample (itself included) fit `max_kv_tokens`, so the budget is
never exceeded and nothing has to be preempted. Prompts and reservations are whole blocks of
`kv_block_size` tokens (`kv_budget.shared_prompt_tokens`, `kv_budget.reserved_tokens`). A call
whose prompts share their first `shared_prefix_tokens` (held once by the engine: the slot engine,
block size 1) holds that prefix for the whole call and each group only the rest. Which pending
sample goes next, and what it reserves, is the admission policy's (`policies/`); this class only
keeps the books.

Beyond plain admission the books handle parking (`policy.to_park`, kept or dropped KV),
probes (`policies/probe.py`: short first reservations that grow or park), turns (a sample
waiting on a tool call) and held samples (a gate's: `release`, `cancel`, `stop`); each rule is
told in docs/scheduling.md, "The scheduler's books".

Simplifications: one call = one training step (every sample of the call finishes, or a gate
cancels it, before `done`); slots are identical; the reservation is the worst case
(`max_new_tokens`, or a probe's k), not the predicted length.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Collection, Sequence

from infsamp.errors import SamplingError
from infsamp.planner.kv_budget import (
    max_new_tokens_within,
    reserved_tokens,
    shared_prompt_tokens,
    slot_pool,
)
from infsamp.sampling.grouping import lower_bound, pigeonhole_bound
from infsamp.sampling.length_predictor import LengthPredictor, prediction_quality
from infsamp.sampling.policies import make_policy
from infsamp.sampling.types import Sample, SamplerStats


class SlotScheduler:
    def __init__(self, samples: Sequence[Sample], policy: str, micro_group: int,
                 max_kv_tokens: int = 0, predictor: LengthPredictor | None = None,
                 kv_block_size: int = 1, keep_parked_kv: bool = True,
                 max_micro_group: int = 0, shared_prefix_tokens: int = 0,
                 held: Collection[int] = (), **policy_options):
        self._samples = list(samples)
        _check_samples(self._samples, micro_group)
        if shared_prefix_tokens and kv_block_size != 1:
            raise ValueError("a shared prefix is held by the slot engine only (block size 1)")
        self.predictor = predictor
        self._policy = make_policy(policy, self._samples, micro_group, predictor, **policy_options)
        for sample_id in held:
            self._samples[sample_id].status = "held"
        if held:
            self._policy.hold(set(held))
        self._num_cancelled = 0
        self.micro_group = self._policy.micro_group
        self.max_kv_tokens = max_kv_tokens if self._policy.uses_budget else 0  # 0: no budget
        if self._policy.probe_tokens and not max_kv_tokens:
            raise SamplingError(f"policy {policy} needs a KV budget (it decides how many samples "
                                "run at once)")
        self._prefix = shared_prefix_tokens  # held once for the whole call
        self._shared = [shared_prompt_tokens(s.prompt_tokens - self._prefix, kv_block_size)
                        for s in self._samples]
        self._reserve = [reserved_tokens(s.prompt_tokens, s.max_new_tokens, kv_block_size)
                         for s in self._samples]
        self._max_reserve = max(self._reserve, default=0)
        self._new_reserve = [reserved_tokens(s.prompt_tokens, self._policy.start_tokens(s),
                                             kv_block_size) for s in self._samples]
        self._check_budget(kv_block_size)
        self.prefix_tokens_wanted = self._policy.prefix_tokens_wanted
        # slots, and the most KV running samples hold at once (the slot engine's pool)
        self.num_slots, self.max_running_tokens = self._slot_pool(max_micro_group)
        # a heap, lowest free slot first; no more than one per sample is ever taken
        self._free_slots = list(range(min(self.num_slots, len(self._samples))))
        self._active: dict[int, Sample] = {}
        self._running_reserve: dict[int, int] = {}  # sample_id -> what it reserves now
        self._seen_tokens: dict[int, int] = {}  # sample_id -> tokens at its last step or parking
        self._last_point: dict[int, int] = {}  # sample_id -> tokens at its latest prediction point
        self._group_open = [0] * (max((s.group_id for s in self._samples), default=-1) + 1)
        self._group_unfinished = list(self._group_open)
        for sample in self._samples:
            self._group_unfinished[sample.group_id] += 1
        self._held_prompt_tokens = self._prefix
        self._unopened_prompt_tokens = sum({s.group_id: self._shared[s.sample_id]
                                            for s in self._samples}.values())
        self.keep_parked_kv = keep_parked_kv and self._policy.keeps_parked_kv
        self._parked_kv_tokens = 0  # KV the engine keeps for parked samples
        self._returning: deque[Sample] = deque()  # answered tool calls, waiting for a slot
        self._num_waiting = 0  # samples waiting on a tool call
        self._reserved_tokens = 0  # reservations of running samples
        self._active_tokens = 0  # tokens generated so far by running samples
        self._num_finished = 0
        self._predicted: dict[int, float] = {}
        self.stats = SamplerStats(num_samples=len(self._samples) - len(set(held)),
                                  micro_group=self.micro_group,
                                  policy=policy, kv_block_size=kv_block_size)

    # ---- the loop -------------------------------------------------------------------------------
    def admit(self) -> list[tuple[int, Sample]]:
        """(slot, sample) pairs to start now, before the next decode step."""
        all_free = not self._active
        for sample in self._policy.to_grow(self._active.values(), self._probing):
            if self.can_allocate(sample, instead_of=sample):  # its probe for its whole reserve
                self._reserved_tokens += self._reserve[sample.sample_id] - \
                    self._running_reserve[sample.sample_id]
                self._running_reserve[sample.sample_id] = self._reserve[sample.sample_id]
            else:
                self._park(sample)
        if self._active:
            for sample in self._policy.to_park(self.active(), len(self._free_slots),
                                               self.can_allocate):
                self._park(sample)
        self._policy.begin_admit(all_free)
        started = []
        while self._free_slots and self._returning and self.can_allocate(self._returning[0]):
            slot = heapq.heappop(self._free_slots)
            self._allocate(slot, self._returning.popleft())
            started.append((slot, self._active[slot]))
            if self.prefix_tokens_wanted:  # after a tool's answer: now, not at its next k
                self._show_point(self._active[slot])
        while self._free_slots:
            sample = self._policy.pick(self._free_slots[0], self.can_allocate)
            if sample is None:
                break
            slot = heapq.heappop(self._free_slots)
            self._allocate(slot, sample)
            started.append((slot, sample))
        if all_free and started:
            self.stats.num_rounds += 1
        if not self._active and not self.done and not self._num_waiting:
            raise RuntimeError(f"scheduler stalled: policy {self._policy.name!r} admitted nothing "
                               f"with {len(self._samples) - self._num_finished} samples left")
        return started

    def step(self, finished: Sequence[Sample]) -> None:
        """After each decode step: the samples that ended in it (their tokens are on them)."""
        if not self._active:
            raise RuntimeError("step() called with no active sample; call admit() first")
        self.stats.decode_steps += 1
        self.stats.row_steps += len(self._active)
        self.stats.peak_rows = max(self.stats.peak_rows, len(self._active))
        for sample in self._active.values():
            grown = sample.num_tokens - self._seen_tokens[sample.sample_id]
            if grown not in (0, 1):
                raise ValueError(f"step: sample {sample.sample_id} grew by {grown} tokens in one "
                                 "decode step")
            self._seen_tokens[sample.sample_id] = sample.num_tokens
            self._active_tokens += grown
            self.stats.generated_tokens += grown  # live count (exact sum once the call is done)
        kv_tokens = self._held_prompt_tokens + self._active_tokens + self._parked_kv_tokens
        self.stats.peak_kv_tokens_used = max(self.stats.peak_kv_tokens_used, kv_tokens)
        if self.prefix_tokens_wanted:
            self._observe_progress(finished)
        # in slot order, whatever order the engine reports them in (the predictor learns from
        # them in this order, so the simulator and every engine must agree on it)
        for sample in sorted(finished, key=lambda s: s.slot):
            self._release(sample)
        if self.done:
            self._finish_call()

    def wait(self, sample: Sample) -> None:
        """A running sample whose turn ended in a tool call leaves its slot until `resume`."""
        self._take_out(sample, "waiting")
        self._num_waiting += 1
        self._policy.on_waiting(sample)

    def resume(self, sample: Sample) -> None:
        """Its call answered (the answer's tokens are on it): it starts at the next `admit`
        that has room, before the policy's picks."""
        if sample.status != "waiting":
            raise ValueError(f"resume: sample {sample.sample_id} is not waiting")
        sample.status = "parked"
        self._num_waiting -= 1
        self._returning.append(sample)

    @property
    def num_waiting(self) -> int:
        """Samples waiting on a tool call (not running, not admissible yet)."""
        return self._num_waiting

    def active(self) -> dict[int, Sample]:
        """slot -> running sample."""
        return dict(self._active)

    @property
    def num_finished(self) -> int:
        return self._num_finished

    @property
    def done(self) -> bool:
        return self._num_finished + self._num_cancelled == len(self._samples)

    # ---- held samples (a gate's) ----------------------------------------------------------------
    def release(self, sample_ids: Sequence[int]) -> None:
        """Held samples become pending: the policy may start them from the next `admit`."""
        released = [self._samples[i] for i in sample_ids]
        not_held = sorted(s.sample_id for s in released if s.status != "held")
        if not_held:
            raise ValueError(f"release: samples {not_held} not held")
        for sample in released:
            sample.status = "pending"
        self.stats.num_samples += len(released)
        self._policy.release(released)

    def cancel(self, sample_ids: Sequence[int]) -> list[Sample]:
        """Samples that will never start, held or pending (a running one runs to its end);
        returns those cancelled (the engine forgets them too)."""
        waiting = [self._samples[i] for i in sample_ids
                   if self._samples[i].status in ("held", "pending")]
        pending = {s.sample_id for s in waiting if s.status == "pending"}
        if pending:
            self._policy.hold(pending)  # out of the policy's queue
        for sample in waiting:
            self.stats.num_samples -= sample.status == "pending"
            sample.status = "cancelled"
            self._num_cancelled += 1
            self._end_in_group(sample)
        if waiting and self.done:
            self._finish_call()
        return waiting

    def stop(self) -> bool:
        """The call ends now (its gate has what it needs): every sample not finished is
        cancelled; returns whether one was running or parked (the engine must drop it)."""
        left = [s for s in self._samples if s.status not in ("finished", "cancelled")]
        started = any(s.status not in ("held", "pending") for s in left)
        for sample in left:
            self.stats.num_samples -= sample.status != "held"
            sample.status = "cancelled"
        self._num_cancelled += len(left)
        self._active = {}
        if left:
            self._finish_call()
        return started

    def _end_in_group(self, sample: Sample) -> None:
        """A sample of its group ended (or was cancelled): the last gives the prompt back."""
        self._group_unfinished[sample.group_id] -= 1
        if self._group_unfinished[sample.group_id]:
            return
        if self._group_open[sample.group_id]:
            self._held_prompt_tokens -= self._shared[sample.sample_id]
        else:  # never opened: every sample of it was cancelled
            self._unopened_prompt_tokens -= self._shared[sample.sample_id]

    # ---- KV books -------------------------------------------------------------------------------
    def can_allocate(self, sample: Sample, instead_of: Sample | None = None) -> bool:
        """Whether starting `sample` now keeps the worst-case KV within the budget (with the
        running sample `instead_of` parked first, if given)."""
        if not self.max_kv_tokens:
            return True
        opens_group = not self._group_open[sample.group_id]
        held = self._held_prompt_tokens + (self._shared[sample.sample_id] if opens_group else 0)
        own = self._seen_tokens[sample.sample_id] if sample.parked_kv and \
            sample.status == "parked" else 0
        held += self._parked_kv_tokens - own
        freed = self._running_reserve[instead_of.sample_id] if instead_of is not None else 0
        reserved = self._reserved_tokens - freed + self._start_reserve(sample)
        if held + reserved > self.max_kv_tokens or reserved > self.max_running_tokens:
            return False
        # never open a group whose prompt would leave too little room to run any one sample alone
        return not opens_group or held + self._max_reserve <= self.max_kv_tokens

    def _start_reserve(self, sample: Sample) -> int:
        """What a sample reserves when it starts: the policy's first reservation when new, else
        its whole one (a parked sample resumes to run to its end)."""
        return self._new_reserve[sample.sample_id] if sample.status == "pending" \
            else self._reserve[sample.sample_id]

    def _probing(self, sample: Sample) -> bool:
        """Whether a running sample still holds less than its whole reservation."""
        return self._running_reserve[sample.sample_id] < self._reserve[sample.sample_id]

    def _slot_pool(self, max_micro_group: int) -> tuple[int, int]:
        """`kv_budget.slot_pool` for this call: with probes, every group's prompt is held at once,
        each counted as the longest (as the slot engine's prompt table pads its rows)."""
        probes = self._policy.probe_tokens and self.max_kv_tokens and self._samples
        held = len({s.group_id for s in self._samples}) * max(self._shared) if probes else 0
        held += self._prefix
        return slot_pool(self.max_kv_tokens, self.micro_group, len(self._samples), held,
                         self._max_reserve, min(self._new_reserve) if probes else 0,
                         max_micro_group)

    def _allocate(self, slot: int, sample: Sample) -> None:
        if not self._group_open[sample.group_id]:
            self._group_open[sample.group_id] = 1
            self._held_prompt_tokens += self._shared[sample.sample_id]
            self._unopened_prompt_tokens -= self._shared[sample.sample_id]
        self._running_reserve[sample.sample_id] = self._start_reserve(sample)
        self._reserved_tokens += self._running_reserve[sample.sample_id]
        if sample.status == "parked":
            self._resume(sample)
        sample.status, sample.slot = "running", slot
        self._active[slot] = sample
        self._seen_tokens[sample.sample_id] = sample.num_tokens
        self._active_tokens += sample.num_tokens
        if self.predictor is not None and sample.sample_id not in self._predicted:
            self._predicted[sample.sample_id] = float(self.predictor.predict(sample))
        self._policy.on_started(slot, sample)

    def _park(self, sample: Sample) -> None:
        """Take a running sample out of its slot: it keeps its tokens, and its KV if the books
        can hold it beside every slot's reservation."""
        self._take_out(sample, "parked")
        self.stats.num_preemptions += 1
        self._policy.on_parked(sample)

    def _take_out(self, sample: Sample, status: str) -> None:
        """Out of its slot (parked, or waiting on a tool call), its tokens and maybe its KV kept."""
        if sample.status != "running" or self._active.get(sample.slot) is not sample:
            raise ValueError(f"{status}: sample {sample.sample_id} is not running")
        self._free_slot(sample)
        sample.status, sample.slot = status, -1
        sample.parked_kv = self.keep_parked_kv and self._can_keep(sample.num_tokens)
        self._seen_tokens[sample.sample_id] = sample.num_tokens
        if sample.parked_kv:
            self._parked_kv_tokens += sample.num_tokens

    def _free_slot(self, sample: Sample) -> None:
        """A running sample leaves its slot: its tokens and reservation leave the books."""
        del self._active[sample.slot]
        heapq.heappush(self._free_slots, sample.slot)
        self._active_tokens -= sample.num_tokens
        self._reserved_tokens -= self._running_reserve.pop(sample.sample_id)

    def _can_keep(self, num_tokens: int) -> bool:
        """Whether `num_tokens` more held KV still leave room for every slot's reservation and
        every prompt still to open (kept KV must never cost a slot, nor a group its start)."""
        if not self.max_kv_tokens:
            return True
        held = (self._held_prompt_tokens + self._unopened_prompt_tokens + self._parked_kv_tokens
                + num_tokens)
        return held + self.micro_group * self._max_reserve <= self.max_kv_tokens

    def _resume(self, sample: Sample) -> None:
        """A parked sample starts again: its kept KV becomes running KV, or is recomputed."""
        parked_with = self._seen_tokens[sample.sample_id]  # tool tokens came after
        if sample.parked_kv:
            self._parked_kv_tokens -= parked_with
        else:
            self.stats.recomputed_tokens += parked_with

    def _release(self, sample: Sample) -> None:
        if sample.status != "running" or self._active.get(sample.slot) is not sample:
            raise ValueError(f"step: sample {sample.sample_id} finished but is not active")
        length = sample.num_tokens
        if not 1 <= length <= sample.max_new_tokens:
            raise ValueError(f"step: sample {sample.sample_id} finished with {length} tokens "
                             f"(max_new_tokens {sample.max_new_tokens})")
        self._free_slot(sample)
        sample.status = "finished"
        self._end_in_group(sample)
        self._num_finished += 1
        if self.predictor is not None:
            self.predictor.observe_finished(sample, length)
        self._policy.on_finished(sample, length)

    def _observe_progress(self, finished: Sequence[Sample]) -> None:
        """Each running sample at k, 2k, ... tokens, once per point, to the policy; the first
        point's re-predicted total is what the prediction quality is measured on."""
        ended = {s.sample_id for s in finished}
        every = self.prefix_tokens_wanted
        for sample in self._active.values():
            if sample.num_tokens % every or sample.sample_id in ended:
                continue
            total = self._show_point(sample)
            if total is not None and sample.num_tokens == every:
                self._predicted[sample.sample_id] = float(total)

    def _show_point(self, sample: Sample) -> float | None:
        """A running sample shown to the policy at its tokens now, unless already shown there;
        its re-predicted total, if any."""
        if self._last_point.get(sample.sample_id, 0) >= sample.num_tokens:
            return None
        self._last_point[sample.sample_id] = sample.num_tokens
        return self._policy.on_tokens(sample)

    def _finish_call(self) -> None:
        ran = [s for s in self._samples if s.status == "finished"]
        lengths = [s.num_tokens - s.num_context_tokens for s in ran]  # decoded
        self.stats.generated_tokens = sum(lengths)
        self.stats.lower_bound = lower_bound(lengths, self.micro_group)
        self.stats.opt_lower_bound = pigeonhole_bound(lengths, self.micro_group)
        if self.predictor is not None:
            predicted = [self._predicted[s.sample_id] for s in ran]
            quality = prediction_quality(predicted, lengths)
            self.stats.predictor_kendall_tau, self.stats.predictor_mae = quality
            self.predictor.end_call()

    def _check_budget(self, block_size: int) -> None:
        if not self.max_kv_tokens or not self._samples:
            return
        largest = max(self._samples, key=lambda s: self._shared[s.sample_id])
        max_new = max(s.max_new_tokens for s in self._samples)
        if max_new_tokens_within(self.max_kv_tokens - self._prefix,
                                 largest.prompt_tokens - self._prefix, max_new,
                                 block_size) < max_new:
            raise SamplingError(
                f"kv budget {self.max_kv_tokens} tokens is too small for group {largest.group_id}: "
                f"prompt {largest.prompt_tokens} + max_new_tokens {max_new}")


def _check_samples(samples: list[Sample], micro_group: int) -> None:
    if micro_group < 1:
        raise SamplingError(f"micro_group must be >= 1, got {micro_group}")
    for position, sample in enumerate(samples):
        if sample.sample_id != position:
            raise ValueError(f"samples must be numbered 0..N-1 in order; got id "
                             f"{sample.sample_id} at {position}")
        if sample.max_new_tokens < 1 or sample.prompt_tokens < 0:
            raise SamplingError(f"sample {position}: max_new_tokens must be "
                                f">= 1 and prompt_tokens >= 0")
