"""models.source and models.loading: path or hub id decided at once (never waiting on the hub),
stop tokens, quiet loading."""

import time
from types import SimpleNamespace

import pytest

import infsamp.hub
from infsamp.config import ModelConfig
from infsamp.errors import ModelError
from infsamp.hub import looks_like_path
from infsamp.models import source
from infsamp.models.loading import load_model_and_tokenizer, stop_token_ids
from infsamp.models.source import resolve_model_source


@pytest.mark.parametrize("name, is_path", [
    ("Qwen/Qwen3-1.7B", False), ("gpt2", False), ("./model", True), ("/models/x", True),
    ("~/m", True), ("runs/a/checkpoint-4/model", True), ("data.jsonl", True), ("models/", True),
])
def test_looks_like_path(name, is_path):
    assert looks_like_path(name) == is_path


def test_a_local_folder_next_to_the_name_makes_it_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not looks_like_path("models/qwen3-tin")
    (tmp_path / "models").mkdir()
    assert looks_like_path("models/qwen3-tin")
    start = time.perf_counter()
    with pytest.raises(ModelError, match="^model.name_or_path 'models/qwen3-tin': no such folder$"):
        resolve_model_source("models/qwen3-tin")
    assert time.perf_counter() - start < 1


def test_hub_id_without_network_or_offline_fails_at_once(monkeypatch):
    monkeypatch.setattr(source, "cached_hub_snapshot", lambda repo: None)
    with pytest.raises(ModelError, match="not a local folder, and huggingface.co cannot be"):
        resolve_model_source("org/model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="not a local folder, and HF_HUB_OFFLINE is set"):
        load_model_and_tokenizer(ModelConfig(name_or_path="org/model"))


def test_hub_id_offline_uses_the_cached_snapshot_and_online_the_id(monkeypatch, tiny_model_dir):
    monkeypatch.setattr(source, "cached_hub_snapshot", lambda repo: tiny_model_dir)
    assert resolve_model_source("org/model").path == str(tiny_model_dir)
    monkeypatch.setattr(infsamp.hub, "_endpoint_answers", lambda: True)
    assert resolve_model_source("org/model").path == "org/model"


def test_stop_token_ids_are_the_union_of_generation_config_model_config_and_tokenizer():
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[1, 5, 4]),
                            config=SimpleNamespace(eos_token_id=1))
    assert stop_token_ids(model, SimpleNamespace(eos_token_id=9)) == (1, 5, 4, 9)
    bare = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None),
                           config=SimpleNamespace(eos_token_id=3))
    assert stop_token_ids(bare, None) == (3,)


def test_loading_weights_shows_no_progress_bars(tiny_model_dir, capfd):
    from transformers.utils import logging as hf_logging

    load_model_and_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    assert not hf_logging.is_progress_bar_enabled()
    assert "Loading weights" not in capfd.readouterr().err


def test_the_cli_decides_before_loading_transformers(tmp_path):
    """`infsamp train` with a hub id and no network: one line, without loading the trainer."""
    import os
    import subprocess
    import sys

    code = ("import sys, infsamp.hub as h; h._endpoint_answers = lambda: False; "
            "from infsamp.cli import main; "
            "rc = main(['train', '--model.name_or_path', 'org/model']); "
            "print(rc, 'infsamp.run.trainer' in sys.modules, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": ""}, timeout=300)
    assert done.stdout.split()[-3:] == ["2", "False", "False"], done.stdout + done.stderr
    assert "not a local folder, and huggingface.co cannot be reached" in done.stderr
