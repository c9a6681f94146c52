#!/usr/bin/python
# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# Ansible modules keep their imports below the documentation blocks.
# ruff: noqa: E402
from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_verify
short_description: Read the GPUs through nvidia-smi and wait until they are idle, busy or present
description:
  - Runs C(nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu) and
    C(nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory) (CSV, no header, no units) and
    returns the GPUs and their compute processes as data.
  - Polls until O(expect) holds or O(timeout) passes; on timeout it fails with a table of what it
    saw.
  - Placeholders such as C([N/A]), C([Not Supported]), C([Insufficient Permissions]) and
    C([Unknown Error]) become null. Driver errors, C(No devices were found) and a missing
    C(nvidia-smi) get a clear message.
  - Inside an LXC container nvidia-smi lists, depending on the driver, every process on the device
    with its host pid (older drivers) or only the container's own processes with the container's
    pids (newer drivers); memory used and utilization are the device's, whichever container uses it.
    So idle and busy are judged by memory used and the number of compute processes, never by looking
    the pids up. Run on the Proxmox node (C(delegate_to)), each process is mapped to its container
    through C(/proc/<pid>/cgroup).
  - Always read-only.
version_added: "0.3.0"
author: dflash-ops contributors (@dflash-ops)
extends_documentation_fragment:
  - dflash.ops.attributes
  - dflash.ops.attributes.read_only
options:
  expect:
    description:
      - V(idle) every selected GPU has no compute process and at most O(max_memory_mib) used.
      - V(busy) every selected GPU has a compute process or more than O(max_memory_mib) used.
      - V(present) the selected GPUs (at least one) are listed.
      - V(any) no expectation beyond O(gpus) and O(count); report only.
    type: str
    choices: [idle, busy, present, any]
    default: any
  gpus:
    description: Indices of the GPUs to judge. Default all that nvidia-smi lists. An empty list is
      accepted only with O(expect=any).
    type: list
    elements: int
  max_memory_mib:
    description: Memory used (MiB) that still counts as idle.
    type: int
    default: 100
  count:
    description: Number of GPUs nvidia-smi must list at least.
    type: int
  timeout:
    description: Seconds to keep polling until the expectation holds; V(0) looks once.
    type: float
    default: 0
  interval:
    description: Seconds between polls.
    type: float
    default: 2
  executable:
    description: The nvidia-smi program, a name looked up in C(PATH) or a path.
    type: str
    default: nvidia-smi
  run_pidfile:
    description:
      - The pidfile of the run whose GPUs these are (see M(dflash.ops.training_run)). With
        O(run_expect_pid), every poll first checks, under the pidfile's lock, that the run is still
        the one the play expects, and fails at once (naming the run that holds the pidfile, its pid
        and release) when another deploy has started or stopped one meanwhile, or holds the lock now.
    type: path
  run_name:
    description: The run's name in messages.
    type: str
    default: main
  run_expect_pid:
    description: The pid of the run the play expects in O(run_pidfile); V(0) for no run (the wait for idle
      GPUs after a stop). Without it the pidfile is not checked.
    type: int
notes:
  - Driver errors fail at once without polling; they do not clear up by waiting.
"""

EXAMPLES = r"""
- name: Ensure GPUs 0 and 1 are idle before the run starts.
  dflash.ops.gpu_verify:
    expect: idle
    gpus: [0, 1]
    timeout: 60

- name: Ensure the run holds its GPUs.
  dflash.ops.gpu_verify:
    expect: busy
    gpus: [0, 1]
    timeout: 120
    interval: 5

- name: Find which container holds each GPU (on the Proxmox node).
  dflash.ops.gpu_verify:
    expect: any
  delegate_to: "{{ proxmox_node }}"
  register: node_gpus
