#!/usr/bin/python
# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# Ansible modules keep their imports below the documentation blocks.
# ruff: noqa: E402
from __future__ import annotations

DOCUMENTATION = r"""
---
module: proxmox_container
short_description: Create a training container on its Proxmox VE node with its GPUs passed through
description:
  - Runs on the Proxmox VE node. Reads the container with C(pct status) and C(pct config), computes
    the config the options ask for (hostname, cores, memory, swap, root disk, unprivileged, onboot,
    networks, a C(devN) entry (PVE 8.1+) for each GPU's C(/dev/nvidiaN) and each control device, and an
    C(mpN) bind mount point for each of O(mounts)), and compares the two.
  - A container that does not exist is created with C(pct create) from O(template) (unpinned, the newest
    O(template_name) in the node's index) and started. Before anything is created it checks that the
    template is on the node's storage (C(pvesm path)), that the node has every GPU of O(gpus) (its
    C(nvidia-smi), by minor number), that no other container of the node has one of them passed through
    (unless O(allow_shared_gpus)), that the vmid is not taken by a VM or a container anywhere in the
    cluster (C(pvesh get /cluster/resources)), that the root disk's storage holds container root disks
    (C(pvesm status --content rootdir)) and has room for it, and that each directory of O(mounts) is on
    the node. A container whose start fails is destroyed again.
  - An existing container whose config differs is reported with the differences and left alone,
    unless O(reconcile) is set; then only the differing keys change (C(pct set)), and only when
    O(run_live) is false. A changed GPU passthrough or bind mount takes effect by restarting the container.
    A bind mount point the options do not list is removed then too; a storage volume's is left alone.
    The root disk and C(unprivileged) are never changed (C(pct resize) and a new container do that).
  - V(absent) destroys the container, only when O(run_live) is false.
  - A container whose config has a lock (a running backup's C(backup), a killed C(pct create)'s
    C(create)) is refused before anything is changed when the module would start, shut down, change or
    destroy it (pve-container refuses those), with what to do about that lock; with nothing to change it
    goes on with a warning. A container the HA manager manages (C(hastate) in C(pvesh get
    /cluster/resources)) is refused when it would be started or shut down, since C(pct) would only queue
    a request with the HA manager.
  - The node's C(pvesm) and C(pvesh) run with the prefix of O(pct_argv) (through sudo when pct is), its
    C(nvidia-smi) without sudo.
version_added: "0.3.0"
author: dflash-ops contributors (@dflash-ops)
extends_documentation_fragment:
  - dflash.ops.attributes
  - dflash.ops.pct
attributes:
  check_mode:
    support: full
    details: Reads and checks the same in check mode, and reports what it would create, change or destroy.
  diff_mode:
    support: full
    details: >-
      The container's config before and after, one C(key: value) line each, as C(pct config) prints it.
options:
  state:
    description: V(present) creates or checks the container; V(absent) destroys it.
    type: str
    choices: [present, absent]
    default: present
  template:
    description:
      - A pinned template's volume on the node's storage, e.g.
        V(local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst).
      - Unset or empty, the newest O(template_name) that the node's C(pveam available --section system)
        lists, on O(template_storage).
    type: str
  template_name:
    description: The template a create uses without a pinned O(template), by name, without its version.
    type: str
    default: debian-12-standard
  template_storage:
    description: The storage holding the templates (C(vztmpl) content) without a pinned O(template).
    type: str
    default: local
  hostname:
    description: The container's hostname.
    type: str
  cores:
    description: CPU cores.
    type: int
    default: 2
  memory:
    description: Memory in MiB.
    type: int
    default: 8192
  swap:
    description: Swap in MiB.
    type: int
    default: 0
  rootfs_storage:
    description: The storage of the root disk; it needs C(rootdir) content (C(local-lvm) on a default
      install, C(local-zfs) on ZFS; C(local) holds none).
    type: str
    default: local-lvm
  rootfs_size:
    description: Size of the root disk in GiB.
    type: int
    default: 32
  unprivileged:
    description: An unprivileged container (its root is an unprivileged user on the node).
    type: bool
    default: true
  onboot:
    description: Start the container when the node boots.
    type: bool
    default: false
  nesting:
    description:
      - In an unprivileged container, C(features nesting=1) (other feature flags the node has are left as they
        are). systemd newer than 241 needs it there (pve-container's LXC.pm C(check_systemd_nesting) warns
        without it). Ignored for a privileged container.
    type: bool
    default: true
  networks:
    description: >-
      The container's network interfaces, C(netN) to its value, e.g.
      V({net0: "name=eth0,bridge=vmbr0,ip=dhcp"}). Only the properties given are compared.
    type: dict
    default: {}
  gpus:
    description: The node's GPUs to pass through, by the N of C(/dev/nvidiaN) (nvidia-smi's minor number).
    type: list
    elements: int
    default: []
  control_devices:
    description: The devices CUDA needs besides the GPUs, passed through with them (when O(gpus) is not
      empty). The node must have each; a missing one fails the start, and the new container is removed.
    type: list
    elements: str
    default: [/dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia-uvm-tools]
  device_gid:
    description: In an unprivileged container, the group (its gid in the container) that owns the
      passed-through device nodes; V(44) is Debian's C(video) group.
    type: int
    default: 44
  mounts:
    description:
      - Directories of the node bind mounted into the container at its start (C(mp0), C(mp1), ... in
        this order, written C(/srv/models,mp=/srv/models,replicate=0,ro=1) as pve-container writes
        them; C(replicate=0) because a replication job cannot copy a node's directory).
      - Each O(mounts[].node_path) must be a directory on the node; else nothing is created or changed.
      - In an unprivileged container the node's uids and gids appear shifted (its root is uid 100000 on
        the node); a writable mount whose directory the container's users cannot write is warned about.
    type: list
    elements: dict
    default: []
    suboptions:
      node_path:
        description: The directory on the node (an absolute path).
        type: str
        required: true
      container_path:
        description: Where the container sees it (an absolute path, not V(/)).
        type: str
        required: true
      read_only:
        description: Mount it read-only (C(ro=1)), so that nothing in the container can write to it.
        type: bool
        default: false
  allow_shared_gpus:
    description: Pass a GPU through that another container of the node already has.
    type: bool
    default: false
  reconcile:
    description: Change the keys of an existing container's config that differ (else only report them).
    type: bool
    default: false
  run_live:
    description: A training run is live in the container (the caller read its pidfile); a reconcile or
      a destroy is then refused.
    type: bool
    default: false
  start:
    description: Start the container when it is stopped.
    type: bool
    default: true
"""

