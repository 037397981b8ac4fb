"""One output folder, one writer: an exclusive lock on ``OUT/.lock`` for as long as a command writes there.

Two sweeps on one folder read each other's worker events, move each other's state files aside and overwrite
each other's report. The lock is ``fcntl.flock`` on ``OUT/.lock``: the kernel releases it when its holder
exits, however it exits (SIGKILL included), so a dead process never keeps a folder. The file also names its
holder (pid, command line, start time) for the message a refused command prints. Where ``fcntl`` does not
exist (Windows), nothing is locked.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import sys
from pathlib import Path

from harness.options import UsageError, make_out_folder

LOCK_NAME = ".lock"


class OutFolderLock:
    """Held from :meth:`acquire` to :meth:`release` (or until the process ends)."""

    def __init__(self, out_dir: Path, flag: str = "--out") -> None:
        self.out_dir, self.flag = Path(out_dir), flag
        self.fd: int | None = None

    def acquire(self) -> OutFolderLock:
        try:
            import fcntl
        except ImportError:  # no flock here: one writer is the user's to ensure
            return self
        make_out_folder(self.flag, self.out_dir)
        path = self.out_dir / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace")
            os.close(fd)
            raise UsageError(f"{self.flag} {self.out_dir} is in use by {describe_holder(holder)}; "
                             f"wait for it to end or choose another {self.flag}") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({
            "pid": os.getpid(), "command": shlex.join([Path(sys.executable).name, *sys.orig_argv[1:]])
            if hasattr(sys, "orig_argv") else shlex.join(sys.argv),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}).encode())
        os.fsync(fd)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = None

    def __enter__(self) -> OutFolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def describe_holder(text: str) -> str:
    """'pid 123 (`python -m harness sweep ...`, started 2025-01-01T02:17:00+00:00)' from the lock file."""
    try:
        h = json.loads(text)
        return f"pid {h['pid']} (`{h['command']}`, started {h['started']})"
    except (ValueError, KeyError, TypeError):
        return "another process (it has not written its name yet)"
