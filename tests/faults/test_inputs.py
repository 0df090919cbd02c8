"""Bad input is one line, and outputs never overwrite inputs (issue 19, item 6): bytes that are
not UTF-8 in a dataset or prompts file, a temperature vLLM refuses, a dangling-symlink run folder,
`sample --out/--trace` and `simulate --plot` onto existing files or the command's own inputs, CSV
datasets, an export whose checkpoint a live run prunes, and the last line of `infsamp train`."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from infsamp import cli
from infsamp.config import DataConfig
from infsamp.errors import DataError

from fault_runs import run_args
from test_config_property import assert_one_line_naming, run_train


def main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def assert_one_line(code: int, stderr: str, *fragments: str) -> None:
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


# ---- bytes that are not UTF-8


NOT_UTF8 = b"caf\xe9"  # latin-1


@pytest.mark.parametrize("suffix", [".jsonl", ".txt", ".csv"])
def test_a_file_that_is_not_utf8_is_one_line_naming_file_and_line(tmp_path, suffix):
    path = tmp_path / f"data{suffix}"
    rows = {".jsonl": [b'{"prompt": "a", "answer": "1"}', b'{"prompt": "b", "answer": "2"}',
                       b'{"prompt": "' + NOT_UTF8 + b'", "answer": "3"}'],
            ".txt": [b"a", b"b", NOT_UTF8],
            ".csv": [b"prompt,answer", b"b,2", NOT_UTF8 + b",3"]}[suffix]
    path.write_bytes(b"\n".join(rows) + b"\n")
    if suffix == ".txt":  # a prompts file for `infsamp sample`
        code, _, stderr = main(["sample", "--prompts", str(path), "--quiet"])
    else:
        code, stderr = run_train("data.dataset", "flag", str(path), tmp_path,
                                 "--eval.num_problems", "0")
    assert_one_line(code, stderr, f"{path} line 3: not UTF-8 text (byte 0xe9)")


# ---- settings an engine refuses, checked with the rest of the config


def test_a_temperature_vllm_refuses_is_one_line_before_anything_loads(tmp_path):
    code, stderr = run_train("sampling.temperature", "flag", "2.5", tmp_path,
                             "--sampling.engine", "vllm")
    assert_one_line_naming("sampling.temperature", code, stderr)
    assert "with sampling.engine vllm" in stderr


def test_auto_engine_decodes_a_temperature_vllm_refuses_on_slots():
    from infsamp.sampling.engines.base import resolve_engine_name, vllm_installed

    cuda = torch.device("cuda")
    expected = "vllm" if vllm_installed() else "slots"
    assert resolve_engine_name("auto", cuda, temperature=2.0) == expected
    assert resolve_engine_name("auto", cuda, temperature=2.5) == "slots"


# ---- a run folder that is a dangling symbolic link


@pytest.mark.parametrize("where", ["folder", "parent"])
def test_a_dangling_symlink_output_dir_is_one_line(tmp_path, where):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    out = link if where == "folder" else link / "run"
    code, stderr = run_train("logging.output_dir", "flag", str(out), tmp_path)
    assert_one_line_naming("logging.output_dir", code, stderr)
    assert f"{link} is a symbolic link to {tmp_path / 'gone'}, which does not exist" in stderr
    assert not (tmp_path / "gone").exists()


# ---- outputs never overwrite an existing file unasked, nor an input ever


def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("1+1=\n2+2=\n")
    return path


def test_sample_refuses_to_write_over_a_file_or_its_inputs(tiny_model_dir, tmp_path):
    prompts = prompts_file(tmp_path)
    mine = tmp_path / "mine.jsonl"
    mine.write_text("my data\n")
    base = ["sample", "--model", str(tiny_model_dir), "--prompts", str(prompts), "-G", "2",
            "--max-new-tokens", "4", "--quiet"]
    cases = [(["--out", str(mine)], "exists (nothing was written); pass --overwrite"),
             (["--trace", str(prompts), "--overwrite"], "is an input of this command"),
             (["--out", str(tiny_model_dir / "config.json"), "--overwrite"], "is an input"),
             (["--out", str(tmp_path / "a.jsonl"), "--trace", str(tmp_path / "a.jsonl")],
              "the same file as --trace")]
    for extra, fragment in cases:
        code, _, stderr = main(base + extra)
        assert_one_line(code, stderr, fragment)
    assert mine.read_text() == "my data\n" and prompts.read_text() == "1+1=\n2+2=\n"
    code, _, stderr = main(base + ["--out", str(mine), "--overwrite"])
    assert code == 0, stderr
    assert len(mine.read_text().splitlines()) == 4  # 2 prompts x G 2


def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    row = {"prompt_id": "a", "prompt_tokens": 3, "lengths": [4, 9, 2, 7]}
    path.write_text(json.dumps(row) + "\n")
    return path


def test_simulate_plot_refuses_existing_files_and_its_trace(tmp_path):
    trace = trace_file(tmp_path)
    base = ["simulate", "--trace", str(trace), "--micro-group", "2"]
    existing = tmp_path / "q.png"
    existing.write_bytes(b"mine")
    for extra, fragment in [(["--plot", str(existing)], "exists (nothing was written)"),
                            (["--plot", str(trace), "--overwrite"], "is an input of this command"),
                            (["--plot", str(tmp_path / "x.jsonl")],
                             "matplotlib cannot write .jsonl files")]:
        code, _, stderr = main(base + extra)
        assert_one_line(code, stderr, fragment)
    assert existing.read_bytes() == b"mine" and not (tmp_path / "x.jsonl").exists()


def test_simulate_plot_without_extension_names_the_file_it_writes(tmp_path):
    trace = trace_file(tmp_path)
    code, stdout, stderr = main(["simulate", "--trace", str(trace), "--micro-group", "2",
                                 "--plot", str(tmp_path / "noext")])
    assert code == 0, stderr
    assert f"wrote {tmp_path / 'noext.png'}" in stdout
    assert (tmp_path / "noext.png").is_file() and not (tmp_path / "noext").exists()


# ---- CSV datasets


@pytest.mark.parametrize("suffix, separator", [(".csv", ","), (".tsv", "\t")])
def test_a_csv_dataset_loads(tmp_path, suffix, separator):
    from infsamp.commands.train import check_sources
    from infsamp.config import Config
    from infsamp.tasks.loading import load_splits

    path = tmp_path / f"data{suffix}"
    lines = ["question,answer,level"] + [f"What is {i}+{i}?,#### {2 * i},{i % 3}"
                                         for i in range(10)]
    path.write_text("\n".join(line.replace(",", separator) for line in lines) + "\n")
    cfg = Config()
    cfg.data = DataConfig(dataset=str(path), prompt_column="question", answer_parser="gsm8k",
                          eval_fraction=0.2)
    check_sources(cfg)  # a local file, not a hub id
    splits = load_splits(cfg.data, num_eval=2)
    assert len(splits.train) == 8 and len(splits.eval) == 2
    first = min(splits.train + splits.eval, key=lambda e: e["level"] * 100 + int(e["answer"]))
    assert first["prompt"] == "What is 0+0?" and first["answer"] == "0" and first["level"] == 0


def test_a_file_of_another_format_is_one_line(tmp_path):
    from infsamp.tasks.loading import load_examples

    path = tmp_path / "data.xlsx"
    path.write_bytes(b"PK\x03\x04")
    with pytest.raises(DataError, match=r"cannot read \.xlsx files \(give \.jsonl, \.json, \.txt, "
                                        r"\.csv, \.tsv, \.parquet, or a folder\)"):
        load_examples(DataConfig(dataset=str(path)), "train")


# ---- export racing a live run's pruning


@pytest.mark.parametrize("when", ["weights", "tokenizer"])
def test_export_of_a_checkpoint_that_vanishes_says_so(tiny_model_dir, tmp_path, monkeypatch,
                                                      when):
    from infsamp.commands import export
    from infsamp.errors import InfsampError

    checkpoint = tmp_path / "run" / "checkpoint-4"
    shutil.copytree(tiny_model_dir, checkpoint / "model")
    (checkpoint / "manifest.json").write_text("{}")
    target = "_load" if when == "weights" else "write_tokenizer_and_generation_config"
    original = getattr(export, target)

    def pruned_first(*args, **kwargs):
        shutil.rmtree(checkpoint)  # what the live run's keep_last does at that moment
        return original(*args, **kwargs)

    if when == "tokenizer":
        monkeypatch.setattr(export, "write_model", lambda *args: "full weights")
    monkeypatch.setattr(export, target, pruned_first)
    with pytest.raises(InfsampError, match="the checkpoint vanished while it was being exported"):
        export.export_checkpoint(checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


# ---- the last line names what the run folder holds


def test_the_last_line_lists_only_files_the_run_wrote(runner, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    code, output = runner.run(run_args(tiny_model_dir, out, "--training.max_steps", "1",
                                       "--eval.num_problems", "0", "--logging.plot", "false"))
    assert code == 0, output
    last = output.strip().splitlines()[-1]
    assert last == f"run folder: {out} (metrics.jsonl, lengths.jsonl)", last
