"""A model folder's code never runs unasked (issue 19, item 5): a folder whose config.json names
its own classes (`auto_map`) is one line, nothing of it runs and nothing prompts on stdin, for the
policy (`infsamp sample`, `infsamp train`) and for a reward-model folder; `model.trust_remote_code`
opts in."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
from pathlib import Path
from unittest import mock

import pytest

from infsamp import cli

CODE = '''
import pathlib
pathlib.Path({marker!r}).write_text("the folder's code ran")

from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification


class MarkerConfig(LlamaConfig):
    model_type = "marker"


class MarkerForCausalLM(LlamaForCausalLM):
    config_class = MarkerConfig


class MarkerForSequenceClassification(LlamaForSequenceClassification):
    config_class = MarkerConfig
'''


def remote_code_folder(tiny_model_dir: Path, folder: Path, marker: Path) -> Path:
    """The tiny model, its config naming classes of its own Python file (which writes `marker`)."""
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="marker", architectures=["MarkerForCausalLM"], auto_map={
        "AutoConfig": "marker_model.MarkerConfig",
        "AutoModelForCausalLM": "marker_model.MarkerForCausalLM",
        "AutoModelForSequenceClassification": "marker_model.MarkerForSequenceClassification"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "marker_model.py").write_text(CODE.format(marker=str(marker)))
    return folder


def main_with_yes_on_stdin(argv: list[str]) -> tuple[int, str]:
    """`echo y | infsamp ...`: transformers' prompt would read the 'y'."""
    err = io.StringIO()
    trap = mock.patch("infsamp.run.trainer.load_model_and_tokenizer",
                      side_effect=AssertionError("the policy loaded"))
    with mock.patch.object(sys, "stdin", io.StringIO("y\ny\ny\n")), trap, \
            contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(argv)
    return code, err.getvalue()


def assert_refused(code: int, stderr: str, marker: Path) -> None:
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1, stderr
    assert "Python code shipped in the folder" in lines[0], lines[0]
    assert "model.trust_remote_code true" in lines[0]
    assert not marker.exists()  # nothing of the folder ran


def test_sample_refuses_a_policy_folder_with_code(tiny_model_dir, tmp_path):
    marker = tmp_path / "RAN"
    folder = remote_code_folder(tiny_model_dir, tmp_path / "model", marker)
    prompts = tmp_path / "p.txt"
    prompts.write_text("1+1=\n")
    code, stderr = main_with_yes_on_stdin(["sample", "--model", str(folder), "--prompts",
                                           str(prompts), "-G", "2", "--max-new-tokens", "2"])
    assert_refused(code, stderr, marker)
    assert stderr.startswith(f"infsamp sample: error: model.name_or_path {str(folder)!r}")


def test_train_refuses_a_reward_model_folder_with_code(tiny_model_dir, tmp_path):
    marker = tmp_path / "RAN"
    folder = remote_code_folder(tiny_model_dir, tmp_path / "rm", marker)
    code, stderr = main_with_yes_on_stdin(["train", "--logging.output_dir", str(tmp_path / "run"),
                                           "--rewards.functions", f"format,{folder}"])
    assert_refused(code, stderr, marker)
    assert stderr.startswith(f"infsamp train: error: rewards.functions {str(folder)!r}")


@pytest.mark.parametrize("trust", [False, True])
def test_the_opt_in_runs_the_folder_code(tiny_model_dir, tmp_path, trust):
    from infsamp.config import ModelConfig
    from infsamp.errors import ModelError
    from infsamp.models.loading import load_model_and_tokenizer

    marker = tmp_path / "RAN"
    folder = remote_code_folder(tiny_model_dir, tmp_path / "model", marker)
    cfg = ModelConfig(name_or_path=str(folder), trust_remote_code=trust)
    if not trust:
        with pytest.raises(ModelError, match="model.trust_remote_code true"):
            load_model_and_tokenizer(cfg)
        assert not marker.exists()
        return
    model, _ = load_model_and_tokenizer(cfg)
    assert type(model).__name__ == "MarkerForCausalLM" and marker.exists()


def test_export_refuses_a_model_folder_with_code(tiny_model_dir, tmp_path):
    from infsamp.commands.export import write_model
    from infsamp.errors import ModelError

    marker = tmp_path / "RAN"
    folder = remote_code_folder(tiny_model_dir, tmp_path / "model", marker)
    with pytest.raises(ModelError, match="Python code shipped in the folder") as info:
        write_model(folder, None, tmp_path / "out", "auto")
    assert "\n" not in str(info.value) and not marker.exists()
