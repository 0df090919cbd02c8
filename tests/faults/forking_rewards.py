"""Reward functions that start processes of their own, for `test_reward_process_trees.py`:
module-level (a worker finds them by name), importing nothing heavy. Each started process writes
its PID to `FOLDER/KIND.pid` and then appends a line to `FOLDER/KIND.log` every 50 ms."""

from __future__ import annotations

import os
import subprocess
import time

KINDS = ("plain", "session", "daemon")  # a child, a child in a session of its own, a daemon

_WRITER = ("echo $$ > \"$1/$2.pid.tmp\" && mv \"$1/$2.pid.tmp\" \"$1/$2.pid\" && "
           "while :; do echo still here >> \"$1/$2.log\"; sleep 0.05; done")


def _write_until_killed(folder: str, kind: str) -> None:
    os.execv("/bin/sh", ["/bin/sh", "-c", _WRITER, "sh", folder, kind])


def _start(folder: str, kind: str) -> None:
    """Fork a process of `kind` that writes until it is killed (the caller goes on)."""
    if os.fork():
        return
    try:
        if kind != "plain":
            os.setsid()
        if kind == "daemon" and os.fork():  # the double fork: its parent ends at once
            os._exit(0)
        _write_until_killed(folder, kind)
    finally:
        os._exit(1)


def _started(folder: str) -> None:
    for kind in KINDS:
        _start(folder, kind)
    deadline = time.monotonic() + 30
    while not all(os.path.exists(os.path.join(folder, k + ".pid")) for k in KINDS):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with open(os.path.join(folder, "caller.pid"), "w") as f:
        f.write(str(os.getpid()))


def gone(pid: int) -> bool:
    """True once process `pid` has ended (a zombie counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except (FileNotFoundError, IndexError):
        return True


def forks_then_hangs(prompts, completions, folder, **kwargs):
    """Starts its three processes, then overruns any timeout."""
    _started(folder[0])
    time.sleep(3600)


async def async_starts_then_hangs(prompts, completions, folder, **kwargs):
    """An async function: a `subprocess.Popen` in a new session, then blocks its loop."""
    subprocess.Popen(["/bin/sh", "-c", _WRITER, "sh", folder[0], "popen"],
                     start_new_session=True, stdin=subprocess.DEVNULL)
    _started(folder[0])
    time.sleep(3600)  # noqa: ASYNC251 - blocks the event loop


def forks_and_returns(prompts, completions, folder, **kwargs):
    """Starts its three processes once (say, a server it keeps), and answers."""
    if not os.path.exists(os.path.join(folder[0], "daemon.pid")):
        _started(folder[0])
    return [1.0] * len(completions)


def forks_then_dies(prompts, completions, folder, **kwargs):
    """Starts its three processes, then its worker ends (a crash)."""
    _started(folder[0])
    os._exit(3)
