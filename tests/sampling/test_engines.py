"""Slot engine pieces: per-sample random streams, the prompt table, preemption and recomputation."""

from __future__ import annotations

import pytest
import torch
from tiny_sampling import RecordLogits, run_steps
from transformers import LlamaConfig, LlamaForCausalLM

from infsamp.sampling.engines.base import DecodeOptions
from infsamp.sampling.engines.select import build_warpers, select_tokens, uniform_noise
from infsamp.sampling.engines.slot_cache import SlotKVCache
from infsamp.sampling.engines.slots import SlotEngine
from infsamp.sampling.types import Sample, SamplerStats

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
    tokens = select_tokens(logits, torch.arange(num), torch.zeros(num, dtype=torch.long), options,
                           [])
    freq = torch.bincount(tokens, minlength=4).float() / num
    assert torch.allclose(freq, logits[0].softmax(-1), atol=0.015)


def test_noise_belongs_to_the_sample_not_the_batch():
    alone = uniform_noise(7, torch.tensor([9]), torch.tensor([4]), 16)
    batched = uniform_noise(7, torch.tensor([5, 9, 2]), torch.tensor([0, 4, 4]), 16)
    assert torch.equal(alone[0], batched[1])
    assert not torch.equal(batched[1], batched[2])  # other sample, same step: other noise
    # other seed
    assert not torch.equal(alone, uniform_noise(8, torch.tensor([9]), torch.tensor([4]), 16))
    assert 0 < alone.min() and alone.max() < 1


def test_top_k_one_is_greedy():
    logits = torch.randn(6, 10)
    options = DecodeOptions(temperature=1.5, top_k=1, seed=0)
    tokens = select_tokens(logits, torch.arange(6), torch.zeros(6, dtype=torch.long), options,
                           build_warpers(options))
    assert torch.equal(tokens, logits.argmax(-1))


def test_prompt_table_add_and_drop():
    cache = SlotKVCache(num_layers=1, pool_tokens=8, kv_heads=1, head_dim=2,
                        dtype=torch.float32, device=torch.device("cpu"))
    for group_id, length in ((10, 3), (11, 5), (12, 2)):
        kv = [torch.full((1, 1, length, 2), float(group_id))]
        cache.add_prompts([group_id], [kv], [kv])
    assert cache.prompt_keys[0].shape == (3, 1, 5, 2) and cache.held_tokens() == 2 * 4 + 3 * 5
    cache.drop_prompts([11])
    assert cache.group_rows == {10: 0, 12: 1} and cache.prompt_lengths == [3, 2]
    assert cache.prompt_keys[0].shape == (2, 1, 3, 2)  # trimmed to the longest prompt left
    assert cache.prompt_keys[0][1, 0, :2].eq(12).all() and cache.prompt_keys[0][0].eq(10).all()


def _table_of(steps) -> SlotKVCache:
    """A prompt table after `steps`: ("add", [(group, length), ...]) adds those rows at once,
    ("open", [...]) opens zero rows, ("drop", [group, ...]) drops those rows at once."""
    cache = SlotKVCache(num_layers=2, pool_tokens=8, kv_heads=1, head_dim=2,
                        dtype=torch.float32, device=torch.device("cpu"))
    for kind, items in steps:
        if kind == "add":
            kv = [[torch.full((1, 1, n, 2), float(g + layer)) for layer in range(2)]
                  for g, n in items]
            cache.add_prompts([g for g, _ in items], kv, kv)
        elif kind == "open":
            cache.open_rows([g for g, _ in items], [n for _, n in items])
        else:
            cache.drop_prompts(items)
    return cache


def test_rows_added_or_dropped_at_once_make_the_table_of_one_by_one():
    """The batched table updates (one copy per layer) give exactly the one-by-one tables."""
    added, opened, dropped = [(10, 3), (11, 5), (12, 2), (13, 4)], [(14, 6), (15, 1)], [11, 14]
    at_once = _table_of([("add", added), ("open", opened), ("drop", dropped)])
    one_by_one = _table_of([*(("add", [row]) for row in added),
                            *(("open", [row]) for row in opened),
                            *(("drop", [g]) for g in dropped)])
    assert at_once.group_rows == one_by_one.group_rows == {10: 0, 12: 1, 13: 2, 15: 3}
    assert at_once.prompt_lengths == one_by_one.prompt_lengths == [3, 2, 4, 1]
    for mine, theirs in zip(at_once.prompt_tensors(), one_by_one.prompt_tensors(), strict=True):
        assert mine.shape == theirs.shape and torch.equal(mine, theirs) and mine.is_contiguous()
    assert at_once.prompt_keys[0].shape == (4, 1, 4, 2)  # trimmed to the longest row left

