# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# Targets may run a Python older than 3.11 (no datetime.UTC).
# ruff: noqa: UP017
"""Starting a run: checks made before anything running is touched, a detached spawn in its own session
(as the run's user when it has one: its groups, gid and uid set in the child before the exec), the
pidfile written at once, and the wait for the run's first progress line in its log."""

from __future__ import annotations

import glob
import grp
import os
import pwd
import re
import shutil
import signal
import subprocess
import time
from datetime import datetime, timezone
from stat import S_IMODE, S_ISCHR, S_ISDIR

from ansible_collections.dflash.ops.plugins.module_utils.run_pidfile import (
    NOTHING_DONE,
    RunError,
    remove_file,
    running_result,
    write_pidfile,
)
from ansible_collections.dflash.ops.plugins.module_utils.run_proc import read_stat
from ansible_collections.dflash.ops.plugins.module_utils.run_stop import POLL_SECONDS
from ansible_collections.dflash.ops.plugins.module_utils.safe_paths import (
    UnsafePath,
    open_directory,
    open_file,
    path_problem,
    program_problem,
    refusal,
    tree_problem,
    venv_import_directories,
    venv_problem,
)

LOG_TAIL_BYTES = 4096
# A wait's progress: the log's last line, read from at most this many of its last bytes.
PROGRESS_BYTES = 4096


def resolve_program(argv0, chdir, env):
    """Where exec will find argv[0], or None: checked before anything running is touched."""
    if "/" in argv0:
        path = argv0 if os.path.isabs(argv0) else os.path.join(chdir or "/", argv0)
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    return shutil.which(argv0, path=env.get("PATH", os.defpath))


def run_identity(user):
    """Who the run runs as when `user` is set (its uid, gid, the groups initgroups(3) would give it, its
    home and shell), or None (the module's own user, root). Raises RunError for a user the container does
    not have, or for root by name."""
    if not user:
        return None
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise RunError(f"cannot start run as user {user!r}: the container has no such user (the dflash_run "
                       f"role creates dflash_run_user): {NOTHING_DONE}") from None
    if entry.pw_uid == 0:
        raise RunError(f"user {user!r} is uid 0: leave user unset to run as root: {NOTHING_DONE}")
    return {"name": entry.pw_name, "uid": entry.pw_uid, "gid": entry.pw_gid,
            "groups": sorted(set(os.getgrouplist(entry.pw_name, entry.pw_gid))),
            "home": entry.pw_dir, "shell": entry.pw_shell or "/bin/sh"}


def drop_privileges(identity):
    """Runs in the child before exec: the run's groups, then its gid, then its uid (real, effective and
    saved: root's cannot come back). The order matters: once the uid is not root's, groups cannot change."""
    os.setgroups(identity["groups"])
    os.setgid(identity["gid"])
    os.setuid(identity["uid"])


def own_directories(paths, identity):
    """Make each directory of `paths` (created when missing) and what root owns in it the run's user's:
    the output directory of a run that ran as root holds root's checkpoints, which the user must replace.
    Runs after the stop and before the start. Never through a symbolic link (each name changed itself), and
    a file with more than one name is left as it is (another name of it may be outside). Returns the paths
    it changed."""
    changed = []
    for path in paths:
        os.makedirs(path, mode=0o750, exist_ok=True)  # the run's own: no other user reads its weights
        try:
            top = open_directory(path, owner=identity["uid"])
        except UnsafePath as exc:
            raise RunError(refusal("user_directories", path, exc.reason, NOTHING_DONE)) from None
        try:
            count = 0
            if os.fstat(top).st_uid == 0:
                os.fchown(top, identity["uid"], identity["gid"])
                count += 1
            for _path, dirs, files, dir_fd in os.fwalk(".", dir_fd=top):
                for name in dirs + files:
                    info = os.lstat(name, dir_fd=dir_fd)
                    if info.st_uid == 0 and (S_ISDIR(info.st_mode) or info.st_nlink == 1):
                        os.chown(name, identity["uid"], identity["gid"], dir_fd=dir_fd, follow_symlinks=False)
                        count += 1
            if count:
                changed.append(path)
        finally:
            os.close(top)
    return changed


