#!/usr/bin/python
# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# Ansible modules keep their imports below the documentation blocks.
# ruff: noqa: E402
from __future__ import annotations

DOCUMENTATION = r"""
---
module: proxmox_node_check
short_description: Check a Proxmox VE node's prerequisites for GPU training containers, item by item
description:
  - Runs on the Proxmox VE node and checks, in the order a user fixes them, what creating and running
    GPU training containers there needs. Each item passes or fails on its own, and each failure names
    its fix; the module fails when any item fails, with the whole checklist in its message.
  - C(pve-version) - C(pveversion) reports Proxmox VE O(min_pve_version) or later (C(devN) GPU
    passthrough needs 8.1).
  - C(nvidia-driver) - the node's C(nvidia-smi) answers and lists a GPU; its driver version is reported.
  - C(nvidia-uvm) - C(lsmod) lists the C(nvidia_uvm) module, which makes C(/dev/nvidia-uvm) (CUDA in a
    container needs it passed through).
  - C(device-files) - each device file the containers pass through is a character device (C(test -c)):
    every GPU's C(/dev/nvidiaN) and O(device_files). None exists after a boot until C(nvidia-modprobe),
    C(nvidia-smi) or a CUDA program made it, and C(pct start) refuses a missing one; the fix names
    C(nvidia-modprobe -c0 -u) and the boot unit C(dflash-nvidia-devices.service) the role installs.
  - C(fabric-manager) - on an NVSwitch (HGX) board (C(nvidia-smi -q) shows a Fabric State other than N/A):
    C(nvidia-fabricmanager.service) is active, C(nv-fabricmanager --version) is the driver's version, and
    every GPU's fabric is Completed; without it CUDA fails with error 802. Passes where there is no fabric.
  - C(template) - the container template O(template) is on its storage (C(pveam list <storage>)), or is
    downloaded there with C(pveam download <storage> <file>) when O(download_template) is set.
  - C(nvidia-installer) - NVIDIA's installer of the node's driver version,
    C(NVIDIA-Linux-x86_64-<version>.run), is on storage O(installer_storage) (C(pvesm path
    <storage>:snippets/<file>)), where the proxmox_provision role takes it from.
  - C(storage-room) - storage O(room_storage) is active and has O(min_free_gib) GiB available
    (C(pvesm status --storage <storage>)).
  - C(pveam) and C(pvesm) run as root, through C(sudo -n) when O(sudo) is set; C(pveversion),
    C(nvidia-smi) and C(lsmod) as the connection's user.
version_added: "0.3.0"
author: dflash-ops contributors (@dflash-ops)
extends_documentation_fragment:
  - dflash.ops.attributes
attributes:
  check_mode:
    support: full
    details: Checks the same in check mode; a missing template that O(download_template) would download
      is reported as downloaded (changed) but not downloaded.
options:
  node_name:
    description: The node's name in messages (the inventory name). Default the machine's host name.
    type: str
  sudo:
    description: Run C(pveam) and C(pvesm) through C(sudo -n) (a node user other than root).
    type: bool
    default: false
  min_pve_version:
    description: The oldest Proxmox VE release (major.minor) that passes.
    type: str
    default: "8.1"
  template:
    description: The container template's volume, C(<storage>:vztmpl/<file>) (what C(pct create) takes).
    type: str
    required: true
  download_template:
    description: Download a missing template with C(pveam download) (the node needs the internet).
    type: bool
    default: false
  installer_storage:
    description: The storage whose C(snippets) hold NVIDIA's installer.
    type: str
    default: local
  room_storage:
    description: The storage the containers' root disks go on.
    type: str
    default: local
  min_free_gib:
    description: The GiB O(room_storage) must have available.
    type: int
    default: 64
  device_files:
    description: The device files besides each GPU's C(/dev/nvidiaN) the containers pass through.
    type: list
    elements: str
    default: [/dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia-uvm-tools]
"""

EXAMPLES = r"""
- name: Check the node's prerequisites, downloading the template when it is missing.
  dflash.ops.proxmox_node_check:
    template: local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst
    download_template: true
    min_free_gib: 400
"""

