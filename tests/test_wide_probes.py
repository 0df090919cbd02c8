"""benchmarks/wide_probes.py: its `continuous` replays the engines' decode steps on the committed
traces, probes as wide as a whole reservation are `continuous` itself, the budget always holds
and every sample runs to its length, and the figures docs/scheduling.md quotes."""

import json
import random
from pathlib import Path

import pytest

IMG = Path(__file__).resolve().parents[1] / "docs/img"
SMOL = IMG / "bench_scheduling_issue22_smollm2"
EMBEDDED_B1 = IMG / "bench_scheduling_issue22_b1"


@pytest.fixture
def wide(load_benchmark):
    return load_benchmark("wide_probes")


def traces(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.glob("trace_slots_seed*.jsonl"))


def test_continuous_equals_the_engines_decode_steps(wide):
    embedded = json.loads((EMBEDDED_B1 / "scheduling.json").read_text())["totals"]["slots"]
    calls = wide.read_calls(traces(EMBEDDED_B1), 1, last_epoch=True)
    assert sum(wide.continuous_steps(c, 8) for c in calls) == embedded["continuous"]["decode_steps"]
    b1 = wide.read_calls(traces(SMOL / "b1"), 1, last_epoch=True)
    b4 = wide.read_calls(traces(SMOL / "b4"), 4, last_epoch=True)
    assert sum(wide.continuous_steps(c, 8) for c in b1) == 1250  # the replay reports' figures
    assert sum(wide.continuous_steps(c, 8) for c in b4) == 733


def test_probes_of_a_whole_reservation_are_continuous(wide):
    rng = random.Random(0)
    for _ in range(200):
        g, max_new = rng.randint(1, 6), rng.randint(1, 40)
        lengths = [rng.randint(1, max_new) for _ in range(rng.randint(1, 30))]
        replay = wide.wide_probe_replay(lengths, g, max_new, probe_tokens=max_new)
        assert replay.decode_steps == wide.continuous_steps(lengths, g)
        assert replay.max_rows <= g and replay.recomputed_tokens == 0


def test_budget_holds_and_every_sample_runs_its_length(wide):
    rng = random.Random(1)
    for _ in range(300):
        g, max_new = rng.randint(1, 6), rng.randint(2, 40)
        k = rng.randint(1, max_new)
        lengths = [rng.choice([rng.randint(1, k), rng.randint(1, max_new)])
                   for _ in range(rng.randint(1, 30))]
        for keep in (False, True):
            replay = wide.wide_probe_replay(lengths, g, max_new, k, keep_parked_kv=keep)
            assert replay.peak_reserved <= g * max_new
            assert replay.row_steps == sum(lengths)  # one token per running sample and step
            assert max(lengths) <= replay.decode_steps


def test_the_figures_the_docs_quote(wide):
    b1 = wide.summarise(wide.read_calls(traces(SMOL / "b1"), 1, True), 8, 96, [12])
    b4 = wide.summarise(wide.read_calls(traces(SMOL / "b4"), 4, True), 8, 96, [12])
    embedded = wide.summarise(wide.read_calls(traces(EMBEDDED_B1), 1, True), 8, 256, [12])
    assert [r["wide"][0]["decode_steps"] for r in (b1, b4, embedded)] == [980, 564, 5920]
    assert (b1["oracle"], b4["oracle"], embedded["oracle"]) == (979, 590, 5973)
    assert all(r["wide"][0]["share_of_oracle_gain"] > 0.6 for r in (b1, b4, embedded))
    assert b1["wide"][0]["max_rows"] == 32 and b1["wide"][0]["recomputed_tokens"] == 1212


def test_kept_kv_that_blocks_everything_is_dropped(wide):
    """g = 2, budget 20, k = 6: three probes reach 6 tokens with no room to commit any, all
    keep their KV (18 tokens), and none fits back (18 - 6 + 10 > 20) until it is dropped."""
    replay = wide.wide_probe_replay([10, 10, 10], 2, 10, 6, keep_parked_kv=True)
    assert replay.decode_steps == 6 + 4 + 4 and replay.recomputed_tokens == 18


def test_keeping_parked_probes_kv_crowds_out_probes(wide):
    """docs/scheduling.md: a parked probe that keeps its KV takes the room of new probes, so
    dropping it (recomputing) is the better choice at k = 12 on SmolLM2, B = 1."""
    calls = wide.read_calls(traces(SMOL / "b1"), 1, True)
    kept = wide.summarise(calls, 8, 96, [12], keep_parked_kv=True)["wide"][0]
    assert (kept["decode_steps"], kept["recomputed_tokens"]) == (1111, 0)


def test_a_bad_trace_is_one_line(wide, tmp_path, capsys):
    bad = tmp_path / "trace.jsonl"
    bad.write_text('{"prompt_id": "0", "prompt_tokens": 5}\n')
    with pytest.raises(SystemExit):
        wide.main([str(bad)])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert str(bad) in error and "Traceback" not in error


@pytest.mark.parametrize("folder, max_new, expected", [
    (SMOL / "b1", 96, {8: 1059, 12: 980, 16: 923}),
    (EMBEDDED_B1, 256, {8: 6242, 12: 5920, 16: 5661})])
def test_the_probe_policy_takes_the_replays_decode_steps(wide, folder, max_new, expected):
    """The built policy (`sampling.policy: probe`, through the scheduler the engines run) is this
    replay at B = 1: the same decode steps on every committed trace's last epoch, each call with
    the bench's budget (g whole samples beside its prompt)."""
    from infsamp.sampling.simulator import _call_samples, run_call
    from infsamp.sampling.traces import read_trace

    calls = []
    for path in traces(folder):
        groups = read_trace(path)
        calls += groups[len(groups) // 2:]
    for k, steps in expected.items():
        total = 0
        for group in calls:
            samples, lengths = _call_samples([group], max_new)
            total += run_call(samples, lengths, "probe", 8, 8 * max_new + group.prompt_tokens,
                              probe_tokens=k).decode_steps
        replayed = wide.summarise(wide.read_calls(traces(folder), 1, True), 8, max_new, [k])
        assert total == replayed["wide"][0]["decode_steps"] == steps
