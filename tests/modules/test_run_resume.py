"""run_resume, what a container's boot runs (dflash-resume.service): it starts again exactly the runs
that were live when their container stopped, under the run's lock, once their GPUs are idle; never a
run stopped on purpose, one that finished or failed, or a second run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from module_runner import REPO, alive, run_module
from test_gpu_verify_local import FakeNvidiaSmi
from test_nvidia_smi import H100_APPS, H100_BUSY, H100_IDLE

from ansible_collections.dflash.ops.plugins.module_utils import run_resume
from tests.waiting import wait_for

FAKE_RUN = str(Path(__file__).parent / "fixtures" / "fake_run.py")
PACK = REPO / "ansible_collections" / "dflash" / "ops" / "roles" / "dflash_run" / "files" / "pack_resume.py"
MODULE_UTILS = REPO / "ansible_collections" / "dflash" / "ops" / "plugins" / "module_utils"


class Box:
    """A container's /var/lib/dflash in a temporary directory: one run, its start file and status.json."""

    def __init__(self, tmp_path, processes):
        self.dir = tmp_path / "lib"
        self.dir.mkdir()
        self.processes = processes
        self.pidfile = self.dir / "main.pid"
        self.status_file = tmp_path / "out" / "status.json"
        self.spec = {"name": "main", "pidfile": str(self.pidfile), "log_path": str(tmp_path / "main.log"),
                     "command": [sys.executable, FAKE_RUN, "--step-after", "0.2"], "chdir": str(tmp_path),
                     "startup_wait": 0.5, "wait_for": '"event": *"step"', "wait_timeout": 20,
                     "status_file": str(self.status_file), "gpus": [0], "max_memory_mib": 256,
                     "gpu_timeout": 0}
        (self.dir / "main.boot.json").write_text(json.dumps(self.spec))
        (self.dir / "main.boot.json").chmod(0o600)

    def start(self):
        args = {k: self.spec[k] for k in ("name", "pidfile", "log_path", "command", "chdir", "wait_for")}
        result, rc = run_module("training_run", args)
        assert rc == 0, result
        self.processes.track(result["pid"])
        return result["pid"]

    def died(self, status):
        """The run killed with its container, status.json as it last wrote it."""
        pid = self.start()
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: not alive(pid))
        self.status_file.parent.mkdir(exist_ok=True)
        self.status_file.write_text(json.dumps(status))
        return pid

    def boot(self, smi):
        [result] = run_resume.resume_all(str(self.dir), str(smi.bin / "nvidia-smi"))
        assert json.loads((self.dir / "main.boot-result.json").read_text()) == result
        if result.get("pid"):
            self.processes.track(result["pid"])
        return result


@pytest.fixture
def box(tmp_path, processes):
    return Box(tmp_path, processes)


@pytest.fixture
def smi(tmp_path, monkeypatch):
    fake = FakeNvidiaSmi(tmp_path)
    fake.answer({"gpus": H100_IDLE})
    monkeypatch.setenv("FAKE_NVIDIA_SMI_STEPS", str(fake.steps))
    return fake


@pytest.mark.parametrize("status", [{"state": "running", "step": 40}, {"state": "starting"},
                                    {"state": "stopped", "stop_reason": "signal SIGTERM"}, {}],
                         ids=["killed", "killed-starting", "shut-down", "no-status"])
def test_a_run_that_was_live_when_its_container_stopped_starts_again(box, smi, status):
    before = box.died(status)
    result = box.boot(smi)
    assert result["outcome"] == "resumed", result
    assert result["previous_pid"] == before and alive(result["pid"])
    record = json.loads(box.pidfile.read_text())
    assert record["pid"] == result["pid"] and record["started_by"] == "boot"
    assert record["argv"] == box.spec["command"]
    assert '"step"' in result["progress"]
    # Booted again with the run live: nothing is started, the run is left as it is.
    again = box.boot(smi)
    assert again["outcome"] == "running" and again["pid"] == result["pid"]


@pytest.mark.parametrize("status, says", [
    ({"state": "stopped", "stop_reason": "completed"}, "it finished (completed)"),
    ({"state": "stopped", "stop_reason": "max_steps_per_run"}, "it finished (max_steps_per_run)"),
    ({"state": "failed", "error": "data.path: no file"}, "it failed (data.path: no file)"),
])
def test_a_run_that_ended_by_itself_stays_as_it_is(box, smi, status, says):
    box.died(status)
    stale = box.pidfile.read_text()
    result = box.boot(smi)
    assert result["outcome"] == "left" and says in result["msg"], result
    assert box.pidfile.read_text() == stale  # status.yml still tells how it ended


def test_a_run_stopped_on_purpose_stays_stopped(box, smi):
    box.start()
    result, rc = run_module("training_run", {"name": "main", "pidfile": str(box.pidfile), "state": "stopped"})
    assert rc == 0 and result["how"] == "terminated"
    result = box.boot(smi)
    assert result["outcome"] == "stopped" and "on purpose" in result["msg"]
    assert not box.pidfile.exists()


def test_a_run_whose_gpus_are_busy_is_not_started_over_them(box, smi):
    """Another container came back on the same GPU first: this run waits, then says why it did not start."""
    box.died({"state": "running"})
    stale = box.pidfile.read_text()
    smi.answer({"gpus": H100_BUSY, "apps": H100_APPS})
    result = box.boot(smi)
    assert result["outcome"] == "gpus_busy", result
    assert "GPU 0 is busy" in result["msg"] and "deploy.yml starts it" in result["msg"]
    assert box.pidfile.read_text() == stale
    # Idle within the wait: it starts.
    box.spec["gpu_timeout"] = 30
    (box.dir / "main.boot.json").write_text(json.dumps(box.spec))
    smi.answer({"gpus": H100_BUSY, "apps": H100_APPS}, {"gpus": H100_IDLE})
    result = box.boot(smi)
    assert result["outcome"] == "resumed" and smi.calls() >= 2, result


def test_the_packed_program_runs_on_the_system_python_alone(box, smi, tmp_path):
    box.died({"state": "running"})
    pyz = tmp_path / "dflash-resume.pyz"
    packed = subprocess.run([sys.executable, str(PACK), str(MODULE_UTILS), str(pyz)], capture_output=True,
                            text=True, check=True)
    assert json.loads(packed.stdout)["path"] == str(pyz)
    first = pyz.read_bytes()
    subprocess.run([sys.executable, str(PACK), str(MODULE_UTILS), str(pyz)], check=True, capture_output=True)
    assert pyz.read_bytes() == first  # the same sources pack to the same bytes
    env = {"PATH": f"{smi.bin}:/usr/bin:/bin", "FAKE_NVIDIA_SMI_STEPS": str(smi.steps)}
    done = subprocess.run(["/usr/bin/python3", "-I", str(pyz), str(box.dir)], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    result = json.loads(line)
    assert result["outcome"] == "resumed", result
    box.processes.track(result["pid"])
