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

import re
import socket

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.dflash.ops.plugins.module_utils import pve_templates
from ansible_collections.dflash.ops.plugins.module_utils.pct_checks import (
    check_gpus_exist,
    check_gpus_free,
    check_mounts,
    check_room,
    check_template,
    check_vmid_free,
    mount_problem,
    node_gpus,
)
from ansible_collections.dflash.ops.plugins.module_utils.pct_cli import (
    PCT_ARGUMENTS,
    START_TIMEOUT,
    CheckFailed,
    Pct,
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
