"""Every rank watches the others, so that one failure stops the run instead of hanging it.

A rank blocked in a collective cannot notice that a peer is gone (NCCL waits for its timeout, gloo
often does too), so each rank runs a daemon thread that talks to the rendezvous store (a separate
client of the TCPStore torchrun or rank 0 serves) every `POLL_S` seconds:

    failed/<r>    a rank's exception, posted by `ProcessRanks.guard` before the process exits
    host/<r>      "<hostname> <pid>": a peer on the same machine is checked directly (/proc)
    beat/<r>      a counter each rank increments: a peer on another machine whose counter stops
                  for `timeout_s` counts as failed
    done/<r>      the rank finished normally (its exit is not a failure)

It also watches its own launcher: torchrun (or accelerate launch) is this process's parent, and
the ranks run in sessions of their own, so a `kill -9` of the launcher leaves them running. A
parent that is gone (this process was re-parented) stops the rank within a second; a lost store
is named as such, never as rank 0's failure.

When a peer failed, died or went silent, the watcher prints one line naming it and the newest
complete checkpoint, and ends this process with exit code 3 (`os._exit`: the main thread may be
inside a collective that would never return). Checkpoints are written atomically, so the newest
complete one is intact; `--resume` under the same launch continues from it.

Deliberately simple: polling (0.5 s), not callbacks (nor prctl's parent-death signal, which would
kill the rank without a word); the parent is watched only under torchrun's agent
(TORCHELASTIC_RUN_ID), not for processes started some other way.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from infsamp.checkpoint_folders import list_checkpoints

POLL_S = 0.5
PEER_FAILED_EXIT = 3
STORE_LOST = ("the launch's rendezvous store stopped answering (the launcher or the machine "
              "serving it is gone)")


def process_alive(pid: int) -> bool:
    """False for a process that is gone or a zombie (killed, not yet reaped by its parent)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class RankWatch:
    def __init__(self, rank: int, world_size: int, timeout_s: float, output_dir: str, token: str):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.output_dir = Path(output_dir)
        self.store = _connect(f"infsamp/{token}")
        self.host = socket.gethostname()
        # torchrun's agent (accelerate launch runs it too) is the parent: it sets this variable
        self.parent = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        self._stop = threading.Event()
        self._peers: dict[int, tuple[str, int]] = {}
        self._beats: dict[int, tuple[int, float]] = {}
        self._failure: tuple[int | None, str] | None = None

    # ---- this rank
    def start(self) -> RankWatch:
        self.store.set(f"host/{self.rank}", f"{self.host} {os.getpid()}")
        self.store.add(f"beat/{self.rank}", 1)
        threading.Thread(target=self._run, name="infsamp-rank-watch", daemon=True).start()
        return self

    def report_failure(self, message: str) -> None:
        with contextlib.suppress(Exception):  # the store may be gone with rank 0: nothing to tell
            self.store.set(f"failed/{self.rank}", message)
            self.store.add("num_failed", 1)

    def finished(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            self.store.set(f"done/{self.rank}", "1")

    # ---- the others
    def peer_failure(self, wait_s: float = 0.0) -> tuple[int | None, str] | None:
        """(rank, reason) of a failed peer, waiting up to `wait_s` for the watcher to see one."""
        deadline = time.monotonic() + wait_s
        while self._failure is None and time.monotonic() < deadline:
            time.sleep(POLL_S / 5)
        return self._failure

    def describe(self, peer: int | None, reason: str) -> str:
        """One line: which peer failed and why (`peer` None: the launch itself is gone)."""
        found = list_checkpoints(self.output_dir)  # [] while the folder does not exist
        newest = f"the newest complete checkpoint is {found[-1]}; continue with --resume " \
                 "under the same launch" if found else "no checkpoint was written yet"
        if peer is None:
            return f"{reason}; rank {self.rank} stopped without saving: {newest}"
        return f"rank {peer} failed ({reason}); rank {self.rank} stopped too: {newest}"

    def _run(self) -> None:
        lost_since: float | None = None
        while not self._stop.wait(POLL_S):
            try:
                failure = self._launcher_gone() or self._check()
                lost_since = None
            except Exception:  # noqa: BLE001 - the store's client raises several types
                lost_since = lost_since or time.monotonic()
                lost = time.monotonic() - lost_since
                failure = (None, STORE_LOST) if lost > min(self.timeout_s, 10.0) else None
            if failure is not None and not self._stop.is_set():
                self._failure = failure
                time.sleep(POLL_S)  # let the main thread name the peer itself if it can
                print(f"infsamp train: error: {self.describe(*failure)}", file=sys.stderr,
                      flush=True)
                os._exit(PEER_FAILED_EXIT)

    def _launcher_gone(self) -> tuple[None, str] | None:
        if self.parent is None or os.getppid() == self.parent:
            return None
        return None, f"the launcher (PID {self.parent}) is gone: killed, or it crashed"

    def _check(self) -> tuple[int, str] | None:
        self.store.add(f"beat/{self.rank}", 1)
        if self.store.add("num_failed", 0):
            for peer in self._others():
                if self.store.check([f"failed/{peer}"]):
                    return peer, self.store.get(f"failed/{peer}").decode(errors="replace")
        for peer in self._others():
            reason = self._silent(peer)
            if reason and not self.store.check([f"done/{peer}"]):
                return peer, reason
        return None

    def _others(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def _silent(self, peer: int) -> str | None:
        """Why `peer` looks dead, or None: its process is gone, or its heartbeat stopped."""
        if peer not in self._peers:
            if not self.store.check([f"host/{peer}"]):
                return None
            host, pid = self.store.get(f"host/{peer}").decode().rsplit(" ", 1)
            self._peers[peer] = (host, int(pid))
        host, pid = self._peers[peer]
        if host == self.host:
            return None if process_alive(pid) else "its process exited without a message: " \
                "killed, or out of memory"
        beats = self.store.add(f"beat/{peer}", 0)
        seen, since = self._beats.get(peer, (-1, time.monotonic()))
        if beats != seen:
            self._beats[peer] = (beats, time.monotonic())
            return None
        silent = time.monotonic() - since
        return f"no heartbeat for {silent:.0f} s" if silent > self.timeout_s else None


def _connect(prefix: str):
    """A client of the run's rendezvous store (torchrun's agent or rank 0 serves it)."""
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=10))
    return dist.PrefixStore(prefix, store)
