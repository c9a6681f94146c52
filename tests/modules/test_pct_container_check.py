"""pct_container_check run for real against a stand-in pct (and sudo) that keeps its containers in a
JSON file, and its pure helpers.

The failure messages are compared whole: they are the node checks' user-facing errors (the bad-input
table of docs/RELIABILITY.md shows them), so a changed word is a changed contract.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from module_runner import ansible_module, run_module

from ansible_collections.dflash.ops.plugins.module_utils.pct_cli import Answer, pct_cannot_run
from ansible_collections.dflash.ops.plugins.modules.pct_container_check import (
    gpu_passthrough_lines,
    node_containers,
)

FIXTURES = Path(__file__).parent / "fixtures"
NODE = "pve1"


def gpu_lines(count):
    """What `nvidia-smi --query-gpu=index,uuid --format=csv,noheader,nounits` prints for `count` GPUs."""
    return "".join(f"{i}, GPU-{i:08x}-0000-0000-0000-000000000000\n" for i in range(count))


EIGHT_GPUS = gpu_lines(8)
PASSTHROUGH = ["dev0: /dev/nvidia0", "dev1: /dev/nvidiactl", "dev2: /dev/nvidia-uvm",
               "lxc.cgroup2.devices.allow: c 195:* rwm"]
CONFIG = ["arch: amd64", "cores: 2", *PASSTHROUGH[:3], "hostname: ct200", "memory: 8192", PASSTHROUGH[3]]
NVIDIA_SMI = ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader,nounits"]
# What pvesim's (and Proxmox's) pct exec says when the command does not exist in the container.
NO_NVIDIA_SMI = ('lxc-attach: 200: ../src/lxc/attach.c: lxc_attach_run_command: 1841 No such file or '
                 'directory - Failed to exec "nvidia-smi"\n')
DRIVER_ERROR = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                "Make sure that the latest NVIDIA driver is installed and running.\n")


class FakeNode:
    """A node whose pct is tests/modules/fixtures/fake_pct.py, with containers set per test."""

    def __init__(self, tmp_path):
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        self.pct = self.bin / "pct"
        self.pct.symlink_to(FIXTURES / "fake_pct.py")
        self.sudo = self.bin / "sudo"
        self.sudo.symlink_to(FIXTURES / "fake_sudo.py")
        self.state = tmp_path / "pct.json"
        self.env = dict(os.environ, FAKE_PCT_STATE=str(self.state))
        self.containers({})

    def containers(self, containers, start_fails=""):
        self.state.write_text(json.dumps({"containers": {str(k): v for k, v in containers.items()},
                                          "start_fails": start_fails}))
        Path(f"{self.state}.calls").unlink(missing_ok=True)

    def status(self, vmid):
        return json.loads(self.state.read_text())["containers"][str(vmid)]["status"]

    def calls(self):
        path = Path(f"{self.state}.calls")
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def check(self, **args):
        args = {"node_name": NODE, "pct_argv": [str(self.pct)], **args}
        result, rc = run_module("pct_container_check", args, env=self.env)
        assert "Traceback" not in json.dumps(result), result
        return result, rc


def container(status="running", config=CONFIG, smi=EIGHT_GPUS, smi_rc=0, smi_stderr=""):
    return {"status": status, "config": config, "exec": {"rc": smi_rc, "stdout": smi, "stderr": smi_stderr}}


@pytest.fixture
def node(tmp_path):
    return FakeNode(tmp_path)


def test_a_running_container_with_its_gpus_passes_in_three_pct_calls(node):
    node.containers({200: container(), 201: container()})
    result, rc = node.check(vmid=200, required_gpus=[0, 3, 7], require_gpu_passthrough=True)
    assert rc == 0 and result["changed"] is False, result
    assert result["status"] == "running" and result["started"] is False
    assert result["gpu_passthrough"] == PASSTHROUGH and result["gpu_count"] == 8
    assert result["msg"] == ("CT 200 on node pve1: running, 4 GPU passthrough line(s), 8 GPU(s) in "
                             "nvidia-smi")
    assert node.calls() == [["status", "200"], ["config", "200"], ["exec", "200", "--", *NVIDIA_SMI]]


def test_without_required_gpus_nvidia_smi_is_not_run(node):
    node.containers({200: container(smi_rc=127)})
    result, rc = node.check(vmid=200)
    assert rc == 0 and result["gpu_count"] is None, result
    assert [call[0] for call in node.calls()] == ["status", "config"]


def test_a_missing_container_names_the_containers_of_the_node(node):
    node.containers({200: container(), 201: container(status="stopped")})
    result, rc = node.check(vmid=299, required_gpus=[0])
    assert rc == 1 and result["msg"] == (
        "CT 299 does not exist on node pve1 (pct: Configuration file 'nodes/pve1/lxc/299.conf' does not "
        "exist). Fix proxmox_vmid (or proxmox_node) in the inventory; the node has 200, 201.")
    assert result["containers"] == [200, 201] and result["status"] is None
    assert node.calls() == [["status", "299"], ["list"]]


def test_a_node_without_containers_says_so(node):
    result, rc = node.check(vmid=200)
    assert rc == 1 and result["msg"].endswith("the node has no containers.") and result["containers"] == []


def test_a_stopped_container_fails_and_is_left_stopped(node):
    node.containers({201: container(status="stopped")})
    result, rc = node.check(vmid=201, required_gpus=[0])
    assert rc == 1 and result["msg"] == (
        "CT 201 on node pve1 is not running (status: stopped). Start it with `pct start 201` or set "
        "proxmox_host_start_containers: true.")
    assert result["changed"] is False and result["status"] == "stopped"
    assert node.status(201) == "stopped" and node.calls() == [["status", "201"]]


def test_a_stopped_container_is_started_when_allowed_then_checked(node):
    node.containers({201: container(status="stopped")})
    result, rc = node.check(vmid=201, start_stopped=True, required_gpus=[0, 1])
    assert rc == 0 and result["changed"] is True and result["started"] is True, result
    assert result["status"] == "stopped" and result["gpu_count"] == 8
    assert node.status(201) == "running"
    assert [call[0] for call in node.calls()] == ["status", "config", "start", "exec"]
    # Running now: the next check changes nothing.
    result, rc = node.check(vmid=201, start_stopped=True, required_gpus=[0, 1])
    assert rc == 0 and result["changed"] is False and result["started"] is False


def test_check_mode_reports_the_start_without_starting(node):
    node.containers({201: container(status="stopped")})
    result, rc = node.check(vmid=201, start_stopped=True, required_gpus=[0], _ansible_check_mode=True)
    assert rc == 0 and result["changed"] is True and result["started"] is True, result
    assert result["gpu_count"] is None  # nothing to ask nvidia-smi in a stopped container
    assert node.status(201) == "stopped"
    assert [call[0] for call in node.calls()] == ["status", "config"]


def test_a_start_that_fails_says_what_pct_said(node):
    node.containers({201: container(status="stopped")}, start_fails="lxc-start: 201: no rootfs")
    result, rc = node.check(vmid=201, start_stopped=True)
    assert rc == 1 and result["msg"] == (
        "CT 201 on node pve1 did not start (pct start 201, exit 255): startup for container '201' failed\n"
        "lxc-start: 201: no rootfs. A device its config passes through may be missing on pve1: compare "
        "pct config 201 with ls -l /dev/nvidia* on pve1.")
    assert result["started"] is False and result["changed"] is False and node.status(201) == "stopped"


@pytest.mark.parametrize("kind", ["absent", "not executable"])
def test_a_pct_that_cannot_be_run_fails_clearly(node, tmp_path, kind):
    node.containers({200: container()})
    pct = tmp_path / "sbin" / "pct"
    reason = "No such file or directory"
    if kind == "not executable":
        pct.parent.mkdir()
        pct.write_text("#!/bin/sh\n")
        reason = "Permission denied"
    result, rc = node.check(vmid=200, pct_argv=[str(pct)])
    assert rc == 1 and result["msg"] == (
        f"{pct} is missing on node pve1 or cannot be run there ({pct}: {reason}). Is it a Proxmox VE node, "
        "and is the inventory's ansible_host of pve1 its address?")


def test_pct_goes_through_the_argv_prefix_and_sudo_s_not_found_means_missing(node, tmp_path):
    node.containers({200: container(status="stopped")})
    result, rc = node.check(vmid=200, pct_argv=[str(node.sudo), "-n", str(node.pct)], start_stopped=True,
                            required_gpus=[0])
    assert rc == 0 and result["started"] is True, result
    sudo_calls = [json.loads(line) for line in Path(f"{node.state}.sudo").read_text().splitlines()]
    assert sudo_calls == [["-n", str(node.pct), *call] for call in node.calls()]
    assert [call[0] for call in node.calls()] == ["status", "config", "start", "exec"]

    missing = tmp_path / "usr" / "sbin" / "pct"
    result, rc = node.check(vmid=200, pct_argv=[str(node.sudo), "-n", str(missing)])
    assert rc == 1 and result["msg"].startswith(
        f"{missing} is missing on node pve1 or cannot be run there (sudo: {missing}: command not found).")


def test_no_gpu_passthrough_fails_only_when_required(node):
    plain = [line for line in CONFIG if line not in PASSTHROUGH]
    node.containers({200: container(config=plain)})
    result, rc = node.check(vmid=200)
    assert rc == 0 and result["gpu_passthrough"] == [], result
    result, rc = node.check(vmid=200, require_gpu_passthrough=True, required_gpus=[0])
    assert rc == 1 and result["msg"] == (
        "CT 200 on node pve1 has no GPU passthrough lines (lxc.cgroup2.devices.allow / lxc.mount.entry for "
        "/dev/nvidia*, or devN: /dev/nvidia*) in its config.")
    assert "exec" not in [call[0] for call in node.calls()]


def test_nvidia_smi_missing_in_the_container(node):
    # lxc-attach's "No such file or directory" is about nvidia-smi in the container, not about pct.
    node.containers({200: container(smi="", smi_rc=127, smi_stderr=NO_NVIDIA_SMI)})
    result, rc = node.check(vmid=200, required_gpus=[0])
    assert rc == 1 and result["msg"] == (
        f"nvidia-smi is missing in CT 200 on node pve1 ({NO_NVIDIA_SMI.strip()}). Install the NVIDIA "
        "driver's user-space tools in the container (the node's driver version, without the kernel module), "
        "or set dflash_run_verify_gpus: false for a run without GPUs.")


def test_nvidia_smi_failing_in_the_container(node):
    node.containers({200: container(smi=DRIVER_ERROR, smi_rc=9, smi_stderr="")})
    result, rc = node.check(vmid=200, required_gpus=[0])
    assert rc == 1 and result["msg"] == (
        f"nvidia-smi fails in CT 200 on node pve1 (exit 9): {DRIVER_ERROR.strip()} Check the driver on the "
        "node (nvidia-smi on pve1), that the container's user-space driver has the node's version, and the "
        "container's GPU passthrough (pct config 200).")


def test_nvidia_smi_answering_what_cannot_be_read(node):
    node.containers({200: container(smi="0\n1\n")})  # an index alone: not what the query asks for
    result, rc = node.check(vmid=200, required_gpus=[0])
    assert rc == 1 and result["msg"] == (
        "nvidia-smi in CT 200 on node pve1: unexpected nvidia-smi GPU line (want 2 fields): '0'. Check the "
        "driver on the node (nvidia-smi on pve1), that the container's user-space driver has the node's "
        "version, and the container's GPU passthrough (pct config 200).")
    assert result["gpu_count"] is None


def test_fewer_gpus_than_the_layout_names(node):
    node.containers({200: container(smi=gpu_lines(2))})
    result, rc = node.check(vmid=200, required_gpus=[0, 1, 2, 5])
    assert rc == 1 and result["msg"] == (
        "CT 200 on node pve1 has 2 GPU(s) (nvidia-smi in the container: indices 0..1), but the run's layout "
        "names GPU(s) [2, 5]. Fix the layout (dflash_release_target_gpus, dflash_release_drafter_gpus, "
        "dflash_run_gpus) or pass more GPUs through to the container.")
    assert node.check(vmid=200, required_gpus=[0, 1])[1] == 0


@pytest.mark.parametrize(
    "args, complaint",
    [
        (dict(required_gpus=[-1]), "required_gpus must be GPU indices >= 0"),
        (dict(pct_argv=[]), "pct_argv is empty"),
        (dict(vmid="ct200"), "vmid"),
    ],
)
def test_bad_input_gets_a_clear_message(node, args, complaint):
    node.containers({200: container()})
    result, rc = node.check(**{"vmid": 200, **args})
    assert rc == 1 and complaint in result["msg"]
    assert node.calls() == []


def test_node_containers_reads_pct_list():
    listing = ("VMID       Status     Lock         Name                \n"
               "200        running                 ct200               \n"
               "201        stopped    backup       ct201               \n\n")
    assert node_containers(listing) == ["200", "201"]
    assert node_containers("") == []


@pytest.mark.parametrize(
    "line, passes",
    [
        ("lxc.cgroup2.devices.allow: c 195:* rwm", True),
        ("lxc.cgroup.devices.allow: c 195:* rwm", True),
        ("lxc.cgroup2.devices.allow: c 508:* rwm", True),
        ("lxc.cgroup2.devices.allow: c 236:* rwm", True),
        ("lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file", True),
        ("dev3: /dev/nvidia-uvm", True),
        ("lxc.cgroup2.devices.allow: c 10:200 rwm", False),
        ("lxc.mount.entry: /dev/net/tun dev/net/tun none bind,create=file", False),
        ("dev0: /dev/dri/card0", False),
        ("description: dev0: /dev/nvidia0", False),
    ],
)
def test_gpu_passthrough_lines(line, passes):
    assert gpu_passthrough_lines(f"arch: amd64\n{line}\nswap: 0\n") == ([line] if passes else [])


@pytest.mark.parametrize(
    "answer, cannot_run",
    [
        (Answer(None, "", "/usr/sbin/pct: No such file or directory"), True),
        (Answer(127, "", "sh: 1: /usr/sbin/pct: not found"), True),
        (Answer(126, "", "sh: 1: /usr/sbin/pct: Permission denied"), True),
        (Answer(1, "", "sudo: /usr/sbin/pct: command not found"), True),
        (Answer(255, "", "Configuration file 'nodes/pve1/lxc/299.conf' does not exist"), False),
        (Answer(1, "", "sudo: a password is required"), False),
        (Answer(0, "status: running\n", ""), False),
    ],
)
def test_pct_cannot_run(answer, cannot_run):
    assert pct_cannot_run(answer, "/usr/sbin/pct") is cannot_run


@pytest.mark.slow
def test_through_ansible(node):
    node.containers({200: container()})
    args = {"vmid": 200, "node_name": NODE, "pct_argv": [str(node.pct)], "required_gpus": [7]}
    result = ansible_module("pct_container_check", args, env={"FAKE_PCT_STATE": str(node.state)})
    assert result.get("failed") is not True, result
    assert result["gpu_count"] == 8 and result["changed"] is False
