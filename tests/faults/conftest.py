"""Fixtures of the fault suite: a forkserver of pre-imported children, run settings, references."""

from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import fault_harness
from fault_runs import POLICIES, run_args


@dataclass
class Child:
    process: multiprocessing.Process
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait(self, timeout: float = 120) -> int:
        self.process.join(timeout)
        assert self.process.exitcode is not None, f"still running after {timeout} s: {self.output}"
        return self.process.exitcode

    @property
    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def signal(self, number: int) -> None:
        os.kill(self.pid, number)

    def wait_for(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            alive = self.process.is_alive() and time.monotonic() < deadline
            assert alive, f"no {text!r} in: {self.output}"
            time.sleep(0.05)


class Runner:
    """Starts children: `start(argv, kill_at=...)`, or `run(...)` to wait for the exit code too."""

    def __init__(self, context, log_dir: Path):
        self.context, self.log_dir, self.count = context, log_dir, 0

    def start(self, argv: list[str], kill_at: str | None = None, log: Path | None = None) -> Child:
        """`log`: where the child's output goes (default: a new file; a terminal with `tty:`)."""
        self.count += 1
        log = log or self.log_dir / f"child-{self.count}.log"
        process = self.context.Process(target=fault_harness.child_main,
                                       args=(argv, str(log), kill_at))
        process.start()
        return Child(process, log)

    def run(self, argv: list[str], kill_at: str | None = None) -> tuple[int, str]:
        child = self.start(argv, kill_at)
        code = child.wait()
        return code, child.output


@pytest.fixture(scope="session")
def runner(tmp_path_factory):
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["infsamp.cli", "infsamp.commands.train", "infsamp.run.trainer",
                                    "fault_harness", "peft"])
    return Runner(context, tmp_path_factory.mktemp("children"))


@pytest.fixture(scope="session")
def reference(runner, tiny_model_dir, tmp_path_factory):
    """Uninterrupted runs, one per policy, made once: name -> run folder."""
    made: dict[str, Path] = {}

    def get(policy: str) -> Path:
        if policy not in made:
            out = tmp_path_factory.mktemp("reference") / policy
            code, output = runner.run(run_args(tiny_model_dir, out, *POLICIES[policy]))
            assert code == 0, output
            made[policy] = out
        return made[policy]

    return get

