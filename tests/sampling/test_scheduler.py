"""SlotScheduler and the admission policies, alone (no model): hand-checked cases and properties."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infsamp.errors import SamplingError
from infsamp.sampling.grouping import lower_bound
from infsamp.sampling.length_predictor import LengthPredictor, OraclePredictor
from infsamp.sampling.predictors import make_predictor
from infsamp.sampling.scheduler import SlotScheduler
from infsamp.sampling.simulator import run_call
from infsamp.sampling.types import Sample, make_samples

POLICIES = ["full", "rounds", "continuous", "length_aware", "probe"]


def specs_for(groups, prompt_tokens=10, max_new=64):
    """groups: list of length lists -> (specs, flat lengths)."""
    specs, lengths = [], []
    for group_id, group in enumerate(groups):
        for index, length in enumerate(group):
            specs.append(Sample(len(specs), group_id, index, prompt_tokens, max_new,
                                f"p{group_id}"))
            lengths.append(length)
    return specs, lengths


def fresh(specs):
    """Samples carry their state: each run gets new ones."""
    return [Sample(s.sample_id, s.group_id, s.index_in_group, s.prompt_tokens, s.max_new_tokens,
                   s.prompt_key) for s in specs]


class PrefixOracle(LengthPredictor):
    """Token-conditioned and exact once a sample has started: every pending sample looks like
    `prior`, a started one is predicted to the token."""
    name, uses_prefix = "prefix_oracle", True

    def __init__(self, lengths, prior=20.0):
        self.lengths, self.prior = lengths, prior

    def predict(self, spec):
        return self.prior

    def predict_remaining(self, spec, prefix_token_ids):
        return max(1, self.lengths[spec.sample_id] - len(prefix_token_ids))


def checked_run(specs, lengths, policy, micro_group, budget=None, predictor=None,
                keep_parked_kv=True, **options):
    """The engine loop, with the engine-side checks the scheduler must satisfy (a sample starts
    again only after it was parked, with its tokens; parked KV that is kept counts)."""
    specs = fresh(specs)
    sched = SlotScheduler(specs, policy, micro_group, budget, predictor,
                          keep_parked_kv=keep_parked_kv, **options)
    started, open_groups, unfinished = set(), set(), {}
    for spec in specs:
        unfinished[spec.group_id] = unfinished.get(spec.group_id, 0) + 1
    peak, running = 0, {}
    while not sched.done:
        parked_before = {s.sample_id: s.num_tokens for s in specs if s.status == "parked"}
        for _slot, spec in sched.admit():
            if spec.sample_id in started:
                assert parked_before.get(spec.sample_id) == spec.num_tokens > 0, "started twice"
            started.add(spec.sample_id)
            open_groups.add(spec.group_id)
        active = sched.active()
        assert 0 < len(active) <= sched.num_slots
        if budget is not None and policy != "full":  # the engine's pool: what running KV may hold
            assert sum(s.num_tokens for s in active.values()) <= sched.max_running_tokens
        for spec in running.values():  # a sample leaves its slot only by finishing or parking
            assert spec.status in ("running", "parked")
        running = {s.sample_id: s for s in active.values()}
        finished = []
        for spec in active.values():
            spec.token_ids.append(7)
            if spec.num_tokens == lengths[spec.sample_id]:
                spec.finish_reason = "length"
                finished.append(spec)
        kv = sum(specs[[s.group_id for s in specs].index(g)].prompt_tokens for g in open_groups)
        kv += sum(s.num_tokens for s in active.values())
        kv += sum(s.num_tokens for s in specs if s.status == "parked" and s.parked_kv)
        peak = max(peak, kv)
        if budget is not None and policy != "full":
            assert kv <= budget, f"KV {kv} over budget {budget}"
        for spec in finished:
            group = spec.group_id
            unfinished[group] -= 1
            if unfinished[group] == 0:
                open_groups.discard(group)
        sched.step(finished)
        running = {i: s for i, s in running.items() if s.status != "finished"}
    assert started == set(range(len(specs))), "some sample never ran"
    assert all(s.status == "finished" for s in specs)
    stats = sched.stats
    assert stats.peak_kv_tokens_used == peak
    assert stats.generated_tokens == sum(lengths)
    assert stats.lower_bound == lower_bound(lengths, sched.micro_group)
    assert stats.decode_steps >= lower_bound(lengths, sched.num_slots)  # g-slot bound if not wide
    assert stats.row_steps == sum(lengths) and stats.peak_rows <= sched.num_slots
    return stats


def test_full_takes_the_longest_sample():
    specs, lengths = specs_for([[5, 1, 3, 2]])
    # full ignores slots and budget
    stats = checked_run(specs, lengths, "full", micro_group=2, budget=1)
    assert stats.decode_steps == 5 and stats.micro_group == 4 and stats.num_rounds == 1
    assert stats.peak_kv_tokens_used == 10 + 2 + 2 + 2  # prompt once + 2 tokens each of 3 left


def test_rounds_wait_for_their_longest():
    specs, lengths = specs_for([[5, 1, 1, 1, 2, 2]])
    stats = checked_run(specs, lengths, "rounds", micro_group=2)
    assert stats.decode_steps == 5 + 1 + 2 and stats.num_rounds == 3


def test_length_sorted_rounds_group_the_long_ones():
    specs, lengths = specs_for([[5, 1, 1, 4, 1, 1]])
    oracle = OraclePredictor(dict(enumerate(lengths)))
    stats = checked_run(specs, lengths, "rounds", 2, predictor=oracle, length_sorted=True)
    assert stats.decode_steps == 5 + 1 + 1


def test_continuous_refills_a_freed_slot_at_once():
    specs, lengths = specs_for([[5, 1, 1, 1], [2, 2]])
    stats = checked_run(specs, lengths, "continuous", micro_group=2)
    # slot 0 runs the 5; slot 1 runs 1,1,1 then group 1's 2 (steps 4-5); both end at step 5, so the
    # last 2 (steps 6-7) starts from an empty engine: a second "round"
    assert stats.decode_steps == 7 and stats.num_rounds == 2


def test_continuous_takes_arrival_order():
    specs, lengths = specs_for([[3, 3, 3]])
    sched = SlotScheduler(specs, "continuous", 2)
    assert [(slot, s.sample_id) for slot, s in sched.admit()] == [(0, 0), (1, 1)]


def test_shared_prompt_counted_once_per_group():
    specs, lengths = specs_for([[2, 2, 2, 2]], prompt_tokens=100)
    stats = checked_run(specs, lengths, "rounds", micro_group=2)
    assert stats.peak_kv_tokens_used == 100 + 2 * 2


def test_budget_caps_concurrency_below_the_slots():
    specs, lengths = specs_for([[4] * 8], prompt_tokens=10, max_new=8)
    stats = checked_run(specs, lengths, "continuous", micro_group=8, budget=10 + 3 * 8)
    assert stats.decode_steps == 12  # 3 at a time, 8 samples of 4 -> ceil(8/3) waves of 4


@pytest.mark.parametrize("policy", ["rounds", "continuous", "length_aware"])
def test_budget_too_small_is_a_clear_error(policy):
    specs, _ = specs_for([[3]], prompt_tokens=50, max_new=20)
    with pytest.raises(SamplingError, match="kv budget 60 .*prompt 50"):
        SlotScheduler(specs, policy, 4, max_kv_tokens=60)


def test_bad_inputs_are_rejected():
    specs, _ = specs_for([[3, 3]])
    with pytest.raises(SamplingError, match="unknown sampling policy 'fifo'"):
        SlotScheduler(specs, "fifo", 2)
    with pytest.raises(SamplingError, match="unknown option 'refil'"):
        SlotScheduler(specs, "length_aware", 2, refil="sjf")
    with pytest.raises(SamplingError, match="micro_group"):
        SlotScheduler(specs, "continuous", 0)
    with pytest.raises(ValueError, match="numbered"):
        SlotScheduler(list(reversed(specs)), "continuous", 2)


def test_engine_disagreement_is_caught():
    specs, _ = specs_for([[3, 3], [3]])
    sched = SlotScheduler(specs, "continuous", 2)
    sched.admit()
    specs[0].token_ids += [5, 6]
    with pytest.raises(ValueError, match="sample 0 grew by 2 tokens in one decode step"):
        sched.step([])
    specs[0].token_ids.pop()
    with pytest.raises(ValueError, match="sample 2 finished but is not active"):
        sched.step([specs[2]])


def test_a_held_back_sample_takes_more_steps():
    """An engine may hold a running sample back (vLLM preempting it): no token, no error."""
    specs, _ = specs_for([[2]])
    sched = SlotScheduler(specs, "continuous", 1)
    sched.admit()
    specs[0].token_ids.append(3)
    sched.step([])
    sched.step([])  # held back: no token this step
    specs[0].token_ids.append(4)
    specs[0].finish_reason = "length"
    sched.step([specs[0]])
    assert sched.done and sched.stats.decode_steps == 3 and sched.stats.generated_tokens == 2


def test_make_samples_is_group_major():
    specs = make_samples([5, 7], group_size=3, max_new_tokens=9, prompt_keys=["a", "b"])
    assert [(s.sample_id, s.group_id, s.index_in_group, s.prompt_tokens) for s in specs] == [
        (0, 0, 0, 5), (1, 0, 1, 5), (2, 0, 2, 5), (3, 1, 0, 7), (4, 1, 1, 7), (5, 1, 2, 7)]
    assert specs[4].prompt_key == "b"


def test_length_aware_asks_for_prefix_only_with_a_token_conditioned_predictor():
    specs, lengths = specs_for([[30, 5, 20, 40]])
    assert SlotScheduler(specs, "length_aware", 2, predictor=make_predictor("online"),
                         prefix_tokens=8).prefix_tokens_wanted == 8
    assert SlotScheduler(specs, "length_aware", 2,
                         predictor=make_predictor("none")).prefix_tokens_wanted == 0
    assert SlotScheduler(specs, "continuous", 2).prefix_tokens_wanted == 0


def test_length_aware_with_oracle_balances_slots():
    specs, lengths = specs_for([[8, 7, 6, 5, 4, 3, 2, 1]])
    stats = checked_run(specs, lengths, "length_aware", 2,
                        predictor=OraclePredictor(dict(enumerate(lengths))))
    assert stats.decode_steps == stats.lower_bound == 18
    assert stats.predictor_kendall_tau == pytest.approx(1.0) and stats.predictor_mae == 0.0


def test_scheduler_is_fast_per_decode_step():
    lengths = [1 + (i * 37) % 64 for i in range(4 * 256)]
    for policy in ("continuous", "length_aware"):
        specs = make_samples([64] * 4, group_size=256, max_new_tokens=64)
        start = time.perf_counter()
        stats = run_call(specs, lengths, policy, 64, predictor=OraclePredictor())
        per_step = (time.perf_counter() - start) / stats.decode_steps
        assert per_step < 2e-3, (f"{policy}: {per_step * 1e3:.2f} ms per decode "
                                 f"step (engine loop included)")


lengths_st = st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=12), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(groups=lengths_st, policy=st.sampled_from(POLICIES), micro_group=st.integers(1, 9),
       prompt_tokens=st.integers(0, 30), extra_budget=st.one_of(st.none(), st.integers(0, 200)),
       predictor=st.sampled_from(["none", "oracle", "noisy:1.0", "online", "prefix_oracle"]),
       refill=st.sampled_from(["sjf", "ljf"]), prefix_tokens=st.integers(1, 6),
       keep_parked_kv=st.booleans())
def test_every_sample_once_and_budget_kept(groups, policy, micro_group, prompt_tokens, extra_budget,
                                            predictor, refill, prefix_tokens, keep_parked_kv):
    specs, lengths = specs_for(groups, prompt_tokens=prompt_tokens, max_new=40)
    budget = None if extra_budget is None else prompt_tokens + 40 + extra_budget
    if policy == "probe" and budget is None:  # it needs one: what g whole samples need
        budget = prompt_tokens * min(len(groups), micro_group) + 40 * micro_group
    length_predictor = PrefixOracle(lengths) if predictor == "prefix_oracle" else \
        make_predictor(predictor)
    if isinstance(length_predictor, OraclePredictor):
        length_predictor.set_lengths(dict(enumerate(lengths)))
    options = ({"probe_tokens": prefix_tokens} if policy == "probe"
               else {"refill": refill, "prefix_tokens": prefix_tokens})
    checked_run(specs, lengths, policy, micro_group, budget, length_predictor,
                keep_parked_kv=keep_parked_kv, **options)


def test_probes_run_wider_than_g_and_park_what_does_not_fit():
    """g = 2 in a budget of 2 x 40 beside the prompt, probes of 4 tokens: all 6 samples start at
    once and the 3s end inside their probes; at 4 tokens the first 12 and the 30 take the
    budget's two whole reservations (in arrival order: the second 12 does not fit beside the
    first and the 30's probe, the 30 then does), the second 12 is parked (4 tokens recomputed)
    and resumes when the first ends (step 12), ending at 20; the 30 ends at step 30, below the
    2-slot bound of 32."""
    specs, lengths = specs_for([[3, 12, 3, 12, 30, 3]], prompt_tokens=5, max_new=40)
    stats = checked_run(specs, lengths, "probe", 2, 5 + 2 * 40, probe_tokens=4)
    continuous = checked_run(specs, lengths, "continuous", 2, 5 + 2 * 40)
    assert stats.peak_rows == 6 and stats.micro_group == 2
    assert (stats.num_preemptions, stats.recomputed_tokens) == (1, 4)
    assert (stats.decode_steps, stats.lower_bound, continuous.decode_steps) == (30, 32, 42)


def test_probes_of_a_whole_reservation_are_continuous():
    """k = max_new: continuous on as many slots as the budget holds (g, or more with room)."""
    specs, lengths = specs_for([[5, 1, 3, 2, 9, 4, 4]], prompt_tokens=5, max_new=10)
    for budget, slots in ((5 + 2 * 10, 2), (5 + 3 * 10 + 7, 3)):
        probe = checked_run(specs, lengths, "probe", 2, budget, probe_tokens=10)
        same = checked_run(specs, lengths, "continuous", slots, budget)
        assert (probe.decode_steps, probe.peak_rows) == (same.decode_steps, slots)


def test_probe_needs_a_budget_and_a_positive_k():
    specs, _ = specs_for([[3, 3]])
    with pytest.raises(SamplingError, match="policy probe needs a KV budget"):
        SlotScheduler(specs, "probe", 2)
    with pytest.raises(SamplingError, match="probe_tokens must be >= 1"):
        SlotScheduler(specs, "probe", 2, 100, probe_tokens=0)


def test_probe_runs_the_likely_longest_first_with_a_predictor():
    """With a token-conditioned predictor the probes at k are grown longest first."""
    specs, lengths = specs_for([[3, 20, 3, 30, 25, 3]], prompt_tokens=5, max_new=40)
    plain = checked_run(specs, lengths, "probe", 2, 5 + 2 * 40, probe_tokens=4)
    ranked = checked_run(specs, lengths, "probe", 2, 5 + 2 * 40, PrefixOracle(lengths),
                         probe_tokens=4)
    assert ranked.decode_steps < plain.decode_steps


def test_short_samples_are_parked_after_their_first_tokens():
    """One group of 3+3+3+12+12 tokens, 2 slots, k=2, every pending sample predicted 8: each
    3-token sample is parked at its first point (1 token left), the 12-token ones keep their
    slots from steps 2 and 4, and the parked ones fill the end: 17 steps (the bound) against 18
    in arrival order."""
    specs, lengths = specs_for([[3, 3, 3, 12, 12]])
    continuous = checked_run(specs, lengths, "continuous", 2)
    parked = checked_run(specs, lengths, "length_aware", 2, predictor=PrefixOracle(lengths, 8.0),
                         prefix_tokens=2)
    assert (continuous.decode_steps, parked.decode_steps, parked.lower_bound) == (18, 17, 17)
    assert parked.num_preemptions == 3 and parked.recomputed_tokens == 0


def test_parked_kv_is_dropped_when_the_budget_cannot_hold_it():
    """Budget for exactly 2 reservations: a parked sample's 2 tokens are recomputed on resume."""
    specs, lengths = specs_for([[3, 3, 3, 12, 12]], prompt_tokens=5, max_new=40)
    kept = checked_run(specs, lengths, "length_aware", 2, 5 + 2 * 40 + 6,
                       PrefixOracle(lengths, 8.0), prefix_tokens=2)
    dropped = checked_run(specs, lengths, "length_aware", 2, 5 + 2 * 40,
                          PrefixOracle(lengths, 8.0), prefix_tokens=2)
    assert kept.decode_steps == dropped.decode_steps == 17 and kept.num_preemptions == 3
    assert (kept.recomputed_tokens, dropped.recomputed_tokens) == (0, 6)
    assert kept.peak_kv_tokens_used > dropped.peak_kv_tokens_used


