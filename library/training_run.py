#!/usr/bin/python
# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# Ansible modules keep their imports below the documentation blocks, and targets may run a Python
# older than 3.11 (no datetime.UTC).
# ruff: noqa: E402, UP017
from __future__ import annotations

DOCUMENTATION = r"""
---
module: training_run
short_description: Start, stop, restart or inspect one training run through its pidfile
description:
  - Manages one long-running process (a training run) identified only by a pidfile that records
    its pid, its process-group id and its start time (field 22 of C(/proc/<pid>/stat)).
  - V(started) runs O(command) in a new session (process-group id = pid), detached from the
    Ansible connection, stdout and stderr appended to O(log_path), and writes the pidfile atomically.
  - V(stopped) acts only if the recorded pid is alive, not a zombie, and has the recorded start
    time. It sends SIGTERM to the process group and to every descendant of the recorded pid (a
    child that called setsid has left the group), waits O(stop_timeout), sends SIGKILL, waits
    O(kill_timeout) and confirms that none of them is left.
  - A stale pidfile (dead pid, zombie, or pid reused by another process) is removed without
    signalling anything. One that names nothing (empty, truncated, not JSON, missing fields) is
    stale too, and is kept for inspection as C(<pidfile>.unreadable-<UTC time>). Processes are never
    chosen by command line or name.
  - A pidfile that is not a regular file, not owned by the module's user, writable by other users,
    or in a directory every user can write to, is never trusted; every state but V(status) fails.
version_added: "0.1.0"
author: dflash-ops contributors
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
  diff_mode:
    support: none
  platform:
    platforms: posix
options:
  name:
    description: Name of the run; stored in the pidfile and used for the default paths.
    type: str
    required: true
  state:
    description:
      - V(started) starts the run unless a live run holds the pidfile. If that run has the same
        O(command) nothing changes; otherwise the module fails and says what is running.
      - V(stopped) stops the run recorded in the pidfile and removes the pidfile.
      - V(restarted) stops the live run (if any), then starts O(command).
      - V(status) reports the run without changing anything.
    type: str
    choices: [started, stopped, restarted, status]
    default: started
  pidfile:
    description: Path of the pidfile. Defaults to C(/var/lib/dflash/<name>.pid).
    type: path
  command:
    description:
      - The argv of the run (no shell). Required for V(started) and V(restarted). A relative
        program path is resolved against O(chdir), a bare name in the run's C(PATH).
    type: list
    elements: str
  chdir:
    description: Working directory of the run. Defaults to C(/) (never the module's temporary
      directory, which Ansible removes).
    type: path
  environment:
    description: Variables added to the module's environment for the run.
    type: dict
    default: {}
  log_path:
    description: File that gets the run's stdout and stderr appended. Defaults to
      C(/var/log/dflash/<name>.log).
    type: path
  stop_timeout:
    description: Seconds the run gets after SIGTERM to checkpoint and exit before SIGKILL.
    type: float
    default: 120
  kill_timeout:
    description: Seconds to wait after SIGKILL before failing with the processes that are left.
    type: float
    default: 10
  startup_wait:
    description: Seconds the run must stay alive after starting; if it exits sooner the module
      fails with the tail of O(log_path).
    type: float
    default: 1
  wait_for:
    description:
      - A regular expression; after a start the module waits until a line the run appends to
        O(log_path) matches it (its first training step, say). The run dying first fails the
        module with the log's tail; no match within O(wait_timeout) fails it and leaves the run.
    type: str
  wait_timeout:
    description: Seconds O(wait_for) may take.
    type: float
    default: 300
  expect_pid:
    description:
      - The pid of the run the caller inspected earlier, or V(0) for no run. If a live run with
        another pid holds the pidfile when the module acts (a concurrent deploy or an operator
        started one), nothing is signalled or started and the module fails saying so. So it does
        when the pidfile is gone (only a stop removes it). A run that died on its own, its pidfile
        left behind, counts as expected.
    type: int
  environment_file:
    description:
      - C(KEY=VALUE) lines added to the run's environment on V(started) and V(restarted), for
        secrets (tokens), which never pass through the module's arguments or result. The file must
        be owned by the module's user and readable by it alone (mode 0600).
    type: path
notes:
  - The run gets stdin from C(/dev/null) and no other inherited descriptor, in its own session,
    so closing the connection (C(ssh), C(pct exec)) neither signals it nor waits for it.
  - A lock file C(<pidfile>.lock) serialises concurrent invocations on the same pidfile.
"""

