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
    (the only change the module makes).
  - >-
    Reads the container's configuration with C(pct config) and reports its GPU passthrough lines
    (C(lxc.cgroup2.devices.allow) for the NVIDIA device majors, C(lxc.mount.entry) of C(/dev/nvidia*),
    C(devN: /dev/nvidia*)); O(require_gpu_passthrough) makes at least one mandatory.
  - With O(required_gpus), runs C(nvidia-smi --query-gpu=index) in the container through C(pct exec)
    and fails when nvidia-smi is missing, fails (a driver error), or lists fewer GPUs than the
    highest required index needs.
  - Every failure names its cause and the fix, before anything in the container is touched. A
    C(pct) that cannot be run (not installed, not executable, or refused by sudo as an unknown
    command) gets a message of its own.
  - The fixes it names are dflash-ops' inventory variables (C(proxmox_host_start_containers),
    C(dflash_run_verify_gpus), the GPU layout variables).
version_added: "0.1.0"
author: dflash-ops contributors (@dflash-ops)
extends_documentation_fragment:
  - dflash.ops.attributes
attributes:
  check_mode:
    support: full
    details: Reads the same in check mode; a stopped container that would be started is reported as
      started (changed) but not started, and its GPUs are then not checked.
options:
  vmid:
    description: The container's CT id.
    type: int
    required: true
  node_name:
    description: The node's name in messages (the inventory name). Default the machine's host name.
    type: str
  pct_argv:
    description:
      - The command that runs pct, as an argv prefix; its last element is pct's path, named in
        messages.
      - A non-root node user runs pct through sudo, for example V([sudo, -n, /usr/sbin/pct]).
    type: list
    elements: str
    default: [/usr/sbin/pct]
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
gpu_passthrough:
  description: The GPU passthrough lines of the container's config.
  returned: when the container exists and runs (or was started)
  type: list
  elements: str
  sample: ["lxc.cgroup2.devices.allow: c 195:* rwm",
           "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file"]
gpu_count:
  description: Number of GPUs nvidia-smi lists in the container; null when the GPUs were not checked.
  returned: always
  type: int
  sample: 8
containers:
  description: The CT ids the node has, from C(pct list); read only when the container does not exist.
  returned: when the container does not exist
  type: list
  elements: int
  sample: [200, 201]
"""

import os
import re
import socket
import subprocess
from collections import namedtuple

from ansible.module_utils.basic import AnsibleModule

ARGUMENT_SPEC = dict(
    vmid=dict(type="int", required=True),
    node_name=dict(type="str"),
    pct_argv=dict(type="list", elements="str", default=["/usr/sbin/pct"]),
    start_stopped=dict(type="bool", default=False),
    require_gpu_passthrough=dict(type="bool", default=False),
    required_gpus=dict(type="list", elements="int", default=[]),
)
# Config lines that pass a GPU through: cgroup device rules for the NVIDIA majors, bind mounts, devN entries.
GPU_LINE = re.compile(r"^(lxc\.cgroup2?\.devices\.allow:\s*c\s+(195|50[0-9]|23[0-9]):"
                      r"|lxc\.mount\.entry:\s*/dev/nvidia|dev\d+:\s*/dev/nvidia)")
# nvidia-smi in the container: one GPU index a line.
NVIDIA_SMI_ARGV = ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader,nounits"]
GPU_INDEX_LINE = re.compile(r"^\s*[0-9]+\s*$")
# What a shell or sudo answers for a command it cannot run.
CANNOT_RUN_CODES = (126, 127)
READ_TIMEOUT = 60
START_TIMEOUT = 300

# rc is None when the program could not be executed at all (stderr then says why).
Answer = namedtuple("Answer", "rc stdout stderr")


class CheckFailed(Exception):
    """A failed check: the message is what the user sees."""


# ---------------------------------------------------------------------------------------------
# Judging (pure)


def said(answer):
    """What pct said about a failure: its stderr, else its stdout, trimmed."""
    return answer.stderr.strip() or answer.stdout.strip()


def pct_cannot_run(answer, pct_path):
    """pct answers as a missing command does: it could not be executed, a shell's 126/127, or a
    'not found' from sudo or a shell."""
    if answer.rc is None or answer.rc in CANNOT_RUN_CODES:
        return True
    missing = re.compile(rf"No such file or directory|{re.escape(pct_path)}: (command )?not found")
    return answer.rc != 0 and bool(missing.search(said(answer)))


def node_containers(list_output):
    """The CT ids of `pct list` (a header line, then one container a line)."""
    rows = [line.split() for line in list_output.splitlines()[1:]]
    return [row[0] for row in rows if row]


def gpu_passthrough_lines(config_output):
    return [line for line in config_output.splitlines() if GPU_LINE.search(line)]


def gpu_count(nvidia_smi_output):
    return sum(1 for line in nvidia_smi_output.splitlines() if GPU_INDEX_LINE.match(line))


def pct_missing_message(pct_path, node, answer):
    return (f"{pct_path} is missing on node {node} or cannot be run there ({said(answer)}). Is it a "
            f"Proxmox VE node, and is the inventory's ansible_host of {node} its address?")


def missing_container_message(vmid, node, status, containers):
    return (f"CT {vmid} does not exist on node {node} (pct: {said(status)}). Fix proxmox_vmid (or "
            f"proxmox_node) in the inventory; the node has {', '.join(containers) or 'no containers'}.")


def stopped_message(vmid, node, status):
    return (f"CT {vmid} on node {node} is not running ({status.stdout.strip()}). Start it with "
            f"`pct start {vmid}` or set proxmox_host_start_containers: true.")


def no_passthrough_message(vmid, node):
    return (f"CT {vmid} on node {node} has no GPU passthrough lines (lxc.cgroup2.devices.allow / "
            "lxc.mount.entry for /dev/nvidia*, or devN: /dev/nvidia*) in its config.")


def nvidia_smi_problem(vmid, node, answer, required_gpus):
    """Why nvidia-smi in the container does not show the run's GPUs (None when it does)."""
    if answer.rc in CANNOT_RUN_CODES:
        return (f"nvidia-smi is missing in CT {vmid} on node {node} ({answer.stderr.strip()}). Install the "
                "NVIDIA driver's user-space tools in the container (the node's driver version, without the "
                "kernel module), or set dflash_run_verify_gpus: false for a run without GPUs.")
    if answer.rc != 0:
        output = f"{answer.stdout.strip()} {answer.stderr.strip()}".strip()
        return (f"nvidia-smi fails in CT {vmid} on node {node} (exit {answer.rc}): {output} Check the driver "
                f"on the node (nvidia-smi on {node}), that the container's user-space driver has the node's "
                f"version, and the container's GPU passthrough (pct config {vmid}).")
    count = gpu_count(answer.stdout)
    beyond = [gpu for gpu in required_gpus if gpu >= count]
    if beyond:
        return (f"CT {vmid} on node {node} has {count} GPU(s) (nvidia-smi in the container: indices "
                f"0..{count - 1}), but the run's layout names GPU(s) {beyond}. Fix the layout "
                "(dflash_release_target_gpus, dflash_release_drafter_gpus, dflash_run_gpus) or pass more "
                "GPUs through to the container.")
    return None


