"""pct_container_check's reading of GPU passthrough (every form Proxmox takes), of pct's failures
(only pct's own path missing is a missing pct; only a missing config is a missing container), and of
GPUs another container holds."""

from __future__ import annotations

import pytest

from ansible_collections.dflash.ops.plugins.module_utils.nvidia_smi import COMPUTE_APPS
from ansible_collections.dflash.ops.plugins.module_utils.pct_cli import Answer, CheckFailed, pct_cannot_run
from ansible_collections.dflash.ops.plugins.modules.pct_container_check import (
    Pct,
    container_gpus,
    gpu_holders,
    gpu_passthrough_lines,
    passed_devices,
    passthrough_problem,
    shared_gpu_message,
    status_failure_message,
)

PCT = "/usr/sbin/pct"
UUIDS = ["GPU-aaaa", "GPU-bbbb"]


@pytest.mark.parametrize("config, devices", [
    # PVE 8.1+: devN entries, plain or as a property string.
    ("dev0: /dev/nvidia1\ndev1: /dev/nvidiactl\ndev2: /dev/nvidia-uvm\n",
     ["/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"]),
    ("dev0: path=/dev/nvidia3,mode=0666\ndev1: mode=0660,path=/dev/nvidiactl\ndev2: /dev/nvidia-uvm\n",
     ["/dev/nvidia3", "/dev/nvidiactl", "/dev/nvidia-uvm"]),
    # Before: cgroup rules and bind mounts, as pct config prints them (`lxc.key: value`) or as written.
    ("lxc.cgroup2.devices.allow: c 195:* rwm\nlxc.cgroup2.devices.allow: c 508:* rwm\n"
     "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file\n"
     "lxc.mount.entry = /dev/nvidiactl dev/nvidiactl none bind,optional,create=file\n"
     "lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file\n",
     ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"]),
])
def test_every_passthrough_form_names_its_devices(config, devices):
    lines = gpu_passthrough_lines("arch: amd64\nhostname: ct200\n" + config)
    assert passed_devices(lines) == devices
    assert passthrough_problem(200, "pve1", devices) is None


def test_a_passthrough_without_nvidia_uvm_is_named():
    problem = passthrough_problem(200, "pve1", ["/dev/nvidia0", "/dev/nvidiactl"])
    assert problem.startswith("CT 200 on node pve1 does not pass through /dev/nvidia-uvm (its config passes "
                              "through /dev/nvidia0, /dev/nvidiactl).")
    assert "a GPU (/dev/nvidia<N>), /dev/nvidiactl, /dev/nvidia-uvm" in passthrough_problem(200, "pve1", [])


@pytest.mark.parametrize("answer, missing", [
    (Answer(None, "", f"{PCT}: No such file or directory"), True),
    (Answer(1, "", f"sudo: {PCT}: command not found"), True),
    (Answer(127, "", f"bash: {PCT}: No such file or directory"), True),
    # What a real pct start says when the container's bind mount of /dev/nvidia-uvm fails: pct ran.
    (Answer(1, "", 'mount_entry: 2416 No such file or directory - Failed to mount "/dev/nvidia-uvm" onto '
                   '"/usr/lib/x86_64-linux-gnu/lxc/rootfs/dev/nvidia-uvm"\n'
                   "command 'systemctl start pve-container@200' failed: exit code 1"), False),
    (Answer(2, "", "Device /dev/nvidia9 does not exist"), False),
])
def test_only_pct_s_own_path_missing_means_pct_is_missing(answer, missing):
    assert pct_cannot_run(answer, PCT) is missing


@pytest.mark.parametrize("stderr, rc, expected", [
    ("Configuration file 'nodes/pve1/lxc/299.conf' does not exist", 2,
     "CT 299 does not exist on node pve1 (pct: Configuration file 'nodes/pve1/lxc/299.conf' does not "
     "exist)."),
    ("please run as root", 255,
     "pct on node pve1 refuses this user (please run as root): pct runs as root only."),
    ("sudo: a password is required", 1,
     "sudo on node pve1 does not let this user run /usr/sbin/pct (sudo: a password is required)."),
    ("ipcc_send_rec[1] failed: Connection refused", 255,
     "pct status 299 failed on node pve1 (exit 255): ipcc_send_rec[1] failed: Connection refused. The node's "
     "Proxmox services (pve-cluster, the cluster filesystem /etc/pve) may be down"),
])
def test_a_failed_pct_status_says_what_failed(stderr, rc, expected):
    message = status_failure_message(Pct([PCT], "pve1"), 299, Answer(rc, "", stderr), ["200", "201"])
    assert message.startswith(expected), message
    assert ("does not exist" in message) == ("Configuration file" in stderr)


def test_gpus_held_by_another_container_or_the_node_are_named():
    apps = COMPUTE_APPS.parse("4100, GPU-aaaa, 1024\n4200, GPU-bbbb, 2048\n4300, GPU-cccc, 512\n"
                              "4400, GPU-aaaa, 100\n[N/A], GPU-bbbb, 5\n")
    owners = {4100: 200, 4200: 201, 4300: 202, 4400: None}
    holders = gpu_holders(apps, UUIDS, [0, 1], 200, owners.get)
    # CT 200's own process is not a holder; GPU-cccc is not one of the run's GPUs; a process without a pid
    # cannot be looked up.
    assert holders == [(0, "GPU-aaaa", None, 4400, 100), (1, "GPU-bbbb", 201, 4200, 2048)]
    message = shared_gpu_message(200, "pve1", holders)
    assert "GPU 1 (GPU-bbbb) by CT 201 (pid 4200, 2048 MiB)" in message
    assert "GPU 0 (GPU-aaaa) by the node itself (pid 4400, 100 MiB)" in message
    assert "Two containers are given the same GPU: stop what runs there (CT 201)" in message
    assert gpu_holders(apps, UUIDS, [0], 201, owners.get) == [(0, "GPU-aaaa", 200, 4100, 1024),
                                                             (0, "GPU-aaaa", None, 4400, 100)]
    unknown_memory = shared_gpu_message(200, "pve1", [(1, "GPU-bbbb", 201, 4200, None)])
    assert "GPU 1 (GPU-bbbb) by CT 201 (pid 4200, ? MiB)" in unknown_memory


def test_the_container_s_gpus_come_by_index():
    gpus = container_gpus(200, "pve1", Answer(0, "1, GPU-bbbb\n0, GPU-aaaa\n", ""))
    assert [gpu["uuid"] for gpu in gpus] == UUIDS


@pytest.mark.parametrize("answer, start", [
    (Answer(127, "", 'Failed to exec "nvidia-smi"'),
     'nvidia-smi is missing in CT 200 on node pve1 (Failed to exec "nvidia-smi"). Install'),
    (Answer(6, "No devices were found\n", ""), "nvidia-smi fails in CT 200 on node pve1 (exit 6): No devices "
                                                "were found Check the driver on the node"),
    (Answer(0, "0, GPU-aaaa, x\n", ""), "nvidia-smi in CT 200 on node pve1: unexpected nvidia-smi GPU line"),
])
def test_the_container_s_gpus_cannot_be_read(answer, start):
    with pytest.raises(CheckFailed) as failed:
        container_gpus(200, "pve1", answer)
    assert str(failed.value).startswith(start), failed.value
