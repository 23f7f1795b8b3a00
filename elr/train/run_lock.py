"""One run per folder: a lock file that refuses a second trainer on the same dump or checkpoint folder.

`{folder}/train.lock` holds the owner's pid, host, process start time (from /proc, where there is one)
and the wall time it started. Two trainers in one folder would interleave their checkpoints and
metrics.jsonl, so the second one stops before any work with one line naming the owner. A lock left
by a run that died is stale, and is taken over with one warning line: on this host, its pid is gone,
or now belongs to a process that started at another time (pids are reused, e.g. in a restarted
container). A lock from another host cannot be checked from here: delete the file once that run is
gone. Only rank 0 takes the lock; every rank learns the outcome.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

import torch.distributed as dist

from elr.errors import FolderInUse

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


class RunLock:
    """The lock files this process holds; `release` removes them."""

    def __init__(self, paths: list[Path], me: dict):
        self.paths, self.me = paths, me

    @classmethod
    def acquire(cls, folders: dict[str, Path], rank: int) -> RunLock | None:
        """Lock each folder ({config key: folder}) on rank 0, or raise FolderInUse on every rank."""
        lock, error = None, None
        if rank == 0:
            me = {"pid": os.getpid(), "host": socket.gethostname(), "process_start": _process_start(os.getpid()),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            lock = cls([], me)
            try:
                for key, folder in folders.items():
                    lock.paths.append(lock._take(key, Path(folder)))
            except FolderInUse as e:
                lock.release()
                lock, error = None, str(e)
        if dist.is_initialized():
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error:
            raise FolderInUse(error)
        return lock

    def _take(self, key: str, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / LOCK
        for _ in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = _read(path)
                if owner is not None and _owner_gone(owner, self.me):
                    if owner["pid"] != self.me["pid"]:
                        logger.warning(f"{path}: taking over the lock of run pid {owner['pid']} on {owner['host']} "
                                       f"(started {owner.get('started')}), which is no longer running")
                    path.unlink(missing_ok=True)
                    continue
                who = (f"pid {owner.get('pid')} on {owner.get('host')}, started {owner.get('started')}"
                       if owner is not None else "its lock file is unreadable")
                raise FolderInUse(
                    f"{key}: {folder} is in use by another run ({who}); two runs in one folder would mix their "
                    f"checkpoints and metrics. Use another folder, or delete {path} if that run is gone") from None
            with os.fdopen(fd, "w") as f:
                json.dump(self.me, f)
            return path
        raise FolderInUse(f"{key}: {folder}: could not take {path} (another run is taking it at the same time)")

    def release(self) -> None:
        """Remove the lock files that still name this process."""
        for path in self.paths:
            if _read(path) == self.me:
                path.unlink(missing_ok=True)
        self.paths = []


def _read(path: Path) -> dict | None:
    try:
        owner = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None
