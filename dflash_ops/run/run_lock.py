"""One writer per run directory: `<output_dir>/train.lock`, held for the run's whole life.

`python -m dflash_ops.train` takes an exclusive `flock` on `<output_dir>/train.lock` before it moves
a run aside (`--fresh`), reads the checkpoint it resumes or writes anything, and holds it until it
exits. That process is the run's owner in either layout: the single-process trainer, or a pipeline's
launcher (dflash_ops.run.launcher), which hands the locked descriptor on to torchrun, so that the lock
is held until the launcher and torchrun are both gone (torchrun outlives its workers; each worker and
torchrun die with their parent). A second trainer on the same directory is refused at once (exit 2)
with the holder's pid and host, which the holder writes into the file. The lock dies with its holder
(the kernel drops a dead process's flock), so a lock file left by a killed run is simply taken over:
its stale pid is overwritten, never trusted. The file itself stays (removing it would let two
trainers lock two different files).

The Ansible start (module_utils/run_pidfile.py) serialises its own changes to the run's pidfile with
`<pidfile>.lock`, another file: the trainer never takes it and never inherits it (the run is spawned
with close_fds), and the module never waits for `train.lock`; neither lock waits for the other, so
they cannot deadlock (docs/CONTRACTS.md, "One writer per run directory").
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from dflash_ops.core.config import ConfigError
from dflash_ops.core.runtime import FILE_MODE, ensure_dir, output_mode
from dflash_ops.core.safe_paths import open_file

LOCK_FILE = "train.lock"


class RunLocked(Exception):
    """Another live process holds the run directory's lock: its pid and host are in the message."""


def holder_of(fd: int) -> dict:
    """What the lock file names as its holder ({} when it names none: being written, or an old file)."""
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def describe_holder(holder: dict) -> str:
    if not holder.get("pid"):
        return "a process that has not yet written its pid"
    since = f", since {holder['since']}" if holder.get("since") else ""
    return f"pid {holder['pid']} on host {holder.get('host') or 'unknown'}{since}"


class RunLock:
    """The held lock of one run directory; `release()` (or the process's exit) lets it go."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / LOCK_FILE
        try:
            ensure_dir(output_dir)
            self.fd = open_file(self.path, os.O_RDWR | os.O_CREAT, output_mode(FILE_MODE))
        except OSError as exc:  # a read-only mount, no permission
            raise ConfigError("run.output_dir", f"cannot create the run's lock file {self.path}: "
                              f"{exc.strerror or exc}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = holder_of(self.fd)
            os.close(self.fd)
            raise RunLocked(f"{output_dir} is in use by another trainer: {describe_holder(holder)} holds "
                            f"{self.path}; stop that run first (or train in another run.output_dir)"
                            ) from None
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (json.dumps(record) + "\n").encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # the flock goes with the last descriptor of it (torchrun may hold one)
            self.fd = -1

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
