"""Packed target features from the target ranks to the drafter ranks, over torch.distributed.

A batch is three point-to-point messages from its target to its drafter (`BatchSchedule`): a
header (kind, batch index, tokens, documents, feature width, dtype), the int64 metadata
(input_ids, loss_mask, position_ids, cu_seqlens) and the `[T, k*H]` features. A target that ends
early (it was stopped) sends an end marker instead to each drafter that still expects a batch of it.

Flow control. Each drafter receives on a thread (`BatchFeed`) into a queue of `queue_depth`
batches; the target's send completes only when a receive is posted, so at most about queue_depth
batches are in flight per drafter and the slower side sets the pace. On a GPU the thread receives on
a CUDA stream of its own and the step waits on an event before it touches a batch
(`dflash_ops.run.device_streams`), so the receive of the next batch overlaps the step before it.
"""

from __future__ import annotations

import queue
import threading
import time

import torch
import torch.distributed as dist

from dflash_ops.run.device_streams import BatchStreams, Pending, streams_for
from dflash_ops.run.ranks import BatchSchedule

HEADER_SIZE = 6  # kind, batch index, tokens, documents, feature width, dtype code
KIND_BATCH, KIND_END = 0, 1
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
FEED_DONE = "done"  # queue item: the schedule is over, or a target ended early
POLL_S = 0.1  # how often a waiting drafter looks at its stop signal and its receiving thread
DONE_POLL_S = 0.0005  # how often a host waiting for a transfer's completion looks at it


def wait_done(works) -> None:
    """Each transfer of `works` (`isend`/`irecv` work objects) complete on its device, not only queued:
    `wait` (which raises a failed transfer's error; on NCCL it only orders the current stream after
    the transfer), then `is_completed` (on NCCL the transfer's CUDA event) until the peer has it."""
    for work in works:
        work.wait()
    for work in works:
        while not work.is_completed():
            time.sleep(DONE_POLL_S)


def send_batch(dst: int, index: int, features: torch.Tensor, cu_seqlens: torch.Tensor,
               position_ids: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
               group=None) -> None:
    """Three messages: a header, the int64 metadata, the `[T, k*H]` features (over `group`: the
    default one, or the start's for the held-out features); it returns once the drafter has them all
    (`wait_done`), so that the host clock around it is the send's own time."""
    n_tokens, width = features.shape
    device = features.device
    header = torch.tensor([KIND_BATCH, index, n_tokens, cu_seqlens.numel() - 1, width,
                           DTYPE_CODES[features.dtype]], dtype=torch.int64, device=device)
    ints = torch.cat([input_ids, loss_mask, position_ids, cu_seqlens.to(torch.int64)]).to(device, torch.int64)
    wait_done([dist.isend(header, dst, group=group), dist.isend(ints, dst, group=group),
               dist.isend(features.contiguous(), dst, group=group)])


def end_marker(device: torch.device) -> torch.Tensor:
    return torch.tensor([KIND_END, -1, 0, 0, 0, 0], dtype=torch.int64, device=device)


def send_end_markers(schedule: BatchSchedule, rank: int, index: int, end: int, device: torch.device) -> None:
    """Tell each drafter that still expects a batch from the target of global rank `rank` (from
    `index` on) that none will come; all at once, since each drafter receives in its own order."""
    waiting = sorted({schedule.drafter_role_rank(i) for i in schedule.target_batches(rank, index, end)})
    wait_done([dist.isend(end_marker(device), schedule.drafter_ranks[dst]) for dst in waiting])


def recv_batch(src: int, device: torch.device, group=None) -> tuple[int, dict] | None:
    """The next batch from `src` (its index, and the keyword arguments of
    `DrafterTrainer.train_step`), or None when `src` sent its end marker."""
    header = torch.empty(HEADER_SIZE, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    kind, index, n_tokens, n_docs, width, dtype_code = header.tolist()
    if kind == KIND_END:
        return None
    ints = torch.empty(3 * n_tokens + n_docs + 1, dtype=torch.int64, device=device)
    features = torch.empty(n_tokens, width, dtype=CODE_DTYPES[dtype_code], device=device)
    # Received, not only queued: the drafter's wait for a batch is its own, never its next step's.
    wait_done([dist.irecv(ints, src, group=group), dist.irecv(features, src, group=group)])
    input_ids, loss_mask, position_ids, cu_seqlens = ints.split([n_tokens, n_tokens, n_tokens, n_docs + 1])
    return index, {"features": features, "cu_seqlens": cu_seqlens.to(torch.int32).cpu(),
                   "position_ids": position_ids, "input_ids": input_ids, "loss_mask": loss_mask}


class BatchFeed:
    """A drafter's incoming batches of [first_batch, end_batch): a receiving thread filling a
    bounded queue, in schedule order, each batch received on `streams`' side stream (by default
    the device's: `streams_for`) and handed to the step's stream by `next`."""

    def __init__(self, schedule: BatchSchedule, role_rank: int, first_batch: int, end_batch: int,
                 depth: int, device: torch.device, streams: BatchStreams | None = None):
        self.schedule, self.device = schedule, device
        self.streams = streams or streams_for(device)
        self.batches = schedule.drafter_batches(role_rank, first_batch, end_batch)
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.draining = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._receive, name="batch-feed", daemon=True)
        self.thread.start()

    def _put(self, item) -> None:
        while not self.draining.is_set():
            try:
                self.queue.put(item, timeout=POLL_S)
                return
            except queue.Full:
                pass

    def _receive(self) -> None:
        ended: set[int] = set()
        try:
            for index in self.batches:
                src = self.schedule.target_rank(index)
                if src in ended:
                    continue
                with self.streams.receiving():
                    received = recv_batch(src, self.device)
                    pending = None if received is None else self.streams.received(received[1])
                if received is None:
                    if not ended:
                        self._put(FEED_DONE)  # the schedule is broken: train no further
                    ended.add(src)
                    if len(ended) == self.schedule.num_targets:
                        return
                elif not ended:
                    if received[0] != index:
                        raise RuntimeError(f"expected batch {index} from rank {src}, got {received[0]}")
                    self._put(pending)
            if not ended:
                self._put(FEED_DONE)
        except BaseException as exc:  # reported by the main thread
            self.error = exc
            self._put(FEED_DONE)

    def next(self, stop) -> dict | str | None:
        """The next batch (the step's stream ordered after its receive), FEED_DONE, or None when `stop`
        (a StopSignal) was requested while waiting."""
        while True:
            try:
                item = self.queue.get(timeout=POLL_S)
                return self.streams.take(item) if isinstance(item, Pending) else item
            except queue.Empty:
                if self.error is not None:
                    raise RuntimeError(f"receiving batches failed: {self.error}") from self.error
                if stop.requested:
                    return None

    def drain(self, timeout: float) -> None:
        """Receive (and drop) what the targets still send, so that none of them blocks for ever."""
        self.draining.set()
        self.thread.join(timeout)
