"""Evaluation helpers: left padding of token-id prompts and cutting at the first stop token."""

from infsamp.run.evaluation import evaluate_accuracy, left_padded, until_stop


def test_left_padded_right_aligns_prompts():
    ids, mask = left_padded([[5, 6, 7], [8]], pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_until_stop_cuts_at_the_first_of_any_stop_token():
    assert until_stop([3, 4, 9, 5, 2], [2, 9]) == [3, 4]
    assert until_stop([3, 4], [2]) == [3, 4]
    assert until_stop([2, 3], [2]) == []


def test_evaluate_accuracy_feeds_the_given_ids(tiny_model_dir, monkeypatch):
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
    accuracy = evaluate_accuracy(model, tokenizer, [[5, 6], [7]], ["7", "8"],
                                 stop_token_ids=stop_token_ids(model, tokenizer))
    assert seen == [[5, 6], [7]] and accuracy == 0.5
    assert model.training  # restored after evaluating in eval mode