"""

RETURN = r"""
gpus:
  description: The GPUs nvidia-smi lists; unknown values are null.
  returned: always
  type: list
  elements: dict
  sample: [{index: 0, uuid: GPU-5c1e..., name: NVIDIA H100 80GB HBM3, memory_used_mib: 0,
            memory_total_mib: 81559, utilization_pct: 0}]
processes:
  description: Compute processes; C(pid) is a host pid. C(vmid) and C(container_pid) are set when
    the module runs on the node and the process lives in an LXC container, else null.
  returned: always
  type: list
  elements: dict
  sample: [{pid: 81234, gpu_uuid: GPU-5c1e..., gpu_index: 0, used_memory_mib: 1024, vmid: 200,
            container_pid: 57}]
met:
  description: Whether the expectation held.
  returned: always
  type: bool
reasons:
  description: Why the expectation did not hold at the last poll (empty when met).
  returned: always
  type: list
  elements: str
table:
  description: Lines of the table of the last poll (also in the failure message).
  returned: always
  type: list
  elements: str
polls:
  description: Number of times nvidia-smi was read.
  returned: always
  type: int
seconds:
  description: Seconds spent polling.
  returned: always
  type: float
"""

import os

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.dflash.ops.plugins.module_utils.gpu_state import poll, unmet_message
from ansible_collections.dflash.ops.plugins.module_utils.nvidia_smi import NvidiaSmiError, find_executable
from ansible_collections.dflash.ops.plugins.module_utils.run_pidfile import RunError, confirm_run

ARGUMENT_SPEC = dict(
    expect=dict(type="str", default="any", choices=["idle", "busy", "present", "any"]),
    gpus=dict(type="list", elements="int"),
    max_memory_mib=dict(type="int", default=100),
    count=dict(type="int"),
    timeout=dict(type="float", default=0),
    interval=dict(type="float", default=2),
    executable=dict(type="str", default="nvidia-smi"),
    run_pidfile=dict(type="path"),
    run_name=dict(type="str", default="main"),
    run_expect_pid=dict(type="int"),
)


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    for key, minimum in (("max_memory_mib", 0), ("count", 0), ("timeout", 0), ("interval", 0.1)):
        if p[key] is not None and p[key] < minimum:
            module.fail_json(msg=f"{key} must be >= {minimum}, got {p[key]}", changed=False)
    if p["gpus"] is not None and any(i < 0 for i in p["gpus"]):
        module.fail_json(msg=f"gpus must be GPU indices >= 0, got {p['gpus']}", changed=False)
    if p["gpus"] == [] and p["expect"] != "any":
        module.fail_json(msg=f"gpus is empty, so expect={p['expect']} would judge nothing: "
                             "name GPU indices, or omit gpus to judge every GPU", changed=False)
    executable = find_executable(p["executable"])
    if executable is None:
        module.fail_json(msg=f"{p['executable']} not found (PATH={os.environ.get('PATH')}): "
                             "no NVIDIA driver utilities on this host", changed=False)

    polls = [0]

    def confirm():
        if p["run_pidfile"] and p["run_expect_pid"] is not None:
            confirm_run(p["run_name"], p["run_pidfile"], p["run_expect_pid"], "Stopped waiting for the GPUs")
        polls[0] += 1

    try:
        seen = poll(executable, p["expect"], p["gpus"], p["max_memory_mib"], p["count"], p["timeout"],
                    p["interval"], before_each=confirm)
    except RunError as exc:
        module.fail_json(msg=str(exc), changed=False, polls=polls[0], **exc.result)
    except NvidiaSmiError as exc:
        module.fail_json(msg=str(exc), changed=False, polls=polls[0] - 1)
    result = dict(changed=False, **seen)
    if not seen["met"]:
        module.fail_json(msg=unmet_message(p["expect"], seen), **result)
    module.exit_json(msg=f"expect={p['expect']} met: {len(seen['gpus'])} GPU(s), "
                         f"{len(seen['processes'])} compute process(es)", **result)


if __name__ == "__main__":
    main()
