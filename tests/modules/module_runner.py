"""Helpers shared by the tests of the dflash.ops collection's modules (a plain module: tests/conftest.py owns
the name conftest).

Unit tests import the modules' pure helpers directly; the other tests run the modules for real,
either as a program (the way Ansible runs a module: a JSON file of arguments, JSON on stdout) or
through the `ansible` command.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pvesim.procs import is_alive as alive  # live and not a zombie

REPO = Path(__file__).resolve().parents[2]
MODULES = REPO / "ansible_collections" / "dflash" / "ops" / "plugins" / "modules"
VENV_BIN = Path(sys.executable).parent


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


def ansible_json(argv, env=None, timeout=120):
    """Run an Ansible program with the json stdout callback; returns its report."""
    full_env = dict(os.environ, ANSIBLE_LOAD_CALLBACK_PLUGINS="1", ANSIBLE_STDOUT_CALLBACK="json",
                    ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), **(env or {}))
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO,
                          stdin=subprocess.DEVNULL)
    try:
        return json.loads(proc.stdout)
    except ValueError:
        pytest.fail(f"{argv[0]} gave no report (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def ansible_module(module, args, env=None, timeout=120, host="localhost", inventory="localhost,"):
    """Run one module through the `ansible` ad-hoc command; returns that host's result."""
    command = [str(VENV_BIN / "ansible"), host, "-i", inventory, "-m", f"dflash.ops.{module}",
               "-a", json.dumps(args)]
    if inventory == "localhost,":
        command += ["-c", "local", "-e", f"ansible_python_interpreter={sys.executable}"]
    return ansible_json(command, env, timeout)["plays"][0]["tasks"][0]["hosts"][host]


def playbook_results(playbook, inventory, host, timeout=120):
    """Run a playbook; returns the results of its tasks for one host, in order."""
    argv = [str(VENV_BIN / "ansible-playbook"), "-i", inventory, str(playbook)]
    tasks = [task for play in ansible_json(argv, timeout=timeout)["plays"] for task in play["tasks"]]
    return [task["hosts"][host] for task in tasks if host in task["hosts"]]


def wait_for(predicate, timeout=10.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


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