@settings(max_examples=60, deadline=None)
@given(groups=lengths_st, micro_group=st.integers(1, 6), prompt_tokens=st.integers(1, 20),
       extra_budget=st.integers(0, 60), prefix_tokens=st.integers(1, 4))
def test_kept_parked_kv_never_changes_the_schedule(groups, micro_group, prompt_tokens, extra_budget,
                                                   prefix_tokens):
    """Parked KV is kept only where it can never cost a slot or a group's start: the decode
    steps and parks are those of recomputing it (several groups, tight budgets)."""
    specs, lengths = specs_for(groups, prompt_tokens=prompt_tokens, max_new=40)
    budget = prompt_tokens * len(groups) + 40 * micro_group + extra_budget
    runs = [checked_run(specs, lengths, "length_aware", micro_group, budget,
                        PrefixOracle(lengths, 12.0), keep_parked_kv=keep,
                        prefix_tokens=prefix_tokens) for keep in (True, False)]
    assert (runs[0].decode_steps, runs[0].num_preemptions) == (runs[1].decode_steps,
                                                               runs[1].num_preemptions)
    assert runs[0].recomputed_tokens <= runs[1].recomputed_tokens


def test_no_parking_without_preempt_or_with_sjf():
    specs, lengths = specs_for([[3, 3, 3, 12, 12]])
    for options in ({"preempt": False}, {"refill": "sjf"}):
        stats = checked_run(specs, lengths, "length_aware", 2,
                            predictor=PrefixOracle(lengths, 8.0), prefix_tokens=2, **options)
        assert stats.num_preemptions == 0


