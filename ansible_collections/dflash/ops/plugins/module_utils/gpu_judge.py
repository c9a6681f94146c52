# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Judging GPUs idle or busy from nvidia-smi's answers: what gpu_verify waits for, and what a run that
comes back at its container's boot checks before it starts (run_resume). Pure, but for `observe`."""

from __future__ import annotations

from ansible_collections.dflash.ops.plugins.module_utils.nvidia_smi import COMPUTE_APPS, GPU_LOAD


def with_gpu_index(processes, gpus):
    """COMPUTE_APPS rows with the index of their GPU looked up (None for a MIG instance's uuid) and the
    container fields that map_containers fills on the node."""
    index_of = {gpu["uuid"]: gpu["index"] for gpu in gpus if gpu["uuid"]}
    return [dict(process, gpu_index=index_of.get(process["gpu_uuid"]), vmid=None, container_pid=None)
            for process in processes]


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


def observe(executable):
    """(gpus, processes) as nvidia-smi lists them now, each process with the index of its GPU."""
    gpus = GPU_LOAD.read(executable)
    if not gpus:
        return [], []
    return gpus, with_gpu_index(COMPUTE_APPS.read(executable), gpus)
