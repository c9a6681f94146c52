# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# Targets may run a Python older than 3.11 (no datetime.UTC).
# ruff: noqa: UP017
"""The run's pidfile: its record (pid, process group, start time), how far it can be trusted, and the
lock that serialises changes to it."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import tempfile
from contextlib import contextmanager
from datetime import datetime, timezone
from stat import S_ISLNK, S_ISREG
from typing import NamedTuple

from ansible_collections.dflash.ops.plugins.module_utils.run_proc import is_alive, read_stat

# The pidfile is trusted by the rule every path of the run follows.
from ansible_collections.dflash.ops.plugins.module_utils.safe_paths import (
    UnsafePath,
    open_file,
    path_problem,
    refusal,
)


class RunError(Exception):
    """A failure to report to the user as a message (never a traceback)."""

    def __init__(self, msg, **result):
        super().__init__(msg)
        self.result = result


# What a run's name must be, as messages say it: the pidfile and the log are named after the run.
PLAIN_FILE_NAME = "a plain file name (no '/', not starting with '.')"
# How a concurrent change is named in messages (a second playbook, or an operator).
CHANGED_UNDER = "another deploy (or an operator) changed it meanwhile"
NOTHING_DONE = "nothing was signalled or started"


class Unreadable(NamedTuple):
    """A pidfile this module cannot trust the content of: stale, never acted on."""
    problem: str


def is_plain_file_name(name):
    """Whether `name` names a file in a directory and nothing outside it (PLAIN_FILE_NAME)."""
    return bool(name) and "/" not in name and not name.startswith(".")


def record_problem(data):
    """Why a parsed pidfile is not a record this module wrote, or None."""
    if not isinstance(data, dict):
        return "does not hold a JSON object"
    for key, minimum in (("pid", 1), ("pgid", 1), ("start_time", 0)):
        value = data.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            return f"has no valid '{key}' (got {value!r})"
    return None


def parse_pidfile(text):
    """The record, or Unreadable(why): an empty, truncated or hand-edited pidfile names nothing."""
    if not text.strip():
        return Unreadable("is empty")
    try:
        data = json.loads(text)
    except ValueError:
        return Unreadable("is not JSON (truncated or not written by training_run)")
    problem = record_problem(data)
    return Unreadable(problem) if problem else data


def load_pidfile(path):
    """(record, unsafe): record is None when there is no pidfile, Unreadable when it names
    nothing; unsafe says why the file itself cannot be trusted, or is None."""
    try:
        file_stat = os.lstat(path)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        raise RunError(f"cannot read pidfile {path}: {exc.strerror}") from None
    unsafe = path_problem(path)
    if S_ISLNK(file_stat.st_mode) or not S_ISREG(file_stat.st_mode):
        return Unreadable("is not a regular file"), unsafe
    try:
        with open(path) as pidfile:
            text = pidfile.read()
    except OSError as exc:
        raise RunError(f"cannot read pidfile {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        return Unreadable("is not text"), unsafe
    return parse_pidfile(text), unsafe


def set_aside(path, now=None):
    """Keep an unreadable pidfile for inspection under a new name; returns that name."""
    now = now or datetime.now(timezone.utc)
    aside = f"{path}.unreadable-{now.strftime('%Y%m%dT%H%M%S%fZ')}"
    os.rename(path, aside)
    return aside


def write_pidfile(path, record):
    """Temp file in the same directory, then rename: a reader sees the old file or the whole new
    one, never a half-written one."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".pidfile-", dir=directory)
    try:
        with os.fdopen(fd, "w") as tmp_file:
            json.dump(record, tmp_file, sort_keys=True)
            tmp_file.write("\n")
            tmp_file.flush()
            os.fsync(tmp_file.fileno())
        os.chmod(tmp, 0o644)
        if os.geteuid() == 0:
            os.chown(tmp, 0, 0)
        os.rename(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def remove_file(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def default_paths(name):
    """(pidfile, log path) of run `name` where the caller names neither: the module's defaults."""
    return f"/var/lib/dflash/{name}.pid", f"/var/log/dflash/{name}.log"


def uptime_seconds(record, now=None):
    try:
        started = datetime.fromisoformat(record["started_at"])
    except (KeyError, TypeError, ValueError):
        return None
    now = now or datetime.now(timezone.utc)
    return round((now - started).total_seconds(), 1)


def pidfile_verdict(record, stat):
    """'live' when the recorded process still runs, else why the pidfile is stale."""
    if stat is None:
        return "dead"
    if stat.start_time != record["start_time"]:
        return "reused"
    if not is_alive(stat):
        return "zombie"
    return "live"


def inspect(pidfile):
    """(record, verdict, unsafe): verdict is 'absent', 'live', 'dead', 'zombie', 'reused' or
    'unreadable'; unsafe says why the pidfile itself cannot be trusted, or is None."""
    record, unsafe = load_pidfile(pidfile)
    if record is None:
        return None, "absent", unsafe
    if isinstance(record, Unreadable):
        return record, "unreadable", unsafe
    return record, pidfile_verdict(record, read_stat(record["pid"])), unsafe


def describe(record):
    if isinstance(record, Unreadable):
        return f"it {record.problem}"
    return f"pid {record['pid']} argv {record.get('argv')} started at {record.get('started_at')}"


def running_result(record, **extra):
    return dict(status="running", pid=record["pid"], run=record, stale_pidfile=False,
                uptime=uptime_seconds(record), **extra)


def stopped_result(record, verdict, **extra):
    readable = record if isinstance(record, dict) else None
    result = dict(status="stopped", pid=None, run=readable, stale_pidfile=verdict not in ("absent", "live"))
    if isinstance(record, Unreadable):
        result["pidfile_problem"] = record.problem
    result.update(extra)
    return result


# The pidfile's lock is root's alone: a lock file others may open is a lock any local user can hold (flock
# works on a read-only descriptor), and a held lock would block every stop, restart and deploy.
LOCK_MODE = 0o600


def lock_holders(fd):
    """The pids that /proc/locks says hold a flock on `fd`'s file (waiters, `->` lines, left out)."""
    st = os.fstat(fd)
    file_id = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            rows = [line.split() for line in f]
    except OSError:
        return []
    return [int(row[4]) for row in rows if len(row) > 5 and row[1] == "FLOCK" and row[5] == file_id]


class _LockWaitOver(Exception):
    pass


def _lock_wait_over(signum, frame):
    raise _LockWaitOver


def take_lock(fd, path, wait):
    """flock(LOCK_EX) on `fd`, blocked at most `wait` seconds (a waiter /proc/locks lists, ended by
    SIGALRM); RunError naming the holder after that."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    previous = signal.signal(signal.SIGALRM, _lock_wait_over)
    signal.setitimer(signal.ITIMER_REAL, max(wait, 0.001))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except _LockWaitOver:
        holders = ", ".join(f"pid {pid}" for pid in lock_holders(fd)) or "a process not seen here"
        raise RunError(f"the run's lock {path} is still held after {wait:.0f} s, by {holders} "
                       f"(another deploy, stop or restart of this run, or a stuck one: look at that "
                       f"process before you end it). {NOTHING_DONE}") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def pidfile_lock(pidfile, enabled, wait=900):
    """Serialises invocations that may change the pidfile; the lock file stays (removing it would
    let two invocations lock two different files). Waits at most `wait` seconds for another invocation."""
    if not enabled:
        yield
        return
    os.makedirs(os.path.dirname(pidfile) or ".", mode=0o755, exist_ok=True)
    try:
        lock_fd = open_file(pidfile + ".lock", os.O_RDWR | os.O_CREAT, mode=LOCK_MODE)
    except UnsafePath as exc:
        raise RunError(refusal("lock file", exc.path, exc.reason, NOTHING_DONE)) from None
    try:
        if os.fstat(lock_fd).st_mode & 0o777 != LOCK_MODE:
            os.fchmod(lock_fd, LOCK_MODE)  # one an earlier release made 0644; a holder's open stays open
        take_lock(lock_fd, pidfile + ".lock", wait)
        yield
    finally:
        os.close(lock_fd)


def check_expected(name, pidfile, expected, record, verdict, consequence):
    """Optimistic concurrency: `expected` is the run this play inspected or started (0: none; None: no
    check). A live run with another pid means somebody else started one since; a pidfile gone while a run
    was expected means somebody stopped it. Raises RunError naming that run (its pid and release)."""
    if expected is None:
        return
    if verdict == "absent" and expected:
        # Only a stop removes a pidfile (a run that dies leaves a stale one): somebody stopped it.
        raise RunError(f"run {name} changed under this deploy: expected pid {expected}, but its pidfile "
                       f"{pidfile} is gone: {CHANGED_UNDER}. {consequence}; rerun to act on the run as it "
                       f"is now.")
    if verdict != "live" or record["pid"] == expected:
        return
    what = f"pid {expected}" if expected else "no run"
    raise RunError(f"run {name} changed under this deploy: expected {what}, found a live run "
                   f"({describe(record)}): {CHANGED_UNDER}. {consequence}; rerun to act on the run as it "
                   f"is now.", **running_result(record))


def confirm_run(name, pidfile, expected, consequence):
    """check_expected under the pidfile's lock, for a step that does not change the run (a GPU wait).
    It never waits for the lock: one held by another invocation is another deploy changing the run now."""
    try:
        lock_fd = os.open(pidfile + ".lock", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:  # no run was ever started through this pidfile
        lock_fd = None
    try:
        if lock_fd is not None:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RunError(f"run {name} is being changed by another deploy (or an operator) right now "
                               f"(its lock {pidfile}.lock is held). {consequence}; rerun to act on the run "
                               f"as it is now.") from None
        record, verdict, _unsafe = inspect(pidfile)
        check_expected(name, pidfile, expected, record, verdict, consequence)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
