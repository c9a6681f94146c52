# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What proxmox_container checks on its node before it creates or changes a container, so that nothing is
made that pct would refuse or that could not start: the node's GPUs (its nvidia-smi), the template, a free
vmid, GPUs no other container has, the root disk's storage and its room, the bind mounts' directories, and
the options' mounts themselves. Each check raises CheckFailed with what to fix."""

from __future__ import annotations

import json
import os
import re
import stat

from ansible_collections.dflash.ops.plugins.module_utils.nvidia_smi import (
    GPU_DEVICES,
    PROGRAM,
    NvidiaSmiError,
    cannot_run,
)
from ansible_collections.dflash.ops.plugins.module_utils.pct_cli import (
    CheckFailed,
    gpu_passthrough_lines,
    passed_devices,
    said,
)

KIB_PER_GIB = 1024 * 1024
# An unprivileged container's uids and gids on the node: 0 to 65535 in it are 100000 to 165535 on the
# node (LXC.pm parse_id_maps' default, lxc.idmap = u 0 100000 65536).
UNPRIVILEGED_IDS = range(100000, 100000 + 65536)


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
