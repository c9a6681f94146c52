"""Helpers shared by the tests of the dflash.ops collection's modules (a plain module: tests/conftest.py owns
the name conftest).

Unit tests import the modules' pure helpers directly; the other tests run the modules for real,
either as a program (the way Ansible runs a module: a JSON file of arguments, JSON on stdout) or
through Ansible, driven by ansible-runner (`pvesim.fleet`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pvesim import fleet
from pvesim.procs import is_alive as alive  # live and not a zombie
from tests.waiting import wait_for

REPO = fleet.REPO
MODULES = REPO / "ansible_collections" / "dflash" / "ops" / "plugins" / "modules"
VENV_BIN = fleet.VENV_BIN


def module_command(name):
    """A shell command prefix that runs the collection's module `name` as a program, the way Ansible's
    wrapper does: Python with the repo (which holds ansible_collections/) on its path."""
    return f"PYTHONPATH={REPO} {sys.executable} {MODULES / (name + '.py')}"


def run_module(name, args, env=None, timeout=60):
    """Run the collection's module `name` with `args` and return (result dict, rc)."""
    fd, name_of_file = tempfile.mkstemp(prefix="module-args-", suffix=".json")
    args_file = Path(name_of_file)
    with os.fdopen(fd, "w") as handle:
        json.dump({"ANSIBLE_MODULE_ARGS": args}, handle)
    try:
        proc = subprocess.run([sys.executable, str(MODULES / f"{name}.py"), str(args_file)],
                              capture_output=True, text=True, timeout=timeout,
                              env=dict(env or os.environ, PYTHONPATH=str(REPO)))
    finally:
        args_file.unlink()
    try:
        return json.loads(proc.stdout), proc.returncode
    except ValueError:
        pytest.fail(f"{name} printed no JSON (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def ansible_module(module, args, env=None, timeout=120, host="localhost", inventory=None):
    """Run one module of the collection ad hoc through ansible-runner; returns that host's result.
    Without `inventory`, localhost on the local connection with this Python."""
    with tempfile.TemporaryDirectory(prefix="module-inventory-") as tmp:
        res = fleet.run_module(f"dflash.ops.{module}", args, inventory or fleet.local_inventory(tmp), host,
                               envvars=env, timeout=timeout)
    results = res.tasks[-1].hosts if res.tasks else {}
    if host not in results:
        pytest.fail(f"no result of {module} for {host} ({res.status}):\n{res}")
    return results[host]


def playbook_results(playbook, inventory, host, timeout=120):
    """Run a playbook through ansible-runner; returns the results of its tasks for one host, in order."""
    res = fleet.run_playbook(playbook, inventory, timeout=timeout)
    return [result for _, name, result in res.host_results() if name == host]


class Processes:
    """Processes a test starts itself, so they can be ended by pid afterwards."""

    def __init__(self):
        self.popens = []
        self.pids = set()

    def spawn(self, argv, **kwargs):
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, **kwargs)
        self.popens.append(proc)
        return proc

    def track(self, pid):
        self.pids.add(pid)

    def cleanup(self):
        for pid in self.pids:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.popens:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


# The stand-in run the training_run tests start: it prints, checkpoints on SIGTERM, or misbehaves on request.
FAKE_RUN = str(Path(__file__).parent / "fixtures" / "fake_run.py")


class Run:
    """One run's paths and the module calls on it."""

    def __init__(self, tmp_path, processes, name="main"):
        self.dir = tmp_path
        self.processes = processes
        self.name = name
        self.pidfile = tmp_path / "state" / f"{name}.pid"
        self.log = tmp_path / "log" / f"{name}.log"

    def args(self, **extra):
        return dict(name=self.name, pidfile=str(self.pidfile), log_path=str(self.log), **extra)

    def call(self, **extra):
        result, rc = run_module("training_run", self.args(**extra))
        assert "Traceback" not in json.dumps(result)
        if result.get("pid") and result.get("status") == "running":
            self.processes.track(result["pid"])
        return result, rc

    def start(self, *flags, **extra):
        command = [sys.executable, FAKE_RUN, *flags]
        result, rc = self.call(command=command, **extra)
        assert rc == 0, result
        return result

    def child_pid(self, filename):
        path = self.dir / filename
        assert wait_for(path.exists), f"{filename} never written"
        pid = int(path.read_text())
        self.processes.track(pid)
        return pid
