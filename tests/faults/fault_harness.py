"""Run `infsamp train` in real child processes that can be SIGKILLed at chosen moments.

Children are forked from a multiprocessing forkserver that has imported torch, transformers and
infsamp once, so each run costs its training time, not the ~10 s of imports. A child runs the real
CLI (`infsamp.cli.main`) with stdout and stderr in a log file; `kill_at` arms a fault in it first:

    sampling@N     SIGKILL as step N starts sampling
    update@N       SIGKILL after step N's backward pass, before its optimizer step
    metrics@N      SIGKILL right after step N's metrics row is written
    torn@N         step N's metrics row is half written (one write cut short), then SIGKILL
    eval@N         SIGKILL during the evaluation at step N
    model@N        SIGKILL inside checkpoint-N's model save_pretrained (after it wrote its files)
    state@N        SIGKILL inside checkpoint-N after its training state, before the manifest
    rename@N       SIGKILL with checkpoint-N.tmp complete, just before it is renamed
    prune@N        after checkpoint-N: SIGKILL while an older checkpoint is half deleted
    enospc@N       checkpoint-N's training state file is half written, then OSError(ENOSPC)
    lowmem@0       no fault: the machine reports 1 MiB of free memory (SC_AVPHYS_PAGES)
    wait@N         after step N's metrics row: wait (up to 30 s) until a signal arrives, then go on
    wait2@N        the same, until a second signal arrives (its handler stops the run there)
    pause@N        after step N's metrics row: print 'paused after step N' and wait (up to 60 s)
                   for SIGUSR1, then go on (the run stays live, holding its folder)

`tty:` before a fault runs the child in a session of its own whose controlling terminal is the
pseudo-terminal named as its log: closing the master end hangs it up (SIGHUP, then EIO on write).

Also here: the spread reward the runs train on, and readers for final weights and log rows.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

VOLATILE = ("time", "per_second", "overhead_fraction")  # wall-clock figures differ run to run


def length_reward(prompts, completions, **kwargs):
    """Longer completions score higher: rewards spread within every group, so every step trains."""
    return [len(c) / 10 for c in completions]


def huge_reward(prompts, completions, **kwargs):
    """Each value fits float32, but their sum does not: the step's mean reward is inf."""
    return [3e38] * len(completions)


def vandal_reward(prompts, completions, answer, **kwargs):
    """Edits every list it is given, in place (each function must score its own copy)."""
    completions[:] = ["<answer>\n72\n</answer>"] * len(completions)
    answer[:] = ["72"] * len(answer)
    prompts.clear()
    return [0.0] * len(completions)


# ---------------------------------------------------------------- the child


