"""Tools in the TRL plug-in: `infsamp_rollout(tools=[...])` runs the episodes' calls inside the
rollout and returns TRL's `env_mask`; TRL 1.x trains on the model's tokens only. A bad tool is
one line at once."""

import sys
from pathlib import Path

import pytest
import torch

from infsamp.integrations.trl import RolloutError, infsamp_rollout
from infsamp.sampling.sampler import GroupSampler

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
from test_tool_episodes import ADD_CALL, FUNCTIONS, forcing  # noqa: E402

G, MAX_COMPLETION = 4, 120


def test_a_bad_tool_or_no_turns_is_one_line_at_once():
    with pytest.raises(RolloutError, match="infsamp_rollout: .*has no function 'nope'"):
        infsamp_rollout(tools=[f"{FUNCTIONS}:nope"])
    with pytest.raises(RolloutError, match="max_turns is 0"):
        infsamp_rollout(tools=[f"{FUNCTIONS}:add"], max_turns=0)


@pytest.mark.slow
def test_trl_trains_with_tools_in_the_rollout(tmp_path, monkeypatch):
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from infsamp.models.tiny import build_tokenizer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    original = GroupSampler.sample

    def forced(self, *args, **kwargs):  # the even samples' first turn is a call to add
        kwargs.setdefault("logits_processor_factory", forcing(self.tokenizer, ADD_CALL))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GroupSampler, "sample", forced)
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    rollout = infsamp_rollout(tools=[f"{FUNCTIONS}:add"], tool_timeout_s=5.0, max_turns=1,
                              kv_budget="100000", micro_group=2)
    outputs = []

    def recorded(prompts, trainer):
        outputs.append(rollout(prompts, trainer))
        return outputs[-1]

    args = GRPOConfig(output_dir=str(tmp_path), num_generations=G, per_device_train_batch_size=G,
                      max_completion_length=MAX_COMPLETION, temperature=1.0, max_steps=1,
                      use_cpu=True, bf16=False, report_to=[], logging_steps=1,
                      save_strategy="no", disable_tqdm=True, seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [1.0] * len(
        completions), args=args, train_dataset=Dataset.from_list([{"prompt": "What is 2+3?"}] * 4),
                          processing_class=tokenizer, rollout_func=recorded)
    try:
        trainer.train()
    finally:
        rollout.close()
    out, = outputs
    called = [row for row, mask in enumerate(out["env_mask"]) if 0 in mask]
    assert called == [0, 2]  # the even samples called add
    for row in called:
        mask, ids = out["env_mask"][row], out["completion_ids"][row]
        answer = [i for i, own in zip(ids, mask) if not own]
        assert "<tool_response>\n5\n</tool_response>" in tokenizer.decode(answer)
        assert all(lp == 0.0 for lp, own in zip(out["logprobs"][row], mask) if not own)
    assert "add" in tokenizer.decode(out["prompt_ids"][0])  # the tool offered in the prompt
    logged = next(row for row in trainer.state.log_history if "loss" in row)
    assert logged["infsamp/tools/calls"] == 2 and logged["infsamp/tool_turns"] == 2
    own_tokens = [sum(mask) for mask in out["env_mask"]]
    assert logged["completions/mean_length"] == pytest.approx(sum(own_tokens) / G)
