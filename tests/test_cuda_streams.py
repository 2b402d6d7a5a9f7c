"""The collectives' CUDA logic, checked where it has a CPU-testable shape:

  * streams.SideStream with a recording stand-in for torch.cuda: the side
    stream waits for the caller's stream before the call, the call runs
    inside it, every tensor is record_stream'ed on it, the handle's wait()
    orders the stream current AT WAIT TIME after the call's event;
  * NcclBackend (a stand-in NCCL communicator): async_op calls go to the side
    stream, blocking ones to the caller's stream;
  * StagedTorchCommunicator on CPU ranks over gloo, every operation staged,
    blocking and async_op: exact values; a gloo group's communicator for
    CUDA tensors stages exactly what gloo cannot run on CUDA;
  * the choice: CUDA tensors use torch.distributed unless SHARDFORMER_COMM=nccl.
"""
import contextlib

import pytest
import torch

from checks import cuda_comm
from shardformer.distributed import communicator as cm
from shardformer.distributed.streams import SideStream

pytestmark = pytest.mark.transformers_independent


class _Event:
    def __init__(self, log, n):
        self.log, self.name, self.done = log, f"event{n}", False

    def record(self, stream):
        self.log.append(("record", self.name, stream.name))

    def query(self):
        return self.done


class _Stream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, event.name))


class FakeCuda:
    """torch.cuda's stream calls, recorded in `log`; `now` is the current stream."""

    def __init__(self):
        self.log, self.events = [], 0
        self.now = _Stream(self.log, "compute")

    def current(self, device):
        return self.now

    def new_stream(self, device):
        self.log.append(("new_stream", str(device)))
        return _Stream(self.log, "side")

    @contextlib.contextmanager
    def use(self, stream):
        before, self.now = self.now, stream
        try:
            yield
        finally:
            self.now = before

    def keep(self, t, stream):
        self.log.append(("record_stream", t.shape[0], stream.name))

    def event(self):
        self.events += 1
        return _Event(self.log, self.events)


def test_side_stream_orders_both_ways():
    api = FakeCuda()
    side = SideStream(api)
    a, b = torch.zeros(3), torch.zeros(5)
    handle = side.run(lambda: api.log.append(("call on", api.now.name)), "cuda:0", (a, b))
    assert api.log == [("new_stream", "cuda:0"), ("wait_stream", "side", "compute"), ("call on", "side"),
                       ("record_stream", 3, "side"), ("record_stream", 5, "side"), ("record", "event1", "side")]
    assert not handle.is_completed()
    api.log.clear()
    api.now = _Stream(api.log, "consumer")          # a different stream is current when the result is used
    handle.wait()
    assert api.log == [("wait_event", "consumer", "event1")]
    handle.wait()                                    # once only
    assert api.log == [("wait_event", "consumer", "event1")] and handle.is_completed()
    side.run(lambda: None, "cuda:0", ())             # the stream is made once per device
    assert ("new_stream", "cuda:0") not in api.log


class _FakeNccl:
    def __init__(self, api):
        self.api, self.calls = api, []

    def _note(self, what):
        self.calls.append((what, self.api.now.name))

    def all_reduce(self, t, op):
        self._note("all_reduce")

    def all_gather(self, out, t):
        self._note("all_gather")

    def reduce_scatter(self, out, t):
        self._note("reduce_scatter")

    def send(self, t, dst):
        self._note("send")

    def recv(self, t, src):
        self._note("recv")


def test_nccl_backend_async_on_side_stream():
    api = FakeCuda()
    backend = cm.NcclBackend(cm.GroupInfo(None), "cuda", "nccl", None)
    backend.nccl, backend.side = _FakeNccl(api), SideStream(api)
    t, out = torch.ones(4), torch.empty(4)
    assert backend.all_reduce(t) is t                                  # blocking: the caller's stream
    handles = [backend.all_reduce(t, async_op=True), backend.all_gather_into_tensor(out, t, async_op=True),
               backend.reduce_scatter_tensor(out, t, async_op=True), backend.send(t, 0, async_op=True),
               backend.recv(t, 0, async_op=True)]
    assert backend.nccl.calls == [("all_reduce", "compute"), ("all_reduce", "side"), ("all_gather", "side"),
                                  ("reduce_scatter", "side"), ("send", "side"), ("recv", "side")]
    for h in handles:
        h.wait()
    assert [e for e in api.log if e[0] == "wait_event"] == [("wait_event", "compute", f"event{i}")
                                                           for i in range(1, 6)]
    assert backend.overlaps


def test_transport_for_cuda():
    assert cm.transport_for_cuda("gloo") == "gloo"
    assert cm.transport_for_cuda("nccl") == "nccl"
    assert cm.transport_for_cuda("cpu:gloo,cuda:nccl") == "nccl"
    assert cm.transport_for_cuda("cuda:gloo, cpu:gloo") == "gloo"
    assert cm.transport_for_cuda("cpu:gloo") == ""


@pytest.mark.parametrize("tp", [2, 4])
def test_staged_collectives_over_gloo(pool, tp):
    for report in pool.run(cuda_comm.staged_collectives, tp):
        assert report["cuda_staged"] == ["all_gather_into_tensor", "all_to_all_single", "recv",
                                         "reduce_scatter_tensor", "send"]
        assert report["cpu_staged"] == []
        assert len(report["checked"]) == 7
