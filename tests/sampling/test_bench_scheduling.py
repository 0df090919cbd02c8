"""`infsamp bench scheduling` on a tiny random checkpoint: every variant runs, lengths agree,
targets add up."""

from __future__ import annotations

import argparse
import json

import pytest

from infsamp.cli import main
from infsamp.commands import bench_scheduling as bench
from infsamp.commands import bench_scheduling_report as bench_report
from infsamp.sampling.engines.base import vllm_installed

pytestmark = pytest.mark.usefixtures("one_thread")


def _args(**overrides) -> argparse.Namespace:
    base = dict(prompts=2, prompts_per_step=1, epochs=2, num_generations=6, micro_group=2,
                max_new_tokens=12, temperature=1.0, prefix_tokens=3, seed=0)
    return argparse.Namespace(**{**base, **overrides})


def test_every_policy_sees_the_same_completions(tiny_model_dir):
    from infsamp.config import ModelConfig
    from infsamp.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    variants = [bench.Variant.parse(v) for v in (*bench.VARIANTS, "length_aware:noisy:0.5/sjf")]
    args = _args()
    rows = bench.run_epochs(model, tokenizer, bench.bench_prompts(tokenizer, 2, 0), variants, args)
    measured = [r for r in rows if r["measured"]]
    learning = sum(v.predictor in bench_report.LEARNING for v in variants)  # epoch 1 warms these up
    assert len(rows) == 2 * learning + 2 * len(variants) and len(measured) == 2 * len(variants)
    assert all(r["same_lengths_as_continuous"] for r in measured)
    assert all(r["decode_steps"] >= r["lower_bound"] for r in rows)
    from infsamp.sampling.grouping import pigeonhole_bound
    assert all(r["opt_lower_bound"]
               == pigeonhole_bound([n for g in r["lengths"] for n in g], r["micro_group"])
               for r in rows)
    oracle = [r for r in measured if r["variant"] == "length_aware:oracle"]
    assert all(r["kendall_tau"] in (None, 1.0) or len(set(r["lengths"][0])) == 1 for r in oracle)
    report = bench_report.summarise(rows, variants, args)
    totals = report["totals"]["slots"]
    assert set(totals) == {v.name for v in variants}
    assert totals["rounds"]["generated_tokens"] == totals["continuous"]["generated_tokens"]
    name = "length_aware:online decode steps saved vs rounds (>= 0.40)"
    saved = report["targets"]["slots"][name]
    assert saved == pytest.approx(
        1 - totals["length_aware:online"]["decode_steps"] / totals["rounds"]["decode_steps"])