EXAMPLES = r"""
- name: Ensure the training run is started.
  training_run:
    name: main
    command: [/opt/dflash/current/run.sh]
    chdir: /opt/dflash/current
    environment:
      CUDA_VISIBLE_DEVICES: "0,1"

- name: Restart the run if it is still the one inspected, and wait for its first step.
  training_run:
    name: main
    state: restarted
    command: [/opt/dflash/current/run.sh]
    expect_pid: "{{ inspected.pid or 0 }}"
    wait_for: '"event": *"step"'
    environment_file: /var/lib/dflash/main.env

- name: Ensure the training run is stopped (it checkpoints on SIGTERM).
  training_run:
    name: main
    state: stopped
    stop_timeout: 300
"""

RETURN = r"""
status:
  description: V(running) or V(stopped), when the module returns.
  returned: always
  type: str
pid:
  description: Pid of the run (the new one after a start), or null.
  returned: always
  type: int
run:
  description: The pidfile's content (pid, pgid, start_time, argv, chdir, started_at, name,
    log_path) or null.
  returned: always
  type: dict
stale_pidfile:
  description: Whether the pidfile named a process that is gone, a zombie or another process.
  returned: always
  type: bool
uptime:
  description: Seconds since the run started.
  returned: when running
  type: float
how:
  description: How the stop ended.
  returned: when a pidfile was acted on outside check mode by V(stopped) or V(restarted), or a
    stale one replaced by V(started)
  type: str
  choices: [terminated, killed, already_stopped, stale_pidfile]
seconds:
  description: Seconds the stop took.
  returned: with O(how)
  type: float
signalled:
  description: Pids that were sent SIGTERM or SIGKILL.
  returned: with O(how)
  type: list
  elements: int
processes:
  description: Pids of the run seen during the stop (process group members and descendants of
    the recorded pid, including those started after SIGTERM); none of them is left.
  returned: with O(how)
  type: list
  elements: int
previous_pid:
  description: Pid of the run V(restarted) stopped, or of the stale pidfile a start replaced.
  returned: when a pidfile existed before V(started) or V(restarted)
  type: int
pidfile_problem:
  description: Why the pidfile names no run (empty, not JSON, missing fields).
  returned: when the pidfile was unreadable
  type: str
pidfile_unsafe:
  description: Why the pidfile is not trusted (owner, mode, directory).
  returned: when it is not
  type: str
set_aside:
  description: Where an unreadable pidfile was moved.
  returned: when an unreadable pidfile was acted on
  type: str
startup_seconds:
  description: Seconds from the start until the run had lived O(startup_wait) and matched O(wait_for).
  returned: after a start
  type: float
progress:
  description: The log line that matched O(wait_for).
  returned: after a start with O(wait_for)
  type: str
log_tail:
  description: End of O(log_path) when the run died at start or did not match O(wait_for).
  returned: on start failure
  type: str
"""

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from datetime import datetime, timezone
from stat import S_IMODE, S_ISLNK, S_ISREG, S_ISVTX
from typing import NamedTuple

from ansible.module_utils.basic import AnsibleModule

PROC = "/proc"
POLL_SECONDS = 0.2
LOG_TAIL_BYTES = 4096
# How a concurrent change is named in messages (a second playbook, or an operator).
CHANGED_UNDER = "another deploy (or an operator) changed it meanwhile"


ARGUMENT_SPEC = dict(
    name=dict(type="str", required=True),
    state=dict(type="str", default="started", choices=["started", "stopped", "restarted", "status"]),
    pidfile=dict(type="path"),
    command=dict(type="list", elements="str"),
    chdir=dict(type="path"),
    environment=dict(type="dict", default={}),
    log_path=dict(type="path"),
    stop_timeout=dict(type="float", default=120),
    kill_timeout=dict(type="float", default=10),
    startup_wait=dict(type="float", default=1),
    wait_for=dict(type="str"),
    wait_timeout=dict(type="float", default=300),
    expect_pid=dict(type="int"),
    environment_file=dict(type="path"),
)