# The NVIDIA device files a container gets through its devN: entries (the GPUs, nvidiactl, nvidia-uvm,
# nvidia-uvm-tools, the MIG capabilities).
GPU_DEVICES = ("/dev/nvidia*", "/dev/nvidia-caps/*")


def may_use(info, identity, wanted=0o6):
    """Whether `identity` has the `wanted` permission bits (read 4, write 2, execute 1) on the file of stat
    `info`: its owner's, group's or others' bits, as the kernel picks them."""
    mode = S_IMODE(info.st_mode)
    if info.st_uid == identity["uid"]:
        bits = mode >> 6
    elif info.st_gid in identity["groups"]:
        bits = mode >> 3
    else:
        bits = mode
    return bits & wanted == wanted


def reach_refusal(identity, program, interpreter, chdir):
    """Why the run's user could not run what the start checked (run.sh it must read and execute, the
    interpreter it execs, the working directory, and the directories a venv interpreter imports from: its
    site-packages and those its .pth files name, which it must read and enter), as the refusal message, or
    None: found before anything is stopped, not by a successor that fails after the stop."""
    wanted = [(program, 0o5), (chdir or "/", 0o1)] + [(path, 0o1) for path in interpreters(interpreter)]
    wanted += [(directory, 0o5) for path in interpreters(interpreter)
               for directory in venv_import_directories(path)]
    return _path_refusal(identity, wanted, "or build the venv on a python the user can run")


def read_refusal(identity, paths):
    """Why the run's user could not read what its run reads (`paths`: the model, the data; a directory
    and each file directly in it), as the refusal message, or None. A path that is not there is left to
    the release's validation, which names it."""
    wanted = []
    for path in paths:
        if os.path.isdir(path):
            wanted.append((path, 0o5))
            wanted += [(entry.path, 0o4) for entry in sorted(os.scandir(path), key=lambda e: e.name)
                       if entry.is_file()]
        elif os.path.exists(path):
            wanted.append((path, 0o4))
    return _path_refusal(identity, wanted, "or give the files to a group the user is in")


def _path_refusal(identity, wanted, otherwise):
    """The first of `wanted` ((path, permission bits)) the user may not use, or a directory on the way to
    it (through each symbolic link's directory too) that it may not enter, as the refusal message."""
    for path, bits in wanted:
        real = os.path.realpath(path)
        hops = [os.path.abspath(path)]
        while os.path.islink(hops[-1]) and len(hops) < 40:  # each link's directory is passed through too
            hops.append(os.path.normpath(os.path.join(os.path.dirname(hops[-1]), os.readlink(hops[-1]))))
        parents = set()
        for name in hops + [real]:
            while name != "/":
                name = os.path.dirname(name)
                parents.add(name)
        for what, needed in [(real, bits)] + [(parent, 0o1) for parent in sorted(parents)]:
            mode = os.stat(what).st_mode
            if not may_use(os.stat(what), identity, needed):
                doing = "enter" if what != real else PERMISSION_WORDS[needed, S_ISDIR(os.stat(real).st_mode)]
                return (f"cannot start run as user {identity['name']}: it may not {doing} {what} (mode "
                        f"{S_IMODE(mode):04o}), on the way to {path}: {NOTHING_DONE}. Make it readable and "
                        f"searchable by other users (chmod o+rx), {otherwise}.")
    return None


# What a refusal says the user may not do with a file (or a directory), by the permission bits it lacks.
PERMISSION_WORDS = {(0o5, False): "read and run", (0o4, False): "read", (0o1, False): "run",
                    (0o5, True): "list and enter", (0o4, True): "list", (0o1, True): "enter"}


