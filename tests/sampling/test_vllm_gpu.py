"""The vLLM engine on a CUDA GPU (the CUDA build, `pip install 'infsamp[gpu]'`): `auto` picks it,
sleep mode frees its pool and weights during training and the weights pushed afterwards are the
ones sampled."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from infsamp.algorithm.logprobs import sequence_logprobs
from infsamp.config_algorithm import SamplingConfig
from infsamp.planner.sizes import RunSizes
from infsamp.sampling.engines.base import make_engine, resolve_engine_name, vllm_installed
from infsamp.sampling.sampler import GroupSampler

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=512)
    return LlamaForCausalLM(config).to("cuda", torch.float32).eval()


def test_auto_picks_vllm_on_cuda():
    assert resolve_engine_name("auto", torch.device("cuda")) == "vllm"


def test_sleep_frees_memory_and_pushed_weights_are_sampled(model):
    cfg = SamplingConfig(policy="continuous", micro_group=8, kv_budget="65536", max_new_tokens=32,
                         temperature=1.0, vllm_sleep="discard")
    engine = make_engine("vllm", model, cfg,
                         RunSizes(kv_budget_tokens=65536, micro_group=8, max_micro_group=8,
                                  max_prompt_tokens=32,
                      max_new_tokens=32))
    try:
        prompts = [[5, 6, 7, 8], [9, 10, 11]]
        GroupSampler(model, None, cfg, engine=engine).sample(prompts, 4)
        free_awake = torch.cuda.mem_get_info()[0]
        engine.sleep()
        assert torch.cuda.mem_get_info()[0] > free_awake  # pool and weights handed back
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.01 * torch.randn_like(param))
        engine.load_weights(model)
        result = GroupSampler(model, None, cfg, engine=engine).sample(
            prompts, 4, generator=torch.Generator().manual_seed(1))
    finally:
        engine.close()
    completions = result.completions
    ours = sequence_logprobs(model, [prompts[c.group_id] for c in completions],
                             [c.token_ids for c in completions], max_tokens=4096, pad_token_id=0,
                             temperature=1.0)
    diffs = [(o.cpu() - torch.tensor(c.logprobs)).abs().max().item()
             for o, c in zip(ours, completions)]
    assert max(diffs) < 1e-3
