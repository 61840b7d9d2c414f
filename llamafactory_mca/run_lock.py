"""One live run per output_dir: a lock file names the process that holds it.

Two runs writing checkpoints into one folder corrupt each other's resume point. The launcher takes the lock
before any worker starts (``torchrun`` started by hand: global rank 0 takes it); a second run is refused
with the holder's PID. A lock whose process is gone (killed, machine rebooted) is stale and taken over.

Taking the lock creates output_dir where it does not exist yet, so releasing it removes what it created if the
run left it empty (a run that failed before writing anything leaves no empty folder behind); a folder that was
there before, or that holds anything, stays.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass

from .errors import UserError


LOCK_NAME = ".llamafactory_mca.lock"
HELD_ENV = "LLAMAFACTORY_MCA_LOCK"  # set by the launcher: its workers need not take the lock again


def _started(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _alive(holder: dict) -> bool:
    if holder.get("host") != socket.gethostname():
        return True  # cannot look into another machine: assume it runs (the message says how to clear it)
    started = _started(int(holder.get("pid", -1)))
    return started is not None and abs(started - float(holder.get("started", 0))) < 1.0


def _read(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


_HELD: list[RunLock] = []  # taken by this process and not yet released


def release_held() -> None:
    """Release every lock this process still holds (a worker's way out, whatever ended its run); a rank forked from
    the launcher inherits the launcher's, which stays the launcher's to release."""
    for lock in [lock for lock in _HELD if lock.pid == os.getpid()]:
        lock.release()


@dataclass
class RunLock:
    path: str
    pid: int
    created: tuple[str, ...] = ()  # the folders acquire made, deepest first

    def release(self) -> None:
        if self in _HELD:
            _HELD.remove(self)
        holder = _read(self.path)
        if holder is not None and holder.get("pid") == self.pid and holder.get("host") == socket.gethostname():
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
        for folder in self.created:
            try:
                os.rmdir(folder)  # only ever an empty folder
            except OSError:
                break  # something is in it (or it is gone): it and its parents stay


def _make_folders(output_dir: str) -> tuple[str, ...]:
    """``os.makedirs(output_dir)``; returns the folders it created, deepest first."""
    missing = []
    folder = os.path.abspath(output_dir)
    while not os.path.exists(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    os.makedirs(output_dir, exist_ok=True)
    return tuple(missing)


def acquire(output_dir: str) -> RunLock:
    """Take the lock of ``output_dir`` for this process, or raise a UserError naming the live holder."""
    created = _make_folders(output_dir)
    path = os.path.join(output_dir, LOCK_NAME)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": _started(os.getpid()),
          "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
    for _ in range(10):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _read(path)
            if holder is not None and _alive(holder):
                raise UserError(
                    f"output_dir={output_dir!r} is in use by another run: pid {holder.get('pid')} on "
                    f"{holder.get('host')}, since {holder.get('since')} ({holder.get('command')}). Wait for it to "
                    f"finish, stop it, or choose another output_dir. If no such run is alive, delete {path}."
                ) from None
            what = f"of pid {holder.get('pid')}, which is no longer running" if holder else "that is unreadable"
            print(f"[llamafactory_mca] taking over the stale lock {path} ({what})", file=sys.stderr)
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(me, f)
        _HELD.append(RunLock(path, me["pid"], created))
        return _HELD[-1]
    raise UserError(f"could not take the lock {path}: other processes keep creating it.")
