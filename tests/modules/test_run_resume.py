"""run_resume, what a container's boot runs (dflash-resume.service): it starts again exactly the runs
that were live when their container stopped, under the run's lock, once their GPUs are idle; never a
run stopped on purpose, one that finished or failed, or a second run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from module_runner import alive, ansible_module, run_module
from test_gpu_verify_local import FakeNvidiaSmi
from test_nvidia_smi import H100_APPS, H100_BUSY, H100_IDLE

from ansible_collections.dflash.ops.plugins.module_utils import run_boot, run_resume
from tests.waiting import wait_for

FAKE_RUN = str(Path(__file__).parent / "fixtures" / "fake_run.py")


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


def fabric_report(state, status):
    """`nvidia-smi -q` of a Hopper GPU on an NVSwitch board, its Fabric section as driver 550 prints it."""
    return ("\n==============NVSMI LOG==============\n\nAttached GPUs                         : 1\n"
            "GPU 00000000:18:00.0\n    Product Name                      : NVIDIA H200\n    Fabric\n"
            f"        State                         : {state}\n"
            f"        Status                        : {status}\n")


def test_on_an_nvswitch_board_the_run_waits_for_the_fabric_and_says_when_it_does_not_come(box, smi):
    """Fabric Manager sets the fabric up after the node's boot; a run started before fails with CUDA error
    802 and, failed, is never started again: the boot waits, bounded, for every Fabric State Completed."""
    box.died({"state": "running"})
    stale = box.pidfile.read_text()
    box.spec["fabric_timeout"] = 0
    (box.dir / "main.boot.json").write_text(json.dumps(box.spec))
    smi.answer({"gpus": H100_IDLE, "q": fabric_report("In Progress", "N/A")})
    result = box.boot(smi)
    assert result["outcome"] == "fabric_not_ready", result
    assert result["msg"].startswith("not started: the GPUs' NVLink fabric is In Progress/N/A after 0s"), \
        result
    assert "deploy.yml starts it once the fabric is Completed" in result["msg"]
    assert box.pidfile.read_text() == stale
    # Completed within the wait: it starts, and says it waited.
    box.spec["fabric_timeout"] = 30
    (box.dir / "main.boot.json").write_text(json.dumps(box.spec))
    smi.answer({"gpus": H100_IDLE, "q": fabric_report("In Progress", "N/A")},
               {"gpus": H100_IDLE, "q": fabric_report("Completed", "Success")})
    result = box.boot(smi)
    assert result["outcome"] == "resumed", result
    waited = r"after \d+s waiting for the GPUs' NVLink fabric to be Completed\)$"
    assert re.search(waited, result["msg"]), result


def test_the_start_writes_what_its_boot_runs_and_a_second_start_writes_nothing(box, tmp_path):
    """training_run with `boot`, through Ansible (so the program is packed from the module's own AnsiballZ
    payload): the start file, the program, the unit and its link, in the start's one call; the program runs
    on the system python alone and resumes the run killed with its container; a call that finds the run
    running writes nothing; a unit changed by hand is written again."""
    systemd, pyz = tmp_path / "systemd", tmp_path / "dflash-resume.pyz"
    spec_file = box.dir / "main.boot.json"
    spec_file.unlink()  # the module writes it
    args = {key: box.spec[key] for key in ("name", "pidfile", "log_path", "command", "chdir", "startup_wait",
                                           "wait_for", "wait_timeout")}
    args["boot"] = {"program": str(pyz), "unit_dir": str(systemd), "status_file": box.spec["status_file"]}
    first = ansible_module("training_run", args)
    assert first.get("status") == "running", first
    box.processes.track(first["pid"])
    unit = systemd / "dflash-resume.service"
    link = systemd / "multi-user.target.wants" / "dflash-resume.service"
    assert sorted(first["boot"]["changed"]) == sorted(map(str, (pyz, unit, spec_file, link))), first
    assert os.readlink(link) == "../dflash-resume.service"
    assert f'ExecStart="/usr/bin/python3" "{pyz}" "{box.dir}"\n' in unit.read_text()
    assert spec_file.stat().st_mode & 0o777 == 0o600
    spec = json.loads(spec_file.read_text())
    assert {k: spec[k] for k in ("command", "pidfile", "status_file", "gpus")} == dict(
        command=box.spec["command"], pidfile=str(box.pidfile), status_file=box.spec["status_file"], gpus=[])

    os.kill(first["pid"], signal.SIGKILL)  # killed with its container
    assert wait_for(lambda: not alive(first["pid"]))
    box.status_file.parent.mkdir(exist_ok=True)
    box.status_file.write_text(json.dumps({"state": "running"}))
    done = subprocess.run(["/usr/bin/python3", "-I", str(pyz), str(box.dir)], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    resumed = json.loads(line)
    assert resumed["outcome"] == "resumed", resumed
    box.processes.track(resumed["pid"])

    again = ansible_module("training_run", args)  # a no-change deploy: the resumed run is the one running
    assert (again["pid"], again["changed"], again["boot"]["changed"]) == (resumed["pid"], False, []), again
    unit.write_text(unit.read_text().replace("multi-user.target", "default.target"))
    mended = ansible_module("training_run", args)
    assert mended["changed"] and mended["boot"]["changed"] == [str(unit)], mended
    assert "WantedBy=multi-user.target" in unit.read_text()


def test_the_program_packs_run_resume_and_all_it_imports(tmp_path):
    """The packed program carries run_resume's whole import closure (it runs with -I, nothing else on its
    path), and the same sources pack to the same bytes (a deploy that changed nothing rewrites nothing)."""
    modules = run_boot.sources()
    assert {"run_resume", "run_start", "run_pidfile", "gpu_state", "safe_paths"} <= set(modules)
    assert "run_boot" not in modules and "pct_config" not in modules
    first = run_boot.pack(modules)
    assert run_boot.pack(run_boot.sources()) == first
    pyz = tmp_path / "dflash-resume.pyz"
    pyz.write_bytes(first)
    empty = tmp_path / "empty"
    empty.mkdir()
    done = subprocess.run(["/usr/bin/python3", "-I", str(pyz), str(empty)], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_a_run_sh_another_user_rewrote_is_not_started_at_the_boot_and_the_boot_result_says_why(box, smi,
                                                                                               tmp_path):
    release = tmp_path / "release"
    release.mkdir()
    run_sh = release / "run.sh"
    run_sh.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE_RUN} --step-after 0.2\n")
    run_sh.chmod(0o755)
    box.spec.update(command=[str(run_sh)], chdir=str(release))
    (box.dir / "main.boot.json").write_text(json.dumps(box.spec))
    before = box.died({"state": "running"})
    stale = box.pidfile.read_text()
    marker = tmp_path / "evil-ran"
    run_sh.write_text(f"#!/bin/sh\necho EVIL > {marker}\n")  # what that user's run.sh does as root
    os.chown(run_sh, 65534, 65534)
    result = box.boot(smi)
    assert result["outcome"] == "failed", result
    assert str(run_sh) in result["msg"] and "owned by uid 65534" in result["msg"], result["msg"]
    assert not marker.exists() and not alive(before) and box.pidfile.read_text() == stale
