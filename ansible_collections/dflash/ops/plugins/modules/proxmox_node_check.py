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
  - C(dkms) - the NVIDIA driver's module is installed by DKMS for every installed C(proxmox-kernel-*)
    (C(dpkg-query -W), C(dkms status)). Installed without DKMS, the next kernel has no C(nvidia.ko), and
    after the reboot into it the node has no driver and no GPU container starts. The fix names
    C(apt install dkms proxmox-default-headers) and the installer's C(--dkms).
  - C(secure-boot) - under UEFI Secure Boot (C(mokutil --sb-state)), DKMS's signing key
    C(/var/lib/dkms/mok.pub) is enrolled (C(mokutil --test-key)), else the kernel refuses the module.
    Passes where Secure Boot is off.
  - C(nvidia-uvm) - C(lsmod) lists the C(nvidia_uvm) module, which makes C(/dev/nvidia-uvm) (CUDA in a
    container needs it passed through).
  - C(device-files) - each device file the containers pass through is a character device (C(test -c)),
    every GPU's C(/dev/nvidiaN) and O(device_files), looked at before the check runs C(nvidia-smi) (which
    makes C(/dev/nvidiactl) and every C(/dev/nvidiaN)). None exists after a boot until C(nvidia-modprobe),
    C(nvidia-smi) or a CUDA program made it, and C(pct start) refuses a missing one. Where the boot unit
    C(dflash-nvidia-devices.service) is installed, it must be enabled, ordered Before=pve-guests.service,
    and its C(ExecStart=) lines must make every one of those files as C(nvidia-modprobe) does (C(-cN) only
    C(/dev/nvidiaN), C(-c255) C(/dev/nvidiactl), C(-u -c0) the two C(/dev/nvidia-uvm) files). The fix
    names C(nvidia-modprobe -c255 -c0 ... -cN && nvidia-modprobe -u -c0) and the unit the role installs.
  - C(fabric-manager) - on an NVSwitch (HGX) board (C(nvidia-smi -q) shows a Fabric State other than N/A,
    or, on an A100-class board, which has no Fabric section, C(lspci -n -d 10de::0680) lists NVSwitches),
    C(nvidia-fabricmanager.service) is active, C(nv-fabricmanager --version) is the driver's version, and
    every GPU's fabric state, where there is one, is Completed; without it CUDA fails with error 802.
    Passes where neither shows an NVSwitch.
  - The items below check what the node's containers of O(containers) are created with, each distinct
    template and storage once.
  - C(template) - a container's template is in the node's index (C(pveam available --section system)),
    a pinned one as it is, else the newest of its name; and it is on its storage (C(pveam list
    <storage>)), or is downloaded there with C(pveam download <storage> <file>) when O(download_template)
    is set. A pinned template the index does not list fails, naming those it does.
  - C(nvidia-installer) - NVIDIA's installer of the node's driver version,
    C(NVIDIA-Linux-x86_64-<version>.run), is on a container's nvidia storage (C(pvesm path
    <storage>:snippets/<file>)), where the proxmox_provision role takes it from.
  - C(rootdir-storage) - a container's root disk storage holds container root disks, C(pvesm status
    --content rootdir) lists it (a default install's C(local) does not; C(local-lvm) or C(local-zfs) do).
  - C(storage-room) - that storage is active and has room for the root disks of the containers the
    cluster does not have yet (C(pvesh get /cluster/resources)), or O(min_free_gib) GiB when set
    (C(pvesm status --storage <storage>)).
  - C(pveam), C(pvesm) and C(pvesh) run as root (C(/usr/bin/pveam), C(/usr/sbin/pvesm),
    C(/usr/bin/pvesh)), through C(sudo -n) when O(sudo) is set; C(pveversion), C(nvidia-smi), C(lsmod),
    C(dpkg-query), C(dkms), C(mokutil) and C(lspci) as the connection's user.
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
  containers:
    description: The training containers of this node, with the settings the proxmox_provision role
      creates them with.
    type: list
    elements: dict
    required: true
    suboptions:
      name:
        description: The container's inventory name (in messages).
        type: str
        required: true
      vmid:
        description: Its CT id.
        type: int
        required: true
      template:
        description: A pinned template volume, C(<storage>:vztmpl/<file>); empty for the newest
          O(containers[].template_name).
        type: str
        default: ""
      template_name:
        description: The template by name, without its version.
        type: str
        default: debian-12-standard
      template_storage:
        description: The storage of an unpinned template.
        type: str
        default: local
      rootfs_storage:
        description: The storage of its root disk.
        type: str
        required: true
      rootfs_size:
        description: Its root disk's size in GiB.
        type: int
        required: true
      nvidia_storage:
        description: The storage whose C(snippets) hold NVIDIA's installer.
        type: str
        default: local
  download_template:
    description: Download a missing template with C(pveam download) (the node needs the internet).
    type: bool
    default: false
  min_free_gib:
    description: The GiB each root disk storage must have available, instead of the sizes of the
      containers still to create.
    type: int
  device_files:
    description: The device files besides each GPU's C(/dev/nvidiaN) the containers pass through.
    type: list
    elements: str
    default: [/dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia-uvm-tools]
"""

EXAMPLES = r"""
- name: Check the node's prerequisites, downloading the template when it is missing.
  dflash.ops.proxmox_node_check:
    containers:
      - {name: ct200, vmid: 200, rootfs_storage: local-lvm, rootfs_size: 200}
    download_template: true
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

import json
import os
import re
import socket

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.dflash.ops.plugins.module_utils import nvidia_kernel, nvidia_node, pve_templates
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
    containers=dict(type="list", elements="dict", required=True, options=dict(
        name=dict(type="str", required=True),
        vmid=dict(type="int", required=True),
        template=dict(type="str", default=""),
        template_name=dict(type="str", default="debian-12-standard"),
        template_storage=dict(type="str", default="local"),
        rootfs_storage=dict(type="str", required=True),
        rootfs_size=dict(type="int", required=True),
        nvidia_storage=dict(type="str", default="local"),
    )),
    download_template=dict(type="bool", default=False),
    min_free_gib=dict(type="int"),
    device_files=dict(type="list", elements="str", default=list(nvidia_node.CONTROL_FILES)),
)
# pve-manager's bin/pveversion: `pve-manager/<version>/<repoid> (running kernel: <release>)`; the version
# is 8.2.4 on 8.x, 7.4-3 on 7.x.
PVEVERSION = re.compile(r"^pve-manager/((\d+)\.(\d+)[0-9.-]*)/")
DRIVER = Query("gpu", "GPU", ("index", "driver_version", "minor_number"))
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


