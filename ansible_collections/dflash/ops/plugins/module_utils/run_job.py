# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A call of training_run run as an Ansible async job (`async`, `poll: 0`), and the status call that waits
for it and says what it does meanwhile.

The call that changes the run writes, under the run's lock, what it is doing (stopping pid N, waiting for
its GPUs to be idle, starting) to `<pidfile>.phase`, and removes it before it lets the lock go. The status
call waits in the container for the job file that Ansible's async wrapper writes (`results_file`: the
call's own result once it ends), up to a number of seconds, and returns at once when the job ends: the
call's result, the job file removed (async_status's cleanup), or, still under way, that phase and the run's
last log line, which the dflash.ops.waits callback prints."""

from __future__ import annotations

import json
import os
import re
import tempfile
import time

from ansible_collections.dflash.ops.plugins.module_utils.run_pidfile import (
    RunError,
    inspect,
    remove_file,
    running_result,
    stopped_result,
)
from ansible_collections.dflash.ops.plugins.module_utils.run_proc import is_alive, read_stat
from ansible_collections.dflash.ops.plugins.module_utils.run_start import last_log_line
from ansible_collections.dflash.ops.plugins.module_utils.safe_paths import UnsafePath, open_file, refusal

# How often the status call reads the job file while it waits: a call that ends is seen within this.
JOB_POLL_SECONDS = 0.1
# The name async_wrapper gives a job file: j<random>.<its pid>.
JOB_FILE_NAME = re.compile(r"j[0-9]+\.[0-9]+")
# What a result keeps of the job's: the call's own result keys, not the module's bookkeeping.
DROPPED_KEYS = frozenset(("invocation", "warnings", "deprecations", "exception", "started", "finished"))
# The phase of a call that holds no phase file: before it holds the run's lock, or as it ends.
NO_PHASE = "the call in the container (the run's lock, or its end)"
NOTHING_READ = "nothing was stopped or started by this status call"


def phase_path(pidfile):
    return f"{pidfile}.phase"


class Phases:
    """What the call holding the run's lock is doing, in `<pidfile>.phase` for a status call to read:
    one JSON object (the text, when it began, the writer's pid and start time), replaced whole at each
    change, removed on leaving. Disabled (check mode, status) it writes nothing."""

    def __init__(self, pidfile, enabled):
        self.path = phase_path(pidfile)
        self.enabled = enabled

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        if self.enabled:
            remove_file(self.path)

    def set(self, doing):
        if not self.enabled:
            return
        me = read_stat(os.getpid())
        record = dict(doing=doing, since=time.time(), pid=os.getpid(), start_time=me and me.start_time)
        directory = os.path.dirname(self.path) or "."
        fd, tmp = tempfile.mkstemp(prefix=".phase-", dir=directory)
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(record, handle)
            os.rename(tmp, self.path)
        except BaseException:
            remove_file(tmp)
            raise


def stop_phase(pid, stop_timeout):
    return f"the stop of pid {pid} (SIGTERM: its checkpoint; SIGKILL after {stop_timeout:g} s)"


def kill_phase(pid, kill_timeout):
    return f"the end of pid {pid} after SIGKILL (at most {kill_timeout:g} s)"


def gpus_phase(gpus, idle_timeout):
    return f"GPUs {gpus} to be idle (at most {idle_timeout:g} s), then the start"


def start_phase(wait_for):
    return "the new run's start" + (f" and its first log line matching {wait_for!r}" if wait_for else "")


def describe_phase(record, now):
    """The line's 'waiting for' part from a phase record: what the call does and for how long so far."""
    return f"{record['doing']}, {max(0.0, now - record['since']):.0f} s so far"


def read_phase(pidfile, now=None):
    """What the call holding the run's lock does, or None when no live call says (no file, an unreadable
    one, or one whose writer is gone: a call killed before it removed it)."""
    try:
        with os.fdopen(open_file(phase_path(pidfile)), "rb") as handle:
            record = json.loads(handle.read().decode("utf-8"))
        writer = read_stat(record["pid"])
        if writer is None or not is_alive(writer) or writer.start_time != record["start_time"]:
            return None
        return describe_phase(record, time.time() if now is None else now)
    except (OSError, UnsafePath, ValueError, KeyError, TypeError):
        return None


def job_file_problem(path):
    """Why `path` cannot be a job file of Ansible's async wrapper, or None."""
    if not os.path.isabs(path):
        return "is not an absolute path (the results_file of an async call)"
    if not JOB_FILE_NAME.fullmatch(os.path.basename(path)):
        return "is not named as Ansible's async wrapper names a job file (j<digits>.<digits>)"
    return None


def parse_job(text):
    """The job's result once it has ended, or None while it runs (async_status's reading: the wrapper's
    first write has `started`, the call's own result has not)."""
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return None if "started" in data else data


def read_job(path):
    """parse_job of the job file at `path`, read without following a symbolic link. Raises RunError."""
    try:
        with os.fdopen(open_file(path), "rb") as handle:
            text = handle.read().decode("utf-8", "replace")
    except UnsafePath as exc:
        raise RunError(refusal("async_results_file", exc.path, exc.reason, NOTHING_READ)) from None
    except FileNotFoundError:
        raise RunError(f"the job file {path} is gone: the call's result was read already (and removed) or "
                       f"the call never started; see the run's state with state=status") from None
    try:
        return parse_job(text)
    except ValueError as exc:
        raise RunError(f"the job file {path} does not hold a job's result ({exc}): {text[:200]!r}") from None


def job_outcome(data):
    """(failed, the call's result as this call returns it) from an ended job's data."""
    result = {key: value for key, value in data.items() if key not in DROPPED_KEYS}
    failed = bool(result.pop("failed", False))
    if failed and "name" not in result:  # the async wrapper's own failure (its time limit, a crash)
        result["msg"] = f"the call in the container did not end by itself: {result.get('msg', 'no message')}"
    return failed, result


def wait_for_job(path, seconds, clock=time.monotonic, sleep=time.sleep):
    """Read the job file until the job has ended or `seconds` have passed (0: until it ends); returns
    the ended job's data, or None. Raises RunError."""
    deadline = clock() + seconds
    while True:
        data = read_job(path)
        if data is not None or (seconds and clock() >= deadline):
            return data
        sleep(JOB_POLL_SECONDS)


def job_status(params, remove):
    """The status call of O(async_results_file): (failed, result). Waits up to `wait_return_after` seconds
    for the job; an ended job gives its call's result (the job file removed when `remove`), a running one
    what its call does and the run's last log line. Raises RunError."""
    path = params["async_results_file"]
    problem = job_file_problem(path)
    if problem:
        raise RunError(f"async_results_file {path} {problem}: {NOTHING_READ}")
    data = wait_for_job(path, params["wait_return_after"])
    if data is not None:
        if remove:
            remove_file(path)
        failed, result = job_outcome(data)
        return failed, dict(result, finished=True)
    record, verdict, _unsafe = inspect(params["pidfile"])
    doing = read_phase(params["pidfile"]) or NO_PHASE
    last = last_log_line(params["log_path"]) or f"(no line in {params['log_path']} yet)"
    state = running_result(record) if verdict == "live" else stopped_result(record, verdict)
    return False, dict(state, changed=False, finished=False, waiting_for=doing, progress=last,
                       msg=f"under way: {doing}; the log's last line: {last}")
