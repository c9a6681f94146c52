"""proxmox_node_check's readings of the node's tools, on their real output formats (pve-manager's
pveversion and pveam, pve-storage's pvesm status, kmod's lsmod); the checks against a node are
tests/roles/test_preflight_node.py."""

from __future__ import annotations

import pytest

from ansible_collections.dflash.ops.plugins.modules import proxmox_node_check as check


@pytest.mark.parametrize("line, expected", [
    ("pve-manager/8.2.4/faa83925c9641325 (running kernel: 6.8.12-4-pve)\n", ("8.2.4", (8, 2))),
    ("pve-manager/8.1.3/b46aac3b42da5d15 (running kernel: 6.5.11-7-pve)", ("8.1.3", (8, 1))),
    ("pve-manager/7.4-3/9002ab8a (running kernel: 5.15.102-1-pve)", ("7.4-3", (7, 4))),
    ("pve-manager/9.0.3/025864202ebb6109 (running kernel: 6.14.8-2-pve)", ("9.0.3", (9, 0))),
    ("bash: pveversion: command not found", None),
])
def test_pveversion_lines_read_as_version_and_release(line, expected):
    assert check.parse_pveversion(line) == expected


def test_an_older_release_is_below_the_minimum_and_a_newer_major_is_not():
    minimum = check.parse_min_version("8.1")
    assert check.parse_pveversion("pve-manager/8.0.4/d258a813 (running kernel: 6.2.16-3-pve)")[1] < minimum
    assert check.parse_pveversion("pve-manager/9.0.3/025864202ebb6109 (running kernel: 6.14)")[1] >= minimum
    with pytest.raises(ValueError, match="major.minor"):
        check.parse_min_version("8")


def test_pveam_list_gives_the_template_volumes():
    output = ("NAME                                                         SIZE  \n"
              "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst         120.29MB\n"
              "local:vztmpl/ubuntu-24.04-standard_24.04-2_amd64.tar.zst     141.57MB\n")
    assert check.parse_pveam_list(output) == ["local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst",
                                              "local:vztmpl/ubuntu-24.04-standard_24.04-2_amd64.tar.zst"]
    assert check.parse_pveam_list("NAME SIZE\n") == []
    assert check.parse_pveam_list("Storage does not support templates!\n") == []


def test_pvesm_status_gives_a_storages_state_and_room():
    output = ("Name             Type     Status           Total            Used       Available        %\n"
              "local             dir     active        98497780        10541160        82906300   10.70%\n"
              "local-lvm     lvmthin   inactive               0               0               0    0.00%\n")
    assert check.parse_pvesm_status(output, "local") == {"status": "active", "total_kib": 98497780,
                                                         "available_kib": 82906300}
    assert check.parse_pvesm_status(output, "local-lvm")["status"] == "inactive"
    assert check.parse_pvesm_status(output, "ceph") is None


def test_lsmod_names_the_loaded_modules():
    output = ("Module                  Size  Used by\n"
              "nvidia_uvm           1802240  0\n"
              "nvidia              62648320  1 nvidia_uvm\n")
    assert check.loaded_modules(output) == {"nvidia_uvm", "nvidia"}
    assert "nvidia_uvm" not in check.loaded_modules("Module                  Size  Used by\nnvidia 1 0\n")


def test_the_checklist_says_pass_or_fail_and_the_fix_of_each_failure():
    checks = [check.check("pve-version", True, "Proxmox VE 8.2.4 (needs 8.1+)", "upgrade"),
              check.check("nvidia-uvm", False, "lsmod lists no nvidia_uvm", "modprobe nvidia-uvm")]
    assert check.checklist_lines(checks) == [
        "PASS pve-version: Proxmox VE 8.2.4 (needs 8.1+)",
        "FAIL nvidia-uvm: lsmod lists no nvidia_uvm. Fix: modprobe nvidia-uvm"]
