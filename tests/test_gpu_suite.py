"""benchmarks/gpu_suite.sh and its driver: a failing part is one line and the others run, a part
past its hard cap is killed and keeps its rows, cells stop at the part's cap, a sampler call stops
at its cell cap; the slow test runs the whole plan at toy sizes on the CPU (--cpu-smoke)."""

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import gpu_suite  # noqa: E402  (benchmarks/, just put on sys.path)
from gpu_suite_common import CPU_SMOKE, Part, random_model, sample_until, sampler_for, toy  # noqa: E402  (benchmarks/, just put on sys.path)

FAKE_PARTS = textwrap.dedent('''
    import time

    def ok(part):
        part.add({"value": 1})

    def fails(part):
        part.add({"value": 2})
        raise ValueError("boom in the fake part")

    def hangs(part):
        part.add({"value": 3})
        time.sleep(120)

    def cells(part):
        def bad():
            raise RuntimeError("cell broke")

        def slow():  # ends past the part's cap
            time.sleep(max(0.0, part.remaining_s()) + 0.2)
            return {"value": 5}

        part.run_cells([("good", lambda: {"value": 4}), ("bad", bad), ("slow", slow),
                        ("never", lambda: {"value": 6})])
''')


@pytest.fixture
def fake_plan(tmp_path, monkeypatch):
    """gpu_suite.PARTS pointed at four fake parts (ok, fails, hangs, cells) with short caps."""
    (tmp_path / "fake_parts.py").write_text(FAKE_PARTS)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(gpu_suite, "GRACE_S", 10)  # a part process starting under load: seconds
    monkeypatch.setattr(gpu_suite, "environment", lambda profile: {"profile": profile})
    parts = {n: (f"fake {name}", f"fake_parts:{name}", ("value",))
             for n, name in enumerate(("ok", "fails", "hangs", "cells"), start=1)}
    monkeypatch.setattr(gpu_suite, "PARTS", parts)
    return tmp_path / "out"


def test_a_failing_part_is_one_line_and_the_others_still_run(fake_plan):
    args = gpu_suite.parse_args(["--out", str(fake_plan), "--profile", "cpu-smoke",
                                 "--parts", "1,2,3,4", "--cap", "1=30", "--cap", "2=30",
                                 "--cap", "3=1", "--cap", "4=4"])
    started = time.monotonic()
    report = gpu_suite.run_plan(args)
    assert time.monotonic() - started < 60
    _, fails, hangs, cells = report["parts"]
    assert [p["status"] for p in report["parts"]] == ["ok", "failed", "killed", "ok"]
    assert fails["reason"] == "exit 1: ValueError: boom in the fake part"
    assert [r["value"] for r in fails["rows"]] == [2]  # rows written before the failure are kept
    assert "hard cap" in hangs["reason"] and [r["value"] for r in hangs["rows"]] == [3]
    names = [r["cell"] for r in cells["rows"]]
    assert names == ["good", "bad", "slow"] and cells["skipped"] == ["never"]
    assert cells["rows"][1]["error"] == "RuntimeError: cell broke"
    assert "part cap 4 s reached" in cells["notes"]["cap_reached"]
    assert sorted(p.name for p in fake_plan.iterdir()) == ["results.json", "results.md",
                                                           "suite.log"]
    saved = json.loads((fake_plan / "results.json").read_text())
    assert [p["status"] for p in saved["parts"]] == ["ok", "failed", "killed", "ok"]
    table = (fake_plan / "results.md").read_text()
    assert "| bad | error: RuntimeError: cell broke |" in table
    assert "status: failed (exit 1: ValueError: boom in the fake part)" in table


def test_the_run_refuses_a_folder_with_files_and_bad_arguments(tmp_path):
    (tmp_path / "other.txt").write_text("not ours")
    with pytest.raises(SystemExit, match="not empty"):
        gpu_suite.check_out_dir(tmp_path)
    gpu_suite.check_out_dir(tmp_path / "new")  # a new folder is fine
    with pytest.raises(SystemExit, match="give PART=SECONDS"):
        gpu_suite.parse_caps(["1:30"])
    with pytest.raises(SystemExit):
        gpu_suite.parse_args(["--out", str(tmp_path / "x"), "--parts", "1,9"])
    with pytest.raises(SystemExit, match="no such setting"):
        gpu_suite.parse_args(["--out", str(tmp_path / "x"), "--set", "plan_gb=12"])
    args = gpu_suite.parse_args(["--out", str(tmp_path / "x"), "--set", "plan_gib=12",
                                 "--set", "memory_groups=32,64"])
    assert args.profile_sizes.plan_gib == 12.0 and args.profile_sizes.memory_groups == (32, 64)


