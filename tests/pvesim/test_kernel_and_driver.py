"""pvesim's kernels and NVIDIA driver (pvesim/driver.py, pvesim/bin/nvidia-driver-tools): dkms status,
dpkg-query and mokutil answer in the real tools' formats; a kernel update without DKMS leaves the next
boot without nvidia.ko (no driver for nvidia-smi, no device file, no GPU container start), with DKMS the
new kernel has it; NVIDIA's installer run on the node moves its module, and a container's user space of
the old version then fails NVML with NVIDIA's words and exit 18; the installer refuses while a GPU is held,
and under Secure Boot only a module signed with an enrolled key loads. The product's side, end to end from
docs/OPERATIONS.md: tests/reliability/test_kernel_and_driver_updates.py."""

import pytest

from pvesim import driver, prerequisites
from pvesim.container import DRIVER_VERSION

pytestmark = [pytest.mark.sim]

NEW_DRIVER = "550.144.03"
NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that "
             "the latest NVIDIA driver is installed and running.\n\n")
MISMATCH = "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 550.127\n"
DPKG = "dpkg-query -W -f '${Package} ${Status}\\n' 'proxmox-kernel-*'"


def on_node(sim, command, rc=0):
    res = sim.ssh("pve1", command)
    assert res.returncode == rc, f"{command}: {res.returncode} {res.stdout} {res.stderr}"
    return res


def dkms_status(sim):
    return on_node(sim, "dkms status").stdout.splitlines()


@pytest.fixture
def node_sim(sim_factory):
    """pve1 with one GPU and CT 380 (its GPU passed through, started at boot)."""
    s = sim_factory(nodes=1, containers=(380,), gpus=1)
    on_node(s, "pct set 380 --onboot 1")
    return s


def test_dkms_dpkg_query_and_mokutil_answer_as_the_real_tools(node_sim):
    assert dkms_status(node_sim) == [f"nvidia/{DRIVER_VERSION}, 6.8.12-4-pve, x86_64: installed"]
    assert on_node(node_sim, DPKG).stdout == ("proxmox-kernel-6.8 install ok installed\n"
                                              "proxmox-kernel-6.8.12-4-pve-signed install ok installed\n"
                                              "proxmox-kernel-helper install ok installed\n")
    assert on_node(node_sim, "dpkg-query -W 'proxmox-kernel-6.8.*'").stdout == \
        "proxmox-kernel-6.8.12-4-pve-signed\t6.8.12-4\n"
    assert on_node(node_sim, "mokutil --sb-state", rc=1).stdout == "SecureBoot disabled\n"
    driver.set_driver(node_sim, "pve1", secure_boot=True, mok_enrolled=True)
    assert on_node(node_sim, "mokutil --sb-state").stdout == "SecureBoot enabled\n"
    assert on_node(node_sim, "mokutil --test-key /var/lib/dkms/mok.pub").stdout == \
        "/var/lib/dkms/mok.pub is already enrolled\n"


def test_a_kernel_update_without_dkms_leaves_the_next_boot_without_the_driver_and_with_dkms_not(node_sim):
    driver.set_driver(node_sim, "pve1", dkms=False)
    assert on_node(node_sim, "dkms status", rc=127).stderr.endswith("dkms: command not found\n")
    assert driver.kernel_update(node_sim, "pve1") == "6.8.12-5-pve"
    # The running kernel keeps its module until the boot.
    assert "nvidia " in on_node(node_sim, "lsmod").stdout

    log = node_sim.reboot_node("pve1")
    assert "Device /dev/nvidia0 does not exist" in log, log
    assert on_node(node_sim, "pct status 380").stdout == "status: stopped\n"
    assert "nvidia" not in on_node(node_sim, "lsmod").stdout
    smi = on_node(node_sim, "nvidia-smi", rc=9)
    assert smi.stdout == NO_DRIVER
    # Neither nvidia-smi nor nvidia-modprobe (its modprobe of nvidia fails) makes a device file.
    assert node_sim.ssh("pve1", "nvidia-modprobe -c255 -c0").returncode != 0
    made = "for f in /dev/nvidiactl /dev/nvidia0 /dev/nvidia-uvm; do test -e $f && echo $f; done; true"
    assert on_node(node_sim, made).stdout == ""

    # The fix the preflight names: dkms installed, the driver reinstalled with --dkms.
    driver.install_dkms(node_sim, "pve1")
    installer = driver.put_installer(node_sim, "pve1", DRIVER_VERSION)
    assert "is now complete" in on_node(node_sim, f"sh {installer} --dkms --silent").stdout
    assert dkms_status(node_sim) == [f"nvidia/{DRIVER_VERSION}, 6.8.12-5-pve, x86_64: installed"]
    on_node(node_sim, "nvidia-smi -L")
    assert driver.kernel_update(node_sim, "pve1") == "6.8.12-6-pve"
    assert dkms_status(node_sim) == [f"nvidia/{DRIVER_VERSION}, 6.8.12-5-pve, x86_64: installed",
                                     f"nvidia/{DRIVER_VERSION}, 6.8.12-6-pve, x86_64: installed"]
    node_sim.reboot_node("pve1")
    assert "nvidia " in on_node(node_sim, "lsmod").stdout
    on_node(node_sim, "nvidia-smi -L")