def template_volume(container, index, index_error):
    """(the container's template volume, None) or (None, the failed check)."""
    pinned, name = container["template"], container["template_name"]
    fix = ("run pveam update on the node, or pin a template it lists (proxmox_provision_template: "
           "<storage>:vztmpl/<file>)")
    if index_error:
        return None, check("template", False, index_error, fix)
    if not pinned:
        found = pve_templates.newest(index, name)
        if found is None:
            return None, check("template", False, f"pveam available --section system lists no {name} "
                               f"(it lists: {', '.join(index) or 'nothing'})", fix)
        return f"{container['template_storage']}:vztmpl/{found}", None
    match = pve_templates.TEMPLATE_VOLUME.match(pinned)
    if not match:
        return None, check("template", False, f"{pinned!r} is not a template volume",
                           "name it <storage>:vztmpl/<file> (proxmox_provision_template's form)")
    if match.group(2) not in index:
        return None, check("template", False, f"{pinned} (pinned by proxmox_provision_template for "
                           f"{container['name']}) is not in the node's index; pveam available --section "
                           f"system lists: {', '.join(index) or 'nothing'}",
                           "pin one of those, or leave proxmox_provision_template empty for the newest "
                           f"{name}")
    return pinned, None


def check_template(tools, template, download, check_mode):
    """The template check and whether it downloaded (or, in check mode, would download) it."""
    storage, name = pve_templates.TEMPLATE_VOLUME.match(template).groups()
    fix = (f"download it on the node: pveam download {storage} {name} (or rerun with "
           f"-e proxmox_host_prerequisites_download_template=true)")
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


