"""pvesim's NVIDIA device nodes and NVSwitch boards: no device node exists after a node's boot until
nvidia-modprobe, nvidia-smi (not /dev/nvidia-uvm) or a CUDA program makes it; nvidia-modprobe makes exactly
the files of its options (NVIDIA/nvidia-modprobe, nvidia-modprobe.c main()); pct refuses a devN path the
node lacks at create and at every start, the onboot start after a reboot included; the node's own units
ordered Before=pve-guests.service run before startall, and the proxmox_host role's unit makes every file
the container passes through; on an NVSwitch board CUDA fails with error 802 until the fabric manager of
the driver's version runs, while nvidia-smi lists every GPU."""

import os
import subprocess

import pytest

from pvesim import node, prerequisites
from pvesim.container import DRIVER_VERSION
from tests.roles.readme_commands import device_unit

pytestmark = [pytest.mark.sim]

DEVICES = "/dev/nvidia0 /dev/nvidia1 /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools"
MISSING_UVM = "Device /dev/nvidia-uvm does not exist\n"
INVALID = ("\nERROR: Invalid commandline, please run `nvidia-modprobe --help` for usage information.\n\n\n")


def on_node(sim, command, rc=0):
    res = sim.ssh("pve1", command)
    assert res.returncode == rc, f"{command}: {res.returncode} {res.stdout} {res.stderr}"
    return res


def present(sim):
    """The device files of DEVICES that the node's sessions see as character devices."""
    out = on_node(sim, f"for f in {DEVICES}; do test -c $f && echo $f; done; true").stdout
    return out.split()


def nvidia_files(sim):
    """{path: (major, minor)} of every NVIDIA character device in the node's /dev (and /dev/nvidia-caps)."""
    out = on_node(sim, "for f in /dev/nvidia*; do test -c $f && stat -c '%n %t %T' $f; done; true").stdout
    return {path: (int(major, 16), int(minor, 16)) for path, major, minor in (line.split() for line in
                                                                              out.splitlines())}


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
    assert nvidia_files(sim) == {"/dev/nvidia0": (195, 0), "/dev/nvidia1": (195, 1),
                                 "/dev/nvidiactl": (195, 255)}
    start = on_node(sim, "pct start 310", rc=2)
    assert start.stderr == MISSING_UVM
    # pct create checks every devN path too.
    template = "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst"
    create = on_node(sim, f"pct create 311 {template} --dev0 /dev/nvidia-uvm", rc=2)
    assert create.stderr == MISSING_UVM
    # nvidia-modprobe -u -c0 loads nvidia-uvm and makes both of its device files.
    on_node(sim, "nvidia-modprobe -u -c0")
    assert present(sim) == DEVICES.split()
    assert "nvidia_uvm" in on_node(sim, "lsmod").stdout.split()
    on_node(sim, "pct start 310")
    # The node's devices are its own: the machine's /dev has none of them, also when the node's tools run
    # outside a session on the node.
    tools = node.NodeFiles(sim.state_dir, "pve1").bin
    assert subprocess.run([str(tools / "nvidia-smi"), "-L"], capture_output=True).returncode == 0
    assert subprocess.run([str(tools / "nvidia-modprobe"), "-c0", "-u"], capture_output=True).returncode == 1
    assert not [name for name in os.listdir("/dev") if name.startswith("nvidia")]


# (command, exit status, the files it leaves in a /dev that had none) as nvidia-modprobe.c main() and
# nvidia-modprobe-utils.c make them: -cN only /dev/nvidiaN (whether a GPU has that minor or not), -c255
# /dev/nvidiactl (assign_device_file_name); -u only the uvm pair, of minors N and N + 1 (nvidia_uvm_mknod);
# -m /dev/nvidia-modeset (195:254); -s the NVSwitch files; the first file it cannot make ends it (exit 1).
MODPROBE = [
    ("nvidia-modprobe -c0", 0, {"/dev/nvidia0": (195, 0)}),
    ("nvidia-modprobe -c 255 -c=1", 0, {"/dev/nvidiactl": (195, 255), "/dev/nvidia1": (195, 1)}),
    ("nvidia-modprobe -c0 -u", 0, {"/dev/nvidia-uvm": (511, 0), "/dev/nvidia-uvm-tools": (511, 1)}),
    ("nvidia-modprobe -u", 0, {}),
    ("nvidia-modprobe --create-nvidia-device-file=7", 0, {"/dev/nvidia7": (195, 7)}),
    ("nvidia-modprobe -c1 -c256 -c0", 1, {"/dev/nvidia1": (195, 1)}),
    ("nvidia-modprobe -m", 0, {"/dev/nvidia-modeset": (195, 254)}),
    ("nvidia-modprobe -s -c0 -c255", 0, {"/dev/nvidia-nvswitch0": (510, 0),
                                         "/dev/nvidia-nvswitchctl": (510, 255)}),
    ("nvidia-modprobe -um -c0", 0, {"/dev/nvidia-uvm": (511, 0), "/dev/nvidia-uvm-tools": (511, 1),
                                    "/dev/nvidia-modeset": (195, 254)}),
]