def device_refusal(identity, patterns=GPU_DEVICES):
    """Why the run's user cannot reach the container's GPUs (a /dev/nvidia* device it may not read and
    write), as the refusal message, or None."""
    for path in sorted(p for pattern in patterns for p in glob.glob(pattern)):
        try:
            info = os.stat(path)
        except OSError:
            continue
        if S_ISCHR(info.st_mode) and not may_use(info, identity):
            mode = S_IMODE(info.st_mode)
            return (f"cannot start run as user {identity['name']}: it may not read and write {path} "
                    f"(owner uid {info.st_uid}, group gid {info.st_gid}, mode {mode:04o}; its groups "
                    f"{identity['groups']}): {NOTHING_DONE}. Pass the GPUs through with a group it is in "
                    f"(the node's container config: devN: {path},gid=<gid>,mode=0660) and make the user a "
                    f"member of that group (dflash_run_gpu_group).")
    return None


def preflight(params, env):
    """Every reason the start would fail that can be known in advance."""
    command, chdir = params["command"], params["chdir"]
    if not command or not command[0]:
        raise RunError("command must be a non-empty list (the run's argv)")
    identity = run_identity(params.get("user"))
    if identity:
        refused = device_refusal(identity)
        if refused:
            raise RunError(refused)
    if chdir and not os.path.isdir(chdir):
        raise RunError(f"chdir {chdir} is not a directory")
    program = resolve_program(command[0], chdir, env)
    if program is None:
        raise RunError(f"cannot start run: {command[0]} is not an executable file (PATH={env.get('PATH')})")
    refused = program_refusal(program, chdir, params.get("interpreter")) or \
        (identity and reach_refusal(identity, program, params.get("interpreter"), chdir)) or \
        (identity and read_refusal(identity, params.get("user_reads") or []))
    if refused:
        raise RunError(refused)
    for path in (params["pidfile"], params["log_path"]):
        parent = os.path.dirname(path)
        if os.path.exists(parent) and not os.path.isdir(parent):
            raise RunError(f"{parent} (parent of {path}) is not a directory")
    refused = log_refusal(params["log_path"])
    if refused:
        raise RunError(refused)
    output_gid(params.get("output_group"))


def interpreters(interpreter):
    """The interpreters of the module's `interpreter` (a list; a start file of an earlier release holds
    one path)."""
    return [interpreter] if isinstance(interpreter, str) else list(interpreter or [])


def program_refusal(program, chdir, interpreter=None):
    """Why what the run executes must not be run, as the refusal message, or None: the program (run.sh)
    and the interpreters it execs (the release's venv python, an engine's venv python) must be this user's
    (root's) and writable by nobody else, as must every directory on their way, what a venv's interpreter
    reads at its start (safe_paths.venv_problem: pyvenv.cfg, site-packages, its .pth files) and, when the
    program is in the run's working directory (run.sh in its release), every file of that tree (the code
    it imports). Whoever could change one of them could run code of their own as root, or as the run's
    user when it has one: that user may not change what it runs either."""
    checks = [("command", program, program_problem(program) or venv_problem(program))]  # a venv's python too
    release = os.path.abspath(chdir or "/")
    if chdir and os.path.commonpath([os.path.abspath(program), release]) == release:
        checks.append(("release tree", chdir, tree_problem(chdir)))
    for path in interpreters(interpreter):
        checks.append(("interpreter", path, program_problem(path) or venv_problem(path)))
    for what, path, problem in checks:
        if problem:
            return (f"cannot start run: {what} {path}: {problem}. It runs as uid {os.geteuid()}, so whoever "
                    f"could change it could run code of their own as that user: {NOTHING_DONE}. Check who "
                    f"changed it, then make it and every directory above it owned by uid {os.geteuid()} and "
                    f"writable by it alone (chown {os.geteuid()}; chmod go-w), or deploy the release again.")
    return None


def log_refusal(log_path):
    """Why a start would refuse the log (a symbolic link, another user's, writable by others), as the
    refusal message, or None; nothing is created. A role asks it through V(status) before it stops a run."""
    problem = path_problem(log_path)
    return refusal("log_path", log_path, problem, NOTHING_DONE) if problem else None


