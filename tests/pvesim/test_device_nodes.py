"""pvesim's NVIDIA device nodes and NVSwitch boards: no device node exists after a node's boot until
nvidia-modprobe, nvidia-smi (not /dev/nvidia-uvm) or a CUDA program makes it; pct refuses a devN path the
node lacks at create and at every start, the onboot start after a reboot included; the node's own units
ordered Before=pve-guests.service run before startall; on an NVSwitch board CUDA fails with error 802
until the fabric manager of the driver's version runs, while nvidia-smi lists every GPU."""

import os
import subprocess

import pytest

from pvesim import node, prerequisites
from pvesim.container import DRIVER_VERSION

pytestmark = [pytest.mark.sim]

DEVICES = "/dev/nvidia0 /dev/nvidia1 /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools"
MISSING_UVM = "Device /dev/nvidia-uvm does not exist\n"
UNIT = """[Unit]
Description=probe
Before=pve-guests.service
[Service]
Type=oneshot
ExecStart=nvidia-modprobe -c0 -u
ExecStart=nvidia-modprobe -c1
[Install]
WantedBy=multi-user.target
"""


def on_node(sim, command, rc=0):
    res = sim.ssh("pve1", command)
    assert res.returncode == rc, f"{command}: {res.returncode} {res.stdout} {res.stderr}"
    return res


def present(sim):
    """The device files of DEVICES that the node's sessions see as character devices."""
    out = on_node(sim, f"for f in {DEVICES}; do test -c $f && echo $f; done; true").stdout
    return out.split()


def test_device_nodes_come_from_nvidia_modprobe_and_nvidia_smi_not_from_the_boot(sim_factory):
    sim = sim_factory(nodes=1, containers=(310,), gpus=2)
    assert present(sim) == DEVICES.split()  # pvesim up: a node its admin prepared since its boot
    on_node(sim, "pct set 310 --onboot 1")
    log = sim.reboot_node("pve1")

    # The boot made none: CT 310's onboot start failed in PVE's words, and lsmod has no nvidia_uvm.
    assert "Device /dev/nvidia0 does not exist" in log, log
    assert on_node(sim, "pct status 310").stdout == "status: stopped\n"
    assert present(sim) == []
    assert "nvidia_uvm" not in on_node(sim, "lsmod").stdout.split()
    # nvidia-smi (NVML) makes the control device and the GPUs', not CUDA's unified memory devices.
    assert on_node(sim, "nvidia-smi -L").stdout.count("GPU ") == 2
    assert present(sim) == ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl"]
    start = on_node(sim, "pct start 310", rc=2)
    assert start.stderr == MISSING_UVM
    # pct create checks every devN path too.
    template = "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst"
    create = on_node(sim, f"pct create 311 {template} --dev0 /dev/nvidia-uvm", rc=2)
    assert create.stderr == MISSING_UVM
    # nvidia-modprobe -u loads nvidia-uvm and makes both of its device nodes; a GPU the node lacks fails.
    on_node(sim, "nvidia-modprobe -c0 -u")
    assert present(sim) == DEVICES.split()
    assert "nvidia_uvm" in on_node(sim, "lsmod").stdout.split()
    on_node(sim, "nvidia-modprobe -c 7", rc=1)
    on_node(sim, "pct start 310")
    # The node's devices are its own: the machine's /dev has none of them, also when the node's tools run
    # outside a session on the node.
    tools = node.NodeFiles(sim.state_dir, "pve1").bin
    assert subprocess.run([str(tools / "nvidia-smi"), "-L"], capture_output=True).returncode == 0
    assert subprocess.run([str(tools / "nvidia-modprobe"), "-c0", "-u"], capture_output=True).returncode == 1
    assert not [name for name in os.listdir("/dev") if name.startswith("nvidia")]


def test_a_unit_before_pve_guests_makes_the_device_nodes_for_the_onboot_start(sim_factory):
    sim = sim_factory(nodes=1, containers=(312,), gpus=2)
    on_node(sim, "pct set 312 --onboot 1")
    on_node(sim, f"cat > /etc/systemd/system/probe-devices.service <<'EOF'\n{UNIT}EOF\n"
                 "systemctl enable probe-devices")
    assert on_node(sim, "systemctl is-enabled probe-devices").stdout == "enabled\n"

    log = sim.reboot_node("pve1")

    assert "does not exist" not in log, log
    assert on_node(sim, "pct status 312").stdout == "status: running\n"
    assert present(sim) == DEVICES.split()
    assert on_node(sim, "systemctl is-active probe-devices").stdout == "active\n"


def test_an_nvswitch_board_fails_cuda_with_802_until_the_fabric_manager_of_the_driver_s_version_runs(
        sim_factory):
    sim = sim_factory(nodes=1, containers=(314,), gpus=2, nvswitch=True)

    def fabric():
        report = on_node(sim, "nvidia-smi -q").stdout
        return [line.split(":", 1)[1].strip() for line in report.splitlines()
                if line.strip().startswith(("State ", "Status "))]

    # pvesim up: the fabric manager of the driver's version installed, enabled and running.
    assert fabric() == ["Completed", "Success"] * 2
    assert on_node(sim, "pvesim-cuda-init").stdout == "cuInit(0): CUDA_SUCCESS, 2 device(s)\n"
    version = on_node(sim, "nv-fabricmanager --version").stdout
    assert version == f"Fabric Manager version is : {DRIVER_VERSION}\n"
    # Another version of it: after the reboot its unit fails, the fabric stays "In Progress", CUDA fails
    # with 802, and nvidia-smi lists every GPU anyway.
    prerequisites.set_fabric_manager(sim, "pve1", "550.90.07", running=False)
    sim.reboot_node("pve1")
    assert on_node(sim, "systemctl is-active nvidia-fabricmanager", rc=3).stdout == "failed\n"
    assert fabric() == ["In Progress", "N/A"] * 2
    assert on_node(sim, "nvidia-smi -L").stdout.count("GPU ") == 2
    cuda = on_node(sim, "pvesim-cuda-init", rc=1)
    assert cuda.stdout == ("cuInit(0) failed: error 802 (CUDA_ERROR_SYSTEM_NOT_READY: system not yet "
                           "initialized)\n")
    # The driver's version, started: the fabric is set up and CUDA initialises.
    prerequisites.set_fabric_manager(sim, "pve1", DRIVER_VERSION)
    assert on_node(sim, "systemctl is-active nvidia-fabricmanager").stdout == "active\n"
    assert fabric() == ["Completed", "Success"] * 2
    on_node(sim, "pvesim-cuda-init")


def test_a_board_without_nvswitches_has_no_fabric_to_wait_for(sim_factory):
    sim = sim_factory(nodes=1, containers=(316,), gpus=1)
    report = on_node(sim, "nvidia-smi -q").stdout
    assert "    Fabric\n        State                         : N/A\n" in report, report
    assert on_node(sim, "pvesim-cuda-init").stdout == "cuInit(0): CUDA_SUCCESS, 1 device(s)\n"
