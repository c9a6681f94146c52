"""A target's balance seconds are its send's to completion, whatever the backend (dflash_ops.run.transport).

NCCL's send returns to the host once it is queued (its `wait` orders the CUDA stream, not the host), so
the host clock around it reads ~0 s while the drafter keeps it waiting, and the wait lands in the next
forward's `torch.cuda.synchronize` (counted as computing): a drafter-bound run looks target-bound. Two
gloo ranks play that backend: rank 0's `isend` returns a work whose `wait` returns at once and whose
`is_completed` is the real transfer's, `dist.send` is that `isend` and its `wait`, and a device
synchronize waits for the transfers still queued; rank 1 is a drafter that takes DELAY before each
receive. The host clock around those `dist.send`s (what `send_batch` timed) counts the drafter's
wait as the next batch's compute; `send_batch` itself returns once the drafter has the batch."""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_ops.run import transport

DELAY = 0.6  # the drafter's step before each receive
BATCHES = 2  # a batch a mode
TOKENS, WIDTH = 64, 32


class QueuedWork:
    """A send as NCCL's: `wait` returns once it is queued, `is_completed` says when the peer has it."""

    def __init__(self, work, queued: list):
        self.work, self.done = work, False
        queued.append(self)

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return self.finish()

    def finish(self) -> bool:
        """The transfer done (gloo records it in its work's `wait` alone, and only once)."""
        if not self.done:
            self.done = self.work.wait()
        return self.done


def queued_backend() -> tuple[list, callable]:
    """Patch `dist.isend` and `dist.send` as above; (the queued works, the device synchronize)."""
    queued: list = []
    isend = dist.isend

    def queued_isend(tensor, dst, group=None, tag=0):
        return QueuedWork(isend(tensor, dst, group=group, tag=tag), queued)

    def synchronize() -> None:
        while queued:
            queued.pop(0).finish()

    dist.isend = queued_isend
    dist.send = lambda tensor, dst, group=None, tag=0: queued_isend(tensor, dst, group, tag).wait()
    return queued, synchronize


def features(index: int) -> dict:
    return {"features": torch.full((TOKENS, WIDTH), float(index)), "cu_seqlens": torch.tensor([0, TOKENS]),
            "position_ids": torch.arange(TOKENS), "input_ids": torch.arange(TOKENS),
            "loss_mask": torch.ones(TOKENS, dtype=torch.int64)}


def host_clock_send(dst: int, index: int, **batch) -> None:
    """The three messages as `send_batch` sent them before: `dist.send` each, timed by the host."""
    header = torch.tensor([transport.KIND_BATCH, index, TOKENS, 1, WIDTH, 0], dtype=torch.int64)
    ints = torch.cat([batch["input_ids"], batch["loss_mask"], batch["position_ids"],
                      batch["cu_seqlens"].to(torch.int64)])
    for tensor in (header, ints, batch["features"]):
        dist.send(tensor, dst)


def _rank(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        if rank == 1:
            for index in range(2 * BATCHES):
                time.sleep(DELAY)  # the drafter's step on the batch before
                got, batch = transport.recv_batch(0, torch.device("cpu"))
                assert got == index and float(batch["features"][0, 0]) == index
        else:
            _, synchronize = queued_backend()
            rows = []
            for mode, send in (("host clock", host_clock_send), ("send_batch", transport.send_batch)):
                for index in range(len(rows), len(rows) + BATCHES):
                    computing = time.perf_counter()
                    batch = features(index)  # the forward
                    synchronize()  # run_target's torch.cuda.synchronize after the forward
                    sending = time.perf_counter()
                    send(1, index, **batch)
                    rows.append({"mode": mode, "compute_s": sending - computing,
                                 "send_s": time.perf_counter() - sending})
                synchronize()  # the mode's last send, before the next mode's clock
            with open(out, "w") as f:
                json.dump(rows, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_queued_send_is_timed_to_the_drafter_receiving_it(tmp_path):
    out = tmp_path / "rows.json"
    mp.spawn(_rank, args=(str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    rows = json.loads(out.read_text())
    queued = [r for r in rows if r["mode"] == "host clock"]
    waited = [r for r in rows if r["mode"] == "send_batch"]
    # Timed by the host: the sends read ~0 s and the drafter's wait is the next batch's compute.
    assert all(r["send_s"] < DELAY / 4 for r in queued), queued
    assert queued[1]["compute_s"] > DELAY * 0.8, queued
    # send_batch: the sends take the drafter's wait, the forwards their own time.
    assert all(r["send_s"] > DELAY * 0.8 for r in waited), waited
    assert all(r["compute_s"] < DELAY / 4 for r in waited), waited
