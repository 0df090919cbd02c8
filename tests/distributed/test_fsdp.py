"""FSDP2 over two CPU processes (gloo): the same run as one process, and sharded checkpoints.

gloo runs what FSDP2 needs on CPU (all-gather, reduce-scatter as a plain SUM). Two processes give
the one-process completions and weights (as with DDP); each checkpoint holds every rank's shards
(safetensors + JSON) beside a consolidated `model/` that transformers loads; a resume under the
same launch continues bit for bit, and another number of ranks is refused in one line. The runs
are launched with `accelerate launch` and the shipped configs (fsdp2_zero2.yaml, then fsdp2.yaml
for the resume: the shards do not depend on resharding after forward), so `distributed.strategy
auto` reads accelerate's FSDP settings.
"""

from __future__ import annotations

import shutil

import pytest

from launching import final_weights, launch, max_difference, train_argv
from test_equal_to_one_process import assert_cases_equal_one_process, case_settings

# dapo-batch also takes the KL term (a whole reference model on each rank) and two passes over
# each rollout (old log-probs from the gathered whole weights)
CASES = {"grpo-group": ("grpo", "group", None),
         "dapo-batch": ("dapo", "batch", {"training.beta": 0.04, "training.num_iterations": 2})}
FSDP = {"distributed.strategy": "auto"}  # the accelerate config says fsdp


@pytest.mark.slow
def test_fsdp_equals_one_process_and_resumes_from_its_shards(tiny_model_dir, tmp_path,
                                                             monkeypatch, one_thread, capsys):
    runs = [(train_argv({**case_settings(tiny_model_dir, tmp_path / f"fsdp-{name}", loss, scale,
                                         extra), **FSDP}), tmp_path / f"record-fsdp-{name}")
            for name, (loss, scale, extra) in CASES.items()]
    result = launch(tmp_path, runs, accelerate_config="fsdp2_zero2.yaml")
    assert result.returncode == 0, result.output[-3000:]
    assert "2 processes (gloo), strategy fsdp (reshard_after_forward false)" in result.output
    assert_cases_equal_one_process(CASES, tiny_model_dir, tmp_path, "fsdp", monkeypatch)

    run = tmp_path / "fsdp-grpo-group"
    shards = sorted(p.name for p in (run / "checkpoint-3" / "ranks").iterdir())
    assert shards == [f"rank-0000{r}-of-00002.{ext}" for r in (0, 1) for ext in ("json",
                                                                               "safetensors")]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run / "checkpoint-3" / "model")  # consolidated

    again = tmp_path / "again"
    shutil.copytree(run, again)
    shutil.rmtree(again / "checkpoint-3")
    values = {**case_settings(tiny_model_dir, again, "grpo", "group"), **FSDP}
    resumed = launch(tmp_path, [(train_argv(values, "--resume"), tmp_path / "record-again")],
                     accelerate_config="fsdp2.yaml")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "resuming from" in resumed.output and "checkpoint-2" in resumed.output
    assert max_difference(final_weights(again, 3), final_weights(run, 3)) == 0.0

    from infsamp import cli

    shutil.rmtree(again / "checkpoint-3")
    capsys.readouterr()
    code = cli.main(train_argv({**values, "distributed.strategy": "auto"}, "--resume"))
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines  # one process cannot take two ranks' shards
    assert "checkpoint-2 holds FSDP shards of 2 ranks; resume it under the same launch" in lines[0]