RETURN = r"""
checks:
  description: Every item in order, passed or not, with what was found and, for a failure, the fix.
  returned: always
  type: list
  elements: dict
  sample: [{"item": "pve-version", "ok": true, "found": "Proxmox VE 8.2.4", "fix": ""}]
checklist:
  description: >-
    The checks as lines, C(PASS <item>: <found>) or C(FAIL <item>: <found>. Fix: <fix>).
  returned: always
  type: list
  elements: str
pve_version:
  description: The node's Proxmox VE version (pve-manager's), null when C(pveversion) gave none.
  returned: always
  type: str
  sample: 8.2.4
driver_version:
  description: The node's NVIDIA driver version, null when C(nvidia-smi) gave none.
  returned: always
  type: str
  sample: 550.127.05
"""

import os
import re
import socket

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.dflash.ops.plugins.module_utils import nvidia_node
from ansible_collections.dflash.ops.plugins.module_utils.nvidia_smi import (
    NvidiaSmiError,
    Query,
    find_executable,
    run,
)
from ansible_collections.dflash.ops.plugins.module_utils.pct_cli import Pct, said

ARGUMENT_SPEC = dict(
    node_name=dict(type="str"),
    sudo=dict(type="bool", default=False),
    min_pve_version=dict(type="str", default="8.1"),
    template=dict(type="str", required=True),
    download_template=dict(type="bool", default=False),
    installer_storage=dict(type="str", default="local"),
    room_storage=dict(type="str", default="local"),
    min_free_gib=dict(type="int", default=64),
    device_files=dict(type="list", elements="str", default=list(nvidia_node.CONTROL_FILES)),
)
# pve-manager's bin/pveversion: `pve-manager/<version>/<repoid> (running kernel: <release>)`; the version
# is 8.2.4 on 8.x, 7.4-3 on 7.x.
PVEVERSION = re.compile(r"^pve-manager/((\d+)\.(\d+)[0-9.-]*)/")
DRIVER = Query("gpu", "GPU", ("index", "driver_version", "minor_number"))
TEMPLATE_VOLUME = re.compile(r"^([A-Za-z][A-Za-z0-9._-]*):vztmpl/([^/\s]+)$")
DOWNLOAD_TIMEOUT = 1800
KIB_PER_GIB = 1024 * 1024
INSTALLER = "NVIDIA-Linux-x86_64-{}.run"


def check(item, ok, found, fix):
    return {"item": item, "ok": bool(ok), "found": found, "fix": "" if ok else fix}


def checklist_lines(checks):
    return [f"PASS {c['item']}: {c['found']}" if c["ok"]
            else f"FAIL {c['item']}: {c['found']}. Fix: {c['fix']}" for c in checks]


# ---------------------------------------------------------------------------------------------
# Reading the tools' answers (pure)


def parse_pveversion(output):
    """(version, (major, minor)) from pveversion's line; None when it is not one."""
    match = PVEVERSION.match(output.strip())
    return (match.group(1), (int(match.group(2)), int(match.group(3)))) if match else None


def parse_min_version(text):
    match = re.fullmatch(r"(\d+)\.(\d+)", text.strip())
    if not match:
        raise ValueError(f"min_pve_version must be major.minor (8.1), got {text!r}")
    return int(match.group(1)), int(match.group(2))


def parse_pveam_list(output):
    """The template volumes `pveam list <storage>` prints (NAME SIZE, one volume a line)."""
    lines = output.splitlines()
    if not lines or not lines[0].startswith("NAME"):
        return []
    return [line.split()[0] for line in lines[1:] if line.strip()]


def parse_pvesm_status(output, storage):
    """{status, total_kib, available_kib} of `storage` in `pvesm status` (Name Type Status Total Used
    Available %, KiB); None when it is not listed."""
    for row in (line.split() for line in output.splitlines()[1:]):
        if len(row) >= 6 and row[0] == storage and row[3].isdigit() and row[5].isdigit():
            return {"status": row[2], "total_kib": int(row[3]), "available_kib": int(row[5])}
    return None