def test_cli_writes_json(tiny_model_dir, tmp_path, capsys):
    code = main(["bench", "scheduling", "--model", str(tiny_model_dir), "--prompts", "1", "-G", "4",
                 "--micro-group", "2", "--max-new-tokens", "8", "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "scheduling.json").read_text())
    assert report["G"] == 4
    learning = sum(bench.Variant.parse(v).predictor in bench_report.LEARNING
                   for v in bench.VARIANTS)
    assert len(report["rows"]) == learning + len(bench.VARIANTS)
    assert "targets (slots):" in capsys.readouterr().out


def test_seeds_each_measured_with_their_own_predictors(tiny_model_dir, tmp_path):
    code = main(["bench", "scheduling", "--model", str(tiny_model_dir), "--prompts", "1", "-G", "6",
                 "--micro-group", "2", "--max-new-tokens", "10", "--epochs", "2",
                 "--prefix-tokens", "2", "--seeds", "3,4", "--kv-slack", "8",
                 "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "scheduling.json").read_text())
    assert report["seeds"] == [3, 4] and {r["seed"] for r in report["rows"]} == {3, 4}
    for scope in ("slots", "slots, seed 3", "slots, seed 4"):
        assert scope in report["targets"]
    slots = report["targets"]["slots"]
    for name in ("length_aware:online", "length_aware:hidden"):
        assert f"{name} scheduling + prediction share of sampling wall time (<= 0.03)" in slots
    totals = report["totals"]["slots"]
    assert all(t["identical_lengths"] for t in totals.values())
    assert totals["length_aware:hidden"]["num_preemptions"] > 0  # it parks, losslessly
    # the bench's trace replays its online variant's decisions (both epochs, the last measured)
    from infsamp.sampling.simulator import simulate
    from infsamp.sampling.traces import read_trace
    for seed in (3, 4):
        groups = read_trace(tmp_path / f"trace_slots_seed{seed}.jsonl")
        assert len(groups) == 2 and groups[0].first_tokens is not None
        replay = simulate(groups, "length_aware", 2, predictor="online", warmup_steps=1,
                          kv_budget=report["rows"][0]["kv_budget_tokens"], max_new_tokens=10,
                          prefix_tokens=2)
        measured = [r for r in report["rows"] if r["measured"] and r["seed"] == seed
                    and r["variant"] == "length_aware:online"]
        assert replay.decode_steps == measured[0]["decode_steps"]
        assert replay.num_preemptions == measured[0]["num_preemptions"]


def test_variant_names_round_trip():
    assert bench.Variant.parse("length_aware:noisy:0.5/sjf").name == "length_aware:noisy:0.5/sjf"
    assert bench.Variant.parse("rounds") == bench.Variant("rounds")


def test_several_prompts_per_call(tiny_model_dir):
    from infsamp.config import ModelConfig
    from infsamp.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    variants = [bench.Variant.parse(v) for v in bench.VARIANTS]
    args = _args(prompts=4, prompts_per_step=2, num_generations=3)
    rows = bench.run_epochs(model, tokenizer, bench.bench_prompts(tokenizer, 4, 0), variants, args)
    measured = [r for r in rows if r["measured"]]
    assert len(measured) == 2 * len(variants) and all(len(r["lengths"]) == 2 for r in measured)
    # the budget holds exactly g slots
    assert {r["micro_group"] for r in rows} == {args.micro_group}
    assert bench_report.summarise(rows, variants, args)["g"] == [args.micro_group]
    assert all(r["same_lengths_as_continuous"] for r in measured)


@pytest.mark.parametrize("argv, message", [
    (["--prompts-per-step", "0"], "--prompts-per-step must be >= 1, got 0"),
    (["-G", "0"], "--num-generations must be >= 1, got 0"),
    (["--variants", "rounds,continuous"], "--variants must start with continuous"),
    (["--seeds", "1,x"], "--seeds must be comma-separated integers"),
    (["--kv-slack", "-1"], "--kv-slack must be >= 0"),
])
def test_bad_arguments_end_in_one_line(argv, message, capsys):
    assert main(["bench", "scheduling", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.slow
@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")
def test_both_engines_side_by_side(tmp_path, capsys):
    """`--engine slots,vllm`: the same calls on both engines, rows tagged, lossless on each."""
    code = main(["bench", "scheduling", "--engine", "slots,vllm", "--prompts", "2", "-B", "2",
                 "-G", "4", "--micro-group", "3", "--max-new-tokens", "24", "--epochs", "1",
                 "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "scheduling.json").read_text())
    assert report["engines"] == ["slots", "vllm"]
    assert set(report["engine_startup_s"]) == {"slots", "vllm"}
    assert {r["engine"] for r in report["rows"]} == {"slots", "vllm"}
    for engine in ("slots", "vllm"):
        totals = report["totals"][engine]
        assert all(t["identical_lengths"] for t in totals.values())
        assert all(totals[name]["num_preemptions"] == 0 for name in ("continuous", "rounds"))
    assert "length_aware:online: vllm / slots tokens/s" in report["targets"]["vllm vs slots"]
    assert "engine start-up (not in the figures above): vllm" in capsys.readouterr().out


def _recipe(tmp_path, model: str, task: str = "basic_arithmetic") -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(f"model:\n  name_or_path: {model}\ndata:\n  dataset: reasoning_gym:{task}\n"
                    "  dataset_config: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}\n"
                    "  num_train_examples: 20\n  num_eval_examples: 4\n")
    return str(path)


def test_config_gives_the_prompts_and_the_model(tiny_model_dir, tmp_path):
    """`--config RECIPE`: the recipe's data section (task options included) and its model; `--model`
    and `--dataset` override them."""
    from infsamp.config import ModelConfig
    from infsamp.models.loading import load_model_and_tokenizer

    args = _args(config=_recipe(tmp_path, str(tiny_model_dir)), model="", dataset="",
                 prompt_column="prompt")
    data, model_name = bench.bench_sources(args)
    assert model_name == str(tiny_model_dir) and data.dataset == "reasoning_gym:basic_arithmetic"
    assert data.dataset_config["max_digits"] == 1
    _, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=model_name))
    prompts = bench.bench_prompts(tokenizer, 3, 0, data)
    assert len(prompts) == 3 and all("Calculate" in text or "=" in text for text, _ in prompts)
    assert bench.bench_sources(argparse.Namespace(**{**vars(args), "model": "embedded"}))[1] \
        == "embedded"
    assert bench.bench_sources(_args(config="", model="", dataset="", prompt_column="p")) \
        == (None, "embedded")


def test_config_with_an_unknown_task_is_one_line(tmp_path, capsys):
    code = main(["bench", "scheduling", "--config", _recipe(tmp_path, "embedded", "no_such_task")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "no_such_task" in err and len(err.splitlines()) == 1
