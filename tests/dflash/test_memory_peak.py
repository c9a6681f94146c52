"""benchmarks.memory's CPU peak (torch.profiler's allocation events) in a process that profiled before, as
a pytest worker has: what the memory-model tests measure must not depend on the tests run before them."""

from __future__ import annotations

import torch

from benchmarks.memory import peak_allocated_bytes

SIZES = [1000 * (i % 7 + 1) for i in range(60)]  # float32 elements: blocks of 4 to 28 KB


def test_the_peak_is_what_the_call_allocates():
    _, peak = peak_allocated_bytes(lambda: torch.empty(1000))
    assert peak == 4000


def test_blocks_freed_during_the_call_but_allocated_before_it_do_not_lower_the_peak():
    # Blocks allocated under one measurement and freed after it: torch's CPU reporter keeps their sizes
    # (c10/core/CPUAllocator.cpp, ProfiledCPUMemoryReporter::Delete looks them up only while profiling).
    earlier = []
    peak_allocated_bytes(lambda: earlier.extend(torch.empty(n) for n in SIZES))
    stale = {t.data_ptr() for t in earlier}
    earlier.clear()
    # Blocks allocated between measurements, many at those addresses, freed during the next call.
    between = [torch.empty(n) for n in reversed(SIZES)]
    assert any(t.data_ptr() in stale for t in between), "no address reused: nothing to check"

    def call():
        between.clear()
        return torch.empty(1000)

    _, peak = peak_allocated_bytes(call)
    assert peak == 4000  # the running sum of every free event gave 0 here
