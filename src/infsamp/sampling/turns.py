"""Multi-turn episodes in the sampler's loop: a turn that ends in a tool call waits, parked, while
the call runs, then resumes with the tool's answer appended as context tokens.

The sampler knows nothing of tools, templates or rewards: it is handed a `TurnHandler` (built
above it, `infsamp.tools`) and runs this loop around the engine (`sampler.py`):

    while not sched.done:
        turns.resume_answered()                       # answered calls: context tokens appended
        for slot, sample in sched.admit(): engine.start(slot, sample)
        if not sched.active(): turns.wait_for_answer(); continue   # every sample waits on a tool
        finished = engine.decode_step(sched.active())
        sched.step([s for s in finished if s.finish_reason != "tool_call"])
        turns.park_calls(finished)                    # their slots go to other samples

An engine that decodes a stop token asks `continues(sample)` (`DecodeOptions.turn_ends`): True
when the turn holds a tool call the episode goes on with; the sample then ends its decode with
finish reason "tool_call" instead of "eos" (its KV and its group's prompt stay). The scheduler
takes it out of its slot (`SlotScheduler.wait`: KV kept or dropped by the parking rules), the
handler runs its calls asynchronously, and `resume_answered` polls it without blocking the
decode steps of the others; an answered sample gets its context tokens (`Sample.append_context`)
and is resumed (`SlotScheduler.resume`), the engine prefilling what it lacks. The loop only
blocks on the handler when nothing else can decode, and counts that time as `engine_idle_s`.

Limits over the whole episode: at most `max_turns` tool turns, and `max_new_tokens` tokens, the
model's and the context's together. An answer that does not fit is cut so that one more token
fits: the episode then ends at the length limit ("length").

Deliberately simple: a sample's random stream is keyed by its position (`select.py`), so with
deterministic tools the same seed gives the same episodes whatever the schedule.
"""

from __future__ import annotations

import time
from typing import Protocol

from infsamp.sampling.scheduler import SlotScheduler
from infsamp.sampling.types import Sample, SamplerStats

IDLE_POLL_S = 1.0  # how long one wait for an answer blocks before the loop looks again


class TurnHandler(Protocol):
    """What the sampler asks of whoever runs tool calls (one object per sampler call)."""

    def continues(self, sample: Sample) -> bool:
        """The sample just decoded a stop token: does its turn hold a tool call to run?"""

    def submit(self, sample: Sample) -> None:
        """Run the calls of the sample's last turn (asynchronously: return at once)."""

    def answered(self, timeout_s: float) -> list[tuple[Sample, list[int]]]:
        """Samples whose calls have answered, each with the context token ids to append
        (waiting up to `timeout_s` for a first one; 0: only those already answered)."""


class TurnLoop:
    """The sampler's side of multi-turn episodes for one call (see the module docstring)."""

    def __init__(self, handler: TurnHandler, sched: SlotScheduler, stats: SamplerStats,
                 max_turns: int):
        self.handler, self.sched, self.stats = handler, sched, stats
        self.max_turns = max_turns
        self._called_at: dict[int, float] = {}  # sample id -> when its call was submitted

    def continues(self, sample: Sample) -> bool:
        """At a stop token: the episode goes on with a tool turn (turns and room left: at least
        one context token and one more of the model's)."""
        if sample.num_turns >= self.max_turns or sample.num_tokens + 2 > sample.max_new_tokens:
            return False
        return self.handler.continues(sample)

    def park_calls(self, finished: list[Sample]) -> None:
        """The samples whose turn ended in a tool call leave their slots while it runs."""
        for sample in finished:
            if sample.finish_reason == "tool_call":
                self.sched.wait(sample)
                sample.finish_reason = None
                sample.num_turns += 1
                self.stats.num_tool_turns += 1
                self._called_at[sample.sample_id] = time.perf_counter()
                self.handler.submit(sample)

    def resume_answered(self, timeout_s: float = 0.0) -> None:
        """Append each answered call's context tokens (cut to fit) and resume the sample."""
        for sample, token_ids in self.handler.answered(timeout_s):
            called_at = self._called_at.pop(sample.sample_id)
            sample.tool_latencies_s.append(time.perf_counter() - called_at)  # traces keep it
            room = sample.max_new_tokens - sample.num_tokens - 1  # one more model token fits
            sample.append_context(list(token_ids[:max(room, 0)]))
            self.stats.context_tokens += min(len(token_ids), max(room, 0))
            self.sched.resume(sample)

    def wait_for_answer(self) -> None:
        """Nothing can decode: block until a call answers (engine idle time)."""
        start = time.perf_counter()
        while self.sched.num_waiting and not self._answered_any():
            pass
        self.stats.engine_idle_s += time.perf_counter() - start

    def _answered_any(self) -> bool:
        before = self.sched.num_waiting
        self.resume_answered(IDLE_POLL_S)
        return self.sched.num_waiting < before
