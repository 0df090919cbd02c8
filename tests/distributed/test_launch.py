"""What a launch asks for, read before anything loads: strategy, accelerate settings, errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from infsamp import cli
from infsamp.config import Config
from infsamp.distributed.ranks import init_ranks, launch_strategy, reshard_after_forward
from infsamp.options import ConfigError

from launching import SRC


@pytest.fixture
def accelerate_env(monkeypatch):
    for key in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_MIXED_PRECISION",
                "FSDP_VERSION", "FSDP_RESHARD_AFTER_FORWARD", "FSDP_OFFLOAD_PARAMS",
                "FSDP_ACTIVATION_CHECKPOINTING", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_strategy_follows_the_accelerate_config(accelerate_env):
    cfg = Config()
    assert launch_strategy(cfg) == "ddp"
    accelerate_env.setenv("ACCELERATE_USE_FSDP", "true")
    accelerate_env.setenv("FSDP_VERSION", "2")
    assert launch_strategy(cfg) == "fsdp" and reshard_after_forward(cfg)
    accelerate_env.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    assert not reshard_after_forward(cfg)
    cfg.distributed.reshard_after_forward = "true"
    assert reshard_after_forward(cfg)
    cfg.distributed.strategy = "ddp"  # the flag wins over the config file
    assert launch_strategy(cfg) == "ddp"


@pytest.mark.parametrize("env, message", [
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, "DeepSpeed config: not supported"),
    ({"ACCELERATE_MIXED_PRECISION": "bf16"}, "mixed_precision bf16: infsamp sets the weights"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "FSDP1 config: infsamp uses FSDP2"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"},
     "fsdp_offload_params: true is not supported"),
])
def test_unsupported_accelerate_settings_are_one_line(accelerate_env, env, message):
    for key, value in env.items():
        accelerate_env.setenv(key, value)
    with pytest.raises(ConfigError, match=message):
        launch_strategy(Config())


def test_fewer_prompts_than_processes_is_one_line_before_joining(accelerate_env):
    accelerate_env.setenv("RANK", "0")
    accelerate_env.setenv("WORLD_SIZE", "4")
    cfg = Config()
    cfg.training.prompts_per_step = 3
    with pytest.raises(ConfigError, match="3 prompts for 4 processes"):
        init_ranks(cfg)  # raised before the process group: nothing waits for the others


def test_a_strategy_without_a_launcher_is_one_line(accelerate_env, tmp_path, capsys):
    code = cli.main(["train", "--distributed.strategy", "fsdp",
                     "--logging.output_dir", str(tmp_path / "run")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1
    assert "distributed.strategy fsdp: needs a multi-process launch (torchrun" in lines[0]


def test_fsdp_with_lora_is_refused(accelerate_env, tmp_path, capsys):
    code = cli.main(["train", "--distributed.strategy", "fsdp", "--model.lora_rank", "8",
                     "--logging.output_dir", str(tmp_path / "run")])
    assert code == 2
    assert "fsdp shards full fine-tuning; with LoRA (model.lora_rank > 0) use ddp" in \
        capsys.readouterr().err


def test_python_dash_m_infsamp_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "infsamp", "plan", "--model", "qwen3-0.6b",
                           "--num-gpus", "2", "--strategy", "fsdp"], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "per device: 2 GPU(s), fsdp" in done.stdout
