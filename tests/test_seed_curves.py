"""benchmarks/seed_curves.py: the exact McNemar test, a run's summary (a start taken from another
run when it has none) and the table over arms."""

import json

import pytest


@pytest.fixture
def bench(load_benchmark):
    return load_benchmark("seed_curves")


def test_mcnemar_is_the_exact_two_sided_binomial_on_discordant_pairs(bench):
    before = {i: i < 5 for i in range(20)}            # solved 0..4
    after = {i: 2 <= i < 12 for i in range(20)}       # lost 0, 1; gained 5..11
    gained, lost, p = bench.mcnemar_p(before, after)
    assert (gained, lost) == (7, 2)
    assert p == pytest.approx(2 * (1 + 9 + 36) / 2**9)  # 2 * P(X <= 2), X ~ Bin(9, 1/2)
    assert bench.mcnemar_p(before, before) == (0, 0, 1.0)


def write_run(folder, solved_by_step, step_times):
    folder.mkdir()
    rows = [{"step": step, "prompt_id": i, "solved": s}
            for step, solved in solved_by_step.items() for i, s in enumerate(solved)]
    (folder / "eval_completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = [{"step": step, "step_time": t, "sampling/num_samples": 8}
               for step, t in enumerate(step_times, 1)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))


def test_a_run_without_a_start_takes_it_from_the_start_run(bench, tmp_path, capsys):
    write_run(tmp_path / "start", {0: [True, False, False, False]}, [])
    write_run(tmp_path / "a", {2: [True, True, False, False], 4: [True, True, True, False]},
              [1.0, 2.0, 3.0, 4.0])
    (tmp_path / "a.time").write_text("100.0 40.5 1.5\n")
    start = bench.solved_by_step(tmp_path / "start")[0]
    summary = bench.summarise(tmp_path / "a", start)
    assert summary["steps"] == [0, 2, 4]
    assert (summary["start"], summary["best"], summary["final"]) == (0.25, 0.75, 0.75)
    assert summary["seconds"] == {0: 0.0, 2: 3.0, 4: 10.0}
    assert summary["completions"] == {0: 0.0, 2: 16.0, 4: 32.0}
    assert summary["wall_cpu"] == "100 / 42"
    bench.print_table({"arm": [summary]})
    out = capsys.readouterr().out
    assert "0.250 -> 0.500 -> 0.750" in out and "gain +50.0 points" in out


def test_the_plot_takes_either_budget_as_its_x_axis(bench, tmp_path):
    write_run(tmp_path / "a", {0: [True, False], 2: [True, True]}, [1.0, 2.0])
    summary = bench.summarise(tmp_path / "a", None)
    for axis in ("completions", "seconds"):
        bench.plot({"arm": [summary]}, str(tmp_path / f"{axis}.png"), axis)
        assert (tmp_path / f"{axis}.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="x axis 'steps'"):
        bench.plot({"arm": [summary]}, str(tmp_path / "no.png"), "steps")
