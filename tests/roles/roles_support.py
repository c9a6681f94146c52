"""Helpers for the role and playbook tests: a pvesim fleet with the sim inventory's group_vars, a
snapshot of the project's source (so tests change code without touching the tree), tiny demo assets,
and ansible-playbook runs whose results come back as data (the ansible.posix.json callback)."""

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import pvesim

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
SIM_GROUP_VARS = REPO / "inventory" / "sim" / "group_vars"
# Shared by every test module and the molecule scenarios; `dflash.demo prepare` reuses it when current.
ASSETS = REPO / ".cache" / "assets-tiny"


def prepare_assets():
    """The tiny demo target and data (a few seconds the first time, then cached)."""
    subprocess.run([sys.executable, "-m", "dflash.demo", "prepare", str(ASSETS), "--preset", "tiny"],
                   check=True, cwd=REPO, capture_output=True, text=True)
    return ASSETS


def snapshot_source(dest):
    """Copy what the roles ship (pyproject.toml, README.md, dflash/) to `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("pyproject.toml", "README.md"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, dest / name)
    shutil.copytree(REPO / "dflash", dest / "dflash", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
                    dirs_exist_ok=True)
    return dest


def ansible_env(**extra):
    """The environment of an Ansible run: the project's ansible.cfg, the venv first on PATH."""
    env = dict(os.environ)
    env.update({
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_DEPRECATION_WARNINGS": "False",
        "PATH": f"{VENV_BIN}:{env.get('PATH', '/usr/bin:/bin')}",
        **extra,
    })
    return env


@dataclass
class PlayResult:
    rc: int
    data: dict
    stdout: str
    stderr: str

    @property
    def stats(self):
        return self.data.get("stats", {})

    def results(self, task_name):
        """{host: result} of every run of the task named `task_name` (the last run wins)."""
        found = {}
        for play in self.data.get("plays", []):
            for task in play.get("tasks", []):
                if task["task"]["name"].endswith(task_name):
                    found.update(task["hosts"])
        return found

    def messages(self):
        """Every failure message, for assertions and for readable test failures."""
        out = []
        for play in self.data.get("plays", []):
            for task in play.get("tasks", []):
                for host, res in task["hosts"].items():
                    if res.get("failed"):
                        out.append(f"{host}: {res.get('msg')}")
        return "\n".join(out)

    def __str__(self):
        return f"rc={self.rc} stats={self.stats}\n{self.messages()}\n{self.stderr[-3000:]}"


class Fleet:
    """A pvesim with the sim inventory's group_vars next to its hosts.yml, and helpers to look inside."""

    def __init__(self, base, nodes, containers):
        self.base = base
        (base / "inventory").mkdir(parents=True, exist_ok=True)
        (base / "inventory" / "group_vars").symlink_to(SIM_GROUP_VARS)
        self.sim = pvesim.up(nodes=nodes, containers=containers, gpus=8, state_dir=base / "state",
                             inventory=base / "inventory" / "hosts.yml")
        self.src = snapshot_source(base / "src")
        self.assets = prepare_assets()

    @property
    def inventory(self):
        return self.sim.inventory_path

    def env(self):
        return ansible_env(ANSIBLE_STDOUT_CALLBACK="ansible.posix.json", DFLASH_SIM_ASSETS=str(self.assets))

    def play(self, playbook, *args, timeout=900):
        argv = [str(VENV_BIN / "ansible-playbook"), "-i", str(self.inventory),
                str(REPO / "playbooks" / playbook),
                "-e", f"dflash_release_source_dir={self.src / 'dflash'}", *args]
        res = subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=timeout, cwd=REPO,
                             stdin=subprocess.DEVNULL)
        try:
            data = json.loads(res.stdout[res.stdout.index("{"):])
        except ValueError:
            data = {}
        return PlayResult(res.returncode, data, res.stdout, res.stderr)

    def ct(self, vmid, command, timeout=60):
        """Run a shell command inside a container, through its node and pct."""
        node = self.sim.node_of(vmid).name
        return self.sim.ssh(node, f"/usr/sbin/pct exec {vmid} -- /bin/sh -c {shlex.quote(command)}",
                            timeout=timeout)

    def read(self, vmid, path):
        res = self.ct(vmid, f"cat {shlex.quote(path)}")
        return res.stdout if res.returncode == 0 else None

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

    def wait_for_checkpoint(self, vmid, timeout=120):
        """Wait until the run has saved a checkpoint; returns status.json."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.status(vmid)
            if status.get("last_checkpoint"):
                return status
            time.sleep(2)
        pytest.fail(f"CT {vmid}: no checkpoint within {timeout} s; status {self.status(vmid)}")

    def down(self):
        pvesim.down(self.sim.state_dir)


def change_code(src, marker):
    """A code change that makes a new release: one line appended to the package's __init__.py."""
    with open(src / "dflash" / "__init__.py", "a") as fh:
        fh.write(f"# release marker: {marker}\n")