class ProcStat(NamedTuple):
    state: str
    ppid: int
    pgid: int
    start_time: int


class RunError(Exception):
    """A failure to report to the user as a message (never a traceback)."""

    def __init__(self, msg, **result):
        super().__init__(msg)
        self.result = result


# ---------------------------------------------------------------------------------------------
# /proc: pure readers (proc_root is a parameter so tests can hand them a fake tree)


def parse_stat(text):
    """The fields of /proc/<pid>/stat we use. Field 2 (the command name) may contain spaces and
    ')', so fields are counted from the last ')': field N is at index N - 3 after it."""
    rparen = text.rfind(")")
    if rparen < 0:
        return None
    fields = text[rparen + 1 :].split()
    if len(fields) < 20:
        return None
    try:
        return ProcStat(fields[0], int(fields[1]), int(fields[2]), int(fields[19]))
    except ValueError:
        return None


def read_stat(pid, proc_root=PROC):
    try:
        with open(f"{proc_root}/{pid}/stat") as stat_file:
            return parse_stat(stat_file.read())
    except OSError:  # gone between listing and reading, or never there
        return None


def process_table(proc_root=PROC):
    table = {}
    for entry in os.listdir(proc_root):
        if entry.isdigit():
            stat = read_stat(int(entry), proc_root)
            if stat is not None:
                table[int(entry)] = stat
    return table


def is_alive(stat):
    """Zombies (Z) and dead tasks (X) count as gone: they run nothing and hold no GPU."""
    return stat is not None and stat.state not in ("Z", "X", "x")


def pidfile_verdict(record, stat):
    """'live' when the recorded process still runs, else why the pidfile is stale."""
    if stat is None:
        return "dead"
    if stat.start_time != record["start_time"]:
        return "reused"
    if not is_alive(stat):
        return "zombie"
    return "live"


def self_and_ancestors(proc_root=PROC):
    """This module and the processes above it (the shell, pct exec, sshd...): never signalled,
    even if a run were started from within them."""
    protected, pid = set(), os.getpid()
    while pid > 1 and pid not in protected:
        protected.add(pid)
        stat = read_stat(pid, proc_root)
        pid = stat.ppid if stat else 0
    return protected


def run_members(table, pgid, roots, protected=frozenset()):
    """Live processes of the run, pid -> start time: the process group plus every descendant of
    the roots. A child that called setsid has left the group but is still a descendant until its
    parent dies, which is why callers snapshot before signalling and keep what they saw."""
    members = {pid: st.start_time for pid, st in table.items() if st.pgid == pgid and is_alive(st)}
    children = defaultdict(list)
    for pid, st in table.items():
        children[st.ppid].append(pid)
    pending = [pid for pid in roots if is_alive(table.get(pid))] + list(members)
    seen = set()
    while pending:
        pid = pending.pop()
        if pid in seen:
            continue
        seen.add(pid)
        for child in children.get(pid, ()):
            if is_alive(table[child]):
                members[child] = table[child].start_time
                pending.append(child)
    return {pid: start for pid, start in members.items() if pid not in protected}


def still_running(tracked, table):
    """Tracked pids that still run with the start time they had when first seen."""
    return sorted(pid for pid, start in tracked.items()
                  if is_alive(table.get(pid)) and table[pid].start_time == start)


# ---------------------------------------------------------------------------------------------
# The pidfile


class Unreadable(NamedTuple):
    """A pidfile this module cannot trust the content of: stale, never acted on."""
    problem: str


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


def unsafe_reason(file_stat, dir_stat, euid):
    """Why a pidfile must not be trusted (someone else could have written the pid in it), or None."""
    if S_ISLNK(file_stat.st_mode) or not S_ISREG(file_stat.st_mode):
        return "is not a regular file"
    if file_stat.st_uid != euid:
        return f"is owned by uid {file_stat.st_uid}, not by uid {euid} that runs this module"
    if file_stat.st_mode & 0o022:
        return f"is writable by other users (mode {S_IMODE(file_stat.st_mode):04o})"
    if dir_stat.st_mode & 0o002 and not dir_stat.st_mode & S_ISVTX:
        return f"is in a directory every user can write to (mode {S_IMODE(dir_stat.st_mode):04o})"
    return None


