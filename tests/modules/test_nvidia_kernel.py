"""The node's NVIDIA kernel module across kernel updates (proxmox_node_check's `dkms` and `secure-boot`
items) on the real tools' output formats: dpkg-query's `${Package} ${Status}`, dkms 3.0.10's `dkms status`
(`do_status`) and dkms 2.x's, mokutil's `--sb-state` and `--test-key` (`print_sb_state`, `test_key`); and
what the product says of NVML's driver/library version mismatch (exit 18) in a container, where
provision.yml is the fix. Against a pvesim node: tests/pvesim/test_kernel_and_driver.py."""

from __future__ import annotations

import pytest

from ansible_collections.dflash.ops.plugins.module_utils import nvidia_kernel as kernel
from ansible_collections.dflash.ops.plugins.module_utils.nvidia_smi import explain_failure
from ansible_collections.dflash.ops.plugins.module_utils.pct_cli import Answer, CheckFailed
from ansible_collections.dflash.ops.plugins.modules.pct_container_check import container_gpus
from ansible_collections.dflash.ops.plugins.modules.proxmox_node_check import check

DPKG = ("proxmox-kernel-6.5.13-5-pve-signed deinstall ok config-files\n"
        "proxmox-kernel-6.8 install ok installed\n"
        "proxmox-kernel-6.8.12-4-pve-signed install ok installed\n"
        "proxmox-kernel-6.8.12-10-pve install ok installed\n"
        "proxmox-kernel-helper install ok installed\n")
DKMS_3 = ("nvidia/550.127.05, 6.8.12-10-pve, x86_64: installed\n"
          "nvidia/550.127.05, 6.8.12-4-pve, x86_64: installed\n"
          "zfs/2.2.6, 6.8.12-4-pve, x86_64: installed\n")
MISMATCH = "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 550.127\n"


class Tools:
    """The node's tools as proxmox_node_check runs them: answers by program and first argument."""

    def __init__(self, answers):
        self.answers, self.asked = answers, []

    def tool(self, program, *args, as_root=True, timeout=None):
        self.asked.append((program, *args))
        return self.answers.get((program, args[0]), Answer(127, "", f"sh: 1: {program}: not found"))


def node(dkms=DKMS_3, sb="SecureBoot disabled\n", sb_rc=1, key=None):
    answers = {("dpkg-query", "-W"): Answer(0, DPKG, ""), ("mokutil", "--sb-state"): Answer(sb_rc, sb, "")}
    if dkms is not None:
        answers[("dkms", "status")] = Answer(0, dkms, "")
    if key is not None:
        answers[("mokutil", "--test-key")] = key
    return Tools(answers)


def test_the_installed_kernels_are_the_image_packages_dpkg_has_installed():
    assert kernel.installed_kernels(DPKG) == ["6.8.12-4-pve", "6.8.12-10-pve"]


@pytest.mark.parametrize("output, expected", [
    (DKMS_3, {"550.127.05": ["6.8.12-10-pve", "6.8.12-4-pve"]}),
    ("nvidia, 535.183.01, 6.5.13-5-pve, x86_64: installed\n", {"535.183.01": ["6.5.13-5-pve"]}),  # dkms 2
    ("nvidia/550.127.05: added\n", {"550.127.05": []}),
    ("nvidia/550.127.05, 6.8.12-4-pve, x86_64: built\n", {}),
    ("", {}),
])
def test_dkms_status_gives_the_kernels_each_driver_version_is_installed_for(output, expected):
    assert kernel.dkms_kernels(output) == expected


def test_a_driver_installed_by_dkms_for_every_kernel_passes():
    result = kernel.check_dkms(check, node(), "550.127.05")
    assert result["ok"], result
    assert result["found"] == ("nvidia 550.127.05 installed by DKMS for every installed kernel "
                               "(6.8.12-4-pve, 6.8.12-10-pve)")