def loaded_modules(lsmod_output):
    return {line.split()[0] for line in lsmod_output.splitlines()[1:] if line.strip()}


# ---------------------------------------------------------------------------------------------
# The items


def check_pve_version(tools, minimum):
    answer = tools.tool("pveversion", as_root=False)
    parsed = parse_pveversion(answer.stdout) if answer.rc == 0 else None
    if parsed is None:
        found = f"pveversion gives no version ({said(answer) or 'no output'})"
        fix = "run this on a Proxmox VE node (is the inventory's ansible_host its address?)"
        return check("pve-version", False, found, fix), None
    version, numbers = parsed
    wanted = f"{minimum[0]}.{minimum[1]}"
    fix = (f"upgrade the node to Proxmox VE {wanted} or later (apt update && apt full-upgrade; across a "
           "major release follow Proxmox's upgrade guide, pve7to8); devN GPU passthrough needs 8.1")
    return check("pve-version", numbers >= minimum, f"Proxmox VE {version} (needs {wanted}+)", fix), version


def check_driver():
    fix = ("install NVIDIA's driver on the node (NVIDIA-Linux-x86_64-<version>.run with the kernel headers, "
           "proxmox-default-headers), until nvidia-smi on the node lists the GPUs")
    executable = find_executable()
    if executable is None:
        return check("nvidia-driver", False, "no nvidia-smi on the node", fix), None, []
    try:
        gpus = DRIVER.read(executable)
    except NvidiaSmiError as exc:
        return check("nvidia-driver", False, f"nvidia-smi fails: {exc}", fix), None, []
    if not gpus:
        return check("nvidia-driver", False, "nvidia-smi lists no GPU", fix), None, []
    version = gpus[0]["driver"]
    minors = [g["minor"] for g in gpus if g.get("minor") is not None]
    return check("nvidia-driver", True, f"driver {version}, {len(gpus)} GPU(s)", fix), version, minors


def query_report():
    """`nvidia-smi -q` (the fabric's state), None when it cannot be run or fails."""
    executable = find_executable()
    try:
        answer = run(executable, ["-q"]) if executable else None
    except NvidiaSmiError:
        return None
    return answer.stdout if answer is not None and answer.rc == 0 else None


def check_uvm(tools):
    answer = tools.tool("lsmod", as_root=False)
    if answer.rc != 0:
        found = f"lsmod fails ({said(answer) or 'no output'})"
    else:
        loaded = "nvidia_uvm" in loaded_modules(answer.stdout)
        found = "nvidia_uvm is loaded" if loaded else "lsmod lists no nvidia_uvm"
    fix = ("load it and make its device nodes: modprobe nvidia-uvm && nvidia-modprobe -u -c=0 "
           "(/dev/nvidia-uvm, /dev/nvidia-uvm-tools); load it at boot: "
           "echo nvidia-uvm > /etc/modules-load.d/nvidia-uvm.conf")
    return check("nvidia-uvm", found == "nvidia_uvm is loaded", found, fix)


def check_template(tools, template, download, check_mode):
    """The template check and whether it downloaded (or, in check mode, would download) it."""
    match = TEMPLATE_VOLUME.match(template)
    if not match:
        return check("template", False, f"{template!r} is not a template volume",
                     "name it <storage>:vztmpl/<file> (proxmox_provision_template's form)"), False
    storage, name = match.groups()
    fix = (f"download it on the node: pveam update && pveam download {storage} {name} (or rerun with "
           f"-e proxmox_host_prerequisites_download_template=true); pveam available lists the templates")
    listing = tools.tool("pveam", "list", storage)
    if listing.rc != 0:
        return check("template", False, f"pveam list {storage} fails: {said(listing)}", fix), False
    if template in parse_pveam_list(listing.stdout):
        return check("template", True, f"{template} is on storage {storage}", fix), False
    command = f"pveam download {storage} {name}"
    if not download:
        return check("template", False, f"{template} is not on storage {storage} (pveam list {storage})",
                     fix), False
    if check_mode:
        return check("template", True, f"{template} would be downloaded ({command})", fix), True
    fetched = tools.tool("pveam", "download", storage, name, timeout=DOWNLOAD_TIMEOUT)
    present = fetched.rc == 0 and template in parse_pveam_list(tools.tool("pveam", "list", storage).stdout)
    found = f"{template} downloaded ({command})" if present else f"{command} fails: {said(fetched)}"
    return check("template", present, found, fix), present


