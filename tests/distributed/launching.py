"""Launching real process groups from a test: torchrun children on the tiny model, CPU and gloo.

`launch` runs `torchrun --standalone --nproc-per-node N tests/distributed/rank_child.py` (a free
port each time, so parallel test runs do not collide), or `accelerate launch` with one of the
configs in examples/accelerate/, with this worktree's sources first on the path; `one_process`
runs the same settings in the test's own process, the reference.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
EXAMPLES = HERE.parents[1] / "examples" / "accelerate"
REWARD = f"{HERE / 'recording_reward.py'}:length_reward"


def settings(model_dir: Path, out: Path, **overrides) -> dict[str, object]:
    """B = 4 prompts x G = 8 for 3 steps, fp32, the slot engine; a reward that always spreads."""
    base = {
        "model.name_or_path": model_dir, "model.attn_implementation": "eager",
        "model.dtype": "fp32", "data.num_train_examples": 40, "data.num_eval_examples": 6,
        # no evaluation: it scores with the run's rewards, and the recording reward counts steps
        "eval.num_problems": 0,
        "rewards.functions": REWARD, "sampling.num_generations": 8, "sampling.max_new_tokens": 12,
        "sampling.micro_group": 4, "sampling.kv_budget": 4096, "sampling.temperature": 1.0,
        "training.max_steps": 3, "training.prompts_per_step": 4, "training.learning_rate": 1e-3,
        "training.warmup_ratio": 0.0, "checkpointing.save_every": 1, "checkpointing.keep_last": 5,
        "logging.output_dir": out, "logging.progress_bar": False, "logging.plot": False,
    }
    base.update(overrides)
    return base


def train_argv(values: dict[str, object], *extra: str) -> list[str]:
    return ["train", *[item for k, v in values.items() for item in (f"--{k}", str(v))], *extra]


@dataclass
class Launch:
    returncode: int
    output: str
    seconds: float


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launcher(nproc: int, accelerate_config: str | None) -> list[str]:
    """torchrun on a free port, or accelerate launch with one of examples/accelerate/."""
    if accelerate_config is None:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={nproc}"]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(EXAMPLES / accelerate_config), "--num_processes", str(nproc),
            "--main_process_port", str(free_port())]


def launch(folder: Path, runs: list[tuple[list[str], Path]], nproc: int = 2,
           kill: str | None = None, timeout: float = 170,
           accelerate_config: str | None = None) -> Launch:
    """Each (argv, record folder) run in turn by the same `nproc` processes."""
    command, env = launch_command(folder, [{"argv": argv, "record": str(record)}
                                           for argv, record in runs], nproc, kill,
                                  accelerate_config)
    start = time.monotonic()
    returncode, output = run_to_end(command, env, timeout)
    return Launch(returncode, output, time.monotonic() - start)


def run_to_end(command: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """The launcher's exit code and output (stdout, then stderr). Past `timeout` its whole
    process group is killed (the launcher and every rank, none left running) and the output so
    far comes back, ending in a line saying so."""
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            stderr += f"\n[launch killed: still running after {timeout:.0f} s]"
    return process.returncode, stdout + stderr


def launch_command(folder: Path, runs: list[dict], nproc: int = 2, kill: str | None = None,
                   accelerate_config: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The launcher's command line and environment for `runs` (rank_child.py's RUNS.json
    entries, written to folder/runs-*.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = folder / f"runs-{time.monotonic_ns()}.json"
    spec.write_text(json.dumps(runs))
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = launcher(nproc, accelerate_config) + [str(HERE / "rank_child.py"), str(spec)]
    return command + ([kill] if kill else []), env


def one_process(values: dict[str, object], record: Path, monkeypatch) -> Path:
    """The same run in this process (the reference); returns its folder."""
    from infsamp.config_io import load_config
    from infsamp.run.trainer import GRPOTrainer

    monkeypatch.setenv("INFSAMP_TEST_RECORD", str(record))
    cfg = load_config(overrides={k: str(v) for k, v in values.items()})
    return GRPOTrainer(cfg).train().output_dir


def final_weights(run: Path, step: int) -> dict:
    from safetensors.torch import load_file

    folder = run / f"checkpoint-{step}" / "model"  # LoRA: adapter_model.safetensors
    weights = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    assert weights, f"no weights in {folder}"
    return weights


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)