def test_nvidia_modprobe_makes_exactly_the_files_of_its_options(sim_factory):
    sim = sim_factory(nodes=1, containers=(313,), gpus=2)
    clear = "rm -f /dev/nvidia*"
    for command, rc, files in MODPROBE:
        on_node(sim, clear)
        assert sim.ssh("pve1", command).returncode == rc, command
        assert nvidia_files(sim) == files, command
    assert "nvidia_uvm" in on_node(sim, "lsmod").stdout.split()
    modules = (node.NodeFiles(sim.state_dir, "pve1").dev_current / "modules").read_text().split()
    assert {"nvidia", "nvidia_uvm", "nvidia_modeset"} == set(modules)
    # What nvgetopt cannot read ends it before anything is made: its line, then main()'s.
    on_node(sim, clear)
    bad = on_node(sim, "nvidia-modprobe -c0 -x", rc=1)
    assert bad.stderr == 'nvidia-modprobe: unrecognized option: "-x"\n' + INVALID
    bad = on_node(sim, "nvidia-modprobe -c zero", rc=1)
    assert bad.stderr == 'nvidia-modprobe: "zero" is not a valid argument for option "-c".\n' + INVALID
    assert nvidia_files(sim) == {}
    assert on_node(sim, "nvidia-modprobe -v").stdout == f"\nnvidia-modprobe:  version {DRIVER_VERSION}\n\n"


def test_the_role_s_unit_before_pve_guests_makes_every_file_for_the_onboot_start(sim_factory):
    sim = sim_factory(nodes=1, containers=(312,), gpus=2)
    on_node(sim, "pct set 312 --onboot 1")
    unit = device_unit([0, 1])
    on_node(sim, f"cat > /etc/systemd/system/dflash-nvidia-devices.service <<'EOF'\n{unit}EOF\n"
                 "systemctl enable dflash-nvidia-devices")
    assert on_node(sim, "systemctl is-enabled dflash-nvidia-devices").stdout == "enabled\n"

    log = sim.reboot_node("pve1")

    assert "does not exist" not in log, log
    assert on_node(sim, "pct status 312").stdout == "status: running\n"
    assert nvidia_files(sim) == {"/dev/nvidiactl": (195, 255), "/dev/nvidia0": (195, 0),
                                 "/dev/nvidia1": (195, 1), "/dev/nvidia-uvm": (511, 0),
                                 "/dev/nvidia-uvm-tools": (511, 1)}
    assert on_node(sim, "systemctl is-active dflash-nvidia-devices").stdout == "active\n"


def test_an_nvswitch_board_fails_cuda_with_802_until_the_fabric_manager_of_the_driver_s_version_runs(
        sim_factory):
    sim = sim_factory(nodes=1, containers=(314,), gpus=2, nvswitch=True)

    def fabric(command="nvidia-smi -q"):
        report = on_node(sim, command).stdout
        return [line.split(":", 1)[1].strip() for line in report.splitlines()
                if line.strip().startswith(("State ", "Status "))]

    # pvesim up: the fabric manager of the driver's version installed, enabled and running; the container
    # sees the same fabric state. lspci shows HGX H200's four NVSwitches.
    assert fabric() == ["Completed", "Success"] * 2
    assert fabric("pct exec 314 -- nvidia-smi -q") == ["Completed", "Success"] * 2
    assert on_node(sim, "lspci -n -d 10de::0680").stdout == "".join(
        f"{bus:02x}:00.0 0680: 10de:22a3 (rev a1)\n" for bus in range(5, 9))
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


def test_an_a100_nvswitch_board_has_no_fabric_section_and_lspci_shows_its_nvswitches(sim_factory):
    """NVML's fabric info is Hopper's and later's: an A100's nvidia-smi -q has no Fabric section, NVSwitch
    board or not, and CUDA still fails with 802 until the fabric manager runs."""
    sim = sim_factory(nodes=1, containers=(318,), gpus=2, nvswitch=True, gpu_generation="ampere")
    report = on_node(sim, "nvidia-smi -q").stdout
    assert "Fabric" not in report
    assert "    Product Name                      : NVIDIA A100-SXM4-80GB\n" in report
    assert on_node(sim, "lspci -n -d 10de::0680").stdout.count(" 0680: 10de:1af1 (rev a1)\n") == 6
    assert on_node(sim, "lspci -d 10de:").stdout.splitlines()[-2:] == [
        "18:00.0 3D controller: NVIDIA Corporation Device 20b2 (rev a1)",
        "19:00.0 3D controller: NVIDIA Corporation Device 20b2 (rev a1)"]
    on_node(sim, "pvesim-cuda-init")
    prerequisites.set_fabric_manager(sim, "pve1", DRIVER_VERSION, running=False, enabled=False)
    sim.reboot_node("pve1")
    assert on_node(sim, "pvesim-cuda-init", rc=1).stdout.startswith("cuInit(0) failed: error 802 ")
    assert "Fabric" not in on_node(sim, "nvidia-smi -q").stdout


def test_a_board_without_nvswitches_has_no_fabric_to_wait_for(sim_factory):
    sim = sim_factory(nodes=1, containers=(316,), gpus=1)
    report = on_node(sim, "nvidia-smi -q").stdout
    assert "    Fabric\n        State                         : N/A\n" in report, report
    assert on_node(sim, "lspci -n -d 10de::0680").stdout == ""
    assert on_node(sim, "lspci -nn").stdout == (
        "18:00.0 3D controller [0302]: NVIDIA Corporation Device [10de:2335] (rev a1)\n")
    assert on_node(sim, "pvesim-cuda-init").stdout == "cuInit(0): CUDA_SUCCESS, 1 device(s)\n"