EXAMPLES = r"""
- name: Ensure CT 204 exists on its node with GPUs 4 to 7.
  dflash.ops.proxmox_container:
    vmid: 204
    node_name: pve1
    template: local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst
    hostname: ct204
    cores: 16
    memory: 262144
    rootfs_size: 200
    networks:
      net0: name=eth0,bridge=vmbr0,ip=dhcp
    gpus: [4, 5, 6, 7]
    mounts:
      - {node_path: /srv/models, container_path: /srv/models, read_only: true}
      - {node_path: /srv/features, container_path: /srv/features}
  delegate_to: pve1
"""

RETURN = r"""
template:
  description: The template volume a create used (or, in check mode, would use); null when nothing was
    created.
  returned: always
  type: str
  sample: local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst
exists:
  description: Whether the container existed before.
  returned: always
  type: bool
status:
  description: The container's status before the module acted (V(running), V(stopped)); null when it did
    not exist.
  returned: always
  type: str
started:
  description: Whether an existing, stopped container was started (in check mode, would be).
  returned: always
  type: bool
created:
  description: Whether the container was created (in check mode, would be).
  returned: always
  type: bool
destroyed:
  description: Whether the container was destroyed (in check mode, would be).
  returned: always
  type: bool
differences:
  description: The keys of an existing container's config that differ from the options; C(applied)
    is false for those left alone (not reconciled, or never changed by pct set).
  returned: always
  type: list
  elements: dict
  sample: [{key: cores, have: "2", want: "8", applied: false}]
config:
  description: The container's config, key to value (what it would be, in check mode).
  returned: when O(state=present)
  type: dict
lock:
  description: The C(lock:) of the container's config (V(backup), V(create), ...); null without one or when
    it did not exist.
  returned: always
  type: str
  sample: backup
ha_state:
  description: The HA manager's state of the container (C(hastate)); null when HA does not manage it.
  returned: always
  type: str
gpu_uuids:
  description: The UUIDs of the GPUs of O(gpus), in the order the container numbers them (0, 1, ...).
  returned: always
  type: list
  elements: str
driver_version:
  description: The node's NVIDIA driver version (null without GPUs on the node).
  returned: always
  type: str
  sample: 550.127.05
"""

