"""The estimate's arithmetic, checked by hand against the rule of thumb and its stated refinements."""

import pytest

from infsamp.planner import PRESETS, count_lora_parameters, kv_bytes_per_token, plan_memory
from infsamp.planner.estimate import (activation_bytes_per_token, embedding_parameters, generation_breakdown,
                                      training_breakdown)

LLAMA_1B = PRESETS["llama-3.2-1b"]
N = 1_235_814_400  # parameters of Llama-3.2-1B
VH = 128256 * 2048  # its embedding
HUGE = 2**50


def plan(**kw):
    settings = dict(gpu_memory_bytes=HUGE, group_size=4, max_prompt=256, max_completion=786)
    return plan_memory(LLAMA_1B, **{**settings, **kw})


def test_kv_bytes_per_token_by_hand():
    assert kv_bytes_per_token(LLAMA_1B, "bf16") == 2 * 16 * 8 * 64 * 2 == 32_768
    assert kv_bytes_per_token(PRESETS["qwen3-1.7b"], "bf16") == 2 * 28 * 8 * 128 * 2 == 114_688
    assert kv_bytes_per_token(LLAMA_1B, "fp32") == 65_536


def test_rule_of_thumb_bf16_full_fine_tuning_with_reference():
    training = plan(beta=0.04).training
    assert training["weights"] == 2 * N  # rule of thumb: 2 B/param
    assert training["reference"] == 2 * N  # 2 B/param
    assert training["gradients"] == 2 * N + 2 * VH  # 2 B/param + lm_head's fresh gradient (peak moment)
    assert training["optimizer"] == 4 * N  # torch AdamW: two bf16 moments (the seed says 8: fp32 moments)


def test_optimizer_bytes_per_parameter():
    assert plan(dtype="fp32").generation["optimizer"] == 8 * N  # the seed's AdamW 8 B/param
    assert plan(optimizer="adamw8bit").generation["optimizer"] == int(N * (2 + 8 / 256))
    assert plan(optimizer="sgd").generation["optimizer"] == 0


def test_lora_shrinks_gradients_and_optimizer_and_drops_reference():
    num_lora = count_lora_parameters(LLAMA_1B, 16)
    training = plan(lora_rank=16, beta=0.04).training
    assert training["reference"] == 0  # reference = base with adapters disabled
    assert training["weights"] == 2 * N + 4 * num_lora  # fp32 adapters
    assert training["gradients"] == 4 * num_lora
    assert plan(lora_rank=16).generation["optimizer"] == 8 * num_lora


def test_no_reference_with_beta_zero_and_no_gradients_while_generating():
    result = plan()
    assert result.training["reference"] == 0 and result.generation["gradients"] == 0
    assert result.generation["optimizer"] == result.training["optimizer"]  # states stay resident


def test_kv_cache_shared_prompt_once():
    p = plan(micro_group=4).inputs
    kv = generation_breakdown(p, 4)["kv_cache"]
    concat = -(-4 * 1042 // 16)  # one layer's K/V concatenation per step
    assert kv == (256 + 4 * 786 + concat) * 32_768


def test_training_peak_does_not_grow_with_group_size():
    peaks = {G: plan(group_size=G, train_micro_batch_tokens=2084).training["peak"] for G in (4, 16, 64)}
    assert len(set(peaks.values())) == 1


def test_activations_scale_with_micro_batch_and_checkpointing_cuts_them():
    p = plan().inputs
    one, two = training_breakdown(p, 1042)["activations"], training_breakdown(p, 2084)["activations"]
    assert two == 2 * one
    with_ckpt = plan(gradient_checkpointing=True).inputs
    assert activation_bytes_per_token(with_ckpt) < activation_bytes_per_token(p) / 5


def test_overhead_is_context_plus_fragmentation_on_cuda_and_zero_on_cpu():
    gen = plan().generation
    tensors = sum(v for k, v in gen.items() if k not in ("overhead", "peak"))
    assert gen["overhead"] == 512 * 2**20 + int(0.10 * tensors)
    assert gen["peak"] == tensors + gen["overhead"]
    assert plan(device="cpu").generation["overhead"] == 0


def test_optimizer_step_can_be_the_peak():
    result = plan_memory(PRESETS["qwen3-8b"], gpu_memory_bytes=HUGE, group_size=2, max_prompt=16,
                         max_completion=16, train_micro_batch_tokens=32)
    assert result.training_peak_moment == "optimizer step"
    assert result.training["optimizer"] == (4 + 2) * result.num_parameters  # 2 bf16 moments + a sqrt(v) temp
    assert result.training["activations"] == 0


def test_embedding_grad_helper():
    assert embedding_parameters(LLAMA_1B) == VH


def test_invalid_inputs_raise_config_error():
    from infsamp.config import ConfigError

    for bad in (dict(max_completion=0), dict(group_size=-1), dict(optimizer="adam"), dict(dtype="int8"),
                dict(beta=-1.0), dict(micro_group=-1)):
        with pytest.raises(ConfigError):
            plan(**bad)


def test_micro_group_above_the_step_samples_means_all_of_them():
    assert plan(micro_group=10_000).micro_group == plan(micro_group=0).inputs.group_size
