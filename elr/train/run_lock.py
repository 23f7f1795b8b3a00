"""One run per folder: a lock file that refuses a second trainer on the same dump or checkpoint folder.

`{folder}/train.lock` is held with an exclusive `flock` for the life of the run and holds the owner's
pid, host, process start time (from /proc, where there is one) and the wall time it started. Two
trainers in one folder would interleave their checkpoints and metrics.jsonl, so the second one stops
before any work with one line naming the owner. The kernel drops a dead process's flock, so taking
over the lock of a run that died is atomic: of two trainers racing for it, exactly one gets it. The
file a dead run left is reported in one warning line. A file naming a process on another host is
refused (a shared filesystem may not carry flocks across hosts): delete it once that run is gone.
The trainer locks its dump folder and, with checkpoints on, its checkpoint folder (which may lie
anywhere). Only rank 0 takes the locks; every rank learns the outcome.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

import torch.distributed as dist

from elr.errors import ConfigError, FolderInUse

logger = logging.getLogger("elr")

LOCK = "train.lock"


def _process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), or None where /proc has none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the command name in (...) may hold spaces


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _owner_gone(owner: dict, me: dict) -> bool:
    """True when the run that wrote `owner` is certainly not running (nor is this process)."""
    if owner.get("host") != me["host"] or not isinstance(owner.get("pid"), int):
        return False
    start = owner.get("process_start")
    if owner["pid"] == me["pid"]:  # this process: a trainer it built earlier and did not close, or a reused pid
        return True
    return not _alive(owner["pid"]) or (start is not None and _process_start(owner["pid"]) not in (None, start))


# Lock files this process holds, by real path: a trainer built again in the same process (and not
# closed) takes its predecessor's lock over, since a second flock of the same file would refuse it.
_HELD_HERE: dict[str, RunLock] = {}


class RunLock:
    """The lock files this process holds (open, flocked); `release` removes them."""

    def __init__(self, me: dict):
        self.me = me
        self.held: dict[str, int] = {}  # real path -> open descriptor holding the flock

    @property
    def paths(self) -> list[Path]:
        return [Path(p) for p in self.held]

    @classmethod
    def acquire(cls, folders: dict[str, Path], rank: int) -> RunLock | None:
        """Lock each folder ({config key: folder}) on rank 0, or raise FolderInUse on every rank."""
        lock, error = None, None
        if rank == 0:
            me = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "process_start": _process_start(os.getpid()),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            lock = cls(me)
            try:
                for key, folder in folders.items():
                    try:
                        lock._take(key, Path(folder))
                    except OSError as e:  # read-only, no permission, no space: before any work starts
                        raise ConfigError(
                            f"{key}: cannot write in {folder} ({e.strerror or e}); a run needs a "
                            "writable folder for its lock, metrics and checkpoints"
                        ) from None
            except (FolderInUse, ConfigError) as e:
                lock.release()
                lock, error = None, (type(e).__name__, str(e))
        if dist.is_initialized():
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error:
            raise (ConfigError if error[0] == "ConfigError" else FolderInUse)(error[1])
        return lock

    def _take(self, key: str, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        path = Path(os.path.realpath(folder / LOCK))
        if str(path) in self.held:  # the same folder under two keys
            return
        previous = _HELD_HERE.get(str(path))
        if previous is not None:  # this process: a trainer it built earlier and did not close
            fd = previous.held.pop(str(path))
        else:
            fd = _flock(path, lambda: self._in_use(key, folder, path, _read(path)))
            owner = _read(path)  # what a run that held no flock left: it is gone, or on another host
            if owner is not None and not _owner_gone(owner, self.me):
                os.close(fd)
                raise self._in_use(key, folder, path, owner)
            if owner is not None and owner.get("pid") != self.me["pid"]:
                logger.warning(
                    f"{path}: taking over the lock of run pid {owner['pid']} on {owner['host']} "
                    f"(started {owner.get('started')}), which is no longer running"
                )
        data = json.dumps(self.me).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        self.held[str(path)] = fd
        _HELD_HERE[str(path)] = self

    @staticmethod
    def _in_use(key: str, folder: Path, path: Path, owner: dict | None) -> FolderInUse:
        who = (
            f"pid {owner.get('pid')} on {owner.get('host')}, started {owner.get('started')}"
            if owner is not None
            else "its lock file names no owner yet"
        )
        return FolderInUse(
            f"{key}: {folder} is in use by another run ({who}); two runs in one folder would mix "
            f"their checkpoints and metrics. Use another folder, or delete {path} if that run is gone"
        )

    def release(self) -> None:
        """Remove the lock files this lock still holds, then drop their flocks."""
        for path, fd in self.held.items():
            if _HELD_HERE.get(path) is self:
                del _HELD_HERE[path]
            try:
                if _read(Path(path)) == self.me:
                    os.unlink(path)  # before the flock goes: a waiter on this file then finds it replaced
            except OSError:
                pass
            finally:
                os.close(fd)
        self.held = {}


def _flock(path: Path, in_use) -> int:
    """An open descriptor of `path` holding its exclusive flock; `in_use()` (an exception) is raised
    when another process holds it. The file must still be the one at `path` once locked: a run that
    released meanwhile unlinked it, and a lock on the unlinked file would guard nothing."""
    for _ in range(10):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise in_use() from None
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise FolderInUse(f"{path}: could not take the lock (other runs keep taking and releasing it)")


def _read(path: Path) -> dict | None:
    try:
        owner = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None