import json
import os
import re
import socket
import stat

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.dflash.ops.plugins.module_utils import pve_templates
from ansible_collections.dflash.ops.plugins.module_utils.nvidia_smi import (
    GPU_DEVICES,
    PROGRAM,
    NvidiaSmiError,
    cannot_run,
)
from ansible_collections.dflash.ops.plugins.module_utils.pct_cli import (
    PCT_ARGUMENTS,
    START_TIMEOUT,
    CheckFailed,
    Pct,
    gpu_passthrough_lines,
    passed_devices,
    said,
)
from ansible_collections.dflash.ops.plugins.module_utils.pct_config import (
    applied,
    config_differences,
    config_text,
    options_argv,
    parse_config,
    wanted_config,
)
from ansible_collections.dflash.ops.plugins.module_utils.pct_locks import (
    check_lock_and_ha,
    config_lock,
    ha_destroy_refusal,
    ha_state,
    lock_refusal,
    needed_steps,
)

ARGUMENT_SPEC = dict(
    **PCT_ARGUMENTS,
    state=dict(type="str", choices=["present", "absent"], default="present"),
    template=dict(type="str"),
    template_name=dict(type="str", default="debian-12-standard"),
    template_storage=dict(type="str", default="local"),
    hostname=dict(type="str"),
    cores=dict(type="int", default=2),
    memory=dict(type="int", default=8192),
    swap=dict(type="int", default=0),
    rootfs_storage=dict(type="str", default="local-lvm"),
    rootfs_size=dict(type="int", default=32),
    unprivileged=dict(type="bool", default=True),
    onboot=dict(type="bool", default=False),
    nesting=dict(type="bool", default=True),
    networks=dict(type="dict", default={}),
    gpus=dict(type="list", elements="int", default=[]),
    control_devices=dict(type="list", elements="str",
                         default=["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]),
    device_gid=dict(type="int", default=44),
    mounts=dict(type="list", elements="dict", default=[], options=dict(
        node_path=dict(type="str", required=True),
        container_path=dict(type="str", required=True),
        read_only=dict(type="bool", default=False),
    )),
    allow_shared_gpus=dict(type="bool", default=False),
    reconcile=dict(type="bool", default=False),
    run_live=dict(type="bool", default=False),
    start=dict(type="bool", default=True),
)
# Keys pct set cannot change on an existing container (API2/LXC/Config.pm: unprivileged is fixed at
# create; a root disk grows with pct resize).
FIXED_KEYS = ("rootfs", "unprivileged")
KIB_PER_GIB = 1024 * 1024
# An unprivileged container's uids and gids on the node: 0 to 65535 in it are 100000 to 165535 on the
# node (LXC.pm parse_id_maps' default, lxc.idmap = u 0 100000 65536).
UNPRIVILEGED_IDS = range(100000, 100000 + 65536)


# ---------------------------------------------------------------------------------------------
# Reading the node


def node_gpus(pct):
    """The GPU_DEVICES rows {index, uuid, minor, driver} of the node's nvidia-smi, those without a device
    node (a minor number nvidia-smi cannot give) left out; [] when the node has no nvidia-smi."""
    answer = pct.tool(PROGRAM, *GPU_DEVICES.argv, as_root=False)
    if cannot_run(answer.rc):
        return []
    fix = "Check the NVIDIA driver on the node before passing its GPUs through."
    if answer.rc != 0:
        raise CheckFailed(f"nvidia-smi fails on node {pct.node} (exit {answer.rc}): {said(answer)}. {fix}")
    try:
        gpus = GPU_DEVICES.parse(answer.stdout)
    except NvidiaSmiError as exc:
        raise CheckFailed(f"nvidia-smi on node {pct.node}: {exc}. {fix}") from None
    return [gpu for gpu in gpus if gpu["index"] is not None and gpu["minor"] is not None]


def check_gpus_exist(pct, vmid, wanted, gpus):
    minors = sorted(g["minor"] for g in gpus)
    missing = sorted(set(wanted) - set(minors))
    if missing:
        have = ", ".join(f"/dev/nvidia{m}" for m in minors) or "no NVIDIA GPU (nvidia-smi lists none)"
        raise CheckFailed(f"CT {vmid}: node {pct.node} has no GPU {', '.join(map(str, missing))} "
                          f"(/dev/nvidia{missing[0]}); it has {have}. Fix proxmox_provision_gpus (the N of "
                          "/dev/nvidiaN, as nvidia-smi --query-gpu=minor_number lists them on the node).")


def check_template(pct, vmid, template):
    answer = pct.tool("pvesm", "path", template)
    path = answer.stdout.strip()
    if answer.rc != 0 or not os.path.isfile(path):
        where = f" ({path})" if answer.rc == 0 else f": {said(answer)}"
        folder = os.path.dirname(path) if answer.rc == 0 else ""
        found = sorted(os.listdir(folder)) if folder and os.path.isdir(folder) else []
        have = ", ".join(found) or "no templates there"
        raise CheckFailed(f"CT {vmid}: the template {template} is not on node {pct.node}{where}. Download "
                          f"it there (pveam download {template.split(':')[0]} {template.rpartition('/')[2]}) "
                          f"or fix proxmox_provision_template; the node has {have}.")


def check_vmid_free(pct, vmid, hostname):
    """vmids are unique across the cluster, VMs and containers alike (pve-cluster's check_vmid_unused)."""
    answer = pct.tool("pvesh", "get", "/cluster/resources", "--type", "vm", "--output-format", "json")
    if answer.rc != 0:
        return  # no pvesh to ask: pct create refuses a taken vmid itself, before creating anything
    try:
        guests = json.loads(answer.stdout)
    except ValueError:
        return
    for guest in guests:
        if guest.get("vmid") == vmid:
            label = "VM" if guest.get("type") == "qemu" else "CT"
            raise CheckFailed(f"vmid {vmid} of {hostname} is taken: {label} {vmid} ({guest.get('name')}) "
                              f"exists on node {guest.get('node')}. vmids are unique across a Proxmox VE "
                              "cluster: choose a free proxmox_vmid for it.")


def gpu_holders(pct, vmid, devices):
    """{device: [CT ids]} of the node's other containers that pass one of `devices` through."""
    listing = pct.must("list")
    holders = {}
    for row in (line.split() for line in listing.splitlines()[1:]):
        if not row or not row[0].isdigit() or int(row[0]) == vmid:
            continue
        config = pct("config", row[0])
        for device in passed_devices(gpu_passthrough_lines(config.stdout)) if config.rc == 0 else []:
            if device in devices:
                holders.setdefault(device, []).append(int(row[0]))
    return holders


def check_gpus_free(pct, vmid, gpus):
    devices = [f"/dev/nvidia{minor}" for minor in sorted(gpus)]
    holders = gpu_holders(pct, vmid, devices) if devices else {}
    if holders:
        held = "; ".join(f"{dev} by CT {', '.join(map(str, cts))}" for dev, cts in sorted(holders.items()))
        raise CheckFailed(f"CT {vmid}: GPUs of node {pct.node} are already passed through to another "
                          f"container: {held}. Choose other GPUs (proxmox_provision_gpus), or set "
                          "proxmox_provision_allow_shared_gpus: true to share them.")


def check_room(pct, vmid, storage, size_gib):
    """The root disk's storage holds container root disks (pvesm status --content rootdir lists it, as
    pct create requires) and has room for it."""
    answer = pct.tool("pvesm", "status", "--content", "rootdir")
    rows = [line.split() for line in answer.stdout.splitlines()[1:]] if answer.rc == 0 else []
    row = next((r for r in rows if r and r[0] == storage), None)
    if answer.rc == 0 and row is None:
        listed = ", ".join(r[0] for r in rows if r) or "none"
        raise CheckFailed(f"CT {vmid}: storage {storage} on node {pct.node} holds no container root disks "
                          f"(pvesm status --content rootdir lists {listed}; pct create would say: storage "
                          f"'{storage}' does not support container directories). Fix "
                          "proxmox_provision_rootfs_storage: local-lvm on a default install, local-zfs on a "
                          "ZFS one.")
    if row is None or len(row) < 6 or not row[5].isdigit():
        raise CheckFailed(f"CT {vmid}: storage {storage} is not usable on node {pct.node} (pvesm status: "
                          f"{said(answer) or 'no such storage'}). Fix proxmox_provision_rootfs_storage.")
    available = int(row[5])
    if available < size_gib * KIB_PER_GIB:
        raise CheckFailed(f"CT {vmid}: storage {storage} on node {pct.node} has "
                          f"{available / KIB_PER_GIB:.1f} GiB available (pvesm status), its root disk needs "
                          f"{size_gib} GiB. Free space there, or choose another "
                          "proxmox_provision_rootfs_storage or a smaller proxmox_provision_rootfs_size.")


def check_mounts(pct, vmid, mounts, unprivileged):
    """Each node directory of `mounts` is there (a start bind mounts it, LXC.pm mountpoint_mount: `die
    "directory '$volid' does not exist"`); returns the warnings of writable mounts an unprivileged
    container's users cannot write (its root is uid 100000 on the node, and no capability of it
    overrides the permissions of a directory that uid does not own)."""
    warnings = []
    for m in mounts:
        path, where = m["node_path"], f"(proxmox_provision_mounts, for {m['container_path']} in CT {vmid})"
        try:
            found = os.stat(path)
        except FileNotFoundError:
            raise CheckFailed(f"{path} {where} does not exist on node {pct.node}: a container bind mounts "
                              "a directory of its node at its start. Make it there (with what it should "
                              "hold) or fix node_path.") from None
        except OSError as exc:
            raise CheckFailed(f"{path} {where} cannot be checked on node {pct.node} by its user: "
                              f"{exc.strerror}. Let that user reach it, or fix node_path.") from None
        if not stat.S_ISDIR(found.st_mode):
            raise CheckFailed(f"{path} {where} is not a directory on node {pct.node}: a bind mount point "
                              "mounts a directory. Fix node_path.")
        writable = found.st_uid in UNPRIVILEGED_IDS or found.st_mode & stat.S_IWOTH
        if unprivileged and not m["read_only"] and not writable:
            warnings.append(f"CT {vmid} is unprivileged (its root is uid {UNPRIVILEGED_IDS[0]} on node "
                            f"{pct.node}), and {path} (uid {found.st_uid}, mode "
                            f"{stat.S_IMODE(found.st_mode):04o}) is not its: writes to {m['container_path']} "
                            f"fail in it. chown {UNPRIVILEGED_IDS[0]}:{UNPRIVILEGED_IDS[0]} {path} on the "
                            "node for the container's root, or mount it read_only.")
    return warnings


# ---------------------------------------------------------------------------------------------
# Changing the node


def create(pct, vmid, template, wanted, start):
    """pct create, then pct start; a container whose start fails is destroyed again (nothing half-made)."""
    created = pct("create", vmid, template, *options_argv(wanted), timeout=START_TIMEOUT)
    if created.rc != 0:
        # pve-container checks every devN path at create (LXC/Tools.pm get_device_mode_and_rdev).
        hint = (f". A device it passes through is missing on {pct.node}: not made since the node's boot "
                "(playbooks/preflight_node.yml's device-files item names the fix), or not one the node has "
                "(proxmox_provision_control_devices, proxmox_provision_gpus)"
                if re.search(r"Device \S+ does not exist", said(created)) else "")
        raise CheckFailed(f"pct create {vmid} failed on node {pct.node} (exit {created.rc}): {said(created)}"
                          + hint)
    if start:
        started = pct("start", vmid, timeout=START_TIMEOUT)
        if started.rc != 0:
            removed = pct("destroy", vmid, timeout=START_TIMEOUT)
            undo = ("it was destroyed again" if removed.rc == 0
                    else f"destroying it failed too: {said(removed)}")
            raise CheckFailed(f"CT {vmid} was created on node {pct.node} but did not start (pct start "
                              f"{vmid}, exit {started.rc}): {said(started)}; {undo}. A device it passes "
                              f"through may be missing on {pct.node} (proxmox_provision_control_devices, "
                              "proxmox_provision_gpus).")


# How long a shutdown waits for the container's init before pct stops it: pct shutdown's own default
# (pve-container API2/LXC/Status.pm, vm_shutdown: `timeout` 60). No run is live in a container provisioning
# stops (checked first).
SHUTDOWN_TIMEOUT = 60


def shut_down(pct, vmid):
    """pct shutdown: the container's init stops its services (a run's SIGTERM, its checkpoint), then, after
    SHUTDOWN_TIMEOUT, pct stops it (`--forceStop 1`, pct.pm's shutdown; pve-guests' stopall does the same)."""
    pct.must("shutdown", vmid, "--timeout", SHUTDOWN_TIMEOUT, "--forceStop", "1",
             timeout=SHUTDOWN_TIMEOUT + START_TIMEOUT)


def reconcile(pct, vmid, diffs, running):
    sets = {d["key"]: d["want"] for d in diffs if d["want"] is not None}
    deletes = [d["key"] for d in diffs if d["want"] is None]
    args = options_argv(sets) + (["--delete", ",".join(deletes)] if deletes else [])
    pct.must("set", vmid, *args)
    if running and any(k.startswith(("dev", "mp")) for k in [*sets, *deletes]):
        # The passthrough and bind mounts of a running container change at its next start (no live run:
        # checked).
        shut_down(pct, vmid)
        pct.must("start", vmid, timeout=START_TIMEOUT)


def provision(pct, p, check_mode, result):
    vmid, node = p["vmid"], pct.node
    status = pct("status", vmid)
    words = said(status)
    if status.rc != 0 and not ("Configuration file" in words and "does not exist" in words):
        raise CheckFailed(f"pct status {vmid} failed on node {node} (exit {status.rc}): {words}")
    exists = result["exists"] = status.rc == 0
    running = exists and "status: running" in status.stdout
    result["status"] = ("running" if running else "stopped") if exists else None
    before = parse_config(pct.must("config", vmid)) if exists else {}
    lock = result["lock"] = config_lock(before)
    result["ha_state"] = ha_state(pct, vmid) if exists else None
    if p["state"] == "absent":
        if exists:
            if p["run_live"]:
                raise CheckFailed(f"CT {vmid} on node {node} has a live training run: it is not destroyed. "
                                  "Stop the run first (playbooks/stop_training.yml).")
            if lock:
                raise CheckFailed(lock_refusal(vmid, node, lock, f"pct destroy {vmid}"))
            if result["ha_state"]:
                raise CheckFailed(ha_destroy_refusal(vmid, node, result["ha_state"]))
            if not check_mode:
                if running:
                    shut_down(pct, vmid)
                pct.must("destroy", vmid, timeout=START_TIMEOUT)
            result.update(changed=True, destroyed=True, diff=dict(before=config_text(before), after=""))
        return

    gpus = node_gpus(pct) if p["gpus"] else []
    check_gpus_exist(pct, vmid, p["gpus"], gpus)
    by_minor = {g["minor"]: g for g in gpus}
    result["gpu_uuids"] = [by_minor[m]["uuid"] for m in sorted(p["gpus"], key=lambda m: by_minor[m]["index"])]
    result["driver_version"] = gpus[0]["driver"] if gpus else None
    result["warnings"] = check_mounts(pct, vmid, p["mounts"], p["unprivileged"])
    wanted = wanted_config(p)
    if not exists:
        template, _found, error = pve_templates.resolve(pct, p["template"], p["template_name"],
                                                        p["template_storage"])
        if error and not template:
            raise CheckFailed(f"CT {vmid}: no template to create it from on node {pct.node}: {error}. Pin "
                              "one with proxmox_provision_template.")
        result["template"] = template
        check_template(pct, vmid, template)
        check_vmid_free(pct, vmid, wanted["hostname"])
        if not p["allow_shared_gpus"]:
            check_gpus_free(pct, vmid, p["gpus"])
        check_room(pct, vmid, p["rootfs_storage"], p["rootfs_size"])
        if not check_mode:
            create(pct, vmid, template, wanted, p["start"])
        result.update(changed=True, created=True, config=wanted,
                      diff=dict(before="", after=config_text(wanted)))
        return

    diffs = config_differences(wanted, before)
    settable = [d for d in diffs if d["key"] not in FIXED_KEYS]
    for d in diffs:
        d["applied"] = p["reconcile"] and d in settable
    result["differences"] = diffs
    check_lock_and_ha(vmid, node, lock, result["ha_state"], needed_steps(vmid, p, settable, running), result)
    after = before
    if settable and p["reconcile"]:
        if p["run_live"]:
            raise CheckFailed(f"CT {vmid} on node {node} differs from the inventory "
                              f"({difference_text(settable)}) but has a live training run: nothing "
                              "was changed. Stop the run first (playbooks/stop_training.yml), then provision "
                              "again.")
        new = [d["want"].split(",")[0] for d in settable if d["key"].startswith("dev") and d["want"]]
        if not p["allow_shared_gpus"]:
            check_gpus_free(pct, vmid, [int(path[len("/dev/nvidia"):]) for path in new
                                        if re.fullmatch(r"/dev/nvidia[0-9]+", path)])
        if not check_mode:
            reconcile(pct, vmid, settable, running)
        after = applied(before, settable)
        result["changed"] = True
    result["config"] = after
    result["diff"] = dict(before=config_text(before), after=config_text(after))
    if not running and p["start"]:
        if not check_mode:
            pct.must("start", vmid, timeout=START_TIMEOUT)
        result["changed"] = result["started"] = True


def difference_text(diffs):
    return "; ".join(f"{d['key']}: {d['have'] or '(unset)'} -> {d['want'] or '(removed)'}" for d in diffs)


def mount_problem(mounts):
    """What is wrong with `mounts` before anything is read (Config.pm: a bind mount's volume is an
    absolute path, `mp` is a path in the container, neither with `/./` or `/../`, both inside a property
    string, so no `,`), or None."""
    seen = set()
    for m in mounts:
        for key in ("node_path", "container_path"):
            path = m[key]
            if not path.startswith("/") or re.search(r"/\.\.?(/|$)", path) or "," in path or "=" in path:
                return (f"{key} {path!r} must be an absolute path without /./, /../, ',' or '=' "
                        f"(mount {m['node_path']} -> {m['container_path']})")
        if m["node_path"].startswith("/dev/"):
            return f"node_path {m['node_path']} is a device: pass devices through with devN, not a mount"
        if m["container_path"].rstrip("/") == "":
            return f"container_path of {m['node_path']} is the container's root: mount it somewhere below /"
        if m["container_path"].rstrip("/") in seen:
            return f"two mounts have container_path {m['container_path']}"
        seen.add(m["container_path"].rstrip("/"))
    return None


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    if not p["pct_argv"]:
        module.fail_json(msg="pct_argv is empty: name the command that runs pct, e.g. [/usr/sbin/pct]")
    if any(gpu < 0 for gpu in p["gpus"]) or len(set(p["gpus"])) != len(p["gpus"]):
        module.fail_json(msg=f"gpus must be distinct GPU numbers >= 0 (N of /dev/nvidiaN), got {p['gpus']}")
    bad_mount = mount_problem(p["mounts"])
    if bad_mount:
        module.fail_json(msg=f"proxmox_provision_mounts: {bad_mount}")
    node = p["node_name"] or socket.gethostname().split(".")[0]
    result = dict(changed=False, exists=False, status=None, created=False, destroyed=False, started=False,
                  differences=[], gpu_uuids=[], driver_version=None, template=None, lock=None, ha_state=None)
    try:
        provision(Pct(p["pct_argv"], node), p, module.check_mode, result)
    except CheckFailed as exc:
        module.fail_json(msg=str(exc), **result)
    left = [d for d in result["differences"] if not d["applied"]]
    if left:
        module.warn(f"CT {p['vmid']} on node {node} differs from the inventory and was left as it is: "
                    f"{difference_text(left)}. Set proxmox_provision_reconcile: true to change it (not "
                    "the root disk or unprivileged: pct resize, or a new container).")
    if not module._diff:
        result.pop("diff", None)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
