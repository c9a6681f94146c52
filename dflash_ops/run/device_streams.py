"""A drafter's received batches on a stream of their own, handed to the step through an event.

On CUDA, NCCL runs a receive on its own stream after the work queued on the *current* stream of the
thread that posts it (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp: "First let NCCL streams wait
for input tensors allocation streams", `syncStream`), and the work's `wait` orders that current stream
after the receive: posted from the default stream, the receive of batch k+1 waits for the kernels of
step k queued before it, and the step after it waits for the receive, so the transfer (~1 GB a batch at
the recipe) is serialised into every step. `BatchStreams` posts each receive on a side stream
(`receiving`, on the feed's thread), records an event there once the batch is in (`received`), and the
step's stream waits on that event before it touches the tensors (`take`, on the training thread), which
it marks as used on its stream (`record_stream`) so that the caching allocator does not hand their
memory to the next receive while the step still reads it (PyTorch's CUDA semantics notes, "CUDA
streams" and `Tensor.record_stream`).

The stream operations come from `CudaOps` (torch.cuda) on a GPU and `HostOps` on CPU, where gloo
receives synchronously on the host and every operation does nothing (the CPU run is unchanged). Tests
drive the same logic with a stand-in whose received tensors stay unwritten until the step's stream has
waited on the event (tests/pipeline/stream_standin.py), never kinder than CUDA.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch


class Pending(NamedTuple):
    """A received batch and the event after which its tensors are written (None on the host)."""

    batch: dict
    event: object


def tensors_on(batch: dict, device: torch.device) -> list[torch.Tensor]:
    """The tensors of `batch` on `device`: those the receive wrote there (cu_seqlens is a host copy)."""
    return [t for t in batch.values() if isinstance(t, torch.Tensor) and t.device == device]


class HostOps:
    """CPU: a receive is complete on the host when it returns; nothing to order."""

    def new_stream(self):
        return None

    def current_stream(self):
        return None

    def use(self, stream):
        return contextlib.nullcontext()

    def record(self, stream, written: list[torch.Tensor]):
        return None

    def wait(self, stream, event) -> None:
        pass

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        pass


class CudaOps:
    """torch.cuda's streams and events on `device`."""

    def __init__(self, device: torch.device):
        self.device = device

    def new_stream(self):
        return torch.cuda.Stream(device=self.device)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def use(self, stream):
        return torch.cuda.stream(stream)

    def record(self, stream, written: list[torch.Tensor]):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)


class BatchStreams:
    """The side stream a drafter's feed receives on, and the hand-over of each batch to the step."""

    def __init__(self, ops, device: torch.device):
        self.ops, self.device = ops, device
        self.side = ops.new_stream()

    def receiving(self):
        """Make the side stream current on the calling (receiving) thread for one batch's receive."""
        return self.ops.use(self.side)

    def received(self, batch: dict) -> Pending:
        """`batch`, received on the side stream (inside `receiving`), with the event that says it is in."""
        return Pending(batch, self.ops.record(self.side, tensors_on(batch, self.device)))

    def take(self, pending: Pending) -> dict:
        """The batch for the step's stream (the training thread's current one): that stream waits on the
        receive's event, and the tensors are marked as used on it."""
        consumer = self.ops.current_stream()
        self.ops.wait(consumer, pending.event)
        for tensor in tensors_on(pending.batch, self.device):
            self.ops.record_stream(tensor, consumer)
        return pending.batch


def streams_for(device: torch.device) -> BatchStreams:
    return BatchStreams(CudaOps(device) if device.type == "cuda" else HostOps(), device)