def test_a_part_gets_at_most_its_share_of_the_time_left(monkeypatch):
    monkeypatch.setattr(gpu_suite, "GRACE_S", 0)
    caps = {1: 100.0, 2: 50.0, 3: 50.0}
    assert gpu_suite.share_of_time_left(caps, 1, set(), 1000) == 100  # plenty left: its cap
    assert gpu_suite.share_of_time_left(caps, 1, set(), 100) == 50  # half of the caps left
    monkeypatch.setattr(gpu_suite, "GRACE_S", 50)
    assert gpu_suite.share_of_time_left(caps, 1, set(), 250) == 100  # one grace held back
    monkeypatch.setattr(gpu_suite, "GRACE_S", 0)
    assert gpu_suite.share_of_time_left(caps, 3, {1, 2}, 20) == 20
    assert gpu_suite.share_of_time_left(caps, 2, {1}, -5) == 0


def test_memory_table_cells_put_the_largest_group_first():
    from gpu_suite_sampling import memory_cells

    order = memory_cells([8, 64, 512])
    assert order[:3] == [(512, "continuous"), (512, "full"), (8, "full")]
    assert set(order) == {(G, p) for G in (8, 64, 512) for p in ("full", "rounds", "continuous")}


def test_a_sampler_call_stops_at_its_cell_cap_and_keeps_its_statistics():
    from infsamp.planner import load_shape

    model = random_model(toy(load_shape("qwen3-0.6b")), "cpu", "fp32")
    prompt = list(range(1, 9))
    stats, complete = sample_until(sampler_for(model, "continuous", 2, 10**6, 6), prompt, 4,
                                   deadline=time.monotonic() + 600)
    assert complete and stats.decode_steps == 12 and stats.generated_tokens == 24  # no EOS
    stats, complete = sample_until(sampler_for(model, "continuous", 2, 10**6, 6), prompt, 4,
                                   deadline=time.monotonic() - 1)
    assert not complete and stats.decode_steps == 1


def test_part_cells_stop_at_the_cap(tmp_path):
    part = Part(1, "t", CPU_SMOKE, cap_s=0.0, result_path=tmp_path / "p.json")
    part.run_cells([("a", lambda: {"x": 1})])
    assert part.rows == [] and part.skipped == ["a"]
    assert json.loads((tmp_path / "p.json").read_text())["skipped"] == ["a"]


def test_trl_part_runs_vs_trls_cells_at_the_profiles_sizes():
    """Part 3 is vs_trl.py's code: g, the KV budget, one training micro-batch for all, the pool."""
    from transformers.generation import ContinuousBatchingConfig

    from gpu_suite_common import H200
    from gpu_suite_trl import vs_trl_args
    from vs_trl import case_sizes, continuous_batching_config

    args = vs_trl_args(H200)
    assert (args.device, args.precision, args.groups) == ("cuda", "bf16", [64, 32, 8])
    sizes = case_sizes(args, 64)
    assert (sizes.micro_group, sizes.train_batch) == (8, 8)  # TRL: 8 completions, G/8 accumulated
    assert sizes.train_micro_batch_tokens == sizes.kv_budget_tokens == 8 * (32 + 128)
    config = continuous_batching_config(sizes)
    assert config["num_blocks"] == math.ceil(8 * 160 / 16) and config["max_batch_tokens"] == 8 + 32
    ContinuousBatchingConfig(**config)  # this transformers takes every key


@pytest.mark.slow
def test_cpu_smoke_runs_the_whole_plan(tmp_path):
    """The real plan at toy sizes. Under a heavy load a cap may cut cells (reported as skipped or
    killed); no part or cell may fail."""
    out = tmp_path / "smoke"
    env = {**os.environ, "PY": sys.executable}
    done = subprocess.run(["bash", str(BENCHMARKS / "gpu_suite.sh"), "--cpu-smoke", str(out)],
                          check=False, capture_output=True, text=True, env=env, timeout=900)
    report = json.loads((out / "results.json").read_text())
    assert [p["part"] for p in report["parts"]] == [1, 2, 3, 4, 5], done.stderr[-2000:]
    for part in report["parts"]:
        assert part["status"] in ("ok", "killed"), (part.get("reason"), done.stdout[-2000:])
        assert not [r for r in part["rows"] if "error" in r], part["rows"]
        assert part["rows"] or part["status"] == "killed" or part["notes"].get("cap_reached")
    assert report["total_s"] <= report["budget_s"] + 30
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "results.md", "suite.log"]
    assert "## Part 5" in (out / "results.md").read_text()


def test_the_chunked_lm_head_is_found_by_its_config_switch(monkeypatch):
    import dataclasses

    import infsamp.config_algorithm

    from gpu_suite_sampling import chunked_head_switch

    @dataclasses.dataclass
    class WithBool:
        learning_rate: float = 1e-5
        chunked_lm_head: bool = True

    @dataclasses.dataclass
    class WithRows:
        logits_chunk_rows: int = 1024

    @dataclasses.dataclass
    class Without:
        learning_rate: float = 1e-5

    for config, found in ((WithBool, ("chunked_lm_head", True, False)),
                          (WithRows, ("logits_chunk_rows", 1024, 0)), (Without, None)):
        monkeypatch.setattr(infsamp.config_algorithm, "TrainingConfig", config)
        assert chunked_head_switch() == found
