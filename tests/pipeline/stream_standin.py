"""CUDA's streams and events on CPU, never kinder than CUDA: the stream operations of
dflash_ops.run.device_streams (`CudaOps`'s) for tests.

On a GPU, what a receive writes on a side stream is there for another stream only once that stream has
waited on an event recorded after the receive; a kernel that runs before may read the memory's old
contents. The stand-in makes that the rule every time: when the event is recorded (`record`), the
tensors the receive wrote take garbage (their contents kept aside), and get them back only when another
stream waits on that event (`wait`). A consumer that reads them without the wait reads garbage, always.
It also checks two things CUDA does not report:

- the event is recorded on the side stream while that stream is the recording thread's current one
  (`use`): the receive was posted there, not on the step's stream, where it would not overlap the step;
- each tensor the step gets is marked as used on the step's stream (`record_stream`), else the caching
  allocator may give its memory to the next receive while the step still reads it (`unmarked`).
"""

from __future__ import annotations

import contextlib
import threading

import torch


class StandInStream:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class StandInEvent:
    def __init__(self, stream: StandInStream, kept: list[tuple[torch.Tensor, torch.Tensor]]):
        self.stream, self.kept = stream, kept


def garbage(tensor: torch.Tensor) -> None:
    """What unwritten device memory may hold: here, always, values no receive would send."""
    tensor.fill_(float("nan") if tensor.is_floating_point() else torch.iinfo(tensor.dtype).min)


class StandInOps:
    def __init__(self):
        self.default = StandInStream("default")
        self._local = threading.local()
        self.marked: list[tuple[torch.Tensor, StandInStream]] = []
        self.records = 0

    def new_stream(self) -> StandInStream:
        return StandInStream("side")

    def current_stream(self) -> StandInStream:
        return getattr(self._local, "stream", self.default)

    @contextlib.contextmanager
    def use(self, stream: StandInStream):
        previous = self.current_stream()
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def record(self, stream: StandInStream, written: list[torch.Tensor]) -> StandInEvent:
        if self.current_stream() is not stream:
            raise AssertionError(f"the receive was posted on {self.current_stream()}, its event recorded on "
                                 f"{stream}: it does not overlap the step")
        kept = [(tensor, tensor.clone()) for tensor in written]
        for tensor in written:
            garbage(tensor)
        self.records += 1
        return StandInEvent(stream, kept)

    def wait(self, stream: StandInStream, event: StandInEvent) -> None:
        if stream is not event.stream:
            for tensor, contents in event.kept:
                tensor.copy_(contents)

    def record_stream(self, tensor: torch.Tensor, stream: StandInStream) -> None:
        self.marked.append((tensor, stream))

    def unmarked(self, batch: dict, stream: StandInStream) -> list[str]:
        """The names of `batch`'s tensors not marked as used on `stream`."""
        marked = {id(tensor) for tensor, on in self.marked if on is stream}
        return [name for name, t in batch.items() if isinstance(t, torch.Tensor) and id(t) not in marked]