def check_rootdir(tools, storage):
    answer = tools.tool("pvesm", "status", "--content", "rootdir")
    lines = answer.stdout.splitlines()[1:] if answer.rc == 0 else []
    listed = [row.split()[0] for row in lines if row.strip()]
    fix = (f"put the root disks on a storage that holds them: proxmox_provision_rootfs_storage: "
           f"{listed[0] if listed else 'local-lvm'} (local-lvm on a default install, local-zfs on a ZFS "
           f"one), or add rootdir to the content of storage {storage} "
           f"(pvesm set {storage} --content ...,rootdir)")
    if answer.rc != 0:
        return check("rootdir-storage", False, f"pvesm status --content rootdir fails: {said(answer)}", fix)
    ok = storage in listed
    found = (f"storage {storage} holds container root disks" if ok else
             f"storage {storage} holds no container root disks (pvesm status --content rootdir lists "
             f"{', '.join(listed) or 'none'})")
    return check("rootdir-storage", ok, found, fix)


def cluster_vmids(tools):
    """The vmids the cluster has (pvesh get /cluster/resources), None when pvesh gives none."""
    answer = tools.tool("pvesh", "get", "/cluster/resources", "--type", "vm", "--output-format", "json")
    try:
        return {int(r["vmid"]) for r in json.loads(answer.stdout)} if answer.rc == 0 else None
    except (ValueError, KeyError, TypeError):
        return None


def check_room(tools, storage, containers, existing, min_free_gib):
    to_create = [c for c in containers if existing is None or c["vmid"] not in existing]
    needed = min_free_gib if min_free_gib is not None else sum(c["rootfs_size"] for c in to_create)
    why = ("as asked (min_free_gib)" if min_free_gib is not None else
           f"for {', '.join(c['name'] for c in to_create)}" if to_create else "nothing to create")
    answer = tools.tool("pvesm", "status", "--storage", storage)
    row = parse_pvesm_status(answer.stdout, storage) if answer.rc == 0 else None
    fix = (f"free room on storage {storage}, or put the containers' root disks on another "
           f"(proxmox_provision_rootfs_storage), or make them smaller (proxmox_provision_rootfs_size)")
    if row is None:
        return check("storage-room", False, f"pvesm status --storage {storage} gives no row "
                     f"({said(answer) or 'no output'})", fix)
    free_gib = row["available_kib"] / KIB_PER_GIB
    ok = row["status"] == "active" and free_gib >= needed
    return check("storage-room", ok, f"storage {storage} is {row['status']}, {free_gib:.0f} GiB available "
                 f"(needs {needed}, {why})", fix)


def distinct(values):
    return list(dict.fromkeys(values))


def run_checks(tools, params, check_mode):
    """Every item in order; returns (checks, pve_version, driver_version, downloaded)."""
    # Before nvidia-smi runs (check_driver): NVML makes /dev/nvidiactl and every /dev/nvidiaN.
    present = nvidia_node.present_files()
    version_check, pve_version = check_pve_version(tools, parse_min_version(params["min_pve_version"]))
    driver_check, driver_version, minors = check_driver()
    devices = nvidia_node.device_files(minors, params["device_files"]) if driver_version else []
    checks = [version_check, driver_check, nvidia_kernel.check_dkms(check, tools, driver_version),
              nvidia_kernel.check_secure_boot(check, tools), check_uvm(tools),
              nvidia_node.check_device_files(check, devices, present, nvidia_node.read_unit()),
              nvidia_node.check_fabric_manager(check, tools, query_report(), driver_version)]
    downloaded = False
    containers = params["containers"]
    index, index_error = pve_templates.index_names(tools)
    volumes = [template_volume(c, index, index_error) for c in containers]
    checks += list({failed["found"]: failed for _volume, failed in volumes if failed}.values())
    for template in distinct(volume for volume, _failed in volumes if volume):
        template_check, fetched = check_template(tools, template, params["download_template"], check_mode)
        checks.append(template_check)
        downloaded = downloaded or fetched
    checks += [check_installer(tools, storage, driver_version)
               for storage in distinct(c["nvidia_storage"] for c in containers)]
    existing = cluster_vmids(tools)
    for storage in distinct(c["rootfs_storage"] for c in containers):
        checks.append(check_rootdir(tools, storage))
        checks.append(check_room(tools, storage, [c for c in containers if c["rootfs_storage"] == storage],
                                 existing, params["min_free_gib"]))
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
