#!/usr/bin/python
# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# Ansible modules keep their imports below the documentation blocks.
# ruff: noqa: E402
from __future__ import annotations

DOCUMENTATION = r"""
---
module: pct_container_check
short_description: Check a container on its Proxmox VE node (pct, state, GPU passthrough, nvidia-smi)
description:
  - Runs on the Proxmox VE node. Reads the container's status with C(pct status); when the container
    does not exist, lists the node's containers with C(pct list) to name them in the message.
  - A stopped container fails the check, or is started with C(pct start) when O(start_stopped) is set
    (the only change the module makes). The config is read first, and a lock in it (a running backup's
    C(backup), a killed C(pct create)'s C(create)) refuses the start before it runs, naming the lock and what
    to do; a running container's lock is a warning, since what follows (the run's stop and start) needs
    only C(pct exec), which no lock refuses. A container the HA manager manages, whose C(pct start) only
    queues a request with it (C(Requesting HA start for CT ...)), fails the check with that reason.
  - >-
    Reads the container's configuration with C(pct config) and reports its GPU passthrough lines in
    every form Proxmox VE takes (C(devN: /dev/nvidia0), C(devN: path=/dev/nvidia0,...) since PVE 8.1;
    C(lxc.cgroup2.devices.allow) for the NVIDIA device majors with C(lxc.mount.entry) of
    C(/dev/nvidia*) before) and the devices they pass through; O(require_gpu_passthrough) makes a GPU,
    C(/dev/nvidiactl) and C(/dev/nvidia-uvm) (which CUDA needs) mandatory.
  - With O(required_gpus), runs C(nvidia-smi --query-gpu=index,uuid) in the container through
    C(pct exec) and fails when nvidia-smi is missing, fails (a driver error), or lists fewer GPUs
    than the highest required index needs (a container sees only the GPUs passed through to it,
    numbered from 0). Then, when the node has nvidia-smi, fails when another container (or the node)
    has a process on one of those GPUs (two containers given the same GPU).
  - Every failure names its cause and the fix, before anything in the container is touched. A
    C(pct) that cannot be run (not installed, not executable, or refused by sudo as an unknown
    command), a pct that refuses the user (C(please run as root)), sudo asking for a password, a
    container that does not exist and any other pct failure (a cluster filesystem error) each get a
    message of their own, with pct's own words.
  - The fixes it names are dflash-ops' inventory variables (C(proxmox_host_start_containers),
    C(dflash_run_verify_gpus), the GPU layout variables).
version_added: "0.3.0"
author: dflash-ops contributors (@dflash-ops)
extends_documentation_fragment:
  - dflash.ops.attributes
  - dflash.ops.pct
attributes:
  check_mode:
    support: full
    details: Reads the same in check mode; a stopped container that would be started is reported as
      started (changed) but not started, and its GPUs are then not checked.
options:
  start_stopped:
    description: Start the container with C(pct start) when it is stopped, instead of failing.
    type: bool
    default: false
  require_gpu_passthrough:
    description: Fail when the container's config has no GPU passthrough lines.
    type: bool
    default: false
  required_gpus:
    description: GPU indices the container's run uses. When not empty, nvidia-smi in the container
      must answer and list every one of them.
    type: list
    elements: int
    default: []
notes:
  - Runs nothing on the node but O(pct_argv) with C(status), C(list), C(start), C(config) and C(exec),
    so a sudo rule for pct alone is all a non-root node user needs.
"""

EXAMPLES = r"""
- name: Check the container on its Proxmox node.
  dflash.ops.pct_container_check:
    vmid: "{{ proxmox_vmid }}"
    node_name: "{{ proxmox_node }}"
    required_gpus: [0, 1, 2, 3, 4, 5, 6, 7]
  delegate_to: "{{ proxmox_node }}"

- name: Ensure CT 200 runs, starting it if stopped, as a non-root node user.
  dflash.ops.pct_container_check:
    vmid: 200
    pct_argv: [sudo, -n, /usr/sbin/pct]
    start_stopped: true
    require_gpu_passthrough: true
"""

