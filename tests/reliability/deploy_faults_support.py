"""Helpers for the killed-deploy tests: a deploy.yml killed at a chosen moment, the phase it was
in, the container left quiet, and the invariants a killed deploy must keep."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from pvesim import procs
from pvesim.fleet import REPO, VENV_BIN, ansible_env

VMID = 200
RELEASES = "/opt/dflash/releases"
CURRENT = "/opt/dflash/current"
VENV_PYTHON = "/opt/dflash/venv/bin/python"
LOG = "/var/log/dflash/main.log"

# The phase a task belongs to, by its role and words of its name (the first match wins). Task names
# may change: an unknown one falls back to its role's phase.
PHASE_RULES = (
    ("dflash_run", "restart", "restart"),       # one call: stop, GPUs idle, start
    ("dflash_run", "gpus idle and start", "restart"),
    ("dflash_run", "dflash-resume", "boot unit"),
    ("dflash_run", "unit", "boot unit"),
    ("dflash_run", "boot", "boot unit"),
    ("dflash_run", "stop", "stop"),
    ("dflash_run", "idle", "gpus idle"),
    ("dflash_run", "start the run", "start"),
    ("dflash_run", "log before", "start"),
    ("dflash_run", "", "run check"),
    ("dflash_release", "live in the container", "release"),  # one call: unpack, validate, switch
    ("dflash_release", "kept", "prune"),
    ("dflash_release", "symlink", "switch"),
    ("dflash_release", "previous", "switch"),
    ("dflash_release", "list the releases", "prune"),
    ("dflash_release", "pack the release", "pack"),
    ("dflash_release", "render", "pack"),
    ("dflash_release", "revision on the controller", "pack"),
    ("dflash_release", "name the release", "pack"),
    ("dflash_release", "", "stage"),
    ("dflash_env", "", "environment"),
    ("proxmox_host", "", "node checks"),
    # The play's own tasks (preflight, include_role).
    ("", "inventory", "preflight"),
    ("", "variable", "preflight"),
    ("", "gpu layout", "preflight"),
    ("", "node", "node checks"),
    ("", "environment", "environment"),
    ("", "release", "pack"),
    ("", "run", "run check"),
)


def phase_of(heading: str) -> str:
    """The phase of a `TASK [role : name]` / `RUNNING HANDLER [...]` / `PLAY RECAP` line."""
    if heading.startswith("PLAY RECAP"):
        return "finished"
    inside = heading[heading.index("[") + 1: heading.rindex("]")] if "[" in heading else heading
    role, _, name = inside.partition(" : ") if " : " in inside else ("", "", inside)
    role = role.strip().rsplit(".", 1)[-1]  # dflash.ops.dflash_run: the role's own name
    for rule_role, words, phase in PHASE_RULES:
        if rule_role == role and words in name.lower():
            return phase
    return role or "play"


def last_heading(output: str) -> str:
    """The last task the killed playbook announced (the work in flight may be one task further:
    the announcement and the task's start are not one step)."""
    headings = [line.strip(" *") for line in output.splitlines()
                if line.startswith(("TASK [", "RUNNING HANDLER [", "PLAY RECAP"))]
    return headings[-1] if headings else "(nothing started)"


def deploy_argv(fleet) -> list[str]:
    """What Fleet.play runs for deploy.yml, for a run that must be killed half-way."""
    return [str(VENV_BIN / "ansible-playbook"), "-i", str(fleet.inventory),
            str(REPO / "playbooks" / "deploy.yml"),
            "-e", f"dflash_release_source_dir={fleet.src / 'dflash_ops'}"]


@dataclass
class KilledDeploy:
    delay: float
    killed: bool          # False: the deploy finished before the kill was due
    elapsed: float        # how long it ran: the whole deploy when it was not killed
    returncode: int
    heading: str          # the last task it announced
    output: str

    @property
    def phase(self) -> str:
        return phase_of(self.heading) if self.killed else "finished"


def kill_deploy_after(fleet, delay: float, log: Path) -> KilledDeploy:
    """Run deploy.yml in its own process group and SIGKILL the whole group after `delay` seconds.
    The default callback announces each task as it starts (unbuffered), which names the phase."""
    return kill_deploy_when(fleet, lambda elapsed: elapsed >= delay, log, delay)


def in_fleet(pid: int, state_dir: Path) -> bool:
    """Whether host pid `pid` runs in one of this fleet's containers: an ancestor of it names the
    fleet's state directory (the `lxc-attach -P <state>/...` that ran it, or its container's
    `[lxc monitor] <state>/...`). Other fleets on this machine (other test files, side by side under
    xdist) run the same commands in containers of the same ids."""
    marker = str(state_dir).encode()
    for _ in range(64):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if marker in fh.read():
                    return True
        except OSError:
            return False
        fields = procs._stat_fields(pid)
        if not fields or int(fields[1]) <= 1:
            return False
        pid = int(fields[1])
    return False


def validations_in_flight(fleet) -> list[int]:
    """Host pids of the trainer's config validation of a staged release (`python -m dflash_ops.config
    validate <root>/.staging-<id>/config.yaml`) in this fleet's containers: the controller sees every
    container's processes in its own /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if b"dflash_ops.config" in argv and b"validate" in argv and any(b"/.staging-" in a for a in argv) \
                and in_fleet(int(entry), fleet.sim.state_dir):
            found.append(int(entry))
    return found


def kill_in_container(pids: list[int]) -> list[int]:
    """SIGKILL each validation and its parent (the module running it in the container), by pid and
    start time, as a crash of the container's side would; returns the pids killed."""
    targets = []
    for pid in pids:
        fields = procs._stat_fields(pid)
        if fields:
            targets += [(pid, procs.start_time(pid)), (int(fields[1]), procs.start_time(int(fields[1])))]
    killed = []
    for pid, started in targets:
        if procs.is_alive(pid, started):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def kill_deploy_when(fleet, due, log: Path, delay: float | None = None, poll_s=0.01,
                     argv: list[str] | None = None) -> KilledDeploy:
    """Run deploy.yml (or `argv`, another playbook run) in its own process group and SIGKILL the whole
    group as soon as `due(elapsed seconds)` is true (checked every `poll_s`); a run that ends first is
    reported not killed."""
    env = {**ansible_env(DFLASH_SIM_ASSETS=str(fleet.assets)),
           "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.default", "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(argv or deploy_argv(fleet), env=env, stdout=out, stderr=subprocess.STDOUT,
                                cwd=REPO, stdin=subprocess.DEVNULL, start_new_session=True)
        killed = False
        while proc.poll() is None and not due(time.monotonic() - started):
            time.sleep(poll_s)
        if proc.poll() is None:
            # A crashed controller takes its whole process tree; Ansible's workers call setsid, so
            # the group kill alone would leave a task in flight orphaned (blocked on its parent's pipe).
            workers = [(pid, procs.start_time(pid)) for pid in procs.descendants(proc.pid)]
            os.killpg(proc.pid, signal.SIGKILL)
            for pid, pid_started in workers:
                if procs.is_alive(pid, pid_started):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            killed = True
        returncode = proc.wait(timeout=60)
    elapsed = time.monotonic() - started
    output = log.read_text()
    return KilledDeploy(elapsed if delay is None else delay, killed, elapsed, returncode,
                        last_heading(output), output)


def ansible_task_processes(fleet, vmid=VMID) -> list[str]:
    """The container's processes still running for an Ansible task (entered through pct exec, so in
    no session of the container), besides this probe itself, as "<pid> <command line>"; [] when the
    container is quiet."""
    res = fleet.ct(vmid, "echo $$; ps -eo pid=,ppid=,sid=,args=")
    lines = res.stdout.splitlines()
    probe = lines[0].strip()
    busy = []
    for line in lines[1:]:
        pid, ppid, sid, args = line.split(None, 3)
        if sid == "0" and probe not in (pid, ppid):
            busy.append(f"{pid} {args}")
    return busy


def wait_until_quiet(fleet, timeout=300, vmid=VMID) -> float:
    """Wait until no task of the killed deploy is still at work in the container (a module already
    running there finishes its work after the controller is gone); returns the seconds waited."""
    started = time.monotonic()
    quiet_since = None
    while time.monotonic() - started < timeout:
        if ansible_task_processes(fleet, vmid):
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= 3:
            return time.monotonic() - started
        time.sleep(1)
    raise AssertionError(f"CT {vmid} still busy after {timeout} s: {ansible_task_processes(fleet, vmid)}")


def release_problems(fleet, release_dir: str, vmid=VMID) -> list[str]:
    """Why `release_dir` is not a complete, validated release ([] when it is)."""
    if not release_dir.startswith(f"{RELEASES}/"):
        return [f"current points to {release_dir!r}, not a release"]
    release_id = Path(release_dir).name
    if not (fleet.build_dir / f"{release_id}.tar.gz").exists():
        return [f"release {release_id} has no archive on the controller"]
    expected = fleet.release_files(release_id)
    find = f"cd {shlex.quote(release_dir)} && find . -type f ! -path '*/__pycache__/*' -exec sha256sum {{}} +"
    out = fleet.ct(vmid, find).stdout
    found = {line.split(None, 1)[1].strip()[2:]: line.split()[0] for line in out.splitlines()}
    problems = []
    if found != expected:
        missing = sorted(set(expected) - set(found))
        differ = sorted(k for k in set(expected) & set(found) if expected[k] != found[k])
        extra = sorted(set(found) - set(expected))
        problems.append(f"release {release_id}: missing {missing}, different {differ}, extra {extra}")
    if "REVISION" not in found:
        problems.append(f"release {release_id} has no REVISION")
    quoted = shlex.quote(release_dir)
    validate = fleet.ct(vmid, f"PYTHONPATH={quoted} {VENV_PYTHON} -m dflash_ops.config validate "
                              f"--no-target-check {quoted}/config.yaml", timeout=120)
    if validate.returncode != 0:
        problems.append(f"release {release_id}: config does not validate: {validate.stderr.strip()}")
    return problems


def log_events(fleet, vmid=VMID, offset=0) -> list[dict]:
    """The run log's JSON events from byte `offset` on."""
    res = fleet.ct(vmid, f"tail -c +{offset + 1} {LOG}")
    lines = res.stdout.splitlines()
    return [json.loads(line) for line in lines if line.startswith("{") and line.endswith("}")]


def log_size(fleet, vmid=VMID) -> int:
    res = fleet.ct(vmid, f"stat -c %s {LOG}")
    return int(res.stdout) if res.returncode == 0 else 0


def gpu_holders(fleet, vmid=VMID) -> set[str]:
    """The pids that hold a GPU, as the container's nvidia-smi reports them."""
    res = fleet.ct(vmid, "nvidia-smi --query-compute-apps=pid --format=csv,noheader,nounits")
    assert res.returncode == 0, res.stderr
    return {line.strip() for line in res.stdout.splitlines() if line.strip()}


def group_members(fleet, pgid: int, vmid=VMID) -> list[str]:
    return fleet.ct(vmid, f"ps -o pid= -g {int(pgid)}").stdout.split()


@dataclass
class Outcome:
    """What a killed deploy left: the live release, the run and what became of the old run."""
    state: str = ""                       # old running | new running | stopped
    violations: list[str] = field(default_factory=list)
    saved_step: int | None = None         # when stopped: the step the old run checkpointed at
