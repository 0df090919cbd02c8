"""Slot engine pieces: per-sample random streams, the prompt table, preemption and recomputation."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from infsamp.sampling.engines.base import DecodeOptions
from infsamp.sampling.engines.select import build_warpers, select_tokens, uniform_noise
from infsamp.sampling.engines.slots import SlotEngine, SlotKVCache
from infsamp.sampling.scheduler import SampleSpec


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         eos_token_id=1, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def test_gumbel_sampling_matches_softmax():
    num = 20000
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(num, 1)  # [N, 4]
    options = DecodeOptions(temperature=1.0, seed=3)
    tokens = select_tokens(logits, torch.arange(num), torch.zeros(num, dtype=torch.long), options, [])
    freq = torch.bincount(tokens, minlength=4).float() / num
    assert torch.allclose(freq, logits[0].softmax(-1), atol=0.015)


def test_noise_belongs_to_the_sample_not_the_batch():
    alone = uniform_noise(7, torch.tensor([9]), torch.tensor([4]), 16)
    batched = uniform_noise(7, torch.tensor([5, 9, 2]), torch.tensor([0, 4, 4]), 16)
    assert torch.equal(alone[0], batched[1])
    assert not torch.equal(batched[1], batched[2])  # other sample, same step: other noise
    assert not torch.equal(alone, uniform_noise(8, torch.tensor([9]), torch.tensor([4]), 16))  # other seed
    assert 0 < alone.min() and alone.max() < 1


def test_top_k_one_is_greedy():
    logits = torch.randn(6, 10)
    options = DecodeOptions(temperature=1.5, top_k=1, seed=0)
    tokens = select_tokens(logits, torch.arange(6), torch.zeros(6, dtype=torch.long), options, build_warpers(options))
    assert torch.equal(tokens, logits.argmax(-1))


def test_prompt_table_add_and_drop():
    cache = SlotKVCache(num_layers=1, num_slots=2, slot_capacity=4, kv_heads=1, head_dim=2,
                        dtype=torch.float32, device=torch.device("cpu"))
    for group_id, length in ((10, 3), (11, 5), (12, 2)):
        kv = [torch.full((1, 1, length, 2), float(group_id))]
        cache.add_prompt(group_id, kv, kv)
    assert cache.prompt_keys[0].shape == (3, 1, 5, 2) and cache.held_tokens() == 2 * 4 + 3 * 5
    cache.drop_prompt(11)
    assert cache.group_rows == {10: 0, 12: 1} and cache.prompt_lengths == [3, 2]
    assert cache.prompt_keys[0].shape == (2, 1, 3, 2)  # trimmed to the longest prompt left
    assert cache.prompt_keys[0][1, 0, :2].eq(12).all() and cache.prompt_keys[0][0].eq(10).all()


def _spec(sample_id, group_id=0, max_new=5):
    return SampleSpec(sample_id, group_id, sample_id, prompt_tokens=3, max_new_tokens=max_new)


def test_preempted_sample_restarts_and_counts_recomputation(model):
    options = DecodeOptions(temperature=1.0, seed=11, eos_token_ids=())
    engine = SlotEngine(model, [[4, 5, 6]], [2], num_slots=1, slot_capacity=5, options=options)
    first, second = _spec(0), _spec(1)
    engine.start(0, first)
    engine.decode_step({0: first})
    engine.decode_step({0: first})
    engine.start(0, second)  # the scheduler gave slot 0 to another sample: `first` is preempted
    assert engine.counters.num_preemptions == 1
    for _ in range(5):
        ended = engine.decode_step({0: second})
    assert ended == [(1, 5)] and engine.finish_reason(1) == "length"
    reference = SlotEngine(model, [[4, 5, 6]], [1], num_slots=1, slot_capacity=5, options=options)
    reference.start(0, first)
    for _ in range(5):
        reference.decode_step({0: first})
    engine.start(0, first)
    for _ in range(5):
        engine.decode_step({0: first})
    assert engine.counters.recomputed_tokens == 2
    assert engine.tokens(0) == reference.tokens(0)  # same random stream after the restart
    assert engine.counters.prefill_tokens == 2  # the prompt (minus its last token) once


def test_two_groups_share_slots(model):
    """Slots crossing a group boundary attend to their own group's prompt only."""
    options = DecodeOptions(temperature=0.0, eos_token_ids=())
    prompts = [[4, 5, 6, 7], [8, 9]]
    mixed = SlotEngine(model, prompts, [1, 1], num_slots=2, slot_capacity=4, options=options)
    specs = [SampleSpec(0, 0, 0, 4, 4), SampleSpec(1, 1, 0, 2, 4)]
    mixed.start(0, specs[0]), mixed.start(1, specs[1])
    for _ in range(4):
        mixed.decode_step({0: specs[0], 1: specs[1]})
    for group_id, spec in enumerate(specs):
        alone = SlotEngine(model, [prompts[group_id]], [1], num_slots=1, slot_capacity=4, options=options)
        single = SampleSpec(0, 0, 0, spec.prompt_tokens, 4)
        alone.start(0, single)
        for _ in range(4):
            alone.decode_step({0: single})
        assert mixed.tokens(spec.sample_id) == alone.tokens(0)


def test_eager_attention_matches_sdpa(model):
    options = DecodeOptions(temperature=0.0, eos_token_ids=())
    spec = SampleSpec(0, 0, 0, 4, 6)
    outputs = []
    for implementation in ("sdpa", "eager"):
        model.set_attn_implementation(implementation)
        engine = SlotEngine(model, [[4, 5, 6, 7]], [1], num_slots=2, slot_capacity=6, options=options)
        assert engine.eager_mask == (implementation == "eager")  # additive float mask for eager
        engine.start(1, spec)
        for _ in range(6):
            engine.decode_step({1: spec})
        outputs.append(engine.tokens(0))
    model.set_attn_implementation("sdpa")
    assert outputs[0] == outputs[1]
