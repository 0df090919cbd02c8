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
    (tmp_path / "d.json").write_text(json.dumps({"train": [{"prompt": "p1", "answer": 1}],
                                                 "test": []}))
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
    ([{"prompt": "q", "solution": "1"}],
     "no column 'answer' (data.answer_column); available: prompt, solution"),
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
    cfg = DataConfig(dataset="openai/gsm8k", dataset_config="main", prompt_column="question",
                     answer_parser="gsm8k")
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
    assert str(info.value) == ("data.dataset: could not load 'openai/gsm8k' split 'train' "
                               "(ConnectionError: no network)")


# ---------------------------------------------------------------- prompt shapes, .txt, no answer


@pytest.mark.parametrize("prompt, fragment", [
    (["What is", "2+2?"], "is a list of strings; expected text or a list of chat messages"),
    ([{"role": "user"}], "is a list of non-messages"),
    (42, "is a int; expected text"),
])
def test_prompt_that_is_not_text_or_messages_is_one_line(tmp_path, prompt, fragment):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt, "answer": "4"}])
    with pytest.raises(DataError) as info:
        load_examples(DataConfig(dataset=path), "train")
    assert "d.jsonl line 1: the prompt in column 'prompt' " + fragment in str(info.value)


def test_chat_message_prompts_load(tmp_path):
    messages = [{"role": "user", "content": "Hi"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": messages, "answer": "4"}])
    assert load_examples(DataConfig(dataset=path), "train")[0]["prompt"] == messages


def test_txt_prompts_and_sampling_without_answers(tmp_path):
    (tmp_path / "p.txt").write_text("First?\n\n  \nTwo\\nlines\n")
    cfg = DataConfig(dataset=str(tmp_path / "p.txt"), prompt_column="question")
    examples = load_examples(cfg, "train", need_answer=False)
    assert [e["prompt"] for e in examples] == ["First?", "Two\nlines"]
    assert "answer" not in examples[0]
    with pytest.raises(DataError, match="p.txt line 1: no column 'answer'"):
        load_examples(cfg, "train")


# ---------------------------------------------------------------- training and held-out splits

ROWS = [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)]


def test_one_file_as_train_and_eval_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DataError, match="evaluation would read the same rows.*data.eval_fraction"):
        load_splits(DataConfig(dataset=path), num_eval=5)
    assert len(load_splits(DataConfig(dataset=path), num_eval=0).train) == 20  # no evaluation: fine
    with pytest.raises(DataError, match="same rows"):
        load_splits(DataConfig(num_train_examples=5, eval_split="train"), num_eval=2)


def test_eval_fraction_holds_out_seeded_disjoint_rows_and_names_them(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    cfg = DataConfig(dataset=path, eval_fraction=0.2)
    splits = load_splits(cfg, num_eval=3)
    train, held = {e["prompt"] for e in splits.train}, [e["prompt"] for e in splits.eval]
    assert len(train) == 16 and len(held) == 3 and not train & set(held)
    assert load_splits(cfg, num_eval=3).eval == splits.eval  # seeded: the same rows every run
    assert splits.eval_note.startswith("evaluation: 3 of the 4 rows that data.eval_fraction 0.2")
    assert all(f"line {int(q[1:]) + 1}" in splits.eval_note for q in held)
    with pytest.raises(DataError, match="nothing is left to train on"):
        one_row = write_jsonl(tmp_path / "one.jsonl", ROWS[:1])
        load_splits(DataConfig(dataset=one_row, eval_fraction=0.5), 1)


def test_folder_with_split_files_and_json_with_splits_are_separate_rows(tmp_path):
    folder = tmp_path / "gsm"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", ROWS[:4])
    write_jsonl(folder / "test.jsonl", ROWS[4:6])
    splits = load_splits(DataConfig(dataset=str(folder)), num_eval=10)
    assert [e["prompt"] for e in splits.eval] == ["q4", "q5"] and len(splits.train) == 4
    assert "the first 2 row(s) of split 'test'" in splits.eval_note
    (tmp_path / "d.json").write_text(json.dumps({"train": ROWS[:3], "test": ROWS[3:4]}))
    assert len(load_splits(DataConfig(dataset=str(tmp_path / "d.json")), num_eval=1).eval) == 1


SNAPSHOT_CARD = """---
configs:
- config_name: main
  data_files:
  - {split: train, path: main/train-*}
  - {split: test, path: main/test-*}
- config_name: socratic
  data_files:
  - {split: train, path: socratic/train-*}
  - {split: test, path: socratic/test-*}
---
"""


def test_hub_snapshot_folder_is_read_by_datasets_with_its_config(tmp_path, capfd):
    """The layout of a downloaded `openai/gsm8k` snapshot: parquet files per config and split."""
    import datasets

    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "README.md").write_text(SNAPSHOT_CARD)
    parts = {("main", "train"): ROWS[:3], ("main", "test"): ROWS[3:5],
             ("socratic", "train"): ROWS[5:6], ("socratic", "test"): ROWS[6:7]}
    for (config, split), rows in parts.items():
        (snapshot / config).mkdir(exist_ok=True)
        datasets.Dataset.from_list(rows).to_parquet(str(snapshot / config / f"{split}-0.parquet"))
    capfd.readouterr()
    splits = load_splits(DataConfig(dataset=str(snapshot), dataset_config="main"), num_eval=5)
    assert [e["prompt"] for e in splits.eval] == ["q3", "q4"] and len(splits.train) == 3
    assert "Generating" not in capfd.readouterr().err  # no progress bars in the run log


def test_hub_dataset_without_network_fails_at_once(monkeypatch):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("asked the hub"))
    with pytest.raises(DataError, match="not a local file or folder, and huggingface.co cannot be"):
        load_examples(DataConfig(dataset="openai/gsm8k"), "train")
