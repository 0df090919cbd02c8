"""The TRL plug-in: TRL's GRPOTrainer trains two steps on the embedded model with infsamp's sampler
as its rollout_func (g slots < G, KV within the budget, length-aware policy with the online
predictor); the log-probs returned are the policy's; unsupported TRL settings are one line."""

from types import SimpleNamespace

import pytest
import torch

from infsamp.integrations.trl import RolloutError, group_runs, infsamp_rollout

G, PROMPTS_PER_STEP, MICRO_GROUP, KV_BUDGET, MAX_COMPLETION = 8, 2, 4, 1024, 48


def test_group_runs_cuts_repeats_into_groups_of_at_most_G():
    assert group_runs(["a"] * 3 + ["b"] * 3, 3) == [("a", 3), ("b", 3)]
    # a prompt drawn twice in a row, and a group split across processes
    assert group_runs(["a"] * 6 + ["b"] * 2, 3) == [("a", 3), ("a", 3), ("b", 2)]
    chat = [{"role": "user", "content": "1+1"}]
    assert group_runs([chat, chat, list(chat)], 4) == [(chat, 3)]


def fake_trainer(**overrides):
    settings = {"use_vllm": False, "tools": None, "environment_factories": None,
                "repetition_penalty": 1.0, "min_p": None,
                "args": SimpleNamespace(generation_kwargs=None)}
    return SimpleNamespace(**{**settings, **overrides})


@pytest.mark.parametrize("overrides, message", [
    ({"use_vllm": True}, "GRPOConfig use_vllm=True: the infsamp rollout replaces TRL's "
                         "generation (engine='vllm' decodes with vLLM); set use_vllm=False"),
    ({"repetition_penalty": 1.1}, "GRPOConfig repetition_penalty: not supported (use 1.0)"),
    ({"tools": [print]}, "GRPOTrainer tools / environment_factory: TRL would generate every turn "
                         "after the first itself; give the tools to the rollout, "
                         "infsamp_rollout(tools=[...]) (environments are not supported: their "
                         "dataset rows never reach a rollout_func)"),
])
def test_unsupported_trl_settings_are_one_line(overrides, message):
    with pytest.raises(RolloutError) as info:
        infsamp_rollout()(["1+1"] * 2, fake_trainer(**overrides))
    assert str(info.value) == message


def test_unknown_or_conflicting_options_are_refused_at_once():
    with pytest.raises(RolloutError, match="unknown sampling option.*kv_budgets"):
        infsamp_rollout(kv_budgets="1GiB")
    with pytest.raises(RolloutError, match="num_generations"):
        infsamp_rollout(num_generations=4)
    with pytest.raises(RolloutError, match="sampling.engine.*'gpu'"):
        infsamp_rollout(engine="gpu")
    with pytest.raises(RolloutError, match="dynamic sampling does not apply"):
        infsamp_rollout(dynamic=True)


def policy_logprobs(model, prompt, completion, temperature):
    """Reference: a plain forward over prompt + completion, log-softmax at T, sampled tokens."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1] / temperature  # [T_c, V]
    chosen = torch.tensor(completion)[:, None]  # [T_c, 1]
    return torch.log_softmax(logits.float(), -1).gather(-1, chosen)[:, 0]


def train_with_trl(rollout_func, output_dir, num_steps=2):
    """TRL's GRPOTrainer on the embedded model and task; returns (trainer, weights before)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from infsamp.models.loading import EMBEDDED_DIR, load_tokenizer
    from infsamp.rewards.builtin import accuracy_reward, format_reward
    from infsamp.tasks.arithmetic import generate_problems

    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_DIR, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = GRPOConfig(output_dir=str(output_dir), num_generations=G,
                      per_device_train_batch_size=G * PROMPTS_PER_STEP,
                      max_completion_length=MAX_COMPLETION, temperature=0.7, learning_rate=1e-3,
                      max_steps=num_steps, use_cpu=True, bf16=False, report_to=[], logging_steps=1,
                      save_strategy="no", disable_tqdm=True, seed=0)
    problems = [{"prompt": p["prompt"], "answer": p["answer"]}
                for p in generate_problems(16, 1234, "train")]
    trainer = GRPOTrainer(model=model, reward_funcs=[format_reward, accuracy_reward], args=args,
                          train_dataset=Dataset.from_list(problems),
                          processing_class=load_tokenizer("embedded"), rollout_func=rollout_func)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 0.8M model on a shared CPU: more threads only spin
    try:
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    return trainer, before


def weights_moved(trainer, before) -> bool:
    return any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def checked(rollout, calls):
    """Wraps a rollout: checks two rows' log-probs against the current policy's, records calls."""
    def checked_rollout(prompts, trainer):
        out = rollout(prompts, trainer)
        policy = trainer.accelerator.unwrap_model(trainer.model)
        for row in (0, len(prompts) - 1):  # the current policy's log-probs at the trainer's T
            expected = policy_logprobs(policy, out["prompt_ids"][row], out["completion_ids"][row],
                                       trainer.temperature)
            got = torch.tensor(out["logprobs"][row])
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        calls.append((prompts, out, rollout.last_stats))
        return out
    return checked_rollout


