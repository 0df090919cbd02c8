"""Experiment trackers in their local modes: each receives metrics.jsonl's records under the same
names, the config and the plot (read back from what it wrote); bad names fail before any work; a
backend failing mid-run is reported once while the run and the other trackers go on; a resumed run
continues the same tracker runs. No network: tests/conftest.py keeps every client offline."""

import importlib.util
import json
import os
import struct

import pytest

from infsamp.cli import main
from infsamp.config_io import load_config
from infsamp.options import ConfigError
from infsamp.run import trackers
from infsamp.run.trainer import GRPOTrainer

PROJECT = "infsamp-test"
ALL = "tensorboard,wandb,trackio,mlflow"


class Killed(Exception):
    pass


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def expected_points(out):
    """{(name, step): value} of every finite number in metrics.jsonl and eval.jsonl."""
    points = {}
    for row in read_jsonl(out / "metrics.jsonl") + read_jsonl(out / "eval.jsonl"):
        step = row.pop("step")
        points.update({(k, step): v for k, v in trackers.numeric_metrics(row).items()})
    return points


def assert_same_points(got, expected):
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key


@pytest.fixture
def local_trackers(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    return tmp_path


# ---------------------------------------------------------------- readers of what backends wrote


def tensorboard_data(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    scalars = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    config = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    return scalars, acc.Tags()["images"], config


def wandb_records(run_file):
    """Records of a W&B offline run file (LevelDB-style log of protobuf records, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending, records = run_file.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is zero padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):  # FULL or LAST
            records.append(wandb_internal_pb2.Record.FromString(pending))
    return records


def wandb_data(wandb_dir):
    (run_file,) = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    points, images, config = {}, set(), {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            step = record.history.step.num
            for item in record.history.item:
                value = json.loads(item.value_json)
                if len(item.nested_key) > 1:  # a media value, stored field by field
                    if item.nested_key[-1] == "_type" and value == "image-file":
                        images.add(item.nested_key[0])
                elif not (item.key or item.nested_key[0]).startswith("_"):
                    points[(item.key or item.nested_key[0], step)] = value
        elif kind in ("run", "config"):  # the run record carries the config given to init
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
    return points, images, config


def trackio_data(run_name):
    from trackio.sqlite_storage import SQLiteStorage

    points, images = {}, set()
    for row in SQLiteStorage.get_logs(PROJECT, run_name):
        for key, value in row.items():
            if isinstance(value, dict) and "image" in str(value.get("_type", "")):
                images.add(key)
            elif key not in ("step", "timestamp") and value is not None:
                points[(key, row["step"])] = value
    return points, images, SQLiteStorage.get_run_config(PROJECT, run_name)


def mlflow_run(uri):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name(PROJECT).experiment_id])
    return client, run


def mlflow_data(uri):
    client, run = mlflow_run(uri)
    points = {(key, m.step): m.value for key in run.data.metrics
              for m in client.get_metric_history(run.info.run_id, key)}
    artifacts = {a.path for folder in ("", "plots")
                 for a in client.list_artifacts(run.info.run_id, folder)}
    return points, artifacts, run.data.params


# ---------------------------------------------------------------- bad names, before any work


def test_unknown_tracker_is_one_line_naming_the_key():
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"logging.report_to": "tensorboard,neptune"})
    message = str(info.value)
    assert message.startswith("logging.report_to: unknown tracker 'neptune'")
    assert "\n" not in message


def test_tracker_not_installed_names_the_extra(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec",
                        lambda name, *args: None if name == "wandb" else real(name, *args))
    argv = ["train", "--logging.report_to", "wandb", "--logging.output_dir", "/nonexistent/x"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("infsamp train: error: logging.report_to: wandb is not installed: pip install "
                   "'infsamp[tracking]' (got ['wandb'])")


def test_none_means_no_tracker_and_cannot_be_combined(tmp_path):
    assert trackers.open_trackers(["none"], tmp_path, PROJECT, "", {}, 0) is None
    with pytest.raises(ConfigError, match="'none' cannot be combined"):
        load_config(overrides={"logging.report_to": "none,mlflow"})


# ---------------------------------------------------------------- every backend, read back


@pytest.mark.slow
def test_every_backend_gets_the_metrics_config_and_plot(tiny_config, local_trackers):
    cfg = tiny_config(**{"training.max_steps": 2, "logging.plot": True, "logging.report_to": ALL,
                         "logging.project": PROJECT, "logging.run_name": "all-four"})
    out = GRPOTrainer(cfg).train().output_dir
    expected = expected_points(out)
    assert {("reward", 2), ("eval/accuracy", 0), ("sampling/decode_steps", 1)} <= expected.keys()

    scalars, images, config_text = tensorboard_data(out / "tensorboard")
    assert_same_points(scalars, expected)
    assert images == ["plots/training"] and "num_generations: 4" in config_text

    points, images, config = wandb_data(local_trackers / "wandb_dir")
    assert_same_points(points, expected)
    assert images == {"plots/training"} and config["sampling"]["num_generations"] == 4

    points, images, config = trackio_data("all-four")
    assert_same_points(points, expected)
    assert images == {"plots/training"} and config["sampling"]["num_generations"] == 4

    points, artifacts, params = mlflow_data((local_trackers / "mlruns").as_uri())
    assert_same_points(points, expected)
    assert {"plots/training.png", "config.yaml"} <= artifacts
    assert params["sampling.num_generations"] == "4"


# ---------------------------------------------------------------- failures and resume


def test_a_failing_tracker_is_reported_once_and_the_run_goes_on(tiny_config, local_trackers,
                                                                  monkeypatch, capsys):
    calls = {"n": 0}
    original = trackers.TensorBoardTracker.log_metrics

    def disk_full(self, step, metrics):
        calls["n"] += 1
        if calls["n"] >= 2:  # the eval at step 0 gets through, then the disk fills up
            raise OSError(28, "No space left on device")
        original(self, step, metrics)

    monkeypatch.setattr(trackers.TensorBoardTracker, "log_metrics", disk_full)
    cfg = tiny_config(**{"training.max_steps": 3, "logging.report_to": "tensorboard,mlflow",
                         "logging.project": PROJECT})
    out = GRPOTrainer(cfg).train().output_dir
    lines = capsys.readouterr().out.splitlines()
    reports = [line for line in lines if line.startswith("tracker ")]
    assert reports == ["tracker tensorboard: logging step 1 failed (OSError: [Errno 28] No space "
                       "left on device); it is off for the rest of the run, metrics.jsonl keeps "
                       "every step"]
    assert calls["n"] == 2
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    points, _, _ = mlflow_data((local_trackers / "mlruns").as_uri())
    assert_same_points(points, expected_points(out))  # the other tracker missed nothing
    scalars, _, _ = tensorboard_data(out / "tensorboard")
    assert {tag for tag, _ in scalars} == {"eval/accuracy", "eval/num_problems",
                                         "time/eval", "eval/dropped_prompts", "eval/reward",
                                         "eval/rewards/format/mean", "eval/rewards/accuracy/mean"}
    assert {step for _, step in scalars} == {0}


def test_a_tracker_that_cannot_start_is_reported_and_the_others_open(tmp_path, monkeypatch):
    class Unreachable(trackers.Tracker):
        def __init__(self, run):
            raise ConnectionError("server unreachable")

    monkeypatch.setitem(trackers.TRACKERS, "wandb", Unreachable)
    lines = []
    opened = trackers.open_trackers(["wandb", "tensorboard"], tmp_path, PROJECT, "", {"a": 1}, 0,
                                    report=lines.append)
    opened.log_metrics(1, {"reward": 0.5, "note": "text", "nan": float("nan")})
    opened.finish()
    assert lines[0].startswith("tracker wandb: start failed (ConnectionError: server unreachable)")
    assert lines[1] == f"trackers: tensorboard -> {tmp_path / 'tensorboard'}" and len(lines) == 2
    assert tensorboard_data(tmp_path / "tensorboard")[0] == {("reward", 1): 0.5}


def killed_then_resumed(tiny_config, kill_at: int, resume: str, **overrides):
    """A run to TensorBoard and MLflow killed after step `kill_at`, then resumed; returns the
    MLflow run id of the first attempt and the run folder."""
    def kill(step, _metrics):
        if step == kill_at:
            raise Killed

    overrides = {"logging.report_to": "tensorboard,mlflow", "logging.project": PROJECT,
                 **overrides}
    with pytest.raises(Killed):
        GRPOTrainer(tiny_config(**overrides), step_callback=kill).train()
    _, first = mlflow_run(trackers_uri())
    assert first.info.status == "FAILED"
    resumed = tiny_config(**overrides, **{"checkpointing.resume": resume})
    return first.info.run_id, GRPOTrainer(resumed).train().output_dir


def trackers_uri() -> str:
    return os.environ["MLFLOW_TRACKING_URI"]


def tensorboard_steps(out, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def test_resumed_run_continues_the_same_tracker_runs(tiny_config, local_trackers):
    first_id, out = killed_then_resumed(tiny_config, 2, "latest", **{
        "checkpointing.save_every": 2, "eval.num_problems": 0})
    client, run = mlflow_run(trackers_uri())
    assert run.info.run_id == first_id and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(first_id, "reward")] == [1, 2, 3, 4]
    assert_same_points(mlflow_data(trackers_uri())[0], expected_points(out))
    assert_same_points(tensorboard_data(out / "tensorboard")[0], expected_points(out))


def test_steps_after_the_last_checkpoint_are_replaced_on_resume(tiny_config, local_trackers):
    _, out = killed_then_resumed(tiny_config, 3, "latest", **{  # the checkpoint is at step 2
        "checkpointing.save_every": 2, "eval.num_problems": 0})
    assert tensorboard_steps(out, "reward") == [1, 2, 3, 4]  # crashed step 3 purged
    client, run = mlflow_run(trackers_uri())
    history = client.get_metric_history(run.info.run_id, "completions/mean_length")
    latest = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}
    rows = read_jsonl(out / "metrics.jsonl")
    assert latest == {r["step"]: r["completions/mean_length"] for r in rows}  # the resumed values


def test_a_run_started_again_without_a_checkpoint_replaces_its_tracker_steps(tiny_config,
                                                                              local_trackers):
    """checkpointing.resume auto with no checkpoint yet: the logs restart at step 0 (the run
    folder's rewind), and so do the tracker runs, the same ones (no step twice)."""
    first_id, out = killed_then_resumed(tiny_config, 2, "auto", **{
        "checkpointing.save_every": 100, "training.max_steps": 3})
    assert tensorboard_steps(out, "reward") == [1, 2, 3]
    assert tensorboard_steps(out, "eval/accuracy") == [0, 3]
    assert mlflow_run(trackers_uri())[1].info.run_id == first_id