def _spec(sample_id, group_id=0, max_new=5, prompt_tokens=3):
    return Sample(sample_id, group_id, sample_id, prompt_tokens=prompt_tokens,
                  max_new_tokens=max_new)


def engine_for(model, prompts, samples, micro_group, options):
    engine = SlotEngine(model)
    stats = SamplerStats()
    engine.begin_call(prompts, samples, micro_group, options, stats)
    return engine, stats


@pytest.mark.parametrize("keep_kv", [True, False])
def test_parked_sample_resumes_where_it_stopped(model, keep_kv):
    """A sample taken out of its slot after 2 tokens keeps them; it resumes in another slot (its
    KV copied back, or recomputed) and ends with the tokens of an uninterrupted run."""
    options = DecodeOptions(temperature=1.0, seed=11, eos_token_ids=(), hidden_states=True)
    first, second = _spec(0), _spec(1)
    engine, stats = engine_for(model, [[4, 5, 6]], [first, second], 2, options)
    engine.start(0, first)
    engine.decode_step({0: first})
    engine.decode_step({0: first})
    first.parked_kv = keep_kv
    engine.start(0, second)  # the scheduler parked `first` and gave slot 0 to another sample
    assert first.num_tokens == 2 and (first.sample_id in engine.cache.parked) == keep_kv
    assert stats.peak_kv_tokens == 2 * 5 + 2 + (2 if keep_kv else 0)  # slots, prompt, parked
    for _ in range(3):
        engine.decode_step({0: second})
    engine.start(1, first)
    assert engine.decode_step({0: second, 1: first}) == []
    assert engine.decode_step({0: second, 1: first}) == [second]
    assert engine.decode_step({1: first}) == [first] and first.num_tokens == 5
    alone = _spec(0)
    reference, _ = engine_for(model, [[4, 5, 6]], [alone], 1, options)
    reference.start(0, alone)
    for _ in range(5):
        reference.decode_step({0: alone})
    assert first.token_ids == alone.token_ids  # same random stream, same KV after the resume
    assert first.hidden_state.shape == (model.config.hidden_size,)
    assert stats.prefill_tokens == 2  # the prompt (minus its last token) once
    assert not engine.cache.parked


def test_two_groups_share_slots(model):
    """Slots crossing a group boundary attend to their own group's prompt only."""
    options = DecodeOptions(temperature=0.0, eos_token_ids=())
    prompts = [[4, 5, 6, 7], [8, 9]]
    samples = [Sample(0, 0, 0, 4, 4), Sample(1, 1, 0, 2, 4)]
    mixed, _ = engine_for(model, prompts, samples, 2, options)
    mixed.start(0, samples[0]), mixed.start(1, samples[1])
    for _ in range(4):
        mixed.decode_step({0: samples[0], 1: samples[1]})
    for group_id, sample in enumerate(samples):
        single = Sample(0, 0, 0, sample.prompt_tokens, 4)
        alone, _ = engine_for(model, [prompts[group_id]], [single], 1, options)
        alone.start(0, single)
        for _ in range(4):
            alone.decode_step({0: single})
        assert sample.token_ids == single.token_ids


def test_eager_attention_matches_sdpa(model):
    options = DecodeOptions(temperature=0.0, eos_token_ids=())
    outputs = []
    for implementation in ("sdpa", "eager"):
        model.set_attn_implementation(implementation)
        sample = Sample(0, 0, 0, 4, 6)
        engine, _ = engine_for(model, [[4, 5, 6, 7]], [sample], 2, options)
        assert engine.eager_mask == (implementation == "eager")  # additive float mask for eager
        engine.start(1, sample)
        for _ in range(6):
            engine.decode_step({1: sample})
        outputs.append(sample.token_ids)
    model.set_attn_implementation("sdpa")
    assert outputs[0] == outputs[1]


def test_long_lived_engine_restores_training_mode(model):
    model.train()
    sample = Sample(0, 0, 0, 3, 2)
    engine, _ = engine_for(model, [[4, 5, 6]], [sample], 1, DecodeOptions(temperature=0.0))
    assert not model.training  # decoding runs in eval mode
    engine.start(0, sample)
    engine.decode_step({0: sample})
    engine.reset()  # a call that failed half-way
    assert model.training and engine.cache is None
    model.eval()


