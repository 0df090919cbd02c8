"""A reward's processes end with its call (issue 32, item 6): a call stopped at
`rewards.timeout_s` takes with it every process it started (a child, a child in a session of its
own, a double-forked daemon, a `subprocess.Popen(start_new_session=True)`), a worker that dies
takes its children with it, and nothing the reward machinery started outlives the run: not after
`close`, not after a `kill -9` of the trainer or of the trainer's whole process group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import forking_rewards
import pytest
from forking_rewards import KINDS, gone

from infsamp.rewards.workers import RewardWorkers, WorkerDied

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
SRC = Path(__file__).resolve().parents[2] / "src"


def _arguments(folder: Path) -> dict:
    return {"prompts": ["p"], "completions": ["c"], "folder": [str(folder)]}


def _pids(folder: Path, kinds=KINDS) -> dict[str, int]:
    return {kind: int((folder / f"{kind}.pid").read_text()) for kind in (*kinds, "caller")}


def _alive(pids: dict[str, int], within_s: float = 0.0) -> list[str]:
    """The kinds still running after `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while True:
        alive = [kind for kind, pid in pids.items() if not gone(pid)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def _kill_leftovers(pids: dict[str, int]) -> None:
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _logs_grow(folder: Path) -> list[str]:
    sizes = {log.name: log.stat().st_size for log in folder.glob("*.log")}
    time.sleep(0.3)
    return [log.name for log in folder.glob("*.log") if log.stat().st_size != sizes[log.name]]


@contextlib.contextmanager
def _workers(function, timeout_s: float, pids: dict[str, int]):
    """Workers for `function`, closed after the test, with any process of `pids` left killed."""
    workers = RewardWorkers([("f", function)], timeout_s=timeout_s)
    try:
        yield workers
    finally:
        workers.close()
        _kill_leftovers(pids)


@pytest.mark.parametrize("function, kinds", [
    (forking_rewards.forks_then_hangs, KINDS),
    (forking_rewards.async_starts_then_hangs, (*KINDS, "popen")),
])
def test_a_timed_out_call_takes_every_process_it_started_with_it(tmp_path, function, kinds):
    pids: dict[str, int] = {}
    with _workers(function, 1.0, pids) as workers:
        assert workers.call("f", function, _arguments(tmp_path)).timed_out
        pids.update(_pids(tmp_path, kinds))
        assert _alive(pids) == []  # gone when the call's outcome is known
        assert _logs_grow(tmp_path) == []


def test_a_worker_that_dies_takes_its_children_with_it(tmp_path):
    function, pids = forking_rewards.forks_then_dies, {}
    with _workers(function, 60.0, pids) as workers:
        outcome = workers.call("f", function, _arguments(tmp_path))
        assert isinstance(outcome.error, WorkerDied) and "exit code 3" in str(outcome.error)
        pids.update(_pids(tmp_path))
        assert _alive(pids) == []


def test_what_a_call_keeps_running_lives_with_the_run_and_ends_with_it(tmp_path):
    function, pids = forking_rewards.forks_and_returns, {}
    with _workers(function, 60.0, pids) as workers:
        for _ in range(2):
            assert workers.call("f", function, _arguments(tmp_path)).value == [1.0]
        pids.update(_pids(tmp_path), loader=workers.workers["f"].loader.popen.pid)
        assert _alive(pids) == list(pids)  # a server the function keeps lives across calls
        workers.close()
        assert _alive(pids) == []


TRAINER = """
import sys
from pathlib import Path
from forking_rewards import forks_then_hangs
from infsamp.rewards.workers import RewardWorkers

folder = Path(sys.argv[1])
workers = RewardWorkers([("f", forks_then_hangs)], timeout_s=600)
workers.workers["f"].wait_ready()
(folder / "loader.pid").write_text(str(workers.workers["f"].loader.popen.pid))
workers.call("f", forks_then_hangs, {"prompts": ["p"], "completions": ["c"],
                                     "folder": [str(folder)]})
"""


@pytest.mark.parametrize("kill", ["the trainer", "the trainer's process group"])
def test_nothing_outlives_a_killed_trainer(tmp_path, kill):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(Path(__file__).parent)])}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(tmp_path)], env=env,
                               start_new_session=True)
    pids: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "caller.pid").exists():
            assert trainer.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        pids = {**_pids(tmp_path), "loader": int((tmp_path / "loader.pid").read_text())}
        if kill == "the trainer":
            trainer.kill()
        else:
            os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait(10)
        assert _alive(pids, within_s=5.0) == []
        assert _logs_grow(tmp_path) == []
    finally:
        if trainer.poll() is None:
            trainer.kill()
        _kill_leftovers(pids)
