"""Experiment trackers: the run's metrics, config and training plot, sent to the tools people use.

`logging.report_to` picks backends from `TRACKERS` (tensorboard, wandb, trackio, mlflow); each
is one small class that imports its client only when chosen (`pip install 'infsamp[tracking]'`).
Every backend receives the same metrics under the same names as `metrics.jsonl` (finite numbers
only), the run config, and `plots/training.png`. `Trackers` fans each call out; a backend that
raises (disk full, server gone) is reported in one line and switched off for the rest of the run,
and the run goes on: `metrics.jsonl` is written before any tracker is called, so nothing is lost.

Local by default, no server needed: TensorBoard writes `<output_dir>/tensorboard`; W&B logs
offline under `<output_dir>/wandb` unless `WANDB_MODE` is set or an API key is configured;
trackio writes its local store (`TRACKIO_DIR`); MLflow writes the file store
`<output_dir>/mlruns` unless `MLFLOW_TRACKING_URI` names another. `<output_dir>/trackers.json`
keeps the run ids, so a resumed run continues the same tracker runs.

Deliberately simple: scalars, the config and one image; no histograms, model files or system stats.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infsamp.files import write_text
from infsamp.options import ConfigError

TRACKING_EXTRA = "pip install 'infsamp[tracking]'"
STATE_FILE = "trackers.json"
PLOT_NAME = "plots/training"


def numeric_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics record (what every tracker plots; a bool as 0.0 or 1.0)."""
    return {key: float(value) for key, value in metrics.items()
            if isinstance(value, (int, float)) and math.isfinite(value)}


def flatten_config(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'training': {'seed': 0}} -> {'training.seed': 0} (for trackers whose params are flat)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


@dataclass
class RunInfo:
    """What every backend needs to open (or reopen, on resume) its run."""
    output_dir: Path
    project: str
    run_name: str
    run_id: str  # stable across resumes of the same run
    config: dict[str, Any]
    resumed: bool  # continuing a run that already logged steps
    state: dict[str, Any]  # trackers.json, shared by the backends (run ids, purge step)


# ---------------------------------------------------------------- backends


class Tracker:
    """One backend. Subclasses open their run in __init__ and must not print per step."""

    package = ""  # module whose presence means the backend is installed
    where = ""  # where it writes, for the start-up line

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def log_image(self, step: int, name: str, path: Path) -> None:
        raise NotImplementedError

    def finish(self, ok: bool) -> None:
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    package = "tensorboard"

    def __init__(self, run: RunInfo):
        import yaml
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = self.where = run.output_dir / "tensorboard"
        # purge_step drops events a crashed run wrote past the checkpoint it resumes from
        self.writer = SummaryWriter(str(self.log_dir), purge_step=run.state.get("purge_step"))
        text = yaml.safe_dump(run.config, sort_keys=False)
        self.writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)
        self.writer.flush()

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_image(self, step: int, name: str, path: Path) -> None:
        from matplotlib.image import imread

        rgb = imread(str(path))[..., :3]  # [H, W, 3]
        self.writer.add_image(name, rgb, step, dataformats="HWC")
        self.writer.flush()

    def finish(self, ok: bool) -> None:
        self.writer.close()


def _wandb_has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")


class _RunLogTracker(Tracker):
    """A backend whose run logs dicts of scalars and images (wandb, trackio: `self.client`)."""

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_image(self, step: int, name: str, path: Path) -> None:
        self.run.log({name: self.client.Image(str(path))}, step=step)