def decode_logits(model, prompts, samples, split: bool, steps: int = 3) -> list[torch.Tensor]:
    """Each decode step's logits [S, V] with attention reading the cache in place or not."""
    engine, _ = engine_for(model, prompts, samples, len(samples),
                           DecodeOptions(temperature=0.0, eos_token_ids=()))
    engine.split = split
    for slot, sample in enumerate(samples):
        engine.start(slot, sample)
    logits = []
    for _ in range(steps):
        samples = engine._allocate(samples)
        inputs, positions, write_index, rows = engine._step_layout(samples)
        mask = engine.cache.prepare_step([s.sample_id for s in samples], rows, write_index,
                                         engine.eager_mask)
        with torch.inference_mode():
            logits.append(engine._forward(torch.tensor(inputs), torch.tensor(positions),
                                          mask)[0])
        engine._record(samples, logits[-1].argmax(-1).tolist())
    return logits


@pytest.mark.parametrize("prompts", [[[4, 5, 6, 7]], [[4, 5, 6, 7], [8, 9]], [[3]]])
def test_attention_in_place_matches_the_joined_keys(model, prompts):
    """One shared prompt row, a row per group, no prompt KV (one-token prompt); grouped-query
    heads (2 query heads on 1 KV head)."""
    samples = [Sample(i, i % len(prompts), 0, len(prompts[i % len(prompts)]), 4) for i in range(3)]
    copies = [Sample(s.sample_id, s.group_id, 0, s.prompt_tokens, 4) for s in samples]
    in_place, joined = (decode_logits(model, prompts, s, split) for s, split in
                        ((samples, True), (copies, False)))
    for a, b in zip(in_place, joined):
        assert torch.allclose(a, b, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"  # switched back after each forward


def test_attention_beyond_plain_falls_back_to_the_models_own(model):
    """A layer asking for a sliding window gets sdpa over the joined keys: the same numbers here
    (sdpa ignores the window; this checks the fallback's plumbing)."""
    from infsamp.sampling.engines.slot_attention import slot_attention, split_attention_forward

    samples = [Sample(0, 0, 0, 4, 4), Sample(1, 1, 0, 2, 4)]
    engine, _ = engine_for(model, [[4, 5, 6, 7], [8, 9]], samples, 2,
                           DecodeOptions(temperature=0.0, eos_token_ids=()))
    for slot, sample in enumerate(samples):
        engine.start(slot, sample)
    samples = engine._allocate(samples)  # each sample's first column
    _, _, write_index, rows = engine._step_layout(samples)
    mask = engine.cache.prepare_step([0, 1], rows, write_index, False)  # [S, 1, 1, P_max + 1]
    layer = model.model.layers[0].self_attn
    query = torch.randn(2, 2, 1, 16)  # [S, H, 1, D]
    key, value = torch.randn(2, 1, 1, 16), torch.randn(2, 1, 1, 16)  # [S, H_kv, W, D]
    with slot_attention(model, engine.cache):
        plain, _ = split_attention_forward(layer, query, key, value, mask)
        windowed, _ = split_attention_forward(layer, query, key, value, mask, sliding_window=64)
    assert plain.shape == (2, 1, 2, 16) and torch.allclose(plain, windowed, atol=1e-6)


def _noise_int64(seed, sample_ids, num_generated, vocab_size):
    """The hash as first written, in int64 (the reference the int32 path must equal)."""
    from infsamp.sampling.engines.select import _MASK32, _mix32

    per_sample = _mix32((sample_ids * 0x9E3779B1 + (seed & _MASK32)) & _MASK32)
    per_token = _mix32((per_sample + num_generated * 0x85EBCA77) & _MASK32)
    vocab = torch.arange(vocab_size) * 0xC2B2AE3D
    bits = _mix32((per_token[:, None] + vocab[None, :]) & _MASK32)
    return ((bits >> 8).to(torch.float32) + 0.5) / float(1 << 24)


@pytest.mark.parametrize("seed, vocab_size", [(0, 30000), (7, 30000), (2**40 + 3, 30000), (7, 48)])
def test_int32_noise_has_the_int64_formulas_bits(seed, vocab_size):
    """Both paths (int32 in place from IN_PLACE_FROM entries, int64 below) give its bits."""
    generator = torch.Generator().manual_seed(seed % 1000)
    sample_ids = torch.randint(0, 10**6, (5,), generator=generator)
    num_generated = torch.randint(0, 5000, (5,), generator=generator)
    assert torch.equal(uniform_noise(seed, sample_ids, num_generated, vocab_size),
                       _noise_int64(seed, sample_ids, num_generated, vocab_size))


def _decode_with(model, cache_kind: str, steps: int = 6):
    """Three samples (two groups), the middle one ending after 2 tokens: tokens and logits of
    every step, with the rows layout or the token pool."""
    prompts = [[4, 5, 6, 7], [8, 9]]
    samples = [Sample(0, 0, 0, 4, steps), Sample(1, 1, 0, 2, 2), Sample(2, 0, 1, 4, steps)]
    engine = SlotEngine(model)
    options = DecodeOptions(temperature=1.0, seed=5, eos_token_ids=())
    pool = None if cache_kind == "rows" else 3 * steps - 1  # less than 3 whole rows: the pool
    logits = RecordLogits()
    engine.begin_call(prompts, samples, 3, options, SamplerStats(), logits, pool_tokens=pool)
    assert type(engine.cache).__name__ == ("SlotRowCache" if cache_kind == "rows"
                                           else "SlotKVCache")
    run_steps(engine, samples, steps)
    return [s.token_ids for s in samples], logits.seen, engine


def test_rows_layout_gives_the_pools_logits_and_reads_a_view(model):
    """The rows layout (after sample 1 ends, sample 2 moves into its row) gives the token pool's
    logits, bit for bit, at every step; the step's columns are a view of the cache."""
    rows_tokens, rows_logits, engine = _decode_with(model, "rows")
    pool_tokens, pool_logits, _ = _decode_with(model, "pool")
    assert rows_tokens == pool_tokens and rows_logits.keys() == pool_logits.keys()
    assert all(torch.equal(rows_logits[key], pool_logits[key]) for key in pool_logits)
    cache = engine.cache
    assert cache.row_sample == [] and cache.read_rows is None  # all ended; rows [0, S) were read
    sample = Sample(0, 0, 0, 4, 4)
    engine.begin_call([[4, 5, 6, 7]], [sample], 2, DecodeOptions(temperature=0.0), SamplerStats())
    engine.start(0, sample)
    engine._allocate([sample])
    engine.cache.prepare_step([0], [0], [0], False)
    engine.cache.split_from = "sdpa"  # as under slot_attention: the columns alone
    keys, _ = engine.cache.update(torch.ones(1, 1, 1, 16), torch.ones(1, 1, 1, 16), 0)
    assert keys.data_ptr() == engine.cache.keys[0].data_ptr()  # a view of row 0
    assert keys.shape == (1, 1, 1, 16) and keys.eq(1).all()


def test_the_bounds_ready_cache_is_a_real_cache(model):
    """One step over a ReadyCache holding a prompt's KV gives the logits of the model's forward
    over the prompt and the token: the bound times a real decode step."""
    from transformers import DynamicCache

    from infsamp.sampling.engines.decode_bound import ready_step_inputs
    from infsamp.sampling.engines.slots import cache_kwarg_name

    prompt, token = [4, 5, 6, 7], 9
    prefix = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt]), past_key_values=prefix, use_cache=True)
        inputs = ready_step_inputs(model, [len(prompt) + 1])
        cache = inputs[cache_kwarg_name(model)]
        for layer, kv in enumerate(prefix.layers):
            cache.keys[layer][0, :, :len(prompt)] = kv.keys[0]
            cache.values[layer][0, :, :len(prompt)] = kv.values[0]
        inputs["input_ids"] = torch.tensor([[token]])
        step = model(**inputs).logits[0, -1]
        whole = model(input_ids=torch.tensor([prompt + [token]])).logits[0, -1]
    assert inputs["position_ids"].tolist() == [[len(prompt)]]
    assert torch.allclose(step, whole, atol=1e-5)


