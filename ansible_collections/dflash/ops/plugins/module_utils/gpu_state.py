# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the GPUs hold and whether an expectation of them holds (idle, busy, present): nvidia-smi's rows
joined with their compute processes, judged by memory used and process count, polled until the
expectation holds, and the table shown when it does not.

Shared by gpu_verify (the GPU checks of a play) and training_run (a start that waits for idle GPUs under
the run's lock, in its own call).
"""

from __future__ import annotations

import time

from ansible_collections.dflash.ops.plugins.module_utils.gpu_owners import read_text, vmid_from_cgroup
from ansible_collections.dflash.ops.plugins.module_utils.nvidia_smi import COMPUTE_APPS, GPU_LOAD

# ---------------------------------------------------------------------------------------------
# Processes (pure)


def with_gpu_index(processes, gpus):
    """COMPUTE_APPS rows with the index of their GPU looked up (None for a MIG instance's uuid) and the
    container fields that map_containers fills on the node."""
    index_of = {gpu["uuid"]: gpu["index"] for gpu in gpus if gpu["uuid"]}
    return [dict(process, gpu_index=index_of.get(process["gpu_uuid"]), vmid=None, container_pid=None)
            for process in processes]


# ---------------------------------------------------------------------------------------------
# Containers (pure given a proc root)


def container_pid(status_text):
    """The pid inside the process's own namespace: the last NSpid entry of /proc/<pid>/status."""
    for line in (status_text or "").splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    return None


def inside_lxc(proc_root="/proc"):
    """Inside a container, nvidia-smi's host pids mean nothing in the local /proc (a local process
    may even carry the same number), so no mapping is attempted there."""
    if vmid_from_cgroup(read_text(f"{proc_root}/self/cgroup") or "") is not None:
        return True
    environ = read_text(f"{proc_root}/1/environ") or ""
    return "container=lxc" in environ.split("\0")


def map_containers(processes, proc_root="/proc"):
    for process in processes:
        if process["pid"] is None:
            continue
        vmid = vmid_from_cgroup(read_text(f"{proc_root}/{process['pid']}/cgroup") or "")
        if vmid is not None:
            process["vmid"] = vmid
            process["container_pid"] = container_pid(read_text(f"{proc_root}/{process['pid']}/status"))


# ---------------------------------------------------------------------------------------------
# Judging (pure)


def gpu_load(gpu, processes, max_memory_mib):
    """(busy, description) of one GPU: busy when it has a compute process or more memory used
    than max_memory_mib; unknown memory is judged by the processes alone."""
    pids = [p["pid"] for p in processes if p["gpu_uuid"] is not None and p["gpu_uuid"] == gpu["uuid"]]
    used = gpu["memory_used_mib"]
    memory_busy = used is not None and used > max_memory_mib
    memory = "memory used unknown" if used is None else f"{used} MiB used"
    comparison = "" if used is None else (" > " if memory_busy else " <= ") + f"{max_memory_mib}"
    procs = f"{len(pids)} compute process(es) {pids}" if pids else "no compute process"
    # Memory used with no process listed: a driver that lists only this container's processes, and
    # another container (or the node) using the same GPU.
    unseen = " (used by processes not listed here: another container or the node on the same GPU)" \
        if memory_busy and not pids else ""
    return bool(pids) or memory_busy, f"{procs}, {memory}{comparison}{unseen}"


def unmet(expect, gpus, processes, selected, max_memory_mib, count):
    """Why the expectation does not hold; an empty list means it holds."""
    reasons = []
    if count is not None and len(gpus) < count:
        reasons.append(f"{len(gpus)} GPU(s) listed, at least {count} required")
    by_index = {gpu["index"]: gpu for gpu in gpus}
    wanted = sorted(by_index, key=lambda i: (i is None, i)) if selected is None else selected
    missing = [i for i in wanted if i not in by_index]
    if missing:
        listed = sorted(i for i in by_index if i is not None)
        reasons.append(f"GPU(s) {missing} not listed (listed: {listed})")
    chosen = [by_index[i] for i in wanted if i in by_index]
    if expect != "any" and not chosen and not missing:
        reasons.append("no GPU listed")
    if expect in ("idle", "busy"):
        for gpu in chosen:
            busy, description = gpu_load(gpu, processes, max_memory_mib)
            if busy != (expect == "busy"):
                reasons.append(f"GPU {gpu['index']} is {'busy' if busy else 'idle'}: {description}")
    return reasons


def render_table(gpus, processes, max_memory_mib):
    def show(value):
        return "?" if value is None else str(value)

    lines = [f"{'GPU':>3}  {'MEM USED/TOTAL MiB':>18}  {'UTIL%':>5}  {'PROCS':>5}  {'STATE':<5}  NAME"]
    if not gpus:
        lines.append("  (no GPU listed)")
    for gpu in gpus:
        count = sum(1 for p in processes if p["gpu_uuid"] is not None and p["gpu_uuid"] == gpu["uuid"])
        busy = gpu_load(gpu, processes, max_memory_mib)[0]
        memory = f"{show(gpu['memory_used_mib'])}/{show(gpu['memory_total_mib'])}"
        lines.append(f"{show(gpu['index']):>3}  {memory:>18}  {show(gpu['utilization_pct']):>5}  "
                     f"{count:>5}  {'busy' if busy else 'idle':<5}  {show(gpu['name'])}")
    if processes:
        lines.append(f"{'PID':>8}  {'GPU':>3}  {'MEM MiB':>7}  {'VMID':>5}  {'CT PID':>6}")
        for p in processes:
            lines.append(f"{show(p['pid']):>8}  {show(p['gpu_index']):>3}  {show(p['used_memory_mib']):>7}  "
                         f"{show(p['vmid']):>5}  {show(p['container_pid']):>6}")
    return lines


# ---------------------------------------------------------------------------------------------
# Reading nvidia-smi


def observe(executable, map_vmids):
    gpus = GPU_LOAD.read(executable)
    if not gpus:
        return [], []
    processes = with_gpu_index(COMPUTE_APPS.read(executable), gpus)
    if map_vmids:
        map_containers(processes)
    return gpus, processes


# ---------------------------------------------------------------------------------------------
# Polling


def poll(executable, expect, selected, max_memory_mib, count=None, timeout=0.0, interval=2.0,
         before_each=None, map_vmids=None):
    """Read the GPUs until `expect` holds for the `selected` indices (None: all) or `timeout` seconds
    pass; `before_each()` runs before every read (a check that may raise). Returns a dict: met, reasons
    (why not, at the last read), gpus, processes, table, polls, seconds. NvidiaSmiError passes through."""
    map_vmids = (not inside_lxc()) if map_vmids is None else map_vmids
    began, polls = time.monotonic(), 0
    deadline = began + timeout
    while True:
        if before_each is not None:
            before_each()
        gpus, processes = observe(executable, map_vmids)
        polls += 1
        reasons = unmet(expect, gpus, processes, selected, max_memory_mib, count)
        remaining = deadline - time.monotonic()
        if not reasons or remaining <= 0:
            break
        time.sleep(min(interval, remaining))
    return dict(met=not reasons, reasons=reasons, gpus=gpus, processes=processes,
                table=render_table(gpus, processes, max_memory_mib), polls=polls,
                seconds=round(time.monotonic() - began, 1))


def unmet_message(expect, seen):
    """The failure message of a poll whose expectation did not hold, with the table of what it saw."""
    table = "\n".join(seen["table"])
    return (f"expect={expect} not met after {seen['seconds']}s ({seen['polls']} poll(s)): "
            f"{'; '.join(seen['reasons'])}\n{table}")