def load_pidfile(path):
    """(record, unsafe): record is None when there is no pidfile, Unreadable when it names
    nothing; unsafe says why the file itself cannot be trusted, or is None."""
    try:
        file_stat = os.lstat(path)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        raise RunError(f"cannot read pidfile {path}: {exc.strerror}") from None
    unsafe = unsafe_reason(file_stat, os.stat(os.path.dirname(path) or "."), os.geteuid())
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


def uptime_seconds(record, now=None):
    try:
        started = datetime.fromisoformat(record["started_at"])
    except (KeyError, TypeError, ValueError):
        return None
    now = now or datetime.now(timezone.utc)
    return round((now - started).total_seconds(), 1)


# ---------------------------------------------------------------------------------------------
# Stop


def group_is_the_runs(table, record):
    """Whether the recorded process-group id still names the run's group. The id is the leader's
    pid, which the kernel keeps while any member lives; it names another group only if a new
    process now holds that pid."""
    holder = table.get(record["pgid"])
    return holder is None or holder.start_time == record["start_time"]


class RunStopper:
    """Stops one live run: SIGTERM, wait, SIGKILL, wait, confirm that none of its processes is left.

    `tracked` maps every process of the run seen so far to its start time: a snapshot taken before
    signalling (a child that called setsid is a descendant only until its parent dies), grown at
    each poll with new group members and descendants (a helper that finishes the checkpoint)."""

    def __init__(self, record, proc_root=PROC):
        self.record = record
        self.pgid = record["pgid"]
        self.proc_root = proc_root
        self.protected = self_and_ancestors(proc_root)
        self.tracked = run_members(process_table(proc_root), self.pgid, [record["pid"]], self.protected)
        self.signalled = set()

    def send(self, sig, pids, table):
        """killpg also reaches group members forked since the table was read; escaped descendants
        get their own kill, each re-checked against its start time so a reused pid is never hit."""
        running = still_running(pids, table)
        group_running = any(table[pid].pgid == self.pgid for pid in running)
        shares_group = any(table[pid].pgid == self.pgid for pid in self.protected if pid in table)
        targets = [pid for pid in running if shares_group or table[pid].pgid != self.pgid]
        try:
            if group_running and not shares_group:
                os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass
        for pid in targets:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        self.signalled.update(running)

    def wait(self, timeout, late_signal):
        """Poll until every tracked process is gone; returns the pids still running at the deadline.
        Processes that appear meanwhile get late_signal if one is given: none while the run shuts
        down on SIGTERM, SIGKILL once it is being killed."""
        deadline = time.monotonic() + timeout
        while True:
            table = process_table(self.proc_root)
            pgid = self.pgid if group_is_the_runs(table, self.record) else None
            found = run_members(table, pgid, still_running(self.tracked, table), self.protected)
            new = {pid: start for pid, start in found.items() if pid not in self.tracked}
            self.tracked.update(new)
            if new and late_signal is not None:
                self.send(late_signal, new, table)
            running = still_running(self.tracked, table)
            if not running or time.monotonic() >= deadline:
                return running
            time.sleep(POLL_SECONDS)

    def stop(self, stop_timeout, kill_timeout):
        began = time.monotonic()
        self.send(signal.SIGTERM, self.tracked, process_table(self.proc_root))
        how = "terminated"
        left = self.wait(stop_timeout, late_signal=None)
        if left:
            how = "killed"
            self.send(signal.SIGKILL, self.tracked, process_table(self.proc_root))
            left = self.wait(kill_timeout, late_signal=signal.SIGKILL)
        summary = dict(seconds=round(time.monotonic() - began, 2), signalled=sorted(self.signalled),
                       processes=sorted(self.tracked))
        if left:
            raise RunError(f"processes {left} of run pid {self.record['pid']} survived SIGKILL for "
                           f"{kill_timeout}s (uninterruptible sleep?); the pidfile is kept", **summary)
        return dict(how=how, **summary)


# ---------------------------------------------------------------------------------------------
# Start


