"""gpu_verify run for real against a stand-in nvidia-smi on PATH that replays recorded answers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from module_runner import ansible_module, run_module
from test_nvidia_smi import (
    DRIVER_NOT_LOADED,
    H100_APPS,
    H100_BUSY,
    H100_IDLE,
    NVML_UNKNOWN,
    VERSION_MISMATCH,
)

FAKE_NVIDIA_SMI = Path(__file__).parent / "fixtures" / "fake_nvidia_smi.py"


class FakeNvidiaSmi:
    def __init__(self, tmp_path):
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        (self.bin / "nvidia-smi").symlink_to(FAKE_NVIDIA_SMI)
        self.steps = tmp_path / "steps.json"
        self.env = dict(os.environ, PATH=f"{self.bin}:{os.environ['PATH']}",
                        FAKE_NVIDIA_SMI_STEPS=str(self.steps))

    def answer(self, *steps):
        self.steps.write_text(json.dumps(list(steps)))
        Path(f"{self.steps}.calls").unlink(missing_ok=True)
        Path(f"{self.steps}.q-calls").unlink(missing_ok=True)

    def calls(self):
        return int(Path(f"{self.steps}.calls").read_text())

    def verify(self, **args):
        result, rc = run_module("gpu_verify", args, env=self.env)
        assert result.get("changed", False) is False
        assert "Traceback" not in json.dumps(result)
        return result, rc


@pytest.fixture
def smi(tmp_path):
    return FakeNvidiaSmi(tmp_path)


IDLE = {"gpus": H100_IDLE}
BUSY = {"gpus": H100_BUSY, "apps": H100_APPS}


def test_report_returns_gpus_and_processes(smi):
    smi.answer(BUSY)
    result, rc = smi.verify()
    assert rc == 0 and result["met"] is True and result["polls"] == 1
    assert [g["memory_used_mib"] for g in result["gpus"]] == [61234, 4]
    assert result["processes"][0]["pid"] == 81234 and result["processes"][0]["gpu_index"] == 0
    assert result["processes"][0]["vmid"] is None  # pid 81234 is nothing of this machine's


def test_polls_until_the_gpus_are_idle(smi):
    smi.answer(BUSY, BUSY, IDLE)
    result, rc = smi.verify(expect="idle", timeout=30, interval=0.1)
    assert rc == 0 and result["met"] is True
    assert result["polls"] == 3 == smi.calls()


def test_timeout_fails_with_a_table_of_what_it_saw(smi):
    smi.answer(BUSY)
    result, rc = smi.verify(expect="idle", timeout=2, interval=0.1)
    assert rc == 1 and result["met"] is False and result["polls"] >= 2
    assert result["reasons"] == ["GPU 0 is busy: 1 compute process(es) [81234], 61234 MiB used > 100"]
    assert "expect=idle not met after" in result["msg"]
    for line in result["table"]:
        assert line in result["msg"]
    assert any(line.split()[:5] == ["0", "61234/81559", "97", "1", "busy"] for line in result["table"])


def test_busy_on_selected_gpus(smi):
    smi.answer(BUSY)
    assert smi.verify(expect="busy", gpus=[0])[1] == 0
    assert smi.verify(expect="busy", gpus=[0, 1])[1] == 1
    assert smi.verify(expect="idle", gpus=[1])[1] == 0


def test_count_and_missing_gpu(smi):
    smi.answer(IDLE)
    result, rc = smi.verify(expect="present", count=8)
    assert rc == 1 and "2 GPU(s) listed, at least 8 required" in result["msg"]
    result, rc = smi.verify(expect="present", gpus=[3])
    assert rc == 1 and "GPU(s) [3] not listed" in result["msg"]


@pytest.mark.parametrize(
    "step, expected",
    [
        ({"gpus": DRIVER_NOT_LOADED, "rc": 9}, "cannot reach the NVIDIA driver"),
        ({"gpus": VERSION_MISMATCH, "rc": 18}, "ansible-playbook playbooks/provision.yml"),
        ({"gpus": NVML_UNKNOWN, "rc": 255}, "NVML failed to initialise"),
        ({"stderr": "Segmentation fault", "rc": 139}, "exit 139 (unknown exit code): Segmentation"),
        ({"gpus": "0, GPU-x, H100, oops, 1, 0\n"}, "gave 'oops' for memory.used"),
    ],
)
def test_driver_errors_fail_at_once_with_their_cause(smi, step, expected):
    smi.answer(step)
    result, rc = smi.verify(expect="idle", timeout=30, interval=0.1)
    assert rc == 1 and expected in result["msg"]
    assert f"exit {step['rc']}" in result["msg"] if "rc" in step else "exit" not in result["msg"]
    assert smi.calls() == 1  # no polling: waiting does not load a driver


def test_no_devices(smi):
    smi.answer({"gpus": "No devices were found\n", "rc": 6})
    result, rc = smi.verify()
    assert rc == 0 and result["gpus"] == [] and result["processes"] == []
    result, rc = smi.verify(expect="present")
    assert rc == 1 and "no GPU listed" in result["msg"] and "(no GPU listed)" in result["msg"]


def test_missing_nvidia_smi(smi):
    for executable in ("/nonexistent/nvidia-smi", "nvidia-smi-not-installed"):
        result, rc = smi.verify(executable=executable)
        assert rc == 1 and f"{executable} not found" in result["msg"]


def test_check_mode_reads_the_same(smi):
    smi.answer(BUSY)
    result, rc = smi.verify(expect="busy", gpus=[0], _ansible_check_mode=True)
    assert rc == 0 and result["met"] is True


@pytest.mark.parametrize(
    "args, complaint",
    [
        (dict(gpus=[-1]), "gpus must be GPU indices >= 0"),
        (dict(gpus=[], expect="idle"), "gpus is empty"),
        (dict(interval=0), "interval must be >= 0.1"),
        (dict(timeout=-5), "timeout must be >= 0"),
        (dict(expect="warm"), "expect"),
        (dict(gpus=["zero"]), "gpus"),
    ],
)
def test_bad_input_gets_a_clear_message(smi, args, complaint):
    smi.answer(IDLE)
    result, rc = smi.verify(**args)
    assert rc == 1 and complaint in result["msg"]


@pytest.mark.slow
def test_through_ansible(smi):
    smi.answer(BUSY, IDLE)
    result = ansible_module("gpu_verify", {"expect": "idle", "timeout": 30, "interval": 0.1},
                            env={"PATH": smi.env["PATH"], "FAKE_NVIDIA_SMI_STEPS": str(smi.steps)})
    assert result.get("failed") is not True, result
    assert result["met"] is True and result["polls"] == 2 and result["changed"] is False
