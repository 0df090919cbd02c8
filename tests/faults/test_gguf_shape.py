"""Issue 32's "a .gguf whose metadata lies about its shape": the conversion raised a
`load_state_dict` size-mismatch traceback (dozens of lines) for a file whose metadata says another
hidden size, layer count or head count than its tensors have. Now: one line naming the file and
the mismatch, exit 2, and no cache folder kept."""

from __future__ import annotations

import pytest

from infsamp import cli
from infsamp.errors import ModelError
from infsamp.models import gguf

from gguf_files import write_tiny_gguf

# the writer's method, the value it writes (the tiny Llama: 32 wide, 2 layers, 4/2 heads) and the
# words of the line; a layer count that lies converted silently (a layer dropped, or random)
LIES = {
    "hidden size": ("add_embedding_length", 64, "metadata says hidden size 64, but tensor "
                    "token_embd.weight is [261, 32]"),
    "one layer more": ("add_block_count", 3, "metadata says 3 layers, but its tensors hold 2 "
                       "(blk.0 to blk.1)"),
    "one layer less": ("add_block_count", 1, "metadata says 1 layers, but its tensors hold 2"),
    "heads": ("add_head_count", 8, "metadata says 8 heads and 2 key-value heads of size 4, but "
              "tensor blk.0.attn_k.weight is [16, 32]"),
    "key-value heads": ("add_head_count_kv", 4, "metadata says 4 heads and 4 key-value heads of "
                        "size 8, but tensor blk.0.attn_k.weight is [16, 32]"),
    "feed-forward size": ("add_feed_forward_length", 96, "metadata says feed-forward size 96, "
                          "but tensor blk.0.ffn_up.weight is [64, 32]"),
}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFSAMP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("lie", LIES)
def test_metadata_that_lies_about_the_shape_is_one_line_and_no_cache(lie, cache, tmp_path):
    method, value, words = LIES[lie]
    path = tmp_path / "lie.gguf"
    write_tiny_gguf(path, lies={method: value})
    with pytest.raises(ModelError, match="lie.gguf") as caught:
        gguf.ensure_converted(path)
    assert words in str(caught.value) and "\n" not in str(caught.value)
    assert not any((cache / "gguf").glob("lie-*[!k]"))  # the lock file alone


def test_train_on_a_lying_gguf_exits_2_with_one_line(cache, tmp_path, capsys):
    path = tmp_path / "lie.gguf"
    write_tiny_gguf(path, lies={"add_embedding_length": 64})
    out = tmp_path / "run"
    code = cli.main(["train", "--model.name_or_path", str(path), "--training.max_steps", "1",
                     "--logging.output_dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"infsamp train: error: model.name_or_path {str(path)!r}: "
                                 f"{LIES['hidden size'][2]}"]
    assert not out.exists() and not any((cache / "gguf").glob("lie-*[!k]"))


def test_the_truthful_file_still_converts(tiny_gguf_file, cache):
    assert gguf.is_converted(gguf.ensure_converted(tiny_gguf_file[0]))