def test_a_driver_update_on_the_node_leaves_the_containers_user_space_behind(node_sim):
    holder = "CUDA_VISIBLE_DEVICES=0 setsid sleep 300 >/dev/null 2>&1 & echo $!"
    held = on_node(node_sim, holder).stdout.strip()
    refused = driver.driver_update(node_sim, "pve1", NEW_DRIVER)
    assert refused.returncode == 1
    assert refused.stderr.startswith("ERROR: An NVIDIA kernel module 'nvidia' appears to already be "
                                     "loaded in your kernel."), refused.stderr
    on_node(node_sim, f"kill {held}")

    updated = driver.driver_update(node_sim, "pve1", NEW_DRIVER)
    assert updated.returncode == 0, updated.stderr
    assert on_node(node_sim, "nvidia-smi --query-gpu=driver_version --format=csv,noheader").stdout == \
        f"{NEW_DRIVER}\n"
    assert dkms_status(node_sim) == [f"nvidia/{NEW_DRIVER}, 6.8.12-4-pve, x86_64: installed"]
    in_ct = on_node(node_sim, "pct exec 380 -- nvidia-smi --query-gpu=driver_version --format=csv,noheader",
                    rc=18)
    assert in_ct.stdout == MISMATCH
    # The containers' user space of the node's version (what provision.yml installs) works again.
    installer = driver.put_installer(node_sim, "pve1", NEW_DRIVER)
    on_node(node_sim, f"pct push 380 {installer} /root/installer.run && "
                      "pct exec 380 -- sh /root/installer.run --no-kernel-module --silent")
    assert on_node(node_sim, "pct exec 380 -- nvidia-smi --query-gpu=driver_version --format=csv,noheader"
                   ).stdout == f"{NEW_DRIVER}\n"


def test_under_secure_boot_only_a_module_signed_with_an_enrolled_key_loads(node_sim):
    driver.set_driver(node_sim, "pve1", secure_boot=True, mok_enrolled=False)
    refused = driver.driver_update(node_sim, "pve1", NEW_DRIVER)
    assert refused.returncode == 1
    assert refused.stderr.startswith("ERROR: The kernel module failed to load. Secure boot is enabled on "
                                     "this system"), refused.stderr
    on_node(node_sim, "nvidia-smi", rc=9)
    driver.set_driver(node_sim, "pve1", secure_boot=True, mok_enrolled=True)
    assert driver.driver_update(node_sim, "pve1", NEW_DRIVER).returncode == 0
    on_node(node_sim, "nvidia-smi -L")


def test_fabric_manager_of_the_old_version_no_longer_starts_after_a_driver_update(sim_factory):
    s = sim_factory(nodes=1, containers=(381,), gpus=1, nvswitch=True)
    on_node(s, "systemctl restart nvidia-fabricmanager")
    assert driver.driver_update(s, "pve1", NEW_DRIVER).returncode == 0
    assert s.ssh("pve1", "systemctl restart nvidia-fabricmanager").returncode != 0
    assert on_node(s, "systemctl is-active nvidia-fabricmanager", rc=3).stdout == "failed\n"
    prerequisites.set_fabric_manager(s, "pve1", NEW_DRIVER)  # its package of the new version, held
    on_node(s, "systemctl restart nvidia-fabricmanager")
    assert on_node(s, "nv-fabricmanager --version").stdout == f"Fabric Manager version is : {NEW_DRIVER}\n"
