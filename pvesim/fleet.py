"""Ansible against pvesim, for the tests and the benchmarks: a fleet (a sim with the sim inventory's
group_vars, a snapshot of the project's source, the tiny demo assets) and playbook or ad-hoc module
runs driven through ansible-runner, whose event stream gives each task's results and timing.

    fleet = Fleet(base, nodes=2, containers=(200, 201))
    res = fleet.play("deploy.yml", "-l", "ct200")
    res.rc, res.stats["ct200"]["changed"], res.results("Stop the run (...).")["ct200"], res.task_seconds()
    fleet.down()

Every run gets the project's ansible.cfg, the venv's Ansible first on PATH and its own private data
dir (removed afterwards unless the caller names one to keep), whatever the caller's working directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import ansible_runner
import yaml

from .sim import container_hostvars, down, up

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
# The Ansible the runs use: the venv's own, or that of the venv whose bin/ DFLASH_ANSIBLE_BIN names (make
# test-newest: ansible-core 2.20 and 2.21 on Python 3.13, scripts/newest_venv.py); the tests, pvesim and the
# containers' trainer stay in this venv.
ANSIBLE_BIN = Path(os.environ.get("DFLASH_ANSIBLE_BIN") or VENV_BIN).absolute()
PLAYBOOKS = REPO / "playbooks"
SIM_GROUP_VARS = REPO / "inventory" / "sim" / "group_vars"
# The run's start file and its boot outcome in a container, less their suffixes (the dflash_run role's).
BOOT_FILE = "/var/lib/dflash/main"
# Shared by every test module and the molecule scenarios; `dflash_ops.demo prepare` reuses it when current.
ASSETS = REPO / ".cache" / "assets-tiny"

# Host events that end a task on a host, and the flag each sets in the result (as Ansible's own
# result callbacks see it: a failure's result does not carry `failed` itself).
HOST_RESULTS = {
    "runner_on_ok": None, "runner_on_async_ok": None, "runner_on_failed": "failed",
    "runner_on_async_failed": "failed", "runner_on_skipped": "skipped",
    "runner_on_unreachable": "unreachable",
}
TASK_STARTS = ("playbook_on_task_start", "playbook_on_handler_task_start")
# playbook_on_stats keys -> the per-host recap's names.
# ansible-runner runs Ansible on a pty, where ssh (or paramiko) would ask about an unknown host key and
# wait; the answer is no, so the run fails at once, as it does with no terminal.
UNKNOWN_HOST_KEY = {r"continue connecting \(yes/no[^)]*\)\?": "no"}
RECAP = {"ok": "ok", "changed": "changed", "failures": "failures", "dark": "unreachable",
         "skipped": "skipped", "rescued": "rescued", "ignored": "ignored"}


def prepare_assets():
    """The tiny demo target and data (a few seconds the first time, then cached)."""
    subprocess.run([sys.executable, "-m", "dflash_ops.demo", "prepare", str(ASSETS), "--preset", "tiny"],
                   check=True, cwd=REPO, capture_output=True, text=True)
    return ASSETS


def snapshot_source(dest):
    """Copy what the roles ship (pyproject.toml, README.md, dflash_ops/) to `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("pyproject.toml", "README.md"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, dest / name)
    shutil.copytree(REPO / "dflash_ops", dest / "dflash_ops",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True)
    return dest


def change_code(src, marker):
    """A code change that makes a new release: one line appended to the package's __init__.py."""
    with open(src / "dflash_ops" / "__init__.py", "a") as fh:
        fh.write(f"# release marker: {marker}\n")


def ansible_settings(**extra):
    """What an Ansible run sets in its environment: the project's ansible.cfg, the Ansible's venv and
    this venv first on PATH (before an `extra` PATH too)."""
    path = extra.pop("PATH", os.environ.get("PATH", "/usr/bin:/bin"))
    bins = [str(ANSIBLE_BIN)] + ([str(VENV_BIN)] if ANSIBLE_BIN != VENV_BIN else [])
    return {
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_DEPRECATION_WARNINGS": "False",
        "PATH": ":".join([*bins, path]),
        **extra,
    }


def ansible_env(**extra):
    """The whole environment of an Ansible program started as a subprocess."""
    return {**os.environ, **ansible_settings(**extra)}


def _epoch(stamp):
    return datetime.fromisoformat(stamp).timestamp()


# Actions that run inside the controller's ansible-playbook process: no connection at all.
IN_PROCESS = {
    "ansible.builtin.assert", "ansible.builtin.set_fact", "ansible.builtin.debug", "ansible.builtin.fail",
    "ansible.builtin.include_role", "ansible.builtin.include_tasks", "ansible.builtin.import_tasks",
    "ansible.builtin.validate_argument_spec", "ansible.builtin.meta", "ansible.builtin.pause",
}


@dataclass
class TaskRun:
    """One run of a task (a `serial` batch runs each task once per batch): its results per host and
    its wall time, from the task's start to the last host's end."""

    play: str
    name: str
    path: str
    action: str
    start: float
    end: float
    hosts: dict = field(default_factory=dict)
    seconds_by_host: dict = field(default_factory=dict)

    @property
    def seconds(self):
        return self.end - self.start

    @property
    def ran(self):
        """The hosts that did not skip it."""
        return [host for host, result in self.hosts.items() if not result.get("skipped")]


@dataclass(repr=False)
class PlayResult:
    """What an ansible-runner run left in its event stream: the plays (one per `serial` batch) and task
    runs in order, the recap (`stats`: {host: {ok, changed, failures, ...}}), and what Ansible printed
    (stderr comes merged into stdout: ansible-runner runs Ansible on a pty)."""

    rc: int
    status: str
    plays: list
    tasks: list
    stats: dict
    stdout: str
    stderr: str = ""

    @classmethod
    def from_events(cls, rc, status, events, stdout=""):
        plays, tasks, latest, stats, play = [], [], {}, {}, ""
        for event in events:
            kind, data = event.get("event"), event.get("event_data", {})
            if kind == "playbook_on_play_start":
                play = data.get("name", "")
                plays.append(play)
            elif kind in TASK_STARTS:
                start = _epoch(event["created"])
                latest[data["task_uuid"]] = TaskRun(play, data.get("task", ""), data.get("task_path", ""),
                                                    data.get("task_action", ""), start, start)
                tasks.append(latest[data["task_uuid"]])
            elif kind in HOST_RESULTS:
                task = latest.get(data.get("task_uuid"))
                if task is None:  # an ad-hoc run has no task start event
                    start = _epoch(data["start"]) if data.get("start") else 0.0
                    task = latest[data.get("task_uuid")] = TaskRun(
                        play, data.get("task", ""), "", data.get("task_action", ""), start, start)
                    tasks.append(task)
                result = dict(data.get("res") or {}, action=data.get("task_action"))
                if HOST_RESULTS[kind]:
                    result[HOST_RESULTS[kind]] = True
                task.hosts[data["host"]] = result
                task.seconds_by_host[data["host"]] = data.get("duration") or 0.0
                if data.get("end"):
                    task.end = max(task.end, _epoch(data["end"]))
            elif kind == "playbook_on_stats":
                for key, name in RECAP.items():
                    for host, count in (data.get(key) or {}).items():
                        stats.setdefault(host, dict.fromkeys(RECAP.values(), 0))[name] = count
        return cls(rc, status, plays, tasks, stats, stdout)

    def results(self, task_name):
        """{host: result} of every run of the task named `task_name` (the last run wins)."""
        found = {}
        for task in self.tasks:
            if task.name.endswith(task_name):
                found.update(task.hosts)
        return found

    def host_results(self):
        """(task run, host, result) of every host of every task run, in order."""
        for task in self.tasks:
            for host, result in task.hosts.items():
                yield task, host, result

    def connected_tasks(self, host):
        """The task runs that went through `host`'s own connection (for a container, `pct_pipelined`: each
        one a round trip into it): not skipped, not run in the controller's process (IN_PROCESS), not
        delegated to another host (the controller's packing, the node checks)."""
        return [task for task in self.tasks if host in task.ran and task.action not in IN_PROCESS
                and "_ansible_delegated_vars" not in task.hosts[host]]

    def task_seconds(self):
        """[(task name, host, seconds)] of every host of every task run, from the event stream."""
        return [(task.name, host, task.seconds_by_host[host]) for task, host, _ in self.host_results()]

    def messages(self):
        """Every failure message, for assertions and for readable test failures."""
        return "\n".join(f"{host}: {result.get('msg')}" for _, host, result in self.host_results()
                         if result.get("failed"))

    def changed_tasks(self):
        """[(host, task name)] of every task run that reported a change, in order."""
        return [(host, task.name) for task, host, result in self.host_results() if result.get("changed")]

    def __str__(self):
        changed = "".join(f"changed: {host}: {name}\n" for host, name in self.changed_tasks())
        return (f"rc={self.rc} ({self.status}) stats={self.stats}\n{changed}{self.messages()}\n"
                f"{self.stdout[-3000:]}")

    __repr__ = __str__  # what pytest shows of `assert res.rc == 0, res`


def _run(keep_dir, timeout, envvars, on_event=None, **kwargs):
    """One ansible-runner run in its own private data dir (`keep_dir`, emptied first, or a temporary
    one removed afterwards); returns its PlayResult. `on_event(event)`, if given, sees each of ansible-
    runner's events as it comes (its `stdout` is the text the event printed)."""
    if keep_dir:
        shutil.rmtree(keep_dir, ignore_errors=True)
        Path(keep_dir).mkdir(parents=True)
        private = Path(keep_dir)
    else:
        private = Path(tempfile.mkdtemp(prefix="ansible-runner-"))
    # ansible-runner turns host key checking off unless the environment says otherwise; ansible.cfg's
    # `host_key_checking = True` is what every run here keeps.
    env = {"ANSIBLE_HOST_KEY_CHECKING": "True", **ansible_settings(**(envvars or {}))}
    if on_event:  # ansible-runner keeps an event only when its handler returns True
        kwargs["event_handler"] = lambda event: on_event(event) or True
    try:
        runner = ansible_runner.run(private_data_dir=str(private), envvars=env, timeout=timeout, quiet=True,
                                    passwords=UNKNOWN_HOST_KEY, fact_cache_type="memory",
                                    suppress_env_files=True, **kwargs)
        stdout = runner.stdout.read()
        return PlayResult.from_events(runner.rc, runner.status, list(runner.events), stdout)
    finally:
        if not keep_dir:
            shutil.rmtree(private, ignore_errors=True)


def run_playbook(playbook, inventory, *args, extravars=None, limit=None, envvars=None, timeout=900,
                 keep_dir=None, on_event=None):
    """Run `playbook` (a path, or a name under playbooks/) against `inventory`; `args` are further
    ansible-playbook arguments (`-e k=v`, `--check`, ...). Returns a PlayResult."""
    path = Path(playbook) if Path(playbook).is_absolute() else PLAYBOOKS / playbook
    return _run(keep_dir, timeout, envvars, on_event, playbook=str(path), inventory=str(inventory),
                extravars=extravars, limit=limit, cmdline=shlex.join(args) if args else None,
                project_dir=str(REPO))


def run_module(module, args, inventory, pattern, *, envvars=None, timeout=120, keep_dir=None, verbosity=None):
    """Run one module ad hoc (`ansible PATTERN -m MODULE -a ARGS`) against `inventory`; `args` is a dict
    (sent as JSON) or a string of key=value pairs. Returns a PlayResult with one task run."""
    module_args = json.dumps(args) if isinstance(args, dict) else args
    return _run(keep_dir, timeout, envvars, module=module, module_args=module_args, host_pattern=pattern,
                inventory=str(inventory), verbosity=verbosity)


def local_inventory(directory):
    """An inventory file in `directory` with localhost on the local connection and this Python."""
    path = Path(directory) / "localhost.ini"
    path.write_text(f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n")
    return path


class Fleet:
    """A pvesim with the sim inventory's group_vars next to its hosts.yml, and helpers to look inside."""

    def __init__(self, base, nodes, containers, gpus=8, **layout):
        """`layout`: pvesim.up's gpu_passthrough, compute_apps, node_user, sudo_rule and network."""
        self.base = base
        (base / "inventory").mkdir(parents=True, exist_ok=True)
        (base / "inventory" / "group_vars").symlink_to(SIM_GROUP_VARS)
        self.sim = up(nodes=nodes, containers=containers, gpus=gpus, state_dir=base / "state",
                      inventory=base / "inventory" / "hosts.yml", **layout)
        self.src = snapshot_source(base / "src")
        self.assets = prepare_assets()

    @property
    def inventory(self):
        return self.sim.inventory_path

    def play(self, playbook, *args, timeout=900, on_event=None):
        """Run a playbook of playbooks/ against the fleet. Each run keeps its artifacts in a directory of
        its own under base/plays/ (plays may run at once: two restarts of one container, say). `on_event`
        sees each event as it comes (run_playbook)."""
        (self.base / "plays").mkdir(exist_ok=True)
        private = Path(tempfile.mkdtemp(prefix=f"{Path(playbook).stem}-", dir=self.base / "plays"))
        return run_playbook(playbook, self.inventory, *args, timeout=timeout, keep_dir=private,
                            extravars={"dflash_release_source_dir": str(self.src / "dflash_ops")},
                            envvars={"DFLASH_SIM_ASSETS": str(self.assets)}, on_event=on_event)

    def add_to_inventory(self, node_name, vmid, **hostvars):
        """Add container `vmid` of `node_name` to the fleet's inventory as ct<vmid> (whether the node has
        it or not: what an operator does before provisioning a new one), with `hostvars` on top."""
        text = self.inventory.read_text()
        header, _, body = text.partition("---\n")
        data = yaml.safe_load(body)
        hosts = data["all"]["children"]["training_containers"]["hosts"]
        hosts[f"ct{vmid}"] = {**container_hostvars(self.sim, node_name, vmid), **hostvars}
        self.inventory.write_text(header + "---\n" + yaml.safe_dump(data, sort_keys=False, width=1000))

    @property
    def build_dir(self):
        """Where the controller keeps the release archives it built (dflash_release_build_dir's default:
        next to the source it was given)."""
        return self.src / ".cache" / "releases"

    def release_files(self, release_id):
        """{path in the release: sha256} of the archive the controller built for `release_id`."""
        with tarfile.open(self.build_dir / f"{release_id}.tar.gz") as tar:
            return {m.name: hashlib.sha256(tar.extractfile(m).read()).hexdigest()
                    for m in tar.getmembers() if m.isfile()}

    def ct(self, vmid, command, timeout=60):
        """Run a shell command inside a container, through its node and pct."""
        node = self.sim.node_of(vmid).name
        return self.sim.ssh(node, f"/usr/sbin/pct exec {vmid} -- /bin/sh -c {shlex.quote(command)}",
                            timeout=timeout)

    def read(self, vmid, path):
        res = self.ct(vmid, f"cat {shlex.quote(path)}")
        return res.stdout if res.returncode == 0 else None

    def host_vars(self, host, variables):
        """Write the inventory's host_vars/<host>.yml (next to hosts.yml; read by every later play)."""
        (self.base / "inventory" / "host_vars").mkdir(exist_ok=True)
        (self.base / "inventory" / "host_vars" / f"{host}.yml").write_text(yaml.safe_dump(variables))

    def run_info(self, vmid):
        """The run's pidfile as data, or None."""
        text = self.read(vmid, "/var/lib/dflash/main.pid")
        return json.loads(text) if text else None

    def live_release(self, vmid):
        return self.ct(vmid, "readlink /opt/dflash/current").stdout.strip()

    def alive(self, vmid, pid):
        """Whether `pid` (a container pid) is a live, non-zombie process in the container."""
        res = self.ct(vmid, f"grep '^State:' /proc/{int(pid)}/status")
        return res.returncode == 0 and "zombie" not in res.stdout

    def status(self, vmid):
        text = self.read(vmid, "/var/lib/dflash/runs/main/status.json")
        return json.loads(text) if text else {}

    def wait_for_status(self, vmid, predicate, timeout=120, what="the condition"):
        """Wait until `predicate(status.json)` holds; returns status.json (raises TimeoutError)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.status(vmid)
            if predicate(status):
                return status
            time.sleep(2)
        raise TimeoutError(f"CT {vmid}: no {what} within {timeout} s; status {self.status(vmid)}")

    def wait_for_checkpoint(self, vmid, timeout=120):
        """Wait until the run has saved a checkpoint; returns status.json (raises TimeoutError)."""
        return self.wait_for_status(vmid, lambda s: s.get("last_checkpoint"), timeout, "checkpoint")

    def start_container(self, vmid, timeout=180):
        """`pct start` a stopped container and wait until its boot's dflash-resume has judged the run (a
        run that was live when the container stopped starts again, holding the run's lock meanwhile);
        returns that outcome, or None for a container without a run's start file."""
        began = datetime.now(UTC).replace(microsecond=0)
        res = self.sim.ssh(self.sim.node_of(vmid).name, f"pct start {vmid}")
        if res.returncode != 0:
            raise RuntimeError(f"pct start {vmid}: {res.stderr}")
        if self.ct(vmid, f"test -f {BOOT_FILE}.boot.json").returncode != 0:
            return None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.read(vmid, f"{BOOT_FILE}.boot-result.json")
            outcome = json.loads(text) if text else {}
            if outcome and datetime.fromisoformat(outcome["time"]) >= began:
                return outcome
            time.sleep(1)
        raise TimeoutError(f"CT {vmid}: its boot judged no run within {timeout} s")

    def down(self):
        down(self.sim.state_dir)
