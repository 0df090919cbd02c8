"""plan_memory's choices (g, micro-batch), the fits verdict, advice that re-runs the estimate,
JSON."""

import json

import pytest

from infsamp.planner import PARTS, PRESETS, plan_memory
from infsamp.planner.estimate import GIB, generation_breakdown, training_breakdown

LLAMA_1B = PRESETS["llama-3.2-1b"]
# the second seed's laptop
SEED = dict(gpu_memory_bytes=16 * GIB, max_prompt_tokens=256, max_new_tokens=786)


def test_seed_case_full_fine_tuning_with_reference_does_not_fit_and_each_advice_does():
    seed = {**SEED, "gpu_memory_bytes": 15 * GIB}  # at 16 GiB it fits since the chunked LM head
    result = plan_memory(LLAMA_1B, num_generations=4, beta=0.04, **seed)
    assert not result.fits and result.micro_group == 4 and result.train_micro_batch_tokens == 0
    assert result.advice and all(line.startswith("fits with --") for line in result.advice)
    switches = {"--lora-rank 16": dict(lora_rank=16),
                "--optimizer adamw8bit": dict(optimizer="adamw8bit"),
                "--gradient-checkpointing": dict(gradient_checkpointing=True),
                "--beta 0 (no reference model)": dict(beta=0.0)}
    for line in result.advice:
        name = line.removeprefix("fits with ").split(":")[0]
        settings = {**dict(num_generations=4, beta=0.04), **switches[name]}
        assert plan_memory(LLAMA_1B, **settings, **seed).fits, line


def test_chosen_g_and_micro_batch_are_the_largest_that_fit():
    result = plan_memory(PRESETS["qwen3-1.7b"], gpu_memory_bytes=14 * GIB, num_generations=64,
                         max_prompt_tokens=256,
                         max_new_tokens=1024, optimizer="adamw8bit", gradient_checkpointing=True)
    p, g, tokens = result.inputs, result.micro_group, result.train_micro_batch_tokens
    assert 0 < g < 64 and tokens > 0 and tokens % p.seq_len == 0
    assert (generation_breakdown(p, g)["peak"] <= p.gpu_memory_bytes
            < generation_breakdown(p, g + 1)["peak"])
    limit = p.gpu_memory_bytes
    assert (training_breakdown(p, tokens)["peak"] <= limit
            < training_breakdown(p, tokens + p.seq_len)["peak"])
    assert result.kv_cache_tokens == 255 + g * 1024  # the slot engine: pool + one prompt row


def test_user_fixed_g_too_large_gets_smaller_g_advice():
    free_g = plan_memory(PRESETS["qwen3-1.7b"], gpu_memory_bytes=12 * GIB, num_generations=64,
                         max_prompt_tokens=256, max_new_tokens=1024, lora_rank=16).micro_group
    result = plan_memory(PRESETS["qwen3-1.7b"], gpu_memory_bytes=12 * GIB, num_generations=64,
                         max_prompt_tokens=256, max_new_tokens=1024, lora_rank=16, micro_group=64)
    assert not result.fits and result.micro_group == 0
    assert result.advice == [f"fits with a smaller g: --micro-group {free_g} (or 0 for auto)"]


def test_nothing_fits_says_how_much_is_needed():
    result = plan_memory(PRESETS["qwen3-14b"], gpu_memory_bytes=4 * GIB, num_generations=8,
                         max_prompt_tokens=256, max_new_tokens=1024)
    assert not result.fits and len(result.advice) == 1
    assert result.advice[0].startswith("does not fit even with every switch")


def test_large_gpu_fits_whole_group_without_advice():
    result = plan_memory(LLAMA_1B, gpu_memory_bytes=80 * GIB, num_generations=64,
                         **{k: v for k, v in SEED.items() if k != "gpu_memory_bytes"})
    assert result.fits and result.micro_group == 64 and result.advice == []
    assert result.train_micro_batch_tokens == 64 * 1042 or result.train_micro_batch_sequences < 64


def test_json_has_the_promised_keys():
    data = json.loads(plan_memory(LLAMA_1B, num_generations=8, **SEED).to_json())
    for key in ("fits", "micro_group", "train_micro_batch_tokens", "generation", "training",
                "peak_bytes", "advice"):
        assert key in data
    for phase in ("generation", "training"):
        assert set(data[phase]) == {*PARTS, "peak"}
        assert data[phase]["peak"] == sum(v for k, v in data[phase].items() if k != "peak")
    assert data["peak_bytes"] == max(data["generation"]["peak"], data["training"]["peak"])
    assert isinstance(data["advice"], list)


@pytest.mark.parametrize("G", [4, 8, 16, 32, 64])
def test_seed_group_sizes_generation_fits_with_all_g(G):
    result = plan_memory(LLAMA_1B, num_generations=G, optimizer="adamw8bit", beta=0.04, **SEED)
    assert result.fits and result.micro_group == G