def test_prefill_forwards_skip_the_lm_head_and_keep_the_completions(model, monkeypatch):
    """A prompt's prefill (and a parked sample's recompute) computes KV only: the LM head sees
    no position there (`no_logits`), and the tokens are those of keeping one row's logits."""
    from infsamp.sampling.engines import slot_prefix

    def run() -> tuple[list[list[int]], list[int]]:
        rows = []
        handle = model.lm_head.register_forward_hook(
            lambda module, args, out: rows.append(args[0].shape[-2]))  # positions it saw
        try:
            options = DecodeOptions(temperature=1.0, seed=11, eos_token_ids=())
            samples = [_spec(0), _spec(1, group_id=1)]
            engine, _ = engine_for(model, [[4, 5, 6], [7, 8, 9, 10]], samples, 2, options)
            engine.start(0, samples[0])
            engine.start(1, samples[1])
            for _ in range(5):
                engine.decode_step({0: samples[0], 1: samples[1]})
        finally:
            handle.remove()
        return [s.token_ids for s in samples], rows

    tokens, rows = run()
    assert rows.count(0) == 2 and rows.count(1) == 5  # two prefills; five decode steps
    monkeypatch.setattr(slot_prefix, "no_logits", lambda device: 1)  # the last position's
    assert run()[0] == tokens
