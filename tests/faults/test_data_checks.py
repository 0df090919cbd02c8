"""Data and models that cannot train are named before training (issue 19, item 7): GSM8K answers
the parser cannot read, an evaluation split that is (or overlaps) the training split, a model
and tokenizer without an end-of-sequence token."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from infsamp import cli
from infsamp.config import DataConfig
from infsamp.tasks.loading import load_splits

from fault_runs import run_args
from test_config_property import run_train


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def gsm8k_rows(answers: list[str]) -> list[dict]:
    return [{"question": f"Question {i}?", "answer": f"work\n#### {a}" if a else "no hash here"}
            for i, a in enumerate(answers)]


def gsm8k(dataset: Path, **options) -> DataConfig:
    return DataConfig(dataset=str(dataset), prompt_column="question", answer_parser="gsm8k",
                      **options)


# ---- answers the parser cannot read


def test_unreadable_gsm8k_answers_are_counted_named_and_skipped(tmp_path):
    answers = ["72", "seventy-two", "5", "1,000", "", "3", "8", "9", "10", "11"]
    path = write_jsonl(tmp_path / "d.jsonl", gsm8k_rows(answers))
    splits = load_splits(gsm8k(path, eval_fraction=0.2), num_eval=4)
    assert len(splits.train) + len(splits.eval) == 8
    assert {e["answer"] for e in splits.train + splits.eval} >= {"72", "1,000", "5"}
    note, = splits.data_notes
    assert note.startswith(f"data: skipped 2 of the 10 rows of {path} split 'train' whose answer "
                           "data.answer_parser gsm8k cannot read: line 2, line 5 (first: ")
    assert "'seventy-two' after '####' is not a number" in note


@pytest.mark.parametrize("num_bad, words", [(6, "6 of the 10 rows"), (10, "none of the 10 rows")])
def test_when_most_or_all_answers_cannot_be_read_the_run_is_refused(tmp_path, num_bad, words):
    answers = ["seventy-two"] * num_bad + ["4"] * (10 - num_bad)
    path = write_jsonl(tmp_path / "d.jsonl", gsm8k_rows(answers))
    code, stderr = run_train("data.dataset", "flag", str(path), tmp_path,
                             "--data.prompt_column", "question", "--data.answer_parser", "gsm8k",
                             "--data.eval_fraction", "0.2")
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and words in lines[0], stderr
    assert "check data.answer_column and data.answer_parser" in lines[0]


# ---- an evaluation split that is the training split, or overlaps it


def two_splits(tmp_path: Path, test_questions: list[int]) -> Path:
    folder = tmp_path / "data"
    write_jsonl(folder / "train.jsonl", gsm8k_rows([str(i) for i in range(8)]))
    test = [row for i, row in enumerate(gsm8k_rows([str(i) for i in range(8)]))
            if i in test_questions]
    write_jsonl(folder / "test.jsonl", test)
    return folder


def test_an_evaluation_split_identical_to_the_training_split_is_one_line(tmp_path):
    folder = two_splits(tmp_path, list(range(8)))
    code, stderr = run_train("data.dataset", "flag", str(folder), tmp_path,
                             "--data.prompt_column", "question", "--data.answer_parser", "gsm8k")
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1, stderr
    assert f"all 8 rows of split 'test' of {folder} are training rows too" in lines[0]


def test_evaluation_rows_that_are_training_rows_are_skipped_and_counted(tmp_path):
    folder = two_splits(tmp_path, [1, 3, 5])
    extra = [{"question": "A new question?", "answer": "#### 7"}]
    with (folder / "test.jsonl").open("a") as handle:
        handle.write(json.dumps(extra[0]) + "\n")
    splits = load_splits(gsm8k(folder), num_eval=4)
    assert [e["prompt"] for e in splits.eval] == ["A new question?"]
    note = (f"evaluation: skipped 3 of the 4 rows of split 'test' of {folder} whose prompt is "
            "also a training prompt: line 1, line 2, line 3")
    assert splits.data_notes == [note]


# ---- a model and tokenizer without an end-of-sequence token


def without_eos(tiny_model_dir: Path, folder: Path, keep_generation_eos: bool = False) -> Path:
    shutil.copytree(tiny_model_dir, folder)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        path = folder / name
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        if not (keep_generation_eos and name == "generation_config.json"):
            data.pop("eos_token", None)
            data["eos_token_id"] = None
        path.write_text(json.dumps(data))
    return folder


def test_a_model_without_an_end_of_sequence_token_is_one_line_before_training(tiny_model_dir,
                                                                              tmp_path):
    folder = without_eos(tiny_model_dir, tmp_path / "model")
    out = tmp_path / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(run_args(folder, out, "--training.max_steps", "1",
                                 "--eval.num_problems", "0"))
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1, err.getvalue()
    assert "names an end-of-sequence token" in lines[0] and str(folder) in lines[0]
    assert not (out / "metrics.jsonl").exists()


def test_an_end_of_sequence_token_in_the_generation_config_is_enough(tiny_model_dir, tmp_path):
    from infsamp.config import ModelConfig
    from infsamp.errors import ModelError
    from infsamp.models.loading import load_model_and_tokenizer, require_stop_tokens

    for keep, folder in ((True, tmp_path / "kept"), (False, tmp_path / "none")):
        model, tokenizer = load_model_and_tokenizer(
            ModelConfig(name_or_path=str(without_eos(tiny_model_dir, folder, keep))))
        if keep:
            assert require_stop_tokens(model, tokenizer, str(folder)) == (1,)
        else:
            with pytest.raises(ModelError):
                require_stop_tokens(model, tokenizer, str(folder))