def resolve_program(argv0, chdir, env):
    """Where exec will find argv[0], or None: checked before anything running is touched."""
    if "/" in argv0:
        path = argv0 if os.path.isabs(argv0) else os.path.join(chdir or "/", argv0)
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    return shutil.which(argv0, path=env.get("PATH", os.defpath))


def preflight(params, env):
    """Every reason the start would fail that can be known in advance."""
    command, chdir = params["command"], params["chdir"]
    if not command or not command[0]:
        raise RunError("command must be a non-empty list (the run's argv)")
    if chdir and not os.path.isdir(chdir):
        raise RunError(f"chdir {chdir} is not a directory")
    if resolve_program(command[0], chdir, env) is None:
        raise RunError(f"cannot start run: {command[0]} is not an executable file (PATH={env.get('PATH')})")
    for path in (params["pidfile"], params["log_path"]):
        parent = os.path.dirname(path)
        if os.path.exists(parent) and not os.path.isdir(parent):
            raise RunError(f"{parent} (parent of {path}) is not a directory")


def reset_signals():
    """Runs in the child before exec: signals ignored or blocked by whatever launched Ansible
    must not make the run deaf to SIGTERM."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def spawn(argv, chdir, env, log_path):
    """Fork and exec in a new session (pgid == sid == pid), stdin from /dev/null, stdout and
    stderr appended to the log, every other descriptor closed. The module never waits for the
    run: when it exits, the run is re-parented to init, and having no controlling terminal it gets
    no SIGHUP when the connection closes."""
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        return subprocess.Popen(argv, cwd=chdir or "/", env=env, stdin=subprocess.DEVNULL, stdout=log_fd,
                                stderr=subprocess.STDOUT, close_fds=True, start_new_session=True,
                                preexec_fn=reset_signals)
    except OSError as exc:
        raise RunError(f"cannot start run {argv}: {exc}") from None
    finally:
        os.close(log_fd)


def last_lines(text, count=12):
    return "\n".join(text.rstrip("\n").splitlines()[-count:])


def log_tail(path, limit=LOG_TAIL_BYTES):
    try:
        with open(path, "rb") as log_file:
            log_file.seek(0, os.SEEK_END)
            log_file.seek(max(0, log_file.tell() - limit))
            return log_file.read().decode("utf-8", "replace")
    except OSError:
        return ""


def log_size(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


class LogWatcher:
    """Reads what a run appends to its log after `offset`, line by line, looking for `pattern`."""

    def __init__(self, path, offset, pattern):
        self.path, self.offset = path, offset
        self.pattern = re.compile(pattern) if pattern else None
        self.pending = b""
        self.match = None

    def poll(self):
        """The first line matching the pattern so far, or None."""
        if self.match is not None or self.pattern is None:
            return self.match
        try:
            with open(self.path, "rb") as log_file:
                log_file.seek(self.offset)
                chunk = log_file.read()
        except OSError:
            return None
        self.offset += len(chunk)
        lines = (self.pending + chunk).split(b"\n")
        self.pending = lines.pop()
        for line in lines:
            text = line.decode("utf-8", "replace")
            if self.pattern.search(text):
                self.match = text
                break
        return self.match


def start_run(params, env):
    """Spawn the run and write its pidfile; then wait until it has lived `startup_wait` seconds
    and, with `wait_for`, until its log shows a matching line (at most `wait_timeout` seconds)."""
    for path in (params["pidfile"], params["log_path"]):
        os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    began = time.monotonic()
    watcher = LogWatcher(params["log_path"], log_size(params["log_path"]), params["wait_for"])
    child = spawn(params["command"], params["chdir"], env, params["log_path"])
    # Until poll() reaps it the child keeps its /proc entry, even if it has already exited.
    stat = read_stat(child.pid)
    record = dict(name=params["name"], pid=child.pid, pgid=child.pid, start_time=stat.start_time,
                  argv=params["command"], chdir=params["chdir"], log_path=params["log_path"],
                  started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    # Written before the waits so that a module killed during them leaves the run findable.
    write_pidfile(params["pidfile"], record)
    alive_until = began + params["startup_wait"]
    give_up = began + max(params["startup_wait"], params["wait_timeout"] if watcher.pattern else 0)
    while child.poll() is None:
        now = time.monotonic()
        if now >= alive_until and (watcher.poll() is not None or watcher.pattern is None):
            break
        if now >= give_up:
            tail = log_tail(params["log_path"])
            raise RunError(f"run pid {child.pid} logged nothing matching {params['wait_for']!r} within "
                           f"{params['wait_timeout']}s; it is left running. Its log ({params['log_path']}) "
                           f"ends with:\n{last_lines(tail)}", log_tail=tail, **running_result(record))
        time.sleep(POLL_SECONDS / 2)
    if child.returncode is not None:
        remove_file(params["pidfile"])
        tail = log_tail(params["log_path"])
        raise RunError(f"run exited with code {child.returncode} {time.monotonic() - began:.1f}s after "
                       f"starting. Its log ({params['log_path']}) ends with:\n{last_lines(tail)}",
                       log_tail=tail)
    return record, dict(startup_seconds=round(time.monotonic() - began, 2), log_offset=watcher.offset,
                        progress=watcher.match)


# ---------------------------------------------------------------------------------------------
# The module


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


def check_expected(params, record, verdict):
    """Optimistic concurrency: `expect_pid` is the run this play inspected (0: none). A live run with
    another pid means somebody else started one since; nothing may be signalled or started."""
    expected = params["expect_pid"]
    if expected is None:
        return
    if verdict == "absent" and expected:
        # Only a stop removes a pidfile (a run that dies leaves a stale one): somebody stopped it.
        raise RunError(f"run {params['name']} changed under this deploy: expected pid {expected}, but its "
                       f"pidfile {params['pidfile']} is gone: {CHANGED_UNDER}. Nothing was signalled or "
                       f"started; rerun to act on the run as it is now.")
    if verdict != "live" or record["pid"] == expected:
        return
    what = f"pid {expected}" if expected else "no run"
    raise RunError(f"run {params['name']} changed under this deploy: expected {what}, found a live run "
                   f"({describe(record)}): {CHANGED_UNDER}. Nothing was signalled or started; rerun to act "
                   f"on the run as it is now.", **running_result(record))


def do_stop(module, record, verdict):
    """Stop what the pidfile names; returns the result fields."""
    params = module.params
    pidfile = params["pidfile"]
    if verdict == "absent":
        return dict(changed=False, how="already_stopped", seconds=0.0, signalled=[], processes=[], pid=None,
                    msg=f"no pidfile {pidfile}: nothing to stop")
    if verdict == "unreadable":
        aside = None if module.check_mode else set_aside(pidfile)
        return dict(changed=True, how="stale_pidfile", seconds=0.0, signalled=[], processes=[], pid=None,
                    pidfile_problem=record.problem, set_aside=aside,
                    msg=f"stale pidfile {pidfile}: {describe(record)}; nothing signalled, kept as {aside}")
    if verdict != "live":
        msg = f"stale pidfile {pidfile} ({verdict}: {describe(record)}) removed, nothing signalled"
        if not module.check_mode:
            remove_file(pidfile)
        return dict(changed=True, how="stale_pidfile", seconds=0.0, signalled=[], processes=[],
                    pid=record["pid"], msg=msg)
    if module.check_mode:
        return dict(changed=True, pid=record["pid"], msg=f"would stop {describe(record)}")
    stopped = RunStopper(record).stop(params["stop_timeout"], params["kill_timeout"])
    remove_file(pidfile)
    return dict(changed=True, pid=record["pid"], msg=f"stopped {describe(record)}: {stopped['how']}",
                **stopped)


def apply_state(module, env):
    params = module.params
    state = params["state"]
    record, verdict, unsafe = inspect(params["pidfile"])

    if state == "status":
        extra = {"pidfile_unsafe": unsafe} if unsafe else {}
        if verdict == "live":
            return running_result(record, changed=False, msg=f"running: {describe(record)}", **extra)
        return stopped_result(record, verdict, changed=False, msg=f"stopped ({verdict} pidfile)", **extra)

    if unsafe:
        raise RunError(f"pidfile {params['pidfile']} {unsafe}: anyone able to write it could name any "
                       f"process, so it is not trusted and nothing was signalled or started. Check who "
                       f"changed it, then make it root-owned and not writable by others (chmod 0644) or "
                       f"remove it.", pidfile_unsafe=unsafe)
    check_expected(params, record, verdict)

    if state == "stopped":
        result = stopped_result(record, verdict)
        result.update(do_stop(module, record, verdict))
        return result

    preflight(params, env)
    if state == "started" and verdict == "live":
        if record.get("argv") == params["command"]:
            return running_result(record, changed=False, msg=f"already running: {describe(record)}")
        raise RunError(f"pidfile {params['pidfile']} is held by a live run with another command: "
                       f"{describe(record)}; use state=restarted to replace it", **running_result(record))
    result = {}
    if verdict != "absent":  # restarted with a live run, or any stale pidfile
        result.update(do_stop(module, record, verdict))
        result["previous_pid"] = result.pop("pid")
        result["stop_msg"] = result.pop("msg")
    if module.check_mode:
        result.update(stopped_result(record, verdict, changed=True, msg=f"would start {params['command']}"))
        return result
    new_record, startup = start_run(params, env)
    msg = f"started {describe(new_record)}"
    if "stop_msg" in result:
        msg = f"{result['stop_msg']}; {msg}"
    result.update(running_result(new_record, changed=True, msg=msg, **startup))
    result["stale_pidfile"] = verdict not in ("absent", "live")
    return result


def read_environment_file(path):
    """KEY=VALUE lines (blank lines and # comments skipped) of a file only its owner can read:
    the secrets of a run never pass through the module's arguments or its result."""
    file_stat = os.stat(path)
    if file_stat.st_uid != os.geteuid() or file_stat.st_mode & 0o077:
        raise RunError(f"environment_file {path} must be owned by uid {os.geteuid()} and readable by it "
                       f"alone (mode {S_IMODE(file_stat.st_mode):04o}); chmod 0600 it")
    values = {}
    with open(path) as env_file:
        for number, line in enumerate(env_file, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep or not key.replace("_", "a").isalnum() or key[0].isdigit():
                raise RunError(f"environment_file {path} line {number} is not KEY=VALUE")
            values[key] = value
    return values


@contextmanager
def pidfile_lock(pidfile, enabled):
    """Serialises invocations that may change the pidfile; the lock file stays (removing it would
    let two invocations lock two different files)."""
    if not enabled:
        yield
        return
    os.makedirs(os.path.dirname(pidfile) or ".", mode=0o755, exist_ok=True)
    lock_fd = os.open(pidfile + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(lock_fd)


def main():
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
        required_if=[("state", "started", ["command"]), ("state", "restarted", ["command"])],
        supports_check_mode=True,
    )
    params = module.params
    name = params["name"]
    if not name or "/" in name or name.startswith("."):
        module.fail_json(msg=f"name {name!r} must be a plain file name (no '/', not starting with '.')")
    for key in ("stop_timeout", "kill_timeout", "startup_wait", "wait_timeout"):
        if params[key] < 0:
            module.fail_json(msg=f"{key} must be >= 0, got {params[key]}")
    if params["expect_pid"] is not None and params["expect_pid"] < 0:
        module.fail_json(msg=f"expect_pid must be a pid or 0 (no run), got {params['expect_pid']}")
    if params["wait_for"]:
        try:
            re.compile(params["wait_for"])
        except re.error as exc:
            module.fail_json(msg=f"wait_for is not a regular expression: {exc}")
    params["pidfile"] = params["pidfile"] or f"/var/lib/dflash/{name}.pid"
    params["log_path"] = params["log_path"] or f"/var/log/dflash/{name}.log"
    env = dict(os.environ)
    env.update({key: str(value) for key, value in params["environment"].items()})

    result = dict(name=name, pidfile=params["pidfile"])
    try:
        if params["environment_file"] and params["state"] in ("started", "restarted"):
            env.update(read_environment_file(params["environment_file"]))
        with pidfile_lock(params["pidfile"], enabled=params["state"] != "status" and not module.check_mode):
            result.update(apply_state(module, env))
    except RunError as exc:
        result.update(exc.result)
        module.fail_json(msg=str(exc), **result)
    except OSError as exc:
        module.fail_json(msg=f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
