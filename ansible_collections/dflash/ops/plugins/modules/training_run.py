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
version_added: "0.3.0"
author: dflash-ops contributors (@dflash-ops)
extends_documentation_fragment:
  - dflash.ops.attributes
attributes:
  check_mode:
    support: full
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
      - V(checked) runs the checks of a V(restarted) start (the program and its venv, the run's user and
        what it reads, the log, O(free_ports), O(expect_pid)) and changes nothing. A run across
        containers checks every member so before it stops any.
    type: str
    choices: [started, restarted, checked, stopped, status]
    default: started
  free_ports:
    description:
      - TCP ports the run will listen on (the rendezvous of a run across containers, on its first
        member). A start fails before anything is stopped when a process other than the run it replaces
        listens on one, on any address (torch's TCPStore binds the wildcard).
    type: list
    elements: int
    default: []
  pidfile:
    description: Path of the pidfile. Defaults to C(/var/lib/dflash/<name>.pid).
    type: path
  command:
    description:
      - The argv of the run (no shell). Required for V(started) and V(restarted). A relative
        program path is resolved against O(chdir), a bare name in the run's C(PATH).
    type: list
    elements: str
  interpreter:
    description:
      - The programs the command execs (the release's venv C(python) that C(run.sh) execs, an engine's venv
        C(python) it starts), checked as the command is before the start (and the boot's start again). Each,
        the command, every directory on their way and, when the command is in O(chdir), every file under
        O(chdir) must be owned by the user the module runs as and writable by it alone, or nothing is
        stopped or started.
      - For a venv's interpreter, so must what it reads at its start - its C(pyvenv.cfg), each
        C(site-packages) and every entry directly in it (the C(.pth) files whose import lines C(site) runs),
        and each directory a C(.pth) file puts on the path; a venv with the system's site-packages is refused.
    type: list
    elements: path
  user:
    description:
      - The user the run runs as (an existing unprivileged user of the container). The child sets the
        groups C(initgroups) would give it, then its gid, then its uid, after it left the module's session
        and before it execs O(command); C(HOME), C(USER), C(LOGNAME) and C(SHELL) are that user's.
      - What stays the module's (root's) - the pidfile, its lock, the log (opened by the module, written by
        the run through its descriptor), the checks of O(command), O(interpreter) and the release - is
        unchanged, so the user can change none of what it runs. O(environment_file) may be that user's.
      - Before anything is stopped the start fails if the user does not exist, or if it may not read and
        write a C(/dev/nvidia*) device of the container (the GPU passthrough's C(gid=) and C(mode=)).
      - A live run started as another user counts as another run for V(started).
      - Unset, the run runs as the module's user.
    type: str
  user_directories:
    description:
      - With O(user), directories that are the run's own (its output directory, its checkpoints), created
        when missing, and each of them and whatever root owns in it made that user's, after the stop and
        before the start, under the run's lock (a run that ran as root leaves root's checkpoints). Symbolic
        links are changed themselves, never followed; a file with more than one link is left as it is.
    type: list
    elements: path
    default: []
  user_reads:
    description:
      - With O(user), what the run reads (the target model's directory, the data). Before anything is
        stopped the start fails if that user may not read each file (a directory's files, not below it)
        or enter each directory on its way. A model written C(0600) by root would otherwise stop the good
        run and fail its successor once it opens the weights. A path that is not there is not checked.
    type: list
    elements: path
    default: []
  output_group:
    description:
      - A group of the container (a name or a gid) the run's outputs are shared with. The log is made that
        group's, mode 0640 (without it, root's group's, 0640), and the run gets C(DFLASH_OUTPUT_GROUP), so the
        trainer makes its output directory, checkpoints, exports, C(metrics.jsonl) and C(status.json) that
        group's and readable by it (0750 directories, setgid; 0640 files). With O(user), that user must be
        a member. Unset, no other user may read any of them. A group the container does not have fails
        the start before anything is stopped.
    type: str
  chdir:
    description: Working directory of the run. Defaults to C(/) (never the module's temporary
      directory, which Ansible removes).
    type: path
  environment:
    description:
      - Variables of the run's environment, on top of a fixed base (C(PATH) with C(/usr/local/bin), the
        user's C(HOME), C(USER), C(LOGNAME), C(SHELL), C(LANG=C.UTF-8)). Nothing else of the
        module's own environment reaches the run; through C(pct exec) that is the node session's
        (C(SSH_*), C(SUDO_*), its C(LANG), a C(PATH) without C(/usr/local/bin)).
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
  wait_return_after:
    description:
      - With O(wait_for), a start returns after this many seconds if the run lives and has not matched yet,
        with RV(matched) false and RV(log_offset), instead of waiting the whole O(wait_timeout) in one call;
        the caller then polls V(status) with the same O(wait_for) and O(log_offset), a task that says how
        far the run got at each retry. V(0) (default) waits the whole O(wait_timeout) in the call.
    type: float
    default: 0
  log_offset:
    description:
      - With V(status) and O(wait_for), where in O(log_path) to look from (a start's RV(log_offset)); the
        result's RV(matched) says whether a line after it matches O(wait_for).
    type: int
  async_results_file:
    description:
      - With V(status), the C(results_file) of a call of this module run as an Ansible async job (C(async),
        C(poll=0)). The call waits in the target up to O(wait_return_after) seconds (V(0), until the job
        ends) and returns as soon as the job ends, with that call's own result (and RV(finished) true;
        failing with its message if it failed); the job file is then removed. While the job runs it
        returns RV(finished) false, what the job's call is doing (RV(waiting_for)) and the last line of
        O(log_path) (RV(progress)), for a task that polls it until RV(finished).
      - A call that changes the run says what it is doing in C(<pidfile>.phase) while it holds the run's
        lock (stopping pid N, waiting for O(idle_gpus) to be idle, starting).
    type: path
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
        be owned by the module's user (or O(user)) and readable by its owner alone (mode 0600).
    type: path
  stale_environment_file:
    description:
      - A secrets file this start no longer uses (the run's secrets were emptied), removed right before
        V(started) or V(restarted) starts the run (never through a symbolic link), so no secret stays
        behind; RV(removed_environment_file) says so.
    type: path
  idle_gpus:
    description:
      - Indices of the GPUs the run uses. Before V(started) or V(restarted) starts the run (after the
        stop, for V(restarted)), the module waits until C(nvidia-smi) shows each of them idle (no compute
        process, at most O(idle_max_memory_mib) used), in the same call and under the pidfile's lock, so
        no other invocation can start a run meanwhile. If they stay busy for O(idle_timeout) seconds,
        nothing is started and the module fails with a table of what it saw. C(nvidia-smi) must exist
        before anything is stopped. Without it (or empty) no GPU is checked.
    type: list
    elements: int
  idle_max_memory_mib:
    description: GPU memory used (MiB) that still counts as idle for O(idle_gpus).
    type: int
    default: 100
  idle_timeout:
    description: Seconds O(idle_gpus) may take to become idle.
    type: float
    default: 60
  boot:
    description:
      - When set, a V(started) or V(restarted) call that leaves the run running (started now, or found
        running) also ensures that the container's boot starts the run again if it is live when the
        container stops, in the same call. It writes the run's start file
        C(<pidfile dir>/<name>.boot.json) (root, 0600, this call's arguments), C(dflash-resume.pyz) (the
        collection's C(run_resume), packed in the container from this module's own payload) and
        C(dflash-resume.service), enabled in C(multi-user.target). Each is written only when its bytes
        change (RV(boot)); a changed unit under a running systemd is followed by C(systemctl daemon-reload).
      - Nothing of it is written when the start fails.
    type: dict
    suboptions:
      python:
        description: The container's python3 that runs C(dflash-resume.pyz) at boot.
        type: path
        default: /usr/bin/python3
      status_file:
        description: The run's C(status.json); the boot starts the run again only when it says the run
          did not end by itself.
        type: path
      program:
        description: Where C(dflash-resume.pyz) goes.
        type: path
        default: /usr/local/lib/dflash-resume.pyz
      unit_dir:
        description: Where C(dflash-resume.service) goes (and its link, under C(multi-user.target.wants)).
        type: path
        default: /etc/systemd/system
notes:
  - The run gets stdin from C(/dev/null) and no other inherited descriptor, in its own session,
    so closing the connection (C(ssh), C(pct exec)) neither signals it nor waits for it.
  - A lock file C(<pidfile>.lock), root's alone (0600), serialises concurrent invocations on the same
    pidfile. An invocation waits for it at most as long as its own waits (O(stop_timeout), O(kill_timeout),
    O(idle_timeout), O(startup_wait), O(wait_timeout)) and a minute, then fails naming the holder's pid.
  - O(async_results_file) reads the job file of Ansible's async wrapper as M(ansible.builtin.async_status)
    does, and removes it as its V(cleanup) mode does, once it has read the job's end.
"""

EXAMPLES = r"""
- name: Ensure the training run is started.
  dflash.ops.training_run:
    name: main
    command: [/opt/dflash/current/run.sh]
    chdir: /opt/dflash/current
    environment:
      CUDA_VISIBLE_DEVICES: "0,1"

- name: Restart the run if it is still the one inspected, and wait for its first step.
  dflash.ops.training_run:
    name: main
    state: restarted
    command: [/opt/dflash/current/run.sh]
    expect_pid: "{{ inspected.pid or 0 }}"
    wait_for: '"event": *"step"'
    environment_file: /var/lib/dflash/secrets/main.env

- name: Begin a restart as an async job (it may wait minutes for a checkpoint and for idle GPUs).
  dflash.ops.training_run:
    name: main
    state: restarted
    command: [/opt/dflash/current/run.sh]
    idle_gpus: [0, 1]
  async: 1200
  poll: 0
  register: restart_job

- name: Wait for the restart, saying every 30 seconds what it waits for and the log's last line.
  dflash.ops.training_run:
    name: main
    state: status
    async_results_file: "{{ restart_job.results_file }}"
    wait_return_after: 30
  register: restarted
  until: restarted.finished
  retries: 40
  delay: 0

- name: Ensure the training run is stopped (it checkpoints on SIGTERM).
  dflash.ops.training_run:
    name: main
    state: stopped
    stop_timeout: 300
"""

RETURN = r"""
status:
  description: V(running) or V(stopped), when the module returns.
  returned: always
  type: str
removed_environment_file:
  description: The O(stale_environment_file) this start removed.
  returned: when one was removed
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
  returned: with RV(how)
  type: float
signalled:
  description: Pids that were sent SIGTERM or SIGKILL.
  returned: with RV(how)
  type: list
  elements: int
processes:
  description: Pids of the run seen during the stop (process group members and descendants of
    the recorded pid, including those started after SIGTERM); none of them is left.
  returned: with RV(how)
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
log_unsafe:
  description: Why a start would refuse O(log_path) (a symbolic link, a file of another user or writable by
    others, in such a directory), in the words of that refusal; a role checks it before it stops a run.
  returned: with V(status), when a start would refuse the log
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
  description: The log line that matched O(wait_for); with V(status) of a live run, that line (with
    O(wait_for) and O(log_offset), once matched) or else the last line of O(log_path) (how far it got, for
    a task that polls it).
  returned: after a start with O(wait_for); with V(status), O(log_path) and a live run
  type: str
matched:
  description: Whether the run logged a line matching O(wait_for) (after a start; with V(status), after
    O(log_offset)). A start is only unmatched with O(wait_return_after).
  returned: after a start; with V(status), O(wait_for), O(log_offset) and a live run
  type: bool
log_offset:
  description: Where in O(log_path) a status with O(wait_for) goes on looking after a start.
  returned: after a start
  type: int
log_tail:
  description: End of O(log_path) when the run died at start or did not match O(wait_for), or, with
    V(status), when the pidfile is stale (the run ended without a stop; it finished, failed or died).
  returned: on start failure; with V(status) and a stale pidfile
  type: str
boot:
  description: What O(boot) wrote (C(changed), the paths, or in check mode what it would write) and the
    start file's path (C(start_file)).
  returned: with O(boot), when the run is left running
  type: dict
user_directories:
  description: The O(user_directories) whose owner this start changed.
  returned: after a start with O(user) and O(user_directories)
  type: list
  elements: str
gpu_idle:
  description: What the wait for O(idle_gpus) saw at its last read (met, reasons, gpus, processes, table,
    polls, seconds), as M(dflash.ops.gpu_verify) returns it.
  returned: when O(idle_gpus) was waited for
  type: dict
finished:
  description: Whether the async job of O(async_results_file) has ended; once it has, the rest of the result
    is that job's.
  returned: with O(async_results_file)
  type: bool
waiting_for:
  description: What the job's call is doing (stopping pid N, waiting for its GPUs to be idle, starting) and
    for how long so far, or that it holds no phase yet (it waits for the run's lock) or any more.
  returned: with O(async_results_file), while the job runs
  type: str
"""

import re

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.dflash.ops.plugins.module_utils import run_boot, run_job
from ansible_collections.dflash.ops.plugins.module_utils.run_pidfile import (
    PLAIN_FILE_NAME,
    RunError,
    default_paths,
    is_plain_file_name,
    pidfile_lock,
)
from ansible_collections.dflash.ops.plugins.module_utils.run_start import (
    base_environment,
    read_environment_file,
)
from ansible_collections.dflash.ops.plugins.module_utils.run_state import apply_state

# The states that run a start's checks (checked runs only those).
STARTS = ("started", "restarted", "checked")
ARGUMENT_SPEC = dict(
    name=dict(type="str", required=True),
    state=dict(type="str", default="started", choices=[*STARTS, "stopped", "status"]),
    pidfile=dict(type="path"),
    command=dict(type="list", elements="str"),
    chdir=dict(type="path"),
    user=dict(type="str"),
    user_directories=dict(type="list", elements="path", default=[]),
    user_reads=dict(type="list", elements="path", default=[]),
    output_group=dict(type="str"),
    interpreter=dict(type="list", elements="path"),
    environment=dict(type="dict", default={}),
    log_path=dict(type="path"),
    stop_timeout=dict(type="float", default=120),
    kill_timeout=dict(type="float", default=10),
    startup_wait=dict(type="float", default=1),
    wait_for=dict(type="str"),
    wait_timeout=dict(type="float", default=300),
    wait_return_after=dict(type="float", default=0),
    log_offset=dict(type="int"),
    async_results_file=dict(type="path"),
    expect_pid=dict(type="int"),
    environment_file=dict(type="path"),
    stale_environment_file=dict(type="path"),
    idle_gpus=dict(type="list", elements="int"),
    free_ports=dict(type="list", elements="int", default=[]),
    idle_max_memory_mib=dict(type="int", default=100),
    idle_timeout=dict(type="float", default=60),
    boot=dict(type="dict", options=dict(
        python=dict(type="path", default="/usr/bin/python3"),
        status_file=dict(type="path"),
        program=dict(type="path", default="/usr/local/lib/dflash-resume.pyz"),
        unit_dir=dict(type="path", default="/etc/systemd/system"),
    )),
)
# The waits an invocation may spend under the pidfile's lock (a restart: the stop, SIGKILL, the GPUs' idle
# wait, the start and its first step).
LOCK_HELD_FOR = ("stop_timeout", "kill_timeout", "idle_timeout", "startup_wait", "wait_timeout")


def main():
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
        required_if=[("state", state, ["command"]) for state in STARTS],
        supports_check_mode=True,
    )
    params = module.params
    name = params["name"]
    if not is_plain_file_name(name):
        module.fail_json(msg=f"name {name!r} must be {PLAIN_FILE_NAME}")
    for key in ("stop_timeout", "kill_timeout", "startup_wait", "wait_timeout", "wait_return_after",
                "idle_timeout"):
        if params[key] < 0:
            module.fail_json(msg=f"{key} must be >= 0, got {params[key]}")
    if any(not 0 < port < 65536 for port in params["free_ports"]):
        module.fail_json(msg=f"free_ports must be TCP ports (1-65535), got {params['free_ports']}")
    if any(index < 0 for index in params["idle_gpus"] or ()):
        module.fail_json(msg=f"idle_gpus must be GPU indices >= 0, got {params['idle_gpus']}")
    if params["log_offset"] is not None and params["log_offset"] < 0:
        module.fail_json(msg=f"log_offset must be a byte offset >= 0, got {params['log_offset']}")
    if params["expect_pid"] is not None and params["expect_pid"] < 0:
        module.fail_json(msg=f"expect_pid must be a pid or 0 (no run), got {params['expect_pid']}")
    if params["user_directories"] and not params["user"]:
        module.fail_json(msg="user_directories are made the run's user's: set user too")
    if params["user_reads"] and not params["user"]:
        module.fail_json(msg="user_reads are checked for the run's user: set user too")
    if params["async_results_file"] and params["state"] != "status":
        module.fail_json(msg=f"async_results_file is read by state=status only (a task that polls the async "
                             f"job of another call), not state={params['state']}: nothing was done")
    if params["wait_for"]:
        try:
            re.compile(params["wait_for"])
        except re.error as exc:
            module.fail_json(msg=f"wait_for is not a regular expression: {exc}")
    default_pidfile, default_log_path = default_paths(name)
    params["pidfile"] = params["pidfile"] or default_pidfile
    params["log_path"] = params["log_path"] or default_log_path
    result = dict(name=name, pidfile=params["pidfile"])
    try:
        env = base_environment(params["user"] if params["state"] in STARTS else None)
        env.update({key: str(value) for key, value in params["environment"].items()})
        if params["async_results_file"]:
            failed, job = run_job.job_status(params, remove=not module.check_mode)
            result.update(job)
            if failed:
                module.fail_json(**result)
            module.exit_json(**result)
        if params["environment_file"] and params["state"] in ("started", "restarted"):
            env.update(read_environment_file(params["environment_file"], params["user"]))
        changes = params["state"] not in ("status", "checked") and not module.check_mode
        # Another invocation holds the lock at most as long as its own waits: this one's, and a minute.
        lock_wait = 60 + sum(params[key] or 0 for key in LOCK_HELD_FOR)
        with pidfile_lock(params["pidfile"], changes, lock_wait), \
                run_job.Phases(params["pidfile"], changes) as phases:
            result.update(apply_state(module, env, phases))
            if params["boot"] and params["state"] in ("started", "restarted") and (
                    result.get("status") == "running" or module.check_mode):
                result["boot"] = run_boot.ensure(params, params["boot"], check_mode=module.check_mode)
                result["changed"] = result.get("changed", False) or bool(result["boot"]["changed"])
    except RunError as exc:
        result.update(exc.result)
        module.fail_json(msg=str(exc), **result)
    except OSError as exc:
        module.fail_json(msg=f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