@settings(max_examples=60, deadline=None)
@given(groups=lengths_st, micro_group=st.integers(1, 6), extra_budget=st.integers(0, 120))
def test_mispredicted_samples_still_complete_within_budget(groups, micro_group, extra_budget):
    """The predictor claims the reverse of the truth: long looks short and short looks long."""
    specs, lengths = specs_for(groups, prompt_tokens=5, max_new=40)
    liar = OraclePredictor({i: 41 - length for i, length in enumerate(lengths)})
    stats = checked_run(specs, lengths, "length_aware", micro_group, 5 + 40 + extra_budget, liar)
    assert stats.num_samples == len(lengths)


def test_the_docs_diagram():
    """docs/scheduling.md: one group a..h on 3 slots takes 15 / 9 / 8 decode steps."""
    specs, lengths = specs_for([[6, 2, 3, 1, 5, 2, 4, 1]])
    oracle = OraclePredictor(dict(enumerate(lengths)))
    steps = {policy: checked_run(specs, lengths, policy, 3, predictor=oracle).decode_steps
             for policy in ("rounds", "continuous", "length_aware")}
    assert steps == {"rounds": 15, "continuous": 9, "length_aware": 8}


@pytest.mark.parametrize("policy", ["full", "rounds", "continuous", "length_aware", "probe"])
def test_held_samples_start_only_once_released_and_cancelled_ones_close_their_group(policy):
    """A gate's samples (dynamic sampling inside one call): held ones never start before
    `release`; cancelled ones never start, and the books end empty, a group never opened too."""
    specs, lengths = specs_for([[3, 5, 2, 4], [4, 4], [2, 6, 3]], prompt_tokens=10, max_new=8)
    specs = fresh(specs)
    held = {2, 3, 5, 6, 7, 8}
    options = {"probe_tokens": 3} if policy == "probe" else {}
    predictor = make_predictor("online") if policy in ("length_aware", "probe") else None
    sched = SlotScheduler(specs, policy, 2, 60, predictor, held=held, **options)
    assert sched.stats.num_samples == 3
    started, actions = set(), {0: [2, 3], 1: None}  # after sample k ends: release these
    while not sched.done:
        started |= {s.sample_id for _, s in sched.admit()}
        assert not started & held
        finished = []
        for sample in sched.active().values():
            sample.token_ids.append(7)
            if sample.num_tokens == lengths[sample.sample_id]:
                sample.finish_reason = "length"
                finished.append(sample)
        sched.step(finished)
        for sample in finished:
            if actions.get(sample.sample_id):
                sched.release(actions[sample.sample_id])
                held -= set(actions[sample.sample_id])
        if not sched.active() and held:  # nothing runs: the rest will never run
            cancelled = sched.cancel(sorted(held))
            assert [s.status for s in cancelled] == ["cancelled"] * len(held)
            held = set()
    assert started == {0, 1, 2, 3, 4}
    assert sched.stats.num_samples == 5
    assert sched.stats.generated_tokens == sum(lengths[i] for i in started)
    assert sched._held_prompt_tokens == 0 and sched._unopened_prompt_tokens == 0
    with pytest.raises(ValueError, match="not held"):
        sched.release([0])


def test_pending_samples_cancelled_and_a_stopped_call_drops_what_runs():
    specs, _ = specs_for([[3, 3, 3], [3, 3]], prompt_tokens=4, max_new=8)
    sched = SlotScheduler(fresh(specs), "continuous", 2, 100)
    running = [s.sample_id for _, s in sched.admit()]
    assert running == [0, 1]
    assert [s.sample_id for s in sched.cancel([1, 2, 3])] == [2, 3]  # 1 runs on; 2, 3 pending
    assert sched.stats.num_samples == 3
    for sample in sched.active().values():
        sample.token_ids.append(7)
    sched.step([])
    assert sched.stop() is True and sched.done  # 0 and 1 were running: the engine drops them
    assert sched.stats.num_samples == 0 and sched.stats.generated_tokens == 0
