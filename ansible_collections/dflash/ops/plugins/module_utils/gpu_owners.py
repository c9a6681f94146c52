# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Which container a GPU process belongs to, read on the Proxmox node from /proc/<pid>/cgroup."""

from __future__ import annotations

import re

LXC_CGROUP = re.compile(r"(?:^|/)lxc(?:\.payload)?[./]([0-9]+)(?=/|$)")


def read_text(path):
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return None


def vmid_from_cgroup(text):
    """The container id in /proc/<pid>/cgroup: Proxmox puts container processes under
    /lxc/<vmid>/..., plain LXC under /lxc.payload.<name>/... (cgroup v2) or /lxc/<name> (v1)."""
    for line in text.splitlines():
        match = LXC_CGROUP.search(line.split(":", 2)[-1])
        if match:
            return int(match.group(1))
    return None


def vmid_of_pid(pid, proc_root="/proc"):
    """The container a host pid runs in; None for a process of the node itself (or one gone)."""
    return vmid_from_cgroup(read_text(f"{proc_root}/{pid}/cgroup") or "")
