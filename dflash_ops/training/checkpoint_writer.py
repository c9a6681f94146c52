"""A checkpoint written off the step's path: a host copy taken synchronously, the write in a thread.

What the step waits for is the copy of the state to host memory (`CheckpointWriter.snapshot`): device
tensors go into pinned host buffers kept from one save to the next (pinning 12.6 GB each time would cost
more than the copy), CPU tensors into plain ones, and the copy is complete on return (the device
synchronized). The write itself (`dflash_ops.training.checkpoint.save_checkpoint`: the temp dir, the
fsyncs, the rename, the pruning) then runs on a thread while training goes on, so that a kill
mid-write still leaves the previous checkpoint, as a synchronous save does.

At most one write is in flight: a save waits for the previous one before it copies (the buffers are
that write's until it is done), and a run waits for the last one before it ends (`wait`), so a stop's
outcome and exit status are those of a synchronous save. torchtitan's async checkpointing (a staged copy,
then `torch.distributed.checkpoint.async_save` on a thread, the next save waiting for the previous) is
the same shape.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path

import torch


def stage(obj, buffers: dict, path: tuple = ()):
    """`obj` (a state dict: nested dicts, lists and tuples of tensors and plain values) with every
    tensor copied into a host buffer of `buffers` (by its place in `obj`: reused when its shape and dtype
    still match, pinned for a device tensor). Device copies are queued (non-blocking): the caller
    synchronizes before anything reads the buffers."""
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach()
        on_device = tensor.device.type != "cpu"
        buffer = buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                                 pin_memory=on_device and torch.cuda.is_available())
            buffers[path] = buffer
        buffer.copy_(tensor, non_blocking=on_device)
        return buffer
    if isinstance(obj, dict):
        return {key: stage(value, buffers, (*path, key)) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)([stage(value, buffers, (*path, i)) for i, value in enumerate(obj)])
    return copy.deepcopy(obj)


def holds_device_tensor(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.device.type != "cpu"
    if isinstance(obj, dict):
        return any(holds_device_tensor(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(holds_device_tensor(value) for value in obj)
    return False


class CheckpointWriter:
    """One rank's checkpoint writes: `snapshot` the state, `start` its write on a thread, `done` /
    `wait` for its outcome. Not thread-safe: the training loop's thread alone calls it."""

    def __init__(self):
        self._buffers: dict = {}
        self._thread: threading.Thread | None = None
        self._outcome: tuple[Path | None, BaseException | None] = (None, None)
        self.step: int | None = None  # the step of the write in flight (or finished, not yet waited for)

    @property
    def in_flight(self) -> bool:
        """A write was started and its outcome not yet taken by `wait`."""
        return self._thread is not None

    def snapshot(self, state):
        """A host copy of `state`, complete on return: what the step waits for. Refused while a write
        is in flight (its buffers are reused): take that write's outcome with `wait` first."""
        if self.in_flight:
            raise RuntimeError("a checkpoint write is in flight: wait for it before the next snapshot")
        copied = stage(state, self._buffers)
        if holds_device_tensor(state):
            torch.cuda.synchronize()
        return copied

    def start(self, step: int, write: Callable[[], Path]) -> None:
        """Run `write` (which writes the snapshot taken last) on a thread."""
        if self.in_flight:
            raise RuntimeError("a checkpoint write is in flight: at most one at a time")
        self.step = step

        def run() -> None:
            try:
                self._outcome = (write(), None)
            except BaseException as exc:  # handed to the training thread by `wait`
                self._outcome = (None, exc)

        self._outcome = (None, None)
        # Not a daemon: an interpreter that ends without waiting still finishes the write first.
        self._thread = threading.Thread(target=run, name=f"checkpoint-{step}")
        self._thread.start()

    def done(self) -> bool:
        """Whether the write in flight has finished (True when there is none)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path | None:
        """The path of the write in flight once it has finished, raising what it raised; None when no
        write is in flight."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        path, error = self._outcome
        self._outcome = (None, None)
        if error is not None:
            raise error
        return path
