"""The planner over several GPUs: what one device holds under DDP and under FSDP2."""

import pytest

from infsamp.cli import main
from infsamp.planner import PRESETS, plan_memory
from infsamp.planner.estimate import GIB, gradients_bytes, weights_bytes

QWEN3_8B = PRESETS["qwen3-8b"]
RUN = dict(gpu_memory_bytes=24 * GIB, num_generations=8, max_prompt_tokens=256, max_new_tokens=1024)


def test_one_device_plans_as_before():
    single = plan_memory(QWEN3_8B, **RUN)
    assert plan_memory(QWEN3_8B, num_devices=1, strategy="single", **RUN).peak_bytes == \
        single.peak_bytes
    assert not single.fits


def test_ddp_replicas_keep_gradient_buckets_while_sampling():
    single = plan_memory(PRESETS["qwen3-0.6b"], **RUN)
    ddp = plan_memory(PRESETS["qwen3-0.6b"], num_devices=4, strategy="ddp", **RUN)
    assert ddp.generation["gradients"] == gradients_bytes(ddp.inputs) > 0
    assert single.generation["gradients"] == 0
    assert ddp.training["weights"] == single.training["weights"]


def test_fsdp_shards_states_and_samples_with_whole_weights():
    plans = {n: plan_memory(QWEN3_8B, num_devices=n, strategy="fsdp", gradient_checkpointing=True,
                            **RUN) for n in (2, 4, 8, 16)}
    whole = weights_bytes(plans[8].inputs)
    for n, plan in plans.items():
        assert plan.generation["weights"] == whole // n + whole  # shards + the sampler's copy
        assert plan.training["weights"] < whole
    peaks = [plans[n].training["peak"] for n in (2, 4, 8, 16)]
    assert peaks == sorted(peaks, reverse=True)  # more GPUs, less per GPU
    assert not plans[4].fits and plans[8].fits  # 8 x 24 GiB fits with checkpointing
    assert plans[8].peak_bytes <= 24 * GIB


def test_ddp_advice_names_fsdp():
    plan = plan_memory(PRESETS["qwen3-4b"], num_devices=8, strategy="ddp",
                       gradient_checkpointing=True, **RUN)
    assert not plan.fits
    assert any(line.startswith("fits with --strategy fsdp") for line in plan.advice)


def test_cli_flags(capsys):
    base = ["plan", "--model", "qwen3-8b", "--gpu-memory", "24GiB", "--gradient-checkpointing",
            "--engine", "slots"]
    assert main(base + ["--num-gpus", "8", "--strategy", "fsdp"]) == 0
    out = capsys.readouterr().out
    assert "per device: 8 GPU(s), fsdp" in out and "FITS" in out
    assert main(base + ["--num-gpus", "8"]) == 0
    assert "per device: 8 GPU(s), ddp" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--num-gpus", "0"], "--num-gpus: expected an integer >= 1"),
    (["--num-gpus", "two"], "--num-gpus: expected an integer >= 1"),
    (["--num-gpus", "2", "--strategy", "zero3"], "--strategy: must be one of ddp, fsdp"),
    (["--num-gpus", "2", "--strategy", "fsdp", "--lora-rank", "8"], "strategy: fsdp shards full"),
])
def test_cli_errors_are_one_line(args, message, capsys):
    assert main(["plan", "--model", "qwen3-0.6b", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
