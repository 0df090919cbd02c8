"""The estimate's arithmetic, checked by hand against the rule of thumb and its stated
refinements."""

import dataclasses

import pytest

from infsamp.options import ConfigError
from infsamp.planner import PRESETS, count_lora_parameters, kv_bytes_per_token, plan_memory
from infsamp.planner.activations import (
    LOGITS_CHUNK_BUFFERS,
    activation_bytes_per_token,
    inference_workspace_bytes,
    logits_chunk_rows,
    train_logits_bytes,
)
from infsamp.planner.estimate import (
    DEVICES,
    embedding_parameters,
    generation_breakdown,
    training_breakdown,
)
from infsamp.planner.presets import linear_shapes

LLAMA_1B = PRESETS["llama-3.2-1b"]
N = 1_235_814_400  # parameters of Llama-3.2-1B
VH = 128256 * 2048  # its embedding
HUGE = 2**50


def plan(**kw):
    settings = dict(gpu_memory_bytes=HUGE, num_generations=4, max_prompt_tokens=256,
                    max_new_tokens=786)
    return plan_memory(LLAMA_1B, **{**settings, **kw})


def test_kv_bytes_per_token_by_hand():
    assert kv_bytes_per_token(LLAMA_1B, "bf16") == 2 * 16 * 8 * 64 * 2 == 32_768
    assert kv_bytes_per_token(PRESETS["qwen3-1.7b"], "bf16") == 2 * 28 * 8 * 128 * 2 == 114_688
    assert kv_bytes_per_token(LLAMA_1B, "fp32") == 65_536


def test_rule_of_thumb_bf16_full_fine_tuning_with_reference():
    training = plan(beta=0.04).training
    assert training["weights"] == 2 * N  # rule of thumb: 2 B/param
    assert training["reference"] == 2 * N  # 2 B/param
    # 2 B/param + lm_head's fresh gradient (peak moment)
    assert training["gradients"] == 2 * N + 2 * VH
    # torch AdamW: two bf16 moments (the seed says 8: fp32 moments)
    assert training["optimizer"] == 4 * N