@pytest.mark.parametrize("dkms, found", [
    (None, "dkms is not installed, so the NVIDIA driver is built for the kernel it was installed under only"),
    ("zfs/2.2.6, 6.8.12-4-pve, x86_64: installed\n", "dkms status lists no nvidia module"),
])
def test_a_driver_installed_without_dkms_fails_with_the_reinstall_as_fix(dkms, found):
    result = kernel.check_dkms(check, node(dkms=dkms), "550.127.05")
    assert not result["ok"] and result["found"].startswith(found), result
    assert "6.8.12-4-pve, 6.8.12-10-pve" in result["found"]
    assert result["fix"].startswith(
        "register the driver with DKMS, so that each new kernel gets its nvidia.ko: apt install dkms "
        "proxmox-default-headers, then reinstall the driver: sh NVIDIA-Linux-x86_64-550.127.05.run --dkms "
        "--silent")


def test_a_kernel_dkms_did_not_build_for_is_named_with_its_fix():
    only_the_old = "nvidia/550.127.05, 6.8.12-4-pve, x86_64: installed\n"
    result = kernel.check_dkms(check, node(dkms=only_the_old), None)
    assert not result["ok"]
    assert result["found"].startswith(
        "nvidia 550.127.05 is not installed by DKMS for kernel(s) 6.8.12-10-pve")
    assert result["fix"] == ("apt install proxmox-headers-6.8.12-10-pve, then dkms install nvidia/550.127.05 "
                             "-k 6.8.12-10-pve")


def test_dkms_with_another_version_than_the_running_driver_fails():
    result = kernel.check_dkms(check, node(), "550.144.03")
    assert not result["ok"] and "not the running driver 550.144.03" in result["found"]
    assert "NVIDIA-Linux-x86_64-550.144.03.run --dkms" in result["fix"]


@pytest.mark.parametrize("sb, rc, found", [
    ("SecureBoot disabled\n", 1, "not needed: Secure Boot is off"),
    ("", 1, "not needed: no Secure Boot state (EFI variables are not supported on this system)"),
])
def test_secure_boot_off_needs_nothing(sb, rc, found):
    tools = node(sb=sb, sb_rc=rc)
    if not sb:
        unsupported = "EFI variables are not supported on this system\n"
        tools.answers[("mokutil", "--sb-state")] = Answer(1, "", unsupported)
    result = kernel.check_secure_boot(check, tools)
    assert result["ok"] and result["found"] == found


def test_secure_boot_needs_dkms_s_key_enrolled():
    enrolled = Answer(0, "/var/lib/dkms/mok.pub is already enrolled\n", "")
    result = kernel.check_secure_boot(check, node(sb="SecureBoot enabled\n", sb_rc=0, key=enrolled))
    assert result["ok"], result
    not_enrolled = Answer(1, "/var/lib/dkms/mok.pub is not enrolled\n", "")
    refused = kernel.check_secure_boot(check, node(sb="SecureBoot enabled\n", sb_rc=0, key=not_enrolled))
    assert not refused["ok"]
    assert refused["found"] == ("Secure Boot is on and DKMS's signing key is not enrolled "
                                "(/var/lib/dkms/mok.pub is not enrolled): the kernel refuses to load "
                                "nvidia.ko")
    assert refused["fix"].startswith("enrol DKMS's signing key: mokutil --import /var/lib/dkms/mok.pub")


def test_the_version_mismatch_names_provision_yml_not_a_reload():
    message = explain_failure(18, MISMATCH)
    assert "version mismatch (exit 18)" in message and "ansible-playbook playbooks/provision.yml" in message
    assert "reload" not in message
    said = "Failed to initialize NVML: Driver/library version mismatch NVML library version: 550.127"
    assert explain_failure(18, "") == explain_failure(18, MISMATCH).replace(said, "no output")


def test_the_container_check_names_the_mismatch_and_provision_yml():
    with pytest.raises(CheckFailed) as failed:
        container_gpus(201, "pve1", Answer(18, MISMATCH, ""))
    message = str(failed.value)
    assert message.startswith("nvidia-smi fails in CT 201 on node pve1: NVML's driver/library version "
                              "mismatch (exit 18)"), message
    assert "ansible-playbook playbooks/provision.yml" in message and "reload" not in message
