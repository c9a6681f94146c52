"""Peak memory that torch itself allocates during one call, on CPU or CUDA.

- CUDA: the caching allocator's own counters (`torch.cuda.max_memory_allocated` after a reset),
  minus what was allocated before the call.
- CPU: torch has no peak counter for its CPU allocator, and process RSS is blurred by the Python
  heap, the allocator's free lists and pages touched earlier. `torch.profiler` with
  `profile_memory=True` records every allocation and free of torch's CPU allocator as a
  `[memory]` event with a signed byte count and the block's address; the running sum of those events in
  time order (a free counted only for a block allocated during the call) is the memory the call holds at
  each moment beyond what existed before it, and its maximum is the peak.
- CPU, whole process (`peak_rss_bytes`): the kernel's high-water mark of resident memory, reset
  just before the call (`echo 5 > /proc/self/clear_refs`), minus the resident size then. It counts
  every page the call touches (torch's allocator, the Python heap, libraries' buffers), so it is
  meant for a fresh process that does little else; it costs nothing during the call, where the
  profiler records an event per allocation.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch


def _cpu_peak_bytes(fn: Callable[[], object]) -> tuple[object, int]:
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    tree = prof.profiler.kineto_results.experimental_event_tree()
    allocations = sorted((event for event in _event_tree(tree)
                          if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu"),
                         key=lambda event: event.start_time_ns)
    # Only a free of a block allocated in this call counts. torch's CPU reporter keeps the size of a block
    # allocated while a profiler ran and freed after it stopped (c10/core/CPUAllocator.cpp,
    # ProfiledCPUMemoryReporter::Delete looks sizes up only while profiling), so a block allocated later at
    # that address before this call, freed during it, is reported as a free of the stale size.
    held = peak = 0
    sizes: dict[int, int] = {}
    for event in allocations:
        ptr, nbytes = event.extra_fields.ptr, event.extra_fields.alloc_size
        if nbytes > 0:
            sizes[ptr] = nbytes
        elif sizes.pop(ptr, None) is None:
            continue
        held += nbytes
        peak = max(peak, held)
    return result, peak


def _event_tree(nodes):
    for node in nodes:
        yield node
        yield from _event_tree(node.children)


def _cuda_peak_bytes(fn: Callable[[], object], device: torch.device) -> tuple[object, int]:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = fn()
    torch.cuda.synchronize(device)
    return result, torch.cuda.max_memory_allocated(device) - before


def peak_allocated_bytes(fn: Callable[[], object], device: str | torch.device = "cpu") -> tuple[object, int]:
    """Run `fn()` and return (its result, the peak bytes torch allocated during it beyond its inputs).
    The result stays alive, so its own size counts in the peak."""
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_peak_bytes(fn, device)
    return _cpu_peak_bytes(fn)


def _status_bytes(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field))
    return int(line.split()[1]) * 1024


def peak_rss_bytes(fn: Callable[[], object]) -> tuple[object, int]:
    """Run `fn()` and return (its result, the peak resident memory of the process during it above
    its resident size before it). Linux only. Free heap pages are returned to the kernel first
    (`malloc_trim`), so that memory freed earlier and reused by the call is counted."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    before = _status_bytes("VmRSS:")
    result = fn()
    return result, _status_bytes("VmHWM:") - before