def child_main(argv: list[str], log_path: str, kill_at: str | None) -> None:
    terminal = bool(kill_at and kill_at.startswith("tty:"))
    if terminal:
        os.setsid()  # a session of its own, whose controlling terminal is set below
        kill_at = kill_at.removeprefix("tty:")
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    if terminal:
        import fcntl
        import termios

        fcntl.ioctl(fd, termios.TIOCSCTTY, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if kill_at:
        name, _, step = kill_at.partition("@")
        ARM[name](int(step))
    from infsamp.cli import main

    try:
        rc = main(argv)
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # also kept beside the log: a terminal's output may be gone
        import traceback

        Path(f"{log_path}.exception" if not terminal else f"/tmp/infsamp-child-{os.getpid()}.exc"
             ).write_text(traceback.format_exc())
        raise
    sys.exit(rc)


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _current_step() -> int:
    return _state["trainer"].step if "trainer" in _state else -1


_state: dict = {}


def _remember_trainer() -> None:
    from infsamp.run import trainer

    original = trainer.GRPOTrainer.train_step

    def train_step(self, *args, **kwargs):
        _state["trainer"] = self
        return original(self, *args, **kwargs)

    trainer.GRPOTrainer.train_step = train_step


def _arm_sampling(step: int) -> None:
    from infsamp.sampling.sampler import GroupSampler

    _remember_trainer()
    original = GroupSampler.sample

    def sample(self, *args, **kwargs):
        if _current_step() + 1 == step:
            _die()
        return original(self, *args, **kwargs)

    GroupSampler.sample = sample


def _arm_update(step: int) -> None:
    from infsamp.algorithm.grpo_step import GRPOStep

    _remember_trainer()
    original = GRPOStep.accumulate_gradients

    def accumulate(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if _current_step() + 1 == step:
            _die()
        return result

    GRPOStep.accumulate_gradients = accumulate


def _arm_metrics(step: int) -> None:
    from infsamp.run.logs import RunLogger

    original = RunLogger.log_step

    def log_step(self, at, metrics):
        original(self, at, metrics)
        if at == step:
            _die()

    RunLogger.log_step = log_step


def _arm_torn(step: int) -> None:
    original = os.write
    prefix = f'{{"step": {step}, "reward"'.encode()

    def write(fd, data):
        if bytes(data[: len(prefix)]) == prefix:
            original(fd, bytes(data[: len(data) // 2]))
            _die()
        return original(fd, data)

    os.write = write


def _arm_eval(step: int) -> None:
    from infsamp.run import trainer

    _remember_trainer()
    original = trainer.held_out_completions

    def evaluate(*args, **kwargs):
        if "trainer" in _state and _current_step() == step:
            _die()
        return original(*args, **kwargs)

    trainer.held_out_completions = evaluate


def _arm_model(step: int) -> None:
    from transformers import PreTrainedModel

    original = PreTrainedModel.save_pretrained

    def save_pretrained(self, path, *args, **kwargs):
        result = original(self, path, *args, **kwargs)
        if f"checkpoint-{step}.tmp" in str(path):
            _die()
        return result

    PreTrainedModel.save_pretrained = save_pretrained


def _arm_state(step: int) -> None:
    import safetensors.torch

    original = safetensors.torch.save_file

    def save_file(tensors, path, *args, **kwargs):
        original(tensors, path, *args, **kwargs)
        if f"checkpoint-{step}.tmp" in str(path):
            _die()

    safetensors.torch.save_file = save_file


def _arm_enospc(step: int) -> None:
    import errno

    import safetensors.torch

    original = safetensors.torch.save_file

    def save_file(tensors, path, *args, **kwargs):
        if f"checkpoint-{step}.tmp" in str(path):
            original(tensors, path, *args, **kwargs)
            Path(path).write_bytes(Path(path).read_bytes()[:100])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return original(tensors, path, *args, **kwargs)

    safetensors.torch.save_file = save_file


def _arm_lowmem(_step: int) -> None:
    real, page = os.sysconf, os.sysconf("SC_PAGE_SIZE")
    os.sysconf = lambda name: 2**20 // page if name == "SC_AVPHYS_PAGES" else real(name)


def _arm_rename(step: int) -> None:
    from infsamp.run import checkpoint

    original = checkpoint._replace_folder

    def replace(tmp, final):
        if tmp.name == f"checkpoint-{step}.tmp":
            _die()
        return original(tmp, final)

    checkpoint._replace_folder = replace


def _arm_prune(step: int) -> None:
    from infsamp.run import checkpoint

    original = checkpoint.prune

    def prune(output_dir, keep_last, *args, **kwargs):  # keep_step: checkpointing.keep_best
        doomed = checkpoint.list_checkpoints(output_dir)[:-keep_last]
        if doomed and (output_dir / f"checkpoint-{step}").exists():
            (doomed[0] / checkpoint.STATE_TENSORS).unlink()  # rmtree got this far
            _die()
        return original(output_dir, keep_last, *args, **kwargs)

    checkpoint.prune = prune


def _arm_wait(step: int, num_signals: int = 1) -> None:
    from infsamp.run.logs import RunLogger
    from infsamp.run.signals import StopSignals

    original_log, original_handle = RunLogger.log_step, StopSignals._handle

    def handle(self, number, frame):
        _state["signals"] = _state.get("signals", 0) + 1
        original_handle(self, number, frame)

    def log_step(self, at, metrics):
        original_log(self, at, metrics)
        if at == step:
            print(f"waiting for a signal after step {at}", flush=True)
            deadline = time.monotonic() + 30
            while _state.get("signals", 0) < num_signals and time.monotonic() < deadline:
                time.sleep(0.05)

    StopSignals._handle, RunLogger.log_step = handle, log_step


def _arm_pause(step: int) -> None:
    from infsamp.run.logs import RunLogger

    original, resumed = RunLogger.log_step, []
    signal.signal(signal.SIGUSR1, lambda *_: resumed.append(True))

    def log_step(self, at, metrics):
        original(self, at, metrics)
        if at == step:
            print(f"paused after step {at}", flush=True)
            deadline = time.monotonic() + 60
            while not resumed and time.monotonic() < deadline:
                time.sleep(0.05)

    RunLogger.log_step = log_step


ARM = {"sampling": _arm_sampling, "update": _arm_update, "metrics": _arm_metrics,
       "torn": _arm_torn, "eval": _arm_eval, "model": _arm_model, "state": _arm_state,
       "rename": _arm_rename, "prune": _arm_prune, "enospc": _arm_enospc, "lowmem": _arm_lowmem,
       "wait": _arm_wait, "wait2": lambda step: _arm_wait(step, 2), "pause": _arm_pause}


# ---------------------------------------------------------------- reading runs


def rows(path: Path) -> list[dict]:
    """A JSONL file's rows without wall-clock fields (a torn last line fails the assertion)."""
    if not path.exists():
        return []
    text = path.read_text()
    assert text == "" or text.endswith("\n"), f"{path} ends in a torn line"
    return [{k: v for k, v in json.loads(line).items() if not any(m in k for m in VOLATILE)}
            for line in text.splitlines()]


def final_state(run: Path, step: int) -> tuple[dict, dict, dict]:
    """(model tensors, training state tensors, training_state.json) of checkpoint-`step`."""
    from safetensors.torch import load_file

    folder = run / f"checkpoint-{step}"
    return (load_file(str(folder / "model" / "model.safetensors")),
            load_file(str(folder / "training_state.safetensors")),
            json.loads((folder / "training_state.json").read_text()))


def logs(run: Path) -> dict[str, list[dict]]:
    return {name: rows(run / name) for name in ("metrics.jsonl", "eval.jsonl", "lengths.jsonl")}