class WandbTracker(_RunLogTracker):
    package = "wandb"

    def __init__(self, run: RunInfo):
        import wandb

        self.client = wandb
        mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_has_api_key() else "offline")
        directory = Path(os.environ.get("WANDB_DIR") or run.output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=run.project, name=run.run_name, id=run.run_id,
                              resume="allow", dir=str(directory), config=run.config, mode=mode,
                              settings=wandb.Settings(console="off", silent=True))
        offline = f"offline in {directory / 'wandb'} (upload: wandb sync)"
        self.where = offline if mode == "offline" else mode

    def finish(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class TrackioTracker(_RunLogTracker):
    package = "trackio"

    def __init__(self, run: RunInfo):
        import trackio
        from trackio.utils import TRACKIO_DIR

        self.client, self.where = trackio, f"local store {TRACKIO_DIR}"
        self.run = trackio.init(project=run.project, name=run.run_name, config=run.config,
                                resume="allow" if run.resumed else "never", embed=False,
                                auto_log_cpu=False, auto_log_gpu=False)

    def finish(self, ok: bool) -> None:
        self.run.finish()


MLFLOW_MAX_PARAM_CHARS = 6000


class MlflowTracker(Tracker):
    package = "mlflow"

    def __init__(self, run: RunInfo):
        import mlflow

        local = (run.output_dir / "mlruns").resolve().as_uri()
        uri = os.environ.get("MLFLOW_TRACKING_URI") or local
        if uri.startswith("file:"):  # MLflow 3 refuses its file store unless told it is wanted
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        self.run_id = run.state.get("mlflow_run_id") if run.resumed else None
        if self.run_id is None:
            experiment = self.client.get_experiment_by_name(run.project)
            experiment_id = (experiment.experiment_id if experiment
                             else self.client.create_experiment(run.project))
            self.run_id = self.client.create_run(experiment_id, run_name=run.run_name).info.run_id
            self._log_config(run.config)
        else:
            self.client.update_run(self.run_id, status="RUNNING")
        run.state["mlflow_run_id"] = self.run_id
        self.where = uri

    def _log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        flat = flatten_config(config)
        params = [Param(k, str(v)[:MLFLOW_MAX_PARAM_CHARS]) for k, v in flat.items()]
        self.client.log_batch(self.run_id, params=params)
        self.client.log_dict(self.run_id, config, "config.yaml")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.time import get_current_time_millis

        now = get_current_time_millis()
        points = [Metric(k, v, now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=points)

    def log_image(self, step: int, name: str, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path), str(Path(name).parent))

    def finish(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


TRACKERS: dict[str, type[Tracker]] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker,
                                      "trackio": TrackioTracker, "mlflow": MlflowTracker}


def chosen(names: list[str]) -> list[str]:
    """report_to without 'none' (and without repeats), in the given order."""
    return list(dict.fromkeys(n for n in names if n != "none"))


def check_trackers_installed(names: list[str]) -> None:
    """One line when a chosen tracker's client is not installed; imports nothing (the names
    themselves were checked with the config)."""
    for name in chosen(names):
        if importlib.util.find_spec(TRACKERS[name].package) is None:
            raise ConfigError(f"logging.report_to: {name} is not installed: {TRACKING_EXTRA} "
                              f"(got {names!r})")


# ---------------------------------------------------------------- the fan-out


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


def _warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Trackers:
    """Every chosen backend behind one call; a failure is reported once and its backend dropped."""

    def __init__(self, names: list[str], run: RunInfo, report: Callable[[str], None] = _warn):
        self.report = report
        self.active: dict[str, Tracker] = {}
        self.failed: dict[str, str] = {}
        for name in chosen(names):
            self._call(name, "start",
                       lambda name=name: self.active.update({name: TRACKERS[name](run)}))

    def describe(self) -> str:
        """`trackers: tensorboard -> runs/demo/tensorboard, ...`"""
        where = (f"{name} -> {tracker.where}" for name, tracker in self.active.items())
        return "trackers: " + ", ".join(where)

    def _call(self, name: str, what: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as err:  # a tracker must never stop the run
            self.active.pop(name, None)
            self.failed[name] = _first_line(err)
            self.report(f"tracker {name}: {what} failed ({self.failed[name]}); it is off for the "
                        "rest of the run, metrics.jsonl keeps every step")

    def _each(self, what: str, method: str, *args: Any) -> None:
        for name, tracker in list(self.active.items()):
            self._call(name, what, lambda t=tracker: getattr(t, method)(*args))

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        values = numeric_metrics(metrics)
        if values:
            self._each(f"logging step {step}", "log_metrics", step, values)

    def log_image(self, step: int, path: Path, name: str = PLOT_NAME) -> None:
        self._each("logging the plot", "log_image", step, name, path)

    def finish(self, ok: bool = True) -> None:
        self._each("finishing", "finish", ok)
        self.active.clear()


def open_trackers(names: list[str], output_dir: Path, project: str, run_name: str,
                  config: dict[str, Any], start_step: int,
                  report: Callable[[str], None] = _warn) -> Trackers | None:
    """The run's trackers (None for report_to none); ids persist in output_dir/trackers.json."""
    if not chosen(names):
        return None
    path = output_dir / STATE_FILE
    # a new run starts in an empty folder (run/folder.py): trackers.json there is this run's,
    # resumed from `start_step` or, without a checkpoint, started again from step 0
    resumed = path.exists()
    state = json.loads(path.read_text()) if resumed else {}
    state.setdefault("run_id", uuid.uuid4().hex[:12])
    # the first step to log again: the run logs were rewound to start_step (to nothing at 0)
    state["purge_step"] = (start_step + 1 if start_step > 0 else 0) if resumed else None
    name = run_name or output_dir.resolve().name
    run = RunInfo(output_dir, project, name, state["run_id"], config, resumed=resumed, state=state)
    trackers = Trackers(names, run, report)
    write_text(path, json.dumps(state, indent=1))  # atomic: never half a file to resume from
    if trackers.active:
        report(trackers.describe())
    return trackers