RETURN = r"""
status:
  description: The container's status as C(pct status) gave it before any start (V(running),
    V(stopped)); null when the container does not exist.
  returned: always
  type: str
  sample: running
started:
  description: Whether the container was started (in check mode, whether it would have been).
  returned: always
  type: bool
lock:
  description: The C(lock:) of the container's config (V(backup), V(create), ...); null without one or when
    the check failed before reading it.
  returned: always
  type: str
  sample: backup
gpu_passthrough:
  description: The GPU passthrough lines of the container's config.
  returned: when the container exists and runs (or was started)
  type: list
  elements: str
  sample: ["lxc.cgroup2.devices.allow: c 195:* rwm",
           "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file"]
gpu_devices:
  description: The NVIDIA device nodes the container's config passes through, in any form.
  returned: when the container exists and runs (or was started)
  type: list
  elements: str
  sample: [/dev/nvidia0, /dev/nvidia1, /dev/nvidiactl, /dev/nvidia-uvm]
gpu_count:
  description: Number of GPUs nvidia-smi lists in the container; null when the GPUs were not checked.
  returned: always
  type: int
  sample: 8
gpu_uuids:
  description: The UUIDs of the GPUs nvidia-smi lists in the container, by index.
  returned: when the GPUs were checked
  type: list
  elements: str
containers:
  description: The CT ids the node has, from C(pct list); read only when the container does not exist.
  returned: when the container does not exist
  type: list
  elements: int
  sample: [200, 201]
"""

import re
import socket

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.dflash.ops.plugins.module_utils.gpu_owners import vmid_of_pid
from ansible_collections.dflash.ops.plugins.module_utils.nvidia_smi import (
    COMPUTE_APPS,
    GPU_IDS,
    PROGRAM,
    VERSION_MISMATCH,
    NvidiaSmiError,
    cannot_run,
    explain_failure,
    find_executable,
)
from ansible_collections.dflash.ops.plugins.module_utils.pct_cli import (
    PCT_ARGUMENTS,
    READ_TIMEOUT,
    START_TIMEOUT,
    CheckFailed,
    Pct,
    gpu_passthrough_lines,
    passed_devices,
    said,
)
from ansible_collections.dflash.ops.plugins.module_utils.pct_config import parse_config
from ansible_collections.dflash.ops.plugins.module_utils.pct_locks import (
    HA_REQUEST,
    config_lock,
    ha_refusal,
    lock_refusal,
    lock_warning,
)

ARGUMENT_SPEC = dict(
    **PCT_ARGUMENTS,
    start_stopped=dict(type="bool", default=False),
    require_gpu_passthrough=dict(type="bool", default=False),
    required_gpus=dict(type="list", elements="int", default=[]),
)
GPU_DEVICE = re.compile(r"^/dev/nvidia[0-9]+$")
# What CUDA needs besides the GPUs: the driver's control device and the unified memory device.
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm")
# nvidia-smi in the container, by name: the driver installs it in /usr/bin, on the PATH pct forces
# (/sbin:/bin:/usr/sbin:/usr/bin).
CONTAINER_NVIDIA_SMI = [PROGRAM, *GPU_IDS.argv]


# ---------------------------------------------------------------------------------------------
# Judging (pure)


def status_failure_message(pct, vmid, status, containers):
    """Why `pct status` failed, in pct's (or sudo's) own words; only a missing config means the
    container does not exist."""
    node, words = pct.node, said(status)
    if "does not exist" in words and "Configuration file" in words:
        return missing_container_message(vmid, node, status, containers)
    if "please run as root" in words:
        return (f"pct on node {node} refuses this user ({words}): pct runs as root only. Connect to "
                f"{node} as root, or run pct through sudo (proxmox_host_pct_sudo: true) with the sudo rule "
                f"for {pct.path} (inventory/production.example/sudoers.d/ansible_pct) installed on {node}.")
    if words.startswith("sudo:"):
        return (f"sudo on node {node} does not let this user run {pct.path} ({words}). Install the sudo "
                f"rule (inventory/production.example/sudoers.d/ansible_pct) on {node}.")
    return (f"pct status {vmid} failed on node {node} (exit {status.rc}): {words}. The node's Proxmox "
            f"services (pve-cluster, the cluster filesystem /etc/pve) may be down: check `pct list` on "
            f"{node}.")


def node_containers(list_output):
    """The CT ids of `pct list` (a header line, then one container a line)."""
    rows = [line.split() for line in list_output.splitlines()[1:]]
    return [row[0] for row in rows if row]


def passthrough_problem(vmid, node, devices):
    """What is missing for CUDA in the container's passthrough (None when nothing is)."""
    missing = ([] if any(GPU_DEVICE.match(d) for d in devices) else ["a GPU (/dev/nvidia<N>)"])
    missing += [d for d in CONTROL_DEVICES if d not in devices]
    if not missing:
        return None
    return (f"CT {vmid} on node {node} does not pass through {', '.join(missing)} (its config passes "
            f"through {', '.join(devices) or 'no NVIDIA device'}). Add devN entries (pct set {vmid} --devN "
            "/dev/...), or the lxc.cgroup2.devices.allow and lxc.mount.entry lines of older nodes, and "
            "restart it.")


