"""A drafter's batches are received on a stream of their own and handed to the step through an event
(dflash_ops.run.device_streams, dflash_ops.run.transport.BatchFeed).

Over a real gloo group of two ranks (a target sending with `send_batch`, a drafter receiving with
`BatchFeed` at prefetch depth 1), with CUDA's streams and events played by tests/pipeline/stream_standin.py
(a received tensor holds garbage until the step's stream has waited on the receive's event): the batches
reach the step in order and intact, each marked as used on the step's stream, the receive of batch k+1
done while step k holds batch k; a consumer that takes a batch without the wait reads garbage, and is
caught. On a GPU (`-m gpu`), the overlap itself: a transfer on the side stream runs under the step's
kernels instead of after them."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_ops.run.device_streams import BatchStreams, CudaOps, HostOps, Pending, streams_for
from dflash_ops.run.ranks import BatchSchedule
from dflash_ops.run.transport import FEED_DONE, BatchFeed, send_batch
from tests.pipeline.stream_standin import StandInOps
from tests.waiting import wait_for

BATCHES = 4
TOKENS, WIDTH = 24, 8
CPU = torch.device("cpu")
NO_STOP = SimpleNamespace(requested=False)


def batch_of(index: int) -> dict:
    """Batch `index`'s contents: every tensor says which batch it is."""
    positions = torch.arange(TOKENS)
    features = torch.arange(TOKENS * WIDTH, dtype=torch.float32).reshape(TOKENS, WIDTH) + 1000 * index
    return {"features": features,
            "cu_seqlens": torch.tensor([0, TOKENS // 2 + index, TOKENS]), "position_ids": positions,
            "input_ids": positions + index, "loss_mask": (positions + index) % 2}


def intact(batch: dict, index: int) -> bool:
    expected = batch_of(index)
    return all(torch.equal(batch[name].to(expected[name].dtype), expected[name]) for name in expected)


def _drafter(out: str) -> None:
    schedule = BatchSchedule(drafter_ranks=(1,), target_ranks=(0,))
    ops = StandInOps()
    feed = BatchFeed(schedule, 0, 0, BATCHES, depth=1, device=CPU, streams=BatchStreams(ops, CPU))
    steps = []
    for index in range(BATCHES):
        batch = feed.next(NO_STOP)
        # Step k holds batch k: meanwhile the feed's thread receives batch k+1 (prefetch depth 1).
        prefetched = index + 1 == BATCHES or wait_for(feed.queue.full, timeout=60, interval=0.01)
        steps.append({"intact": intact(batch, index), "prefetched": bool(prefetched),
                      "unmarked": ops.unmarked(batch, ops.default)})
    ended = feed.next(NO_STOP) == FEED_DONE

    # A consumer that skips the wait: the batch as the feed's thread queued it.
    skipping = BatchFeed(schedule, 0, 0, BATCHES, 1, CPU, streams=BatchStreams(StandInOps(), CPU))
    pending = skipping.queue.get(timeout=60)
    skipped = {"pending": isinstance(pending, Pending), "intact": intact(pending.batch, 0),
               "nan_features": bool(pending.batch["features"].isnan().all())}
    for _ in range(BATCHES):  # the rest, taken as the step takes them
        skipping.next(NO_STOP)
    with open(out, "w") as f:
        json.dump({"steps": steps, "ended": ended, "records": ops.records, "skipped": skipped}, f)


def _rank(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        if rank == 0:
            for _ in range(2):  # one schedule for each of the drafter's feeds
                for index in range(BATCHES):
                    send_batch(1, index, **batch_of(index))
        else:
            _drafter(out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_batches_reach_the_step_in_order_and_intact_only_through_the_event(tmp_path):
    out = tmp_path / "drafter.json"
    mp.spawn(_rank, args=(str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    seen = json.loads(out.read_text())
    assert seen["steps"] == [{"intact": True, "prefetched": True, "unmarked": []}] * BATCHES
    assert seen["ended"] and seen["records"] == BATCHES
    # Without the wait, the consumer read garbage: the stand-in caught it.
    assert seen["skipped"] == {"pending": True, "intact": False, "nan_features": True}


def test_the_standin_refuses_a_receive_posted_off_the_side_stream():
    ops = StandInOps()
    streams = BatchStreams(ops, CPU)
    with pytest.raises(AssertionError, match="does not overlap"):
        streams.received(batch_of(0))  # outside `receiving()`: on the step's stream
    with streams.receiving():
        pending = streams.received(batch_of(1))
    assert not intact(pending.batch, 1) and intact(streams.take(pending), 1)


def test_cpu_receives_unchanged_and_cuda_receives_on_a_stream_of_their_own():
    host = streams_for(CPU)
    assert isinstance(host.ops, HostOps)
    batch = batch_of(2)
    with host.receiving():
        pending = host.received(batch)
    assert host.take(pending) is batch and intact(batch, 2)  # nothing copied, nothing waited
    if torch.cuda.is_available():
        assert isinstance(streams_for(torch.device("cuda", 0)).ops, CudaOps)


def step_kernels(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = torch.tanh(x @ x) * 0.5
    return x


def timed_steps(streams: BatchStreams | None, host: list[torch.Tensor], work: torch.Tensor, n: int) -> float:
    """Seconds for len(host) steps, each taking the batch received during the step before: with
    `streams`, the copy (a stand-in for NCCL's receive) on the side stream; without, on the step's."""
    device = work.device
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    pending = None
    for i in range(len(host) + 1):
        if i < len(host):
            if streams is None:
                nxt = Pending({"features": host[i].to(device, non_blocking=True)}, None)
            else:
                with streams.receiving():
                    nxt = streams.received({"features": host[i].to(device, non_blocking=True)})
        if pending is not None:
            batch = pending.batch if streams is None else streams.take(pending)
            step_kernels(work + batch["features"][:1, : work.shape[1]].mean(), n)
        pending = nxt if i < len(host) else None
    torch.cuda.synchronize(device)
    return time.perf_counter() - started


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_side_stream_overlaps_the_transfer_with_the_step():
    device = torch.device("cuda", 0)
    host = [torch.randn(64, 2**20).pin_memory() for _ in range(6)]  # 256 MiB a batch
    work = torch.randn(2048, 2048, device=device)
    timed_steps(None, host[:1], work, 8)  # warm-up
    serial = timed_steps(None, host, work, 40)
    overlapped = timed_steps(streams_for(device), host, work, 40)
    print(f"6 steps, 256 MiB received each: one stream {serial:.3f} s, side stream {overlapped:.3f} s, "
          f"side/one {overlapped / serial:.2f}x")
    assert overlapped < 0.9 * serial