@pytest.mark.slow
def test_trl_grpo_trainer_trains_with_the_infsamp_rollout(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    rollout = infsamp_rollout(kv_budget=str(KV_BUDGET), micro_group=MICRO_GROUP,
                              policy="length_aware")
    calls = []
    checked_rollout = checked(rollout, calls)
    trainer, before = train_with_trl(checked_rollout, tmp_path)
    assert trainer.state.global_step == 2 and len(calls) == 2
    for prompts, out, stats in calls:
        num_rows = G * PROMPTS_PER_STEP
        assert len(prompts) == len(out["completion_ids"]) == len(out["logprobs"]) == num_rows
        assert len({tuple(out["prompt_ids"][i]) for i in range(G)}) == 1  # one prompt per group
        assert all(1 <= len(c) <= MAX_COMPLETION for c in out["completion_ids"])
        assert [len(lp) for lp in out["logprobs"]] == [len(c) for c in out["completion_ids"]]
        assert stats.micro_group == MICRO_GROUP < G and stats.peak_kv_tokens <= KV_BUDGET
        assert stats.policy == "length_aware" and stats.predictor_kendall_tau is not None
        assert stats.engine == "slots"
    logged = [row for row in trainer.state.log_history if "loss" in row]
    assert [row["infsamp/micro_group"] for row in logged] == [MICRO_GROUP, MICRO_GROUP]
    assert weights_moved(trainer, before)


@pytest.mark.slow
def test_trl_trains_with_the_continuous_policy_and_no_logprobs(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    rollout = infsamp_rollout(logprobs=False, kv_budget=str(KV_BUDGET), micro_group=MICRO_GROUP)
    outputs = []

    def recorded(prompts, trainer):
        outputs.append(rollout(prompts, trainer))
        return outputs[-1]

    trainer, before = train_with_trl(recorded, tmp_path, num_steps=1)
    assert trainer.state.global_step == 1 and outputs[0]["logprobs"] is None
    stats = rollout.last_stats
    assert stats.policy == "continuous" and stats.micro_group == MICRO_GROUP
    assert weights_moved(trainer, before)


@pytest.mark.slow
def test_trl_trains_with_the_vllm_engine_on_the_current_weights(tmp_path, monkeypatch):
    """engine='vllm': the rollout decodes with vLLM; the second step's log-probs are the updated
    policy's (the weights were pushed after TRL's first optimizer step)."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    rollout = infsamp_rollout(engine="vllm", kv_budget=str(KV_BUDGET), micro_group=MICRO_GROUP)
    sampled, sample = [], rollout._sample
    monkeypatch.setattr(rollout, "_sample", lambda *a: sampled.append(sample(*a)) or sampled[-1])
    calls = []
    trainer, before = train_with_trl(checked(rollout, calls), tmp_path)
    assert trainer.state.global_step == 2 and len(calls) == 2
    assert all(stats.engine == "vllm" for _, _, stats in calls)
    for groups, (_, out, _) in zip(sampled, calls):  # vLLM's own log-probs: the same weights
        by_vllm = [c.logprobs for group in groups for c in group]
        for row in (0, len(by_vllm) - 1):
            torch.testing.assert_close(torch.tensor(by_vllm[row]),
                                       torch.tensor(out["logprobs"][row]), atol=1e-4, rtol=0)
    assert all(stats.peak_kv_tokens <= KV_BUDGET for _, _, stats in calls)
    assert weights_moved(trainer, before)


@pytest.mark.parametrize("share_prompt", [True, False])
def test_rollout_logprobs_in_the_shared_layout_equal_the_unshared(monkeypatch, share_prompt):
    """The plug-in's log-prob pass forwards each group's prompt once (the training step's
    layout, `share_prompt=True`, the default) with the same values as one forward per row."""
    from transformers import AutoModelForCausalLM

    from infsamp.algorithm import shared_prompt
    from infsamp.models.loading import EMBEDDED_DIR, load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_DIR, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    tokenizer = load_tokenizer("embedded")
    used = []
    layouts = {key: shared_prompt.Layout(layout.plan, lambda *a, _k=key, _m=layout.make, **kw:
                                         used.append(_k) or _m(*a, **kw))
               for key, layout in shared_prompt.LAYOUTS.items()}
    monkeypatch.setattr(shared_prompt, "LAYOUTS", layouts)
    prompts = [tokenizer("What is 12 + 30?")["input_ids"], tokenizer("Add 7 and 8.")["input_ids"]]
    rows_prompt = [prompts[0]] * 3 + [prompts[1]] * 2
    rows_completion = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14], [15, 16]]
    rollout = infsamp_rollout(share_prompt=share_prompt)
    rollout.sizes = SimpleNamespace(kv_budget_tokens=4096)
    trainer = SimpleNamespace(processing_class=tokenizer, temperature=0.7)
    got = rollout._logprobs(model, trainer, rows_prompt, rows_completion)
    assert set(used) == {share_prompt}
    for prompt, completion, values in zip(rows_prompt, rows_completion, got):
        torch.testing.assert_close(torch.tensor(values),
                                   policy_logprobs(model, prompt, completion, 0.7),
                                   atol=1e-5, rtol=1e-5)