def gpu_holders(processes, uuids, required_gpus, vmid, vmid_of_pid):
    """(index, uuid, owner, pid, MiB) of every process of another container or the node on a required
    GPU, from the node's COMPUTE_APPS rows."""
    wanted = {uuids[i]: i for i in required_gpus if i < len(uuids) and uuids[i]}
    holders = []
    for process in processes:
        uuid, pid = process["gpu_uuid"], process["pid"]
        if uuid not in wanted or pid is None:
            continue
        owner = vmid_of_pid(pid)
        if owner != vmid:
            holders.append((wanted[uuid], uuid, owner, pid, process["used_memory_mib"]))
    return sorted(holders, key=lambda h: (h[0], h[3]))


def shared_gpu_message(vmid, node, holders):
    held = "; ".join(f"GPU {index} ({uuid}) by {'CT ' + str(owner) if owner else 'the node itself'} "
                     f"(pid {pid}, {'?' if mib is None else mib} MiB)"
                     for index, uuid, owner, pid, mib in holders)
    others = sorted({holder[2] for holder in holders if holder[2]})
    return (f"CT {vmid} on node {node}: GPUs of the run's layout are in use outside this container: {held}. "
            "Two containers are given the same GPU: stop what runs there"
            + (f" (CT {', '.join(map(str, others))})" if others else "")
            + f", or pass other GPUs through to CT {vmid} (pct config {vmid}).")


def missing_container_message(vmid, node, status, containers):
    return (f"CT {vmid} does not exist on node {node} (pct: {said(status)}). Fix proxmox_vmid (or "
            f"proxmox_node) in the inventory; the node has {', '.join(containers) or 'no containers'}.")


def stopped_message(vmid, node, status):
    return (f"CT {vmid} on node {node} is not running ({status.stdout.strip()}). Start it with "
            f"`pct start {vmid}` or set proxmox_host_start_containers: true.")


def no_passthrough_message(vmid, node):
    return (f"CT {vmid} on node {node} has no GPU passthrough lines (lxc.cgroup2.devices.allow / "
            "lxc.mount.entry for /dev/nvidia*, or devN: /dev/nvidia*) in its config.")


def start_failed_message(vmid, node, answer):
    return (f"CT {vmid} on node {node} did not start (pct start {vmid}, exit {answer.rc}): {said(answer)}. "
            f"A device its config passes through may be missing on {node}: compare pct config {vmid} "
            f"with ls -l /dev/nvidia* on {node}.")


def container_gpus(vmid, node, answer):
    """The GPU_IDS rows of nvidia-smi in the container, by index; raises CheckFailed when nvidia-smi is
    missing there, fails, or answers lines it cannot read."""
    if cannot_run(answer.rc):
        raise CheckFailed(
            f"nvidia-smi is missing in CT {vmid} on node {node} ({answer.stderr.strip()}). Install the "
            "NVIDIA driver's user-space tools in the container (the node's driver version, without the "
            "kernel module), or set dflash_run_verify_gpus: false for a run without GPUs.")
    fix = (f"Check the driver on the node (nvidia-smi on {node}), that the container's user-space driver has "
           f"the node's version, and the container's GPU passthrough (pct config {vmid}).")
    if answer.rc != 0:
        output = f"{answer.stdout.strip()} {answer.stderr.strip()}".strip()
        why = explain_failure(answer.rc, output)
        if VERSION_MISMATCH in why:  # the node's driver moved: provision.yml is the fix, as it says
            raise CheckFailed(f"nvidia-smi fails in CT {vmid} on node {node}: {why}")
        raise CheckFailed(f"nvidia-smi fails in CT {vmid} on node {node} (exit {answer.rc}): {output} {fix}")
    try:
        gpus = GPU_IDS.parse(answer.stdout)
    except NvidiaSmiError as exc:
        raise CheckFailed(f"nvidia-smi in CT {vmid} on node {node}: {exc}. {fix}") from None
    return sorted(gpus, key=lambda gpu: (gpu["index"] is None, gpu["index"]))