# ---------------------------------------------------------------------------------------------
# Running pct


class Pct:
    """pct on this node through its argv prefix; a pct that cannot be run fails every call."""

    def __init__(self, argv, node):
        self.argv = list(argv)
        self.path = self.argv[-1]
        self.node = node

    def answer(self, args, timeout=READ_TIMEOUT):
        argv = self.argv + [str(arg) for arg in args]
        try:
            proc = subprocess.run(argv, capture_output=True, encoding="utf-8", errors="replace", check=False,
                                  timeout=timeout, stdin=subprocess.DEVNULL, env=dict(os.environ, LC_ALL="C"))
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"{' '.join(argv)} did not answer within {timeout} s on node {self.node}"
                              ) from None
        except OSError as exc:
            return Answer(None, "", f"{argv[0]}: {exc.strerror}")
        return Answer(proc.returncode, proc.stdout, proc.stderr)

    def __call__(self, *args, timeout=READ_TIMEOUT):
        """pct's answer; fails when pct cannot be run at all. Through `pct exec`, an exit 126 or 127
        and a "not found" are the container command's, not pct's."""
        answer = self.answer(args, timeout)
        cannot_run = answer.rc is None if args[0] == "exec" else pct_cannot_run(answer, self.path)
        if cannot_run:
            raise CheckFailed(pct_missing_message(self.path, self.node, answer))
        return answer

    def must(self, *args, timeout=READ_TIMEOUT):
        """stdout of a pct command that has to succeed."""
        answer = self(*args, timeout=timeout)
        if answer.rc != 0:
            raise CheckFailed(f"pct {' '.join(map(str, args))} failed on node {self.node} "
                              f"(exit {answer.rc}): {said(answer)}")
        return answer.stdout


def check(pct, params, check_mode, result):
    """The checks, in the order a user fixes them; fills `result` and raises CheckFailed."""
    vmid, node = params["vmid"], pct.node
    status = pct("status", vmid)
    if status.rc != 0:
        listing = pct("list")
        containers = node_containers(listing.stdout)
        result["containers"] = [int(c) for c in containers if c.isdigit()]
        raise CheckFailed(missing_container_message(vmid, node, status, containers))
    result["status"] = status.stdout.strip().partition("status:")[2].strip() or None
    running = "status: running" in status.stdout
    if not running:
        if not params["start_stopped"]:
            raise CheckFailed(stopped_message(vmid, node, status))
        if not check_mode:
            pct.must("start", vmid, timeout=START_TIMEOUT)
            running = True
        result["started"] = result["changed"] = True

    result["gpu_passthrough"] = gpu_passthrough_lines(pct.must("config", vmid))
    if params["require_gpu_passthrough"] and not result["gpu_passthrough"]:
        raise CheckFailed(no_passthrough_message(vmid, node))

    if params["required_gpus"] and running:
        smi = pct("exec", vmid, "--", *NVIDIA_SMI_ARGV)
        problem = nvidia_smi_problem(vmid, node, smi, params["required_gpus"])
        if problem:
            raise CheckFailed(problem)
        result["gpu_count"] = gpu_count(smi.stdout)


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
    result = dict(changed=False, status=None, started=False, gpu_count=None)
    try:
        check(Pct(p["pct_argv"], node), p, module.check_mode, result)
    except CheckFailed as exc:
        module.fail_json(msg=str(exc), **result)
    module.exit_json(msg=summary(p["vmid"], node, result), **result)


if __name__ == "__main__":
    main()
