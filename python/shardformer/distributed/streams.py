"""Asynchronous collectives of CUDA tensors: a side stream, and the order of the streams.

A collective issued with async_op=True on CUDA tensors runs on a side stream
(one per communicator and device), so that the kernels the caller launches
meanwhile on its own stream run while the data moves.  Three rules make that
correct, whatever the caller does in between:

 1. before:   the side stream waits for the caller's current stream
              (side.wait_stream(caller)): the transfer reads inputs the
              caller's kernels have finished writing.
 2. lifetime: every tensor the transfer reads or writes is
              `record_stream(side)`ed: the caching allocator does not give its
              memory to a new tensor of the caller's stream before the side
              stream's work on it is done, even when the caller drops its
              last reference first.
 3. after:    an event is recorded on the side stream after the transfer; the
              handle's wait() makes the stream current AT WAIT TIME wait for
              it (current_stream().wait_event(done)).  Every kernel launched
              after wait() on that stream is ordered after the transfer; the
              host does not block (is_completed() asks the event).

`CudaStreams` is the one place these calls meet torch.cuda; the tests hand
`SideStream` a recording stand-in to check the order of the calls on a
machine without a GPU (tests/test_cuda_streams.py).
"""
from __future__ import annotations

import torch


class CudaStreams:
    """The stream operations SideStream uses, on torch.cuda."""

    @staticmethod
    def current(device):
        return torch.cuda.current_stream(device)

    @staticmethod
    def new_stream(device):
        return torch.cuda.Stream(device=device)

    @staticmethod
    def use(stream):
        """Context manager: `stream` is the current stream inside."""
        return torch.cuda.stream(stream)

    @staticmethod
    def keep(t: torch.Tensor, stream) -> None:
        t.record_stream(stream)

    @staticmethod
    def event():
        return torch.cuda.Event()


class StreamWork:
    """The handle of a call enqueued on a side stream (rule 3 above)."""

    __slots__ = ("done", "api", "device", "keep")

    def __init__(self, done, api, device, keep):
        self.done, self.api, self.device, self.keep = done, api, device, keep

    def wait(self, timeout=None) -> None:
        if self.done is not None:
            self.api.current(self.device).wait_event(self.done)
            self.done = self.keep = None

    def is_completed(self) -> bool:
        return self.done is None or bool(self.done.query())


class SideStream:
    """One side stream per device, made on first use, for one communicator."""

    def __init__(self, api=None):
        self.api = CudaStreams if api is None else api
        self.streams: dict = {}

    def run(self, call, device, tensors) -> StreamWork:
        """Enqueue call() on the side stream of `device` after the caller's
        current stream; `tensors` (read or written by the call) are kept
        alive for the side stream.  Returns the handle to wait on."""
        api = self.api
        side = self.streams.get(device)
        if side is None:
            side = self.streams[device] = api.new_stream(device)
        caller = api.current(device)
        side.wait_stream(caller)                    # 1. before
        with api.use(side):
            call()
        for t in tensors:                           # 2. lifetime
            api.keep(t, side)
        done = api.event()
        done.record(side)                           # 3. after (waited on by StreamWork.wait)
        return StreamWork(done, api, device, tuple(tensors))
