"""The planner with the vLLM engine: its weight copy, paged KV pool and CUDA graphs in the
generation column, and in the training column only when sleep mode is off."""

import json

from infsamp.cli import main
from infsamp.planner import PARTS, count_parameters, kv_bytes_per_token, load_shape, plan_memory
from infsamp.planner.estimate import VLLM_GRAPH_BYTES
from infsamp.planner.kv_budget import kv_tokens_needed

GIB = 2**30
SETTINGS = dict(gpu_memory_bytes=80 * GIB, num_generations=128, max_prompt_tokens=256,
                max_new_tokens=1024, micro_group=32)


def test_generation_column_holds_vllm_weights_pool_and_graphs():
    shape = load_shape("qwen3-1.7b")
    slots = plan_memory(shape, **SETTINGS)
    vllm = plan_memory(shape, engine="vllm", **SETTINGS)
    assert {"vllm_weights", "vllm_graphs"} <= set(PARTS)
    assert slots.generation["vllm_weights"] == slots.generation["vllm_graphs"] == 0
    assert vllm.generation["vllm_weights"] == count_parameters(shape) * 2  # a bf16 weight copy
    assert vllm.generation["vllm_graphs"] == VLLM_GRAPH_BYTES["cuda"]
    # whole blocks of 16 on CUDA, and the spare one
    pool = kv_tokens_needed(32, 1024, 256, 1, block_size=16) + 16
    assert vllm.kv_cache_tokens == pool and pool % 16 == 0
    assert vllm.generation["kv_cache"] == pool * kv_bytes_per_token(shape, "bf16")
    assert vllm.generation["peak"] > slots.generation["peak"]  # the second weight copy costs


def test_training_column_depends_on_sleep_mode():
    shape = load_shape("qwen3-1.7b")
    fixed = {**SETTINGS, "train_micro_batch_tokens": 4 * 1280}  # the same micro-batch in both
    asleep = plan_memory(shape, engine="vllm", **fixed)
    awake = plan_memory(shape, engine="vllm", engine_sleep=False, **fixed)
    assert asleep.training["vllm_weights"] == asleep.training["kv_cache"] == 0
    for part in ("vllm_weights", "vllm_graphs", "kv_cache"):
        assert awake.training[part] == awake.generation[part]
    assert awake.training["peak"] > asleep.training["peak"]


def test_plan_command_engine_flags(capsys):
    args = ["plan", "--model", "qwen3-1.7b", "--gpu-memory", "80GiB", "--num-generations", "128",
            "--json"]
    assert main(args + ["--engine", "vllm", "--vllm-sleep", "off"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["settings"]["engine"] == "vllm" and data["training"]["vllm_weights"] > 0
    assert main(args + ["--engine", "sglang"]) == 2
    assert "--engine: must be one of auto, slots, vllm (got 'sglang')" in capsys.readouterr().err
