"""One owner per run folder: an exclusive OS lock held by the process that writes it.

    claim_run_folder(folder)      create the folder if needed, lock `.infsamp.lock` inside it
                                  (`fcntl.flock`, exclusive, not blocking), record who holds it
    RunFolderLock.release(undo)   unlock; `undo` also removes what the claim created (a refused
                                  run leaves the folder as it found it)
    live_holder(folder)           who holds a folder's lock now, or None
    live_run_around(path)         the live run whose folder holds `path` (a run or an export
                                  inside a live run's folder is refused)
    check_still_held(folder)      before each write: the folder is still the one claimed (not
                                  removed, nor removed and made again by another run)

The lock is taken before the run folder's rules are applied (`run/folder.py`), so two runs
started together cannot both find the folder empty; the OS releases it however the process ends
(docs/reliability.md, "A run folder has one owner at a time"). The lock file holds the holder's
PID, host, start time and rank (JSON), written only once the lock is held, so a refused run names
it. The descriptor is not inheritable (PEP 446): a child that execs never holds the lock.

Deliberately simple: `flock` locks are advisory and per machine (on NFS they are emulated and work
between machines on recent Linux kernels); a filesystem that refuses locks gets one warning line
and the run goes on unlocked.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from infsamp.checkpoint_folders import LOCK_NAME
from infsamp.errors import RunFolderError
from infsamp.files import open_for_writing

_LOCK_RETRY_S = 0.3  # a short-lived probe (live_holder) may hold the lock for a moment


@dataclass
class RunFolderLock:
    folder: Path
    fd: int | None
    created_file: bool
    created_folder: bool
    previous: bytes  # the lock file's bytes before this claim wrote its own

    def release(self, undo: bool = False) -> None:
        """Unlock. `undo`: the claim is refused, so restore the lock file's bytes (or remove the
        lock file and the folder the claim created)."""
        _held.pop(_key(self.folder), None)
        if self.fd is None:
            return
        path = self.folder / LOCK_NAME
        if undo and self.created_file:
            with contextlib.suppress(OSError):
                path.unlink()  # still locked: nobody can have taken it meanwhile
        elif undo:
            _write(self.fd, self.previous)
        os.close(self.fd)
        self.fd = None
        if undo and self.created_folder:
            with contextlib.suppress(OSError):
                self.folder.rmdir()  # only if still empty


_held: dict[str, RunFolderLock] = {}  # this process's claims, by resolved folder


def claim_run_folder(folder: Path) -> RunFolderLock:
    """Create `folder` if needed and hold its lock for this process; a folder that another
    process holds is one line naming that process (RunFolderError: exit 2, nothing changed)."""
    what = "logging.output_dir"
    if _key(folder) in _held:
        raise RunFolderError(f"{what} {folder}: in use by this process (an earlier run on it "
                             "has not ended: call its close())")
    around = live_run_around(folder.absolute().parent)
    if around is not None:
        raise RunFolderError(f"{what} {folder}: is inside {around[0]}, the run folder of a live "
                             f"run: {describe(around[1])} (nothing was changed); choose a folder "
                             "outside it")
    created_folder = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = _lock(folder, created_folder)
    except OSError as err:
        raise RunFolderError(f"{what} {folder}: cannot create or lock it: "
                             f"{err.strerror or err}") from None
    if lock is None:
        holder = _read_holder(folder / LOCK_NAME, wait_s=1.0)
        raise RunFolderError(f"{what} {folder}: in use by {describe(holder)}; wait for it to "
                             f"end, or choose another {what} (nothing was changed)")
    _held[_key(folder)] = lock
    return lock


def release_run_folder(folder: str | Path) -> None:
    """The run in this process ended: let the folder go (no-op when this process holds none)."""
    lock = _held.get(_key(Path(folder)))
    if lock is not None:
        lock.release()


def check_still_held(folder: str | Path) -> None:
    """Before this process writes into a folder it holds: the lock file it locked must still be
    the one at `folder/LOCK_NAME`. A folder removed (or removed and made again, perhaps by
    another run) while the run went is one line (RunFolderError), so nothing more is written or
    pruned there. A no-op for a folder this process does not hold (other ranks, tests)."""
    lock = _held.get(_key(Path(folder)))
    if lock is None or lock.fd is None:
        return
    if not _is_at(lock.fd, lock.folder / LOCK_NAME):
        raise RunFolderError(f"logging.output_dir {folder}: removed or replaced while this run "
                             "was going (its lock file is not the one this run holds); stopping "
                             "without writing anything more into it")


def released_on_failure(init):
    """For a run's `__init__(self, cfg, ...)`: when it fails (a resume refused once the data is
    read, a model that does not load), the claim is undone: the lock file as it was (or gone
    with the folder the claim created, when still empty), and a notebook can start again."""
    @functools.wraps(init)
    def wrapper(self, cfg, *args, **kwargs):
        held_before = _key(Path(cfg.logging.output_dir)) in _held
        try:
            init(self, cfg, *args, **kwargs)
        except BaseException:
            lock = None if held_before else _held.get(_key(Path(cfg.logging.output_dir)))
            if lock is not None:
                lock.release(undo=True)
            raise
    return wrapper


def live_holder(folder: Path) -> dict | None:
    """The holder's record when a process holds `folder`'s lock now; None otherwise (no lock
    file, or nobody holds it). Never creates or writes anything."""
    path = folder / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_holder(path, wait_s=1.0)
    except OSError:
        return None
    finally:
        os.close(fd)  # also releases the probe's shared lock at once
    return None


def live_run_around(path: Path) -> tuple[Path, dict] | None:
    """The nearest folder at or above `path` that a live run holds, with its holder's record."""
    for folder in (p for p in [path, *path.absolute().parents] if p.is_dir()):
        holder = live_holder(folder)
        if holder is not None:
            return folder, holder
    return None


