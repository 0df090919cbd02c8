"""The processes below this one, and ending every one of them: what a reward's worker started
(children, children in sessions of their own, double-forked daemons) goes with the worker.

A loader (`worker_process.py`) makes itself a child subreaper (Linux `PR_SET_CHILD_SUBREAPER`):
a process below it whose parent ends is handed to the loader rather than to init, so however a
reward's children detach (`setsid`, a double fork), they stay below the loader. `end_descendants`
then SIGKILLs everything below this process (read from `/proc`), reaps what it can reap, and
repeats until nothing is left: a process forked while the others were killed is found by the
next round.

Deliberately simple: the tree is read from `/proc/*/stat` (one pass a round; the kernel's
`/proc/PID/task/TID/children` is not built everywhere); between reading a PID and killing it the
process could end and its PID be reused, which needs the PID space to wrap within that
microsecond. What this cannot reach: a process started for the reward by another service (a
systemd unit, a container daemon, `at`, a remote host), and anything below a loader that was
itself SIGKILLed (the OOM killer): its workers die with it (`PR_SET_PDEATHSIG`), their children
go to init. Off Linux only the worker's process group is killed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections import defaultdict

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, value: int) -> bool:
    """Linux prctl(2); False where there is none or it failed."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parent_of_each() -> dict[int, int]:
    """PID -> its parent's PID, for every process in /proc (empty without /proc)."""
    parents: dict[int, int] = {}
    try:
        entries = [entry.name for entry in os.scandir("/proc") if entry.name.isdigit()]
    except OSError:
        return parents
    for name in entries:
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()  # after "(comm)": may hold ")"
        except (OSError, IndexError):
            continue  # ended meanwhile
        parents[int(name)] = int(fields[1])
    return parents


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, children first."""
    children: dict[int, list[int]] = defaultdict(list)
    for child, parent in _parent_of_each().items():
        children[parent].append(child)
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(0), [])
        found += below
        todo += below
    return found


def _kill(pid: int, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def end_descendants(group: int = 0) -> dict[int, int]:
    """SIGKILL process group `group` (if any) and every process below this one, until none is
    left; the exit codes of the children reaped, by PID."""
    if group:
        _kill(group, group=True)
    codes: dict[int, int] = {}
    while True:
        below = descendants(os.getpid())
        for pid in below:
            _kill(pid)
        codes.update(_reap_all())
        if not below:
            return codes


def _reap_all() -> dict[int, int]:
    """Wait for every child of this process to end (all were killed): PID -> exit code."""
    codes: dict[int, int] = {}
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return codes
        codes[pid] = os.waitstatus_to_exitcode(status)
