"""load_examples (embedded, local JSONL/JSON/TXT, folders, hub) and load_splits (held-out rows)."""

import json
import sys
import types

import pytest

from infsamp.config import DataConfig
from infsamp.errors import DataError
from infsamp.tasks.loading import load_examples, load_splits

def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_embedded_task_uses_split_sizes_and_seed(monkeypatch):
    calls = []

    def generate_problems(num, seed, split):
        calls.append((num, seed, split))
        return [{"prompt": f"{i}+1=?", "answer": str(i + 1), "num_digits": 1} for i in range(num)]

    stub = types.SimpleNamespace(generate_problems=generate_problems)
    monkeypatch.setitem(sys.modules, "infsamp.tasks.arithmetic", stub)
    cfg = DataConfig(num_train_examples=5, num_eval_examples=3, seed=7)
    train, test = load_examples(cfg, "train"), load_examples(cfg, "test")
    assert calls == [(5, 7, "train"), (3, 7, "test")]
    assert len(train) == 5 and len(test) == 3
    assert train[2] == {"prompt": "2+1=?", "answer": "3", "num_digits": 1}


def test_real_embedded_arithmetic_loads():
    examples = load_examples(DataConfig(num_train_examples=4), "train")
    assert len(examples) == 4 and all(e["prompt"] and e["answer"].isdigit() for e in examples)


def test_unknown_embedded_task():
    with pytest.raises(DataError, match="unknown embedded task 'chess'"):
        load_examples(DataConfig(dataset="embedded:chess"), "train")


def test_jsonl_with_column_mapping_keeps_other_columns(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "Two plus two?", "a": "x\n#### 4", "level": 1}])
    cfg = DataConfig(dataset=path, prompt_column="q", answer_column="a", answer_parser="gsm8k")
    assert load_examples(cfg, "train") == [{"q": "Two plus two?", "a": "x\n#### 4", "level": 1,
                                            "prompt": "Two plus two?", "answer": "4"}]


def test_json_file_with_splits_and_folder_with_split_files(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps({"train": [{"prompt": "p1", "answer": 1}], "test": []}))
    assert load_examples(DataConfig(dataset=str(tmp_path / "d.json")), "train")[0]["answer"] == "1"
    with pytest.raises(DataError, match="no split 'validation'"):
        load_examples(DataConfig(dataset=str(tmp_path / "d.json")), "validation")
    folder = tmp_path / "gsm"
    folder.mkdir()
    write_jsonl(folder / "test.jsonl", [{"prompt": "held out", "answer": "2"}])
    assert load_examples(DataConfig(dataset=str(folder)), "test")[0]["prompt"] == "held out"


@pytest.mark.parametrize("rows, fragment", [
    ([{"prompt": "ok", "answer": "1"}, '{"prompt": "broken"'], "d.jsonl line 2: not valid JSON"),
    ([{"question": "q", "answer": "1"}],
     "d.jsonl line 1: no column 'prompt' (data.prompt_column); available: question, answer"),
    ([{"prompt": "q", "solution": "1"}], "no column 'answer' (data.answer_column); available: prompt, solution"),
    ([{"prompt": "ok", "answer": "1"}, {"prompt": "   ", "answer": "1"}],
     "d.jsonl line 2: empty prompt in column 'prompt'"),
    ([[1, 2]], "d.jsonl line 1: expected an object with columns, got list"),
])
def test_bad_rows_name_file_and_line(tmp_path, rows, fragment):
    path = tmp_path / "d.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    with pytest.raises(DataError) as info:
        load_examples(DataConfig(dataset=str(path)), "train")
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_gsm8k_parser_requires_hash_answer(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "answer": "no marker"}])
    with pytest.raises(DataError, match=r"line 1: answer has no '#### <answer>'"):
        load_examples(DataConfig(dataset=path, answer_parser="gsm8k"), "train")


def test_bad_json_file_names_line(tmp_path):
    (tmp_path / "d.json").write_text('[\n{"prompt": "a", "answer": "1"},\n{oops}\n]')
    with pytest.raises(DataError, match=r"d.json line 3: not valid JSON"):
        load_examples(DataConfig(dataset=str(tmp_path / "d.json")), "train")


@pytest.fixture
def hub_answers(monkeypatch):
    import infsamp.hub

    monkeypatch.setattr(infsamp.hub, "_endpoint_answers", lambda: True)


def test_hub_dataset_is_loaded_through_datasets(monkeypatch, hub_answers):
    import datasets

    seen = {}

    def fake_load_dataset(name, config, split):
        seen.update(name=name, config=config, split=split)
        return datasets.Dataset.from_list([{"question": "How many?", "answer": "because\n#### 12"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = DataConfig(dataset="openai/gsm8k", dataset_config="main", prompt_column="question", answer_parser="gsm8k")
    examples = load_examples(cfg, "test")
    assert seen == {"name": "openai/gsm8k", "config": "main", "split": "test"}
    assert examples[0]["prompt"] == "How many?" and examples[0]["answer"] == "12"


def test_hub_failure_is_one_line(monkeypatch, hub_answers):
    import datasets

    def failing(*args, **kwargs):
        raise ConnectionError("no network\nretry later")

    monkeypatch.setattr(datasets, "load_dataset", failing)
    with pytest.raises(DataError) as info:
        load_examples(DataConfig(dataset="openai/gsm8k", dataset_config="main"), "train")
    assert str(info.value) == "data.dataset: could not load 'openai/gsm8k' split 'train' (ConnectionError: no network)"
