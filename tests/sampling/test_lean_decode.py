"""The slot engine's lean decode forward (`engines/lean_decode.py`): the model's own logits bit for
bit, only where that holds, and the sampler's completions those of main before it (aab4575)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from tiny_sampling import RecordLogits, eos_boost, run_steps, tiny_llama
from transformers import LlamaConfig, LlamaForCausalLM

from infsamp.config_algorithm import SamplingConfig
from infsamp.sampling.engines.base import DecodeOptions
from infsamp.sampling.engines.lean_decode import lean_decode
from infsamp.sampling.engines.slots import SlotEngine
from infsamp.sampling.sampler import GroupSampler
from infsamp.sampling.types import Sample, SamplerStats

pytestmark = pytest.mark.usefixtures("one_thread")


def _llama(attn: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         eos_token_id=1, pad_token_id=0, attn_implementation=attn)
    return LlamaForCausalLM(config).eval()


def _decode(model, lean: bool, pool: bool, steps: int = 7):
    """Four samples of two groups (one ends after 2 tokens): every step's logits."""
    prompts = [[4, 5, 6, 7], [8, 9]]
    samples = [Sample(0, 0, 0, 4, steps), Sample(1, 1, 0, 2, 2), Sample(2, 0, 1, 4, steps),
               Sample(3, 1, 1, 2, steps)]
    engine, logits = SlotEngine(model), RecordLogits()
    engine.begin_call(prompts, samples, 4, DecodeOptions(temperature=1.0, seed=5,
                                                         eos_token_ids=()),
                      SamplerStats(), logits, pool_tokens=4 * steps - 2 if pool else None)
    if lean:
        assert engine.lean is not None
    else:
        engine.lean = None  # the model's own forward
    run_steps(engine, samples, steps)
    engine.end_call()
    return logits.seen


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("pool", [False, True])
def test_lean_forward_gives_the_models_logits_bit_for_bit(attn, pool):
    model = _llama(attn)
    lean, own = _decode(model, True, pool), _decode(model, False, pool)
    assert lean.keys() == own.keys() and len(own) > 20
    assert all(torch.equal(lean[key], own[key]) for key in own)


def test_lean_forward_on_the_embedded_model():
    from infsamp.config import ModelConfig
    from infsamp.models.loading import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(ModelConfig(), torch.device("cpu"))
    model.eval()
    assert lean_decode(model) is not None
    lean, own = _decode(model, True, False), _decode(model, False, False)
    assert all(torch.equal(lean[key], own[key]) for key in own)


def _lora(model, **options):
    """`model` under a peft LoRA adapter on every projection, B random (peft starts it at zero,
    where the adapter would add nothing)."""
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                            target_modules="all-linear", task_type="CAUSAL_LM",
                                            **options))
    torch.manual_seed(4)
    for name, param in lora.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.3)
    return lora


@pytest.mark.parametrize("pool", [False, True])
def test_lean_forward_under_lora_gives_the_models_logits_bit_for_bit(pool):
    model = _lora(_llama())
    plain = _decode(_llama(), False, pool)
    lean, own = _decode(model, True, pool), _decode(model, False, pool)
    assert lean.keys() == own.keys() and len(own) > 20
    assert all(torch.equal(lean[key], own[key]) for key in own)
    assert not all(torch.equal(plain[key], own[key]) for key in own)  # the adapter counts


def test_lean_forward_under_lora_only_where_exact():
    assert lean_decode(_lora(_llama(), use_dora=True)) is None  # DoRA computes differently
    model = _lora(_llama())
    model.merge_adapter()
    assert lean_decode(model) is None  # merged: the base weights changed
    model.unmerge_adapter()
    assert lean_decode(model) is not None
    with model.disable_adapter():
        assert lean_decode(model) is None
    model.base_model.model.model.layers[0].mlp.up_proj.lora_A["default"].half()
    assert lean_decode(model) is None  # peft would cast the input


def test_lean_forward_only_where_exact():
    model = _llama()
    assert lean_decode(model) is not None
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *args: None)
    assert lean_decode(model) is None  # a hook would be skipped
    handle.remove()
    model.model.norm.forward = model.model.norm.forward  # a wrapped forward (autocast)
    assert lean_decode(model) is None
    del model.model.norm.forward
    model.model.layers[1].self_attn.q_proj = torch.nn.Identity()  # not a plain Linear (LoRA)
    assert lean_decode(model) is None
    assert lean_decode(_llama("flex_attention")) is None  # not what the split attention reads
    engine, sample = SlotEngine(_llama()), Sample(0, 0, 0, 2, 2)
    engine.begin_call([[4, 5]], [sample], 1, DecodeOptions(hidden_states=True), SamplerStats())
    assert engine.lean is None  # the predictor wants hidden states: the model's own forward


# sha256 (first 16 hex digits) of the completions' token ids on main of 2026-12-02 (aab4575),
# before the lean forward: the same prompts, seed and settings (`_golden_completions`)
GOLDEN = {("continuous", 3, 0.7): "c0f31b296f5be548", ("probe", 3, 0.7): "c0f31b296f5be548",
          ("continuous", 5, 0.0): "a46bfbae05459fb8", ("full", 0, 1.0): "8a2ebbc95d7fd7dc"}


def _golden_completions(policy: str, micro_group: int, temperature: float) -> str:
    sampler = GroupSampler(tiny_llama(), None, SamplingConfig(
        policy=policy, micro_group=micro_group, kv_budget="100000", max_new_tokens=24,
        temperature=temperature, predictor="none"))
    result = sampler.sample([[5, 6, 7, 8, 9], [10, 11, 12], [13], [20, 21, 22, 23, 24, 25, 26]],
                            4, generator=torch.Generator().manual_seed(2026),
                            logits_processor_factory=eos_boost(boost=1.0))
    ids = [[c.token_ids for c in group] for group in result.groups]
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


@pytest.mark.parametrize("policy, micro_group, temperature", list(GOLDEN))
def test_completions_are_mains_before_the_lean_forward(policy, micro_group, temperature):
    """Fixed-seed completions on the tiny random Llama equal main's (float32 CPU: a different
    CPU's matrix kernels could round differently; the bit-for-bit test above is the strict one)."""
    assert _golden_completions(policy, micro_group, temperature) == GOLDEN[
        policy, micro_group, temperature]


def test_a_model_without_lora_takes_the_lean_path_without_importing_peft():
    """A run without LoRA never imports peft for the decode path (peft imports torchao too)."""
    import subprocess
    import sys

    script = ("import sys; from transformers import LlamaConfig, LlamaForCausalLM; "
              "from infsamp.sampling.engines.lean_decode import lean_decode; "
              "config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, "
              "num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, "
              "attn_implementation='sdpa'); "
              "print(lean_decode(LlamaForCausalLM(config).eval()) is not None, "
              "'peft' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["True", "False"]
