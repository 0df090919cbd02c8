"""Evaluation helpers: left padding of token-id prompts and cutting at the first stop token."""

import pytest

from infsamp.run.evaluation import held_out_completions, left_padded, until_stop


def test_left_padded_right_aligns_prompts():
    ids, mask = left_padded([[5, 6, 7], [8]], pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_until_stop_cuts_at_the_first_of_any_stop_token():
    assert until_stop([3, 4, 9, 5, 2], [2, 9]) == [3, 4]
    assert until_stop([3, 4], [2]) == [3, 4]
    assert until_stop([2, 3], [2]) == []


def test_held_out_completions_feed_the_given_ids(tiny_model_dir, monkeypatch):
    from infsamp.config import ModelConfig
    from infsamp.models.loading import load_model_and_tokenizer, stop_token_ids
    from infsamp.run import evaluation

    model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    answer_ids = tokenizer("<answer>\n7\n</answer>", add_special_tokens=False).input_ids
    seen = []

    def scripted(model, prompt_ids, **kwargs):
        seen.extend(prompt_ids)
        return [answer_ids, []]

    monkeypatch.setattr(evaluation, "generate_completions", scripted)
    model.train()
    ids, texts = held_out_completions(model, tokenizer, [[5, 6], [7]],
                                      stop_token_ids=stop_token_ids(model, tokenizer))
    assert seen == [[5, 6], [7]] and ids == [answer_ids, []]
    assert texts == ["<answer>\n7\n</answer>", ""]
    assert model.training  # restored after evaluating in eval mode


SYSTEM = "You are a calculator. Give the result in one line.\nExample: Calculate 12 + 7."


def _engine_and_generate(model_name: str, num_prompts: int, max_new_tokens: int,
                         kv_budget: str, system: str = ""):
    """Held-out completions of `num_prompts` embedded-task problems both ways: through the
    sampler's slot engine (one call, under `kv_budget`) and through `generate` (the reference).
    `system`: text put before every prompt (a prefix the engine forwards and holds once)."""
    from infsamp.commands.bench_sampling import bench_prompts
    from infsamp.config import ModelConfig
    from infsamp.config_algorithm import SamplingConfig
    from infsamp.models.loading import load_model_and_tokenizer, stop_token_ids
    from infsamp.run.evaluation import held_out_completions
    from infsamp.sampling.sampler import GroupSampler, shared_prefix_tokens

    model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=model_name))
    prompts = bench_prompts(tokenizer, num_prompts, seed=0)
    if system:
        head = tokenizer(system, add_special_tokens=False).input_ids
        prompts = [head + prompt for prompt in prompts]
        assert shared_prefix_tokens(prompts) >= len(head)
    stops = stop_token_ids(model, tokenizer)
    sampler = GroupSampler(model, tokenizer, SamplingConfig(kv_budget=kv_budget, temperature=1.0,
                                                            max_new_tokens=8))
    kwargs = {"stop_token_ids": stops, "max_new_tokens": max_new_tokens}
    engine = held_out_completions(model, tokenizer, prompts, sampler=sampler, **kwargs)
    reference = held_out_completions(model, tokenizer, prompts, **kwargs)
    return engine, reference


def test_held_out_completions_through_the_engine_equal_generate():
    (engine_ids, engine_texts), (ids, texts) = _engine_and_generate("embedded", 24, 24, "600")
    assert engine_ids == ids and engine_texts == texts
    assert len({len(c) for c in ids}) > 1  # completions of several lengths: slots refilled


def test_held_out_completions_sharing_a_system_prompt_equal_generate():
    """The engine forwards the shared prefix once and its suffixes inside decode steps."""
    (engine_ids, engine_texts), (ids, texts) = _engine_and_generate("embedded", 24, 24, "600",
                                                                    SYSTEM)
    assert engine_ids == ids and engine_texts == texts
    assert len({len(c) for c in ids}) > 1


@pytest.mark.slow
@pytest.mark.parametrize("system", ["", SYSTEM])
def test_held_out_completions_through_the_engine_equal_generate_on_smollm2(system):
    (engine_ids, _), (ids, _) = _engine_and_generate("smollm2-135m", 16, 48, "2000", system)
    assert engine_ids == ids
