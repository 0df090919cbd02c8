"""Issue 32's "not yet tried" cases, tried as an adversarial user would: the real-model path
(GGUF files and their cache, a named model whose package is missing), reasoning-gym settings,
tampered checkpoints, folders that cannot be written, huge timeouts. Each case that misbehaved
names what it did; the others pin what already held."""

from __future__ import annotations

import contextlib
import math
import multiprocessing
from pathlib import Path

import pytest

from infsamp.config import ModelConfig
from infsamp.errors import ModelError
from infsamp.models import gguf
from infsamp.models.loading import load_model_and_tokenizer, load_tokenizer
from infsamp.rewards.workers import RewardWorkers

from fault_harness import length_reward
from test_config_property import run_train


def test_a_reward_timeout_past_what_poll_takes_waits_and_scores():
    """poll(2) takes a C int of milliseconds: a wait of 2,147,484 s or more raised OverflowError
    (a library caller's timeout; the config caps rewards.timeout_s at a week)."""
    for timeout_s in (2_147_484.0, 1e10, math.inf):
        workers = RewardWorkers([("length", length_reward)], timeout_s=timeout_s)
        try:
            outcomes = workers.call_all([("length", length_reward)],
                                        {"prompts": ["p"], "completions": ["abc"]})
        finally:
            workers.close()
        assert not outcomes["length"].timed_out and outcomes["length"].error is None


# ---- the GGUF cache


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFSAMP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _converted(tiny_gguf_file, capsys) -> Path:
    folder = gguf.ensure_converted(tiny_gguf_file[0])
    assert "converting tiny-llama.gguf to a transformers folder" in capsys.readouterr().out
    return folder


@pytest.mark.parametrize("damage", ["truncated weights", "no config.json", "an extra byte in "
                                    "the tokenizer", "no source record"])
def test_a_damaged_cache_folder_is_converted_again(tiny_gguf_file, cache, capsys, damage):
    """It was loaded as it was: "cannot load model (... incomplete metadata)" naming the cache
    folder, every run, the user's file being fine."""
    folder = _converted(tiny_gguf_file, capsys)
    if damage == "truncated weights":
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "no config.json":
        (folder / "config.json").unlink()
    elif damage == "no source record":
        (folder / gguf.SOURCE_FILE).unlink()
    else:
        with (folder / "tokenizer.json").open("ab") as handle:
            handle.write(b"x")
    model, _ = load_model_and_tokenizer(ModelConfig(name_or_path=str(tiny_gguf_file[0])))
    assert "converting tiny-llama.gguf again (the cached one is incomplete or damaged)" in \
        capsys.readouterr().out
    assert gguf.is_converted(folder) and model.config.hidden_size == 32


def test_a_cache_damaged_at_the_same_sizes_names_the_folder_to_remove(tiny_gguf_file, cache,
                                                                       capsys):
    folder = _converted(tiny_gguf_file, capsys)
    tokenizer = folder / "tokenizer.json"
    tokenizer.write_bytes(b"{" + b" " * (tokenizer.stat().st_size - 1))
    with pytest.raises(ModelError, match=rf"cannot load tokenizer .*; this is the cache's "
                                         rf"converted copy of .*tiny-llama.gguf: remove "
                                         rf"{folder} to convert it again$"):
        load_tokenizer(str(tiny_gguf_file[0]))


def _convert_in_child(path: Path, log: Path) -> None:
    with log.open("w") as out, contextlib.redirect_stdout(out):
        gguf.ensure_converted(path)


def test_two_runs_converting_one_file_at_once_convert_it_once(tiny_gguf_file, cache, tmp_path):
    """The second waits on the first's lock and uses its folder (before: both converted, and the
    later one's `rmtree` of an "incomplete" folder could remove the first's while it loaded)."""
    context = multiprocessing.get_context("fork")
    logs = [tmp_path / f"child{n}.log" for n in range(2)]
    children = [context.Process(target=_convert_in_child, args=(tiny_gguf_file[0], log))
                for log in logs]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
    assert [child.exitcode for child in children] == [0, 0]
    said = "".join(log.read_text() for log in logs)
    assert said.count("converting tiny-llama.gguf") == 1, said
    assert gguf.is_converted(gguf.converted_dir(tiny_gguf_file[0]))
    assert sorted(p.name for p in (cache / "gguf").iterdir() if ".tmp-" in p.name) == []


def test_a_full_disk_while_converting_is_one_line_and_leaves_nothing(tiny_gguf_file, cache,
                                                                      monkeypatch):
    """safetensors' own SafetensorError ("No space left on device (os error 28)") was a
    traceback: only OSError was caught."""
    import transformers.modeling_utils

    full = type("SafetensorError", (Exception,), {})(
        "Error while serializing: I/O error: No space left on device (os error 28)")

    def no_space(*args, **kwargs):
        raise full

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", no_space)
    with pytest.raises(ModelError, match=r"cannot write the converted model to .*/gguf \(No "
                                         r"space left on device\); free space there or set "
                                         r"INFSAMP_CACHE_DIR"):
        gguf.ensure_converted(tiny_gguf_file[0])
    assert [p.name for p in (cache / "gguf").iterdir() if not p.name.endswith(".lock")] == []


# ---- reasoning-gym settings


@pytest.mark.parametrize("dataset_config, message", [
    ("{seed: abc}", "data.dataset_config: seed must be an integer between 0 and 4,294,967,295 "
                    "(got 'abc')"),  # a ValueError traceback
    ("{seed: -3}", "seed must be an integer between 0"),
    ("{size: 100000000000}", "size must be an integer between 1 and 1,000,000 "
                             "(got 100000000000)"),  # generated for ever
    ("{size: 2.5}", "size must be an integer"),
    ("{size: true}", "size must be an integer"),
    ("{min_terms: abc}", "rejects {'min_terms': 'abc'}"),  # these held already
    ("{min_terms: 99999999999}", "rejects {'min_terms': 99999999999}"),
    ("{operators: 7}", "rejects {'operators': 7}"),
])
def test_reasoning_gym_options_of_the_wrong_type_or_size_are_one_line(dataset_config, message,
                                                                       tmp_path):
    code, stderr = run_train("data.dataset_config", "flag", dataset_config, tmp_path,
                             "--data.dataset", "reasoning_gym:basic_arithmetic")
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key", ["data.num_train_examples", "data.num_eval_examples"])
def test_more_generated_problems_than_a_run_can_make_is_one_line(key, tmp_path):
    code, stderr = run_train(key, "flag", "4000000000", tmp_path)  # generated for ever
    assert code == 2 and stderr.strip() == (f"infsamp train: error: {key}: must be between "
                                            f"{0 if 'eval' in key else 1} and 1,000,000 (got "
                                            "4000000000)")


# ---- keep_best with a metric that never appears (held already: pinned here)


@pytest.mark.parametrize("extra, words", [
    (["--checkpointing.keep_best", "eval/nonexistent"], "'eval/nonexistent' is not logged by "
                                                        "evaluation (it logs eval/accuracy"),
    (["--checkpointing.keep_best", "eval/accuracy", "--eval.num_problems", "0"],
     "needs evaluations (eval.num_problems > 0)"),
])
def test_keep_best_with_a_metric_that_never_appears_is_one_line(extra, words, tmp_path):
    code, stderr = run_train("checkpointing.keep_best", "flag", extra[1], tmp_path, *extra[2:])
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and words in stderr, stderr
    assert not (tmp_path / "run").exists()