def reset_signals():
    """Runs in the child before exec: signals ignored or blocked by whatever launched Ansible
    must not make the run deaf to SIGTERM."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


# The run's log: its owner's (root's) and its group's alone; the output group's when it has one.
LOG_MODE = 0o640
OUTPUT_GROUP_ENV = "DFLASH_OUTPUT_GROUP"  # the trainer's (dflash_ops/core/runtime.py)


def output_gid(group):
    """The gid of `group` (a name or a gid), or None for none; RunError when the container has no such
    group (before anything is stopped)."""
    if not group:
        return None
    if str(group).isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise RunError(f"output_group {group!r} is not a group of the container: create it (groupadd) or "
                       f"unset dflash_run_output_group: {NOTHING_DONE}") from None


def spawn(argv, chdir, env, log_path, identity=None, gid=None):
    """Fork and exec in a new session (pgid == sid == pid), stdin from /dev/null, stdout and
    stderr appended to the log, every other descriptor closed; with `identity`, as that user
    (drop_privileges, after setsid, before the exec). The log is opened here, by the module's user, and
    made LOG_MODE (an earlier release's 0644 log too), group `gid` when given: the run writes it through
    that descriptor. The module never waits for the run: when it exits, the run is re-parented to init,
    and having no controlling terminal it gets no SIGHUP when the connection closes."""
    try:
        log_fd = open_file(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, LOG_MODE)
    except UnsafePath as exc:
        raise RunError(refusal("log_path", log_path, exc.reason, NOTHING_DONE)) from None
    os.fchown(log_fd, -1, os.getegid() if gid is None else gid)  # an output group unset shares it no more
    os.fchmod(log_fd, LOG_MODE)

    def before_exec():
        reset_signals()
        if identity:
            drop_privileges(identity)

    try:
        return subprocess.Popen(argv, cwd=chdir or "/", env=env, stdin=subprocess.DEVNULL, stdout=log_fd,
                                stderr=subprocess.STDOUT, close_fds=True, start_new_session=True,
                                preexec_fn=before_exec)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RunError(f"cannot start run {argv}: {exc}") from None
    finally:
        os.close(log_fd)


def last_lines(text, count=12):
    return "\n".join(text.rstrip("\n").splitlines()[-count:])


def read_log(path):
    """The run's log opened for reading, never through a symbolic link (UnsafePath otherwise)."""
    return os.fdopen(open_file(path), "rb")


def log_tail(path, limit=LOG_TAIL_BYTES):
    """The end of the log; empty when it cannot be read or is not trusted (shown, never followed)."""
    try:
        with read_log(path) as log_file:
            log_file.seek(0, os.SEEK_END)
            log_file.seek(max(0, log_file.tell() - limit))
            return log_file.read().decode("utf-8", "replace")
    except (OSError, UnsafePath):
        return ""


def last_log_line(path):
    """The log's last line (how far the run got, for a wait that reports), or '' when there is none."""
    return last_lines(log_tail(path, limit=PROGRESS_BYTES), count=1)


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
            with read_log(self.path) as log_file:
                log_file.seek(self.offset)
                chunk = log_file.read()
        except (OSError, UnsafePath):
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

    @property
    def line_offset(self):
        """Where the first line not yet read whole starts: a later watcher resumes from here."""
        return self.offset - len(self.pending)


def start_run(params, env):
    """Spawn the run and write its pidfile; then wait until it has lived `startup_wait` seconds
    and, with `wait_for`, until its log shows a matching line (at most `wait_timeout` seconds). With
    `wait_return_after`, a live run that has not matched by then is returned unmatched (`matched` false,
    `log_offset` where a status with `wait_for` goes on looking)."""
    for path in (params["pidfile"], params["log_path"]):
        os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    identity = run_identity(params.get("user"))
    gid = output_gid(params.get("output_group"))
    if gid is not None:  # the trainer shares its outputs with that group (dflash_ops/core/runtime.py)
        env = dict(env, **{OUTPUT_GROUP_ENV: str(gid)})
    began = time.monotonic()
    watcher = LogWatcher(params["log_path"], log_size(params["log_path"]), params["wait_for"])
    child = spawn(params["command"], params["chdir"], env, params["log_path"], identity, gid)
    # Until poll() reaps it the child keeps its /proc entry, even if it has already exited.
    stat = read_stat(child.pid)
    record = dict(name=params["name"], pid=child.pid, pgid=child.pid, start_time=stat.start_time,
                  argv=params["command"], chdir=params["chdir"], log_path=params["log_path"],
                  started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    if identity:  # the pidfile stays root's; the run's user is recorded (a change of user restarts it)
        record.update(user=identity["name"], uid=identity["uid"])
    if params.get("started_by"):  # who started it, when not a deploy (run_resume: the container's boot)
        record["started_by"] = params["started_by"]
    # Written before the waits so that a module killed during them leaves the run findable.
    write_pidfile(params["pidfile"], record)
    alive_until = began + params["startup_wait"]
    give_up = began + max(params["startup_wait"], params["wait_timeout"] if watcher.pattern else 0)
    hand_over = began + max(params["startup_wait"], params.get("wait_return_after") or 0)
    while child.poll() is None:
        now = time.monotonic()
        if now >= alive_until and (watcher.poll() is not None or watcher.pattern is None):
            break
        if params.get("wait_return_after") and now >= hand_over and now < give_up:
            break  # still unmatched: the caller polls a status with wait_for from log_offset
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
    return record, dict(startup_seconds=round(time.monotonic() - began, 2), log_offset=watcher.line_offset,
                        progress=watcher.match, matched=watcher.pattern is None or watcher.match is not None)


def log_match(path, offset, pattern):
    """The first line of the log at `path` after byte `offset` that matches `pattern`, or None."""
    return LogWatcher(path, offset, pattern).poll()


RUN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def base_environment(user=None):
    """The environment every run starts from, whatever the module was started with: `pct exec` passes
    the node session's environment into the container (lxc-attach --keep-env), with PATH as pct
    forces it (/sbin:/bin:/usr/sbin:/usr/bin). HOME, USER, LOGNAME and SHELL are the run's user's (`user`,
    when set), else the module's user's."""
    identity = run_identity(user)
    if identity is None:
        entry = pwd.getpwuid(os.geteuid())
        identity = {"name": entry.pw_name, "home": entry.pw_dir, "shell": entry.pw_shell or "/bin/sh"}
    return {"PATH": RUN_PATH, "HOME": identity["home"], "USER": identity["name"], "LOGNAME": identity["name"],
            "SHELL": identity["shell"], "LANG": "C.UTF-8"}


def read_environment_file(path, user=None):
    """KEY=VALUE lines (blank lines and # comments skipped) of a file only its owner can read, root or the
    run's user (`user`): the secrets of a run never pass through the module's arguments or its result."""
    identity = run_identity(user)
    owner = identity["uid"] if identity else None
    try:
        fd = open_file(path, private=True, owner=owner)
    except UnsafePath as exc:
        whose = f"uid {os.geteuid()}" + (f" or by {identity['name']} (uid {owner})" if identity else "")
        private = f" It must be owned by {whose} and readable by its owner alone: chmod 0600 it."
        raise RunError(refusal("environment_file", path, exc.reason, NOTHING_DONE) + private) from None
    values = {}
    with os.fdopen(fd) as env_file:
        for number, line in enumerate(env_file, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep or not key.replace("_", "a").isalnum() or key[0].isdigit():
                raise RunError(f"environment_file {path} line {number} is not KEY=VALUE")
            values[key] = value
    return values


def remove_private_file(path):
    """Remove the secrets file `path` if it is there (the name itself, never what a link names, in its
    directory reached as safe_paths walks it); whether it was there."""
    directory, name = os.path.split(path)
    try:
        dir_fd = open_directory(directory)
    except FileNotFoundError:
        return False
    except UnsafePath as exc:
        reason = f"is in {directory}: {exc}"
        raise RunError(refusal("stale_environment_file", path, reason, NOTHING_DONE)) from None
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(dir_fd)