def test_optimizer_bytes_per_parameter():
    assert plan(precision="fp32").generation["optimizer"] == 8 * N  # the seed's AdamW 8 B/param
    assert plan(optimizer="adamw8bit").generation["optimizer"] == int(N * (2 + 8 / 256))
    assert plan(optimizer="sgd", precision="fp32").generation["optimizer"] == 0
    assert plan(optimizer="sgd", precision="bf16_lossy").generation["optimizer"] == 0


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
    """The slot engine's KV: g completions in its pool and the prompt once (minus its last token,
    the sample's first column); one layer's K/V concatenation per step is a workspace."""
    p = plan(micro_group=4).inputs
    generation = generation_breakdown(p, 4)
    concat = -(-4 * 1042 // 16)
    assert generation["kv_cache"] == (255 + 4 * 786) * 32_768
    assert generation["activations"] == inference_workspace_bytes(p, 256) + concat * 32_768


def test_training_peak_does_not_grow_with_group_size():
    peaks = {G: plan(num_generations=G, train_micro_batch_tokens=2084).training["peak"]
             for G in (4, 16, 64)}
    assert len(set(peaks.values())) == 1


def test_activations_scale_with_micro_batch_and_checkpointing_cuts_them():
    p = plan().inputs
    one = training_breakdown(p, 1042)["activations"]
    two = training_breakdown(p, 2084)["activations"]
    assert two == 2 * one
    with_ckpt = plan(gradient_checkpointing=True).inputs
    assert activation_bytes_per_token(with_ckpt) < activation_bytes_per_token(p) / 5


def test_training_logits_are_a_few_chunks_whatever_the_micro_batch():
    """The chunked LM head: LOGITS_CHUNK_BUFFERS chunks of fp32 logits (at most 32 MiB each) and
    what it keeps per completion row (hidden state, its fp32 gradient, 32 bytes of row tensors)."""
    p = plan().inputs
    chunk = logits_chunk_rows(128256) * 128256 * 4
    assert 31 * 2**20 < chunk <= 32 * 2**20
    for tokens, rows in ((1042, 786), (4168, 4 * 786)):
        expected = LOGITS_CHUNK_BUFFERS * chunk + rows * (2048 * (2 + 4) + 32)
        assert training_breakdown(p, tokens)["logits"] == expected
    short = plan(max_prompt_tokens=2, max_new_tokens=2).inputs  # 2 rows: fewer than a chunk's
    assert train_logits_bytes(short, 4) == LOGITS_CHUNK_BUFFERS * 2 * 128256 * 4 + 2 * (
        2048 * 6 + 32)  # (its peak is the end of the backward, without logits)


def test_overhead_is_fragmentation_on_cuda_and_zero_on_cpu():
    gen = plan().generation
    tensors = sum(v for k, v in gen.items() if k not in ("runtime", "overhead", "peak"))
    assert gen["overhead"] == int(0.10 * tensors)
    assert gen["peak"] == tensors + gen["runtime"] + gen["overhead"]
    assert plan(device="cpu").generation["overhead"] == 0


def test_runtime_is_the_callers_measurement_else_the_devices_default():
    """Issue 20: the whole process holds the runtime (Python, torch, the CUDA context) beside the
    tensors; a run measures it once and passes it in; both phases carry it, CPU and CUDA alike."""
    for device in ("cuda", "cpu"):
        assumed, measured = plan(device=device), plan(device=device, runtime_bytes=700 * 2**20)
        assert assumed.generation["runtime"] == DEVICES[device].default_runtime_bytes
        for phase in ("generation", "training"):
            parts, base = getattr(measured, phase), getattr(assumed, phase)
            assert parts["runtime"] == 700 * 2**20
            assert parts["peak"] - base["peak"] == 700 * 2**20 - base["runtime"]
    assert DEVICES["cuda"].default_runtime_bytes == 512 * 2**20  # the CUDA context, as before
    fixed = dict(device="cpu", micro_group=4, train_micro_batch_tokens=1042)
    memory = plan(**fixed, runtime_bytes=0).peak_bytes + 2**20  # not room for a 1 GiB runtime
    assert plan(**fixed, gpu_memory_bytes=memory, runtime_bytes=0).fits
    assert not plan(**fixed, gpu_memory_bytes=memory, runtime_bytes=2**30).fits
    with pytest.raises(ConfigError, match="runtime_bytes: must be >= 0"):
        plan(runtime_bytes=-1)


def test_optimizer_step_can_be_the_peak():
    result = plan_memory(PRESETS["qwen3-8b"], gpu_memory_bytes=HUGE, num_generations=2,
                         max_prompt_tokens=16, max_new_tokens=16, train_micro_batch_tokens=32)
    assert result.training_peak_moment == "optimizer step"
    # 2 bf16 moments + a sqrt(v) temp
    assert result.training["optimizer"] == (4 + 2) * result.num_parameters
    assert result.training["activations"] == 0


def test_embedding_grad_helper():
    assert embedding_parameters(LLAMA_1B) == VH


def test_invalid_inputs_raise_config_error():
    from infsamp.options import ConfigError

    for bad in (dict(max_new_tokens=0), dict(num_generations=-1), dict(optimizer="adam"),
                dict(precision="fp16"), dict(beta=-1.0), dict(micro_group=-1),
                dict(load_in_4bit=True), dict(load_in_4bit=True, lora_rank=8, device="cpu")):
        with pytest.raises(ConfigError):
            plan(**bad)


# --- precision modes -----------------------------------------------------------------------------

NORMS = 16 * 2 * 2048 + 2048  # Llama-3.2-1B's RMSNorm weights (not cast by autocast)


COPIES = 2 * (N - NORMS) / N  # mixed: autocast's bf16 copy of every weight but the norms
EIGHT_BIT = 2 + 8 / 256


@pytest.mark.parametrize("precision, optimizer, expected", [
    ("fp32", "adamw", dict(weights=4, gradients=4, optimizer=8, compute_copies=0)),
    ("mixed", "adamw", dict(weights=4, gradients=4, optimizer=8, compute_copies=COPIES)),
    ("bf16", "adamw", dict(weights=2, gradients=2, optimizer=4, compute_copies=0)),  # rounding
    ("bf16_lossy", "adamw", dict(weights=2, gradients=2, optimizer=4, compute_copies=0)),
    ("bf16", "sgd", dict(weights=2, gradients=2, optimizer=2, compute_copies=0)),  # Kahan buffer
    ("bf16", "adamw8bit", dict(weights=2, gradients=2, optimizer=EIGHT_BIT, compute_copies=0)),
    ("mixed", "adamw8bit",
     dict(weights=4, gradients=4, optimizer=EIGHT_BIT, compute_copies=COPIES)),
])
def test_bytes_per_parameter_follow_the_mode(precision, optimizer, expected):
    result = plan(precision=precision, optimizer=optimizer)
    per = result.to_dict()["bytes_per_parameter"]
    for part, value in expected.items():
        assert per[part] == pytest.approx(value, abs=1e-3), part
    assert result.generation["optimizer"] == int(N * expected["optimizer"])
    assert result.to_dict()["precision"] == precision


def test_mixed_adds_bf16_copies_while_decoding_and_in_backward_only():
    mixed = plan(precision="mixed")
    copies = 2 * (N - NORMS)
    assert mixed.generation["compute_copies"] == copies
    assert mixed.training_peak_moment == "backward" and mixed.training["compute_copies"] == copies
    assert plan(precision="fp32").training["compute_copies"] == 0
    at_step = training_breakdown(dataclasses.replace(mixed.inputs, shape=PRESETS["qwen3-8b"]), 32)
    assert at_step["compute_copies"] == 0  # qwen3-8b peaks at the optimizer step: copies freed


def test_activations_follow_the_compute_dtype():
    fp32, bf16 = plan(precision="fp32").inputs, plan(precision="bf16").inputs
    assert activation_bytes_per_token(bf16) < 0.6 * activation_bytes_per_token(fp32)
    mixed = plan(precision="mixed").inputs  # bf16 matmul outputs, fp32 residual stream, casts
    per_token = [activation_bytes_per_token(p) for p in (bf16, mixed, fp32)]
    assert per_token == sorted(per_token) and len(set(per_token)) == 3


@pytest.mark.parametrize("precision, base", [("fp32", 4), ("mixed", 2), ("bf16", 2)])
def test_lora_adapters_are_fp32_over_the_mode_base(precision, base):
    num_lora = count_lora_parameters(LLAMA_1B, 16)
    result = plan(precision=precision, lora_rank=16)
    assert result.training["weights"] == base * N + 4 * num_lora
    assert result.training["gradients"] == 4 * num_lora
    assert result.generation["optimizer"] == 8 * num_lora
    assert result.inputs.dtype == ("fp32" if base == 4 else "bf16")  # the KV cache follows it


def test_qlora_stores_decoder_linears_in_nf4():
    num_lora = count_lora_parameters(LLAMA_1B, 16)
    quantized = 16 * sum(i * o for i, o in linear_shapes(LLAMA_1B).values())
    result = plan(lora_rank=16, load_in_4bit=True)
    assert result.inputs.num_quantized == quantized
    nf4 = 0.5 + 1 / 64 + 4 / (64 * 256)  # codes, 8-bit scale per 64, fp32 scale per 256 scales
    assert result.training["weights"] == int((N - quantized) * 2 + quantized * nf4) + 4 * num_lora
    assert result.training["weights"] < 0.45 * plan(lora_rank=16).training["weights"]


def test_auto_precision_is_the_trainers_default_per_device():
    assert plan(device="cuda").inputs.precision == "bf16"
    assert plan(device="cpu").inputs.precision == "fp32"
def test_micro_group_above_the_step_samples_means_all_of_them():
    assert plan(micro_group=10_000).micro_group == plan(micro_group=0).inputs.num_samples


def test_the_shared_prompt_block_mask_is_counted_in_the_training_step():
    """training.share_prompt: one bool mask [r, 1, W, W] per micro-batch, r x W = its tokens and
    W at most the micro-batch and a whole group (P + G x R)."""
    from dataclasses import replace

    from infsamp.planner.activations import shared_mask_bytes
    from infsamp.planner.estimate import training_moments
    from infsamp.planner.inputs import PlanInputs
    from infsamp.planner.presets import PRESETS

    p = PlanInputs(PRESETS["qwen3-0.6b"], 16 * 2**30, num_generations=8, max_prompt_tokens=64,
                   max_new_tokens=32, share_prompt=True)
    assert shared_mask_bytes(p, 256) == 256 * 256  # W <= the micro-batch
    assert shared_mask_bytes(p, 4096) == 4096 * (64 + 8 * 32)  # W <= one whole group
    unshared = replace(p, share_prompt=False)
    assert shared_mask_bytes(unshared, 4096) == 0
    extra = (training_moments(p, 4096)["backward"]["activations"]
             - training_moments(unshared, 4096)["backward"]["activations"])
    assert extra == 4096 * 320