def describe(holder: dict | None) -> str:
    """'infsamp train (PID 1234, rank 0 of 2, on host gpu1, started 2026-12-01 10:00:03)'."""
    if not holder:
        return "another process (it has not written its PID yet)"
    parts = [f"PID {holder.get('pid')}"]
    if holder.get("world_size", 1) > 1:
        parts.append(f"rank {holder.get('rank')} of {holder.get('world_size')}")
    parts += [f"on host {holder.get('host')}", f"started {holder.get('started')}"]
    return f"{holder.get('command', 'infsamp')} ({', '.join(parts)})"


# ---------------------------------------------------------------- the lock file


def _lock(folder: Path, created_folder: bool) -> RunFolderLock | None:
    """Lock folder/LOCK_NAME (None: another process holds it). Retries when the file was
    replaced between opening and locking (a refused claim removed the one it created)."""
    path = folder / LOCK_NAME
    while True:
        try:
            fd, created = open_for_writing(path, os.O_RDWR | os.O_CREAT | os.O_EXCL), True
        except FileExistsError:
            try:
                fd, created = open_for_writing(path, os.O_RDWR), False
            except FileNotFoundError:  # removed meanwhile by a refused claim: create it
                continue
        if not _try_lock(fd, path):
            os.close(fd)
            return None
        if _is_at(fd, path):
            break
        os.close(fd)
    previous = b"" if created else os.pread(fd, 1 << 16, 0)
    holder = {"command": "infsamp train", "pid": os.getpid(), "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "rank": int(os.environ.get("RANK", "0")),
              "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
    _write(fd, json.dumps(holder).encode())
    return RunFolderLock(folder, fd, created, created_folder, previous)


def _is_at(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is the file at `path` now (not removed, nor replaced)."""
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _try_lock(fd: int, path: Path) -> bool:
    deadline = time.monotonic() + _LOCK_RETRY_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            print(f"warning: {path}: this filesystem does not support file locks "
                  f"({err.strerror}); another run started into this folder would not be "
                  "noticed", file=sys.stderr)
            return True


def _read_holder(path: Path, wait_s: float) -> dict | None:
    """The holder's record; it writes it right after locking, so wait a moment for it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            record = json.loads(path.read_bytes() or b"null")
            if isinstance(record, dict) and "pid" in record:
                return record
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _write(fd: int, data: bytes) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _key(folder: Path) -> str:
    return str(folder.expanduser().resolve())