def layout_problem(vmid, node, count, required_gpus):
    """Why the run's GPU layout does not fit the container's `count` GPUs (None when it does)."""
    beyond = [gpu for gpu in required_gpus if gpu >= count]
    if beyond:
        return (f"CT {vmid} on node {node} has {count} GPU(s) (nvidia-smi in the container: indices "
                f"0..{count - 1}), but the run's layout names GPU(s) {beyond}. Fix the layout "
                "(dflash_release_target_gpus, dflash_release_drafter_gpus, dflash_run_gpus) or pass more "
                "GPUs through to the container.")
    return None


def check(pct, params, check_mode, result, vmid_of_pid=vmid_of_pid):
    """The checks, in the order a user fixes them; fills `result` and raises CheckFailed."""
    vmid, node = params["vmid"], pct.node
    status = pct("status", vmid)
    if status.rc != 0:
        listing = pct("list")
        containers = node_containers(listing.stdout) if listing.rc == 0 else []
        result["containers"] = [int(c) for c in containers if c.isdigit()]
        raise CheckFailed(status_failure_message(pct, vmid, status, containers))
    result["status"] = status.stdout.strip().partition("status:")[2].strip() or None
    running = "status: running" in status.stdout
    if not running and not params["start_stopped"]:
        raise CheckFailed(stopped_message(vmid, node, status))
    config = pct.must("config", vmid)
    lock = result["lock"] = config_lock(parse_config(config))
    if not running:
        if lock:
            raise CheckFailed(lock_refusal(vmid, node, lock, f"pct start {vmid}"))
        if not check_mode:
            started = pct("start", vmid, timeout=START_TIMEOUT)
            if started.rc != 0:
                raise CheckFailed(start_failed_message(vmid, node, started))
            if HA_REQUEST.search(started.stdout):
                raise CheckFailed(ha_refusal(vmid, node, f"pct start {vmid}", queued=said(started)))
            running = True
        result["started"] = result["changed"] = True
    elif lock:
        result["warnings"] = [lock_warning(vmid, node, lock)]

    result["gpu_passthrough"] = gpu_passthrough_lines(config)
    result["gpu_devices"] = passed_devices(result["gpu_passthrough"])
    if params["require_gpu_passthrough"]:
        if not result["gpu_passthrough"]:
            raise CheckFailed(no_passthrough_message(vmid, node))
        problem = passthrough_problem(vmid, node, result["gpu_devices"])
        if problem:
            raise CheckFailed(problem)

    if params["required_gpus"] and running:
        gpus = container_gpus(vmid, node, pct("exec", vmid, "--", *CONTAINER_NVIDIA_SMI))
        problem = layout_problem(vmid, node, len(gpus), params["required_gpus"])
        if problem:
            raise CheckFailed(problem)
        result["gpu_count"] = len(gpus)
        result["gpu_uuids"] = [gpu["uuid"] for gpu in gpus]
        holders = gpu_holders(node_compute_apps(), result["gpu_uuids"], params["required_gpus"], vmid,
                              vmid_of_pid)
        if holders:
            raise CheckFailed(shared_gpu_message(vmid, node, holders))


def node_compute_apps():
    """The node's COMPUTE_APPS rows; none when the node has no nvidia-smi or it fails, since GPUs held
    elsewhere are the one check the node's own nvidia-smi is needed for."""
    executable = find_executable()
    if executable is None:
        return []
    try:
        return COMPUTE_APPS.read(executable, timeout=READ_TIMEOUT)
    except NvidiaSmiError:
        return []


def summary(vmid, node, result):
    parts = [result["status"] or "?"]
    if result["started"]:
        parts.append("started")
    parts.append(f"{len(result['gpu_passthrough'])} GPU passthrough line(s)")
    if result["gpu_count"] is not None:
        parts.append(f"{result['gpu_count']} GPU(s) in nvidia-smi")
    return f"CT {vmid} on node {node}: {', '.join(parts)}"


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    if not p["pct_argv"]:
        module.fail_json(msg="pct_argv is empty: name the command that runs pct, e.g. [/usr/sbin/pct]")
    if any(gpu < 0 for gpu in p["required_gpus"]):
        module.fail_json(msg=f"required_gpus must be GPU indices >= 0, got {p['required_gpus']}")
    node = p["node_name"] or socket.gethostname().split(".")[0]
    result = dict(changed=False, status=None, started=False, gpu_count=None, lock=None)
    try:
        check(Pct(p["pct_argv"], node), p, module.check_mode, result)
    except CheckFailed as exc:
        module.fail_json(msg=str(exc), **result)
    module.exit_json(msg=summary(p["vmid"], node, result), **result)


if __name__ == "__main__":
    main()
