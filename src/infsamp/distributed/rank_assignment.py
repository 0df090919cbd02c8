"""Which rank samples which of a step's prompts, so that the ranks finish sampling together.

Pure Python, no torch. A step's B prompts are divided between R ranks; each rank samples its
prompts' whole groups. A rank that draws the long groups makes every other rank wait at the
gradient reduction, so the assignment balances the ranks' predicted sampling cost (a group's cost:
G x its predicted completion length, the tokens it decodes):

- `lpt`: longest predicted group first onto the rank with the least predicted work so far
  (Graham's LPT, a 4/3-approximation of the best makespan; `grouping.lpt` on ranks instead of
  slots); should round-robin happen to predict a shorter makespan (it can: LPT is not optimal),
  round-robin's plan is kept, so `lpt` is never predicted worse than the baseline.
- `round_robin`: prompt i to rank i mod R (what a data loader's sampler does); the baseline.

`assign` returns each rank's prompt indices in ascending order (the order the rank samples and logs
them in); every rank gets at least one prompt when B >= R and costs are positive. Uneven B is fine:
ranks simply get different numbers of prompts.

Deliberately simple: the cost model is the decoded tokens; it ignores prefill and that a rank's
decode time also depends on how its g slots pack (the sampler's own business).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from infsamp.errors import InfsampError
from infsamp.sampling.grouping import lpt, makespan  # makespan: the busiest rank's predicted cost

Assignment = list[list[int]]  # prompt indices of each rank, ascending


def round_robin(costs: Sequence[float], num_ranks: int) -> Assignment:
    return [list(range(rank, len(costs), num_ranks)) for rank in range(num_ranks)]


def longest_first(costs: Sequence[float], num_ranks: int) -> Assignment:
    """LPT over ranks (ties to the lowest rank), or round-robin where that predicts shorter."""
    plan = [sorted(jobs) for jobs in lpt([max(float(c), 1e-9) for c in costs], num_ranks)]
    baseline = round_robin(costs, num_ranks)
    return baseline if makespan(baseline, costs) < makespan(plan, costs) else plan


ASSIGNMENTS: dict[str, Callable[[Sequence[float], int], Assignment]] = {
    "lpt": longest_first,
    "round_robin": round_robin,
}


def assign(costs: Sequence[float], num_ranks: int, method: str = "lpt") -> Assignment:
    """Each rank's prompt indices (see the module docstring); InfsampError for fewer prompts than
    ranks, since a rank without a whole group would have nothing to sample."""
    if len(costs) < num_ranks:
        raise InfsampError(f"training.prompts_per_step {len(costs)}: fewer prompts than the "
                           f"{num_ranks} processes; each process samples whole groups, so give "
                           f"at least {num_ranks} prompts per step")
    return ASSIGNMENTS[method](costs, num_ranks)


def rank_loads(assignment: Assignment, costs: Sequence[float]) -> list[float]:
    return [sum(costs[i] for i in prompts) for prompts in assignment]


def imbalance(loads: Sequence[float]) -> float:
    """Straggler ratio: the slowest rank's load over the mean (1.0: perfectly even)."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0