def check_installer(tools, storage, driver_version):
    if driver_version is None:
        return check("nvidia-installer", False, "cannot be looked for without the node's driver version",
                     "fix nvidia-driver first")
    name = INSTALLER.format(driver_version)
    answer = tools.tool("pvesm", "path", f"{storage}:snippets/{name}")
    path = answer.stdout.strip()
    fix = (f"put NVIDIA's installer of the node's driver on storage {storage}: {name} from "
           f"https://download.nvidia.com/XFree86/Linux-x86_64/{driver_version}/ to "
           f"{path or f'the snippets directory of storage {storage}'} "
           "(the storage proxmox_provision_nvidia_storage names)")
    if answer.rc != 0:
        found = f"pvesm path {storage}:snippets/{name} fails: {said(answer)}"
        return check("nvidia-installer", False, found, fix)
    present = os.path.isfile(path)
    return check("nvidia-installer", present, f"{path} {'is there' if present else 'is missing'}", fix)


def check_room(tools, storage, min_free_gib):
    answer = tools.tool("pvesm", "status", "--storage", storage)
    row = parse_pvesm_status(answer.stdout, storage) if answer.rc == 0 else None
    fix = (f"free room on storage {storage}, or put the containers' root disks on another "
           f"(proxmox_provision_rootfs_storage and -e proxmox_host_prerequisites_room_storage=...)")
    if row is None:
        return check("storage-room", False, f"pvesm status --storage {storage} gives no row "
                     f"({said(answer) or 'no output'})", fix)
    free_gib = row["available_kib"] / KIB_PER_GIB
    ok = row["status"] == "active" and free_gib >= min_free_gib
    return check("storage-room", ok, f"storage {storage} is {row['status']}, {free_gib:.0f} GiB available "
                 f"(needs {min_free_gib})", fix)


def run_checks(tools, params, check_mode):
    """Every item in order; returns (checks, pve_version, driver_version, downloaded)."""
    version_check, pve_version = check_pve_version(tools, parse_min_version(params["min_pve_version"]))
    driver_check, driver_version, minors = check_driver()
    template_check, downloaded = check_template(tools, params["template"], params["download_template"],
                                                check_mode)
    devices = nvidia_node.device_files(minors, params["device_files"]) if driver_version else []
    checks = [version_check, driver_check, check_uvm(tools), nvidia_node.check_device_files(check, devices),
              nvidia_node.check_fabric_manager(check, tools, query_report(), driver_version), template_check,
              check_installer(tools, params["installer_storage"], driver_version),
              check_room(tools, params["room_storage"], params["min_free_gib"])]
    return checks, pve_version, driver_version, downloaded


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    node = p["node_name"] or socket.gethostname()
    try:
        parse_min_version(p["min_pve_version"])
    except ValueError as exc:
        module.fail_json(msg=str(exc))
    # The tools run through pct_cli's runner: with sudo's prefix for pveam and pvesm, without it for the rest.
    tools = Pct((["sudo", "-n"] if p["sudo"] else []) + ["/usr/sbin/pct"], node)
    checks, pve_version, driver_version, downloaded = run_checks(tools, p, module.check_mode)
    lines = checklist_lines(checks)
    result = dict(changed=downloaded, checks=checks, checklist=lines, pve_version=pve_version,
                  driver_version=driver_version)
    failed = [c for c in checks if not c["ok"]]
    if failed:
        module.fail_json(msg=f"Node {node} lacks {len(failed)} of {len(checks)} prerequisites "
                             f"({', '.join(c['item'] for c in failed)}):\n" + "\n".join(lines), **result)
    module.exit_json(msg=f"Node {node} has all {len(checks)} prerequisites.", **result)


if __name__ == "__main__":
    main()
