"""Global grouping: assign samples (jobs of predicted length) to g identical slots, minimising the
busiest slot (makespan, P||Cmax). Pure Python, no torch.

- `search`: the classic FPTAS for fixed g: every length is rounded down to a grid of
  `delta = epsilon * LB / n`, and the dynamic program over slot-load vectors of the rounded instance
  is solved exactly, so the plan is within (1 + epsilon) of the optimum. The DP states (job, sorted
  loads) are walked depth first from the LPT plan with memoisation and bound cuts, which visits a
  small part of the table; past `max_states` visited states the search keeps its best plan so far
  (never worse than LPT) and reports that it was cut short.
- `lpt`: longest processing time first onto the least loaded slot (a 4/3-approximation, O(n log n)).
- `lower_bound`: max(ceil(sum / g), max): no schedule of these lengths on g slots finishes sooner.
- `pigeonhole_bound`: a tighter bound for lumpy lengths: of the k*g+1 longest samples, some slot
  runs k+1, so it takes at least the sum of the k+1 shortest of them.

Simplification: slots may start with loads (`initial_loads`: the predicted remaining work of samples
already running), but a running sample is never moved.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_MAX_STATES = 2_000  # visited DP states before the search settles for its best plan
# beyond this LPT is within a fraction of a percent anyway (and recursion)
MAX_SEARCH_JOBS = 400


@dataclass
class Grouping:
    slots: list[list[int]]  # job indices per slot
    makespan: float         # predicted busiest slot, initial loads included
    method: str             # "fptas" or "lpt"


def lower_bound(lengths: Sequence[int], micro_group: int) -> int:
    """max(ceil(sum(L) / g), max(L)): decode steps no schedule on g slots can beat."""
    if not lengths:
        return 0
    return max(-(-sum(lengths) // micro_group), max(lengths))


def pigeonhole_bound(lengths: Sequence[int], micro_group: int) -> int:
    """max(lower_bound, max over k of the k+1 shortest among the k*g+1 longest): still <= the
    optimum."""
    longest_first = sorted(lengths, reverse=True)
    best = lower_bound(lengths, micro_group)
    for k in range(1, (len(longest_first) - 1) // micro_group + 1):
        top = longest_first[: k * micro_group + 1]
        best = max(best, sum(top[-(k + 1):]))
    return best


def makespan(slots: Sequence[Sequence[int]], weights: Sequence[float],
             initial_loads: Sequence[float] | None = None) -> float:
    loads = list(initial_loads) if initial_loads else [0.0] * len(slots)
    return max((loads[s] + sum(weights[j] for j in jobs) for s, jobs in enumerate(slots)),
               default=0.0)


def lpt(weights: Sequence[float], micro_group: int,
        initial_loads: Sequence[float] | None = None) -> list[list[int]]:
    """Longest job first onto the currently least loaded slot (ties: lowest slot)."""
    loads = [(float(initial_loads[s]) if initial_loads else 0.0, s) for s in range(micro_group)]
    heapq.heapify(loads)
    slots: list[list[int]] = [[] for _ in range(micro_group)]
    for job in sorted(range(len(weights)), key=lambda j: -weights[j]):
        load, slot = heapq.heappop(loads)
        slots[slot].append(job)
        heapq.heappush(loads, (load + weights[job], slot))
    return slots


def search(weights: Sequence[float], micro_group: int, epsilon: float,
           initial_loads: Sequence[float] | None = None,
           max_states: int = DEFAULT_MAX_STATES) -> tuple[list[list[int]], bool]:
    """The FPTAS's dynamic program over rounded load vectors, walked depth first from the LPT plan.

    Lengths are rounded down to multiples of `delta = epsilon * LB / n`, so any assignment's rounded
    makespan is within epsilon * OPT of its real one. Visited states (job, sorted loads) are
    memoised exactly as the DP table would hold them; branches whose load bound cannot beat the best
    plan so far are cut. Returns (best plan found, whether the search completed: only then is it
    (1 + eps)-optimal). The search compares plans in rounded units, so its winner can lose to LPT on
    the real lengths by up to the rounding error; the LPT plan is returned then (never worse than
    LPT, as `balance` promises).
    """
    n = len(weights)
    initial = [float(x) for x in initial_loads] if initial_loads else [0.0] * micro_group
    if n == 0:
        return [[] for _ in range(micro_group)], True
    jobs = sorted(range(n), key=lambda j: -weights[j])
    delta = epsilon * max((sum(weights) + sum(initial)) / micro_group, max(weights)) / n
    state = _Search([int(weights[j] // delta) for j in jobs], [int(x // delta) for x in initial],
                    max_states)
    greedy = lpt(weights, micro_group, initial_loads)
    slot_of = {j: s for s, slot_jobs in enumerate(greedy) for j in slot_jobs}
    state.best_assign = [slot_of[j] for j in jobs]
    state.best = max(state.loads[s]
                     + sum(state.units[i] for i, j in enumerate(jobs) if slot_of[j] == s)
                     for s in range(micro_group))
    complete = state.run()
    slots: list[list[int]] = [[] for _ in range(micro_group)]
    for position, slot in enumerate(state.best_assign):
        slots[slot].append(jobs[position])
    if makespan(slots, weights, initial) > makespan(greedy, weights, initial):
        return greedy, complete
    return slots, complete


class _Search:
    """Depth-first branch and bound over (job, sorted slot loads) states, in rounded units."""

    def __init__(self, units: list[int], loads: list[int], max_states: int):
        self.units, self.loads, self.max_states = units, loads, max_states
        self.suffix = [sum(units[i:]) for i in range(len(units))] + [0]
        self.target = max(-(-(sum(loads) + self.suffix[0]) // len(loads)), max(loads))
        self.assign = [0] * len(units)
        self.best_assign: list[int] = []
        self.best = 0
        self.visited: set = set()

    def run(self) -> bool:
        try:
            self._visit(0)
        except _OutOfStates:
            return False
        return True

    def _visit(self, depth: int) -> None:
        loads = self.loads
        if self.best <= self.target:
            return
        if depth == len(self.units):
            self.best, self.best_assign = max(loads), list(self.assign)
            return
        bound = max(max(loads), -(-(sum(loads) + self.suffix[depth]) // len(loads)))
        key = (depth, tuple(sorted(loads)))
        if bound >= self.best or key in self.visited:
            return
        if len(self.visited) >= self.max_states:
            raise _OutOfStates
        self.visited.add(key)
        unit, tried = self.units[depth], set()
        for slot in sorted(range(len(loads)), key=loads.__getitem__):  # least loaded first
            if loads[slot] in tried:
                continue
            if loads[slot] + unit >= self.best:
                break
            tried.add(loads[slot])
            loads[slot] += unit
            self.assign[depth] = slot
            self._visit(depth + 1)
            loads[slot] -= unit


class _OutOfStates(Exception):
    pass


def balance(weights: Sequence[float], micro_group: int, epsilon: float = 0.1,
            initial_loads: Sequence[float] | None = None,
            max_states: int = DEFAULT_MAX_STATES) -> Grouping:
    """The FPTAS search when affordable (its best plan so far if cut short), else LPT."""
    if len(weights) <= micro_group or len(weights) > MAX_SEARCH_JOBS or max_states <= 0:
        slots = lpt(weights, micro_group, initial_loads)
        return Grouping(slots, makespan(slots, weights, initial_loads), "lpt")
    slots, complete = search(weights, micro_group, epsilon, initial_loads, max_states)
    return Grouping(slots, makespan(slots, weights, initial_loads), "fptas" if complete
                    else "fptas_cut")
