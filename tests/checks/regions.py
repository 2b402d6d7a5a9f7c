"""Rank-side checks of issue 33 items 2 and 3 (tests/test_regions.py): the
communicator's asynchronous calls and wait handles on every CPU backend, and
the typed sequence-parallel layouts that replace the role strings."""
from __future__ import annotations

import torch

import shardformer
from checks.ring_attention import _backend
from shardformer.distributed import communicator as cm


def _expected(p: int, r: int, n: int, salt: float) -> list:
    """Every rank's tensor of the checks below: rank q holds q * 10 + salt + arange(n)."""
    return [q * 10 + salt + torch.arange(n, dtype=torch.float32) for q in range(p)]


def async_handles(ctx, backends: tuple) -> dict:
    """On each backend (SHARDFORMER_COMM=name): all_gather_into_tensor,
    reduce_scatter_tensor and all_reduce with async_op=True, and a ring
    exchange in both directions (tags told apart), return handles whose
    wait() leaves exactly the synchronous results -- also into a strided
    output, copied back on wait -- while the ledger counts each call once,
    as the synchronous call would.  `overlaps` is the communicator's answer,
    not a name check; the shm group's torch transport exchanges too."""
    p, r, g = ctx.tp_size, ctx.rank, ctx.group
    report = {}
    for backend in backends:
        with _backend(backend):
            comm = cm.get_communicator(g, "cpu")
            assert comm.backend == backend and comm.overlaps, (backend, comm)
            mine = _expected(p, r, 6, 0.5)
            with shardformer.comm_stats() as stats:
                out = torch.empty(6 * p)
                h_gather = comm.all_gather_into_tensor(out, mine[r], async_op=True)
                summed = torch.zeros(p * 2, 3)
                for q in range(p):
                    summed += _expected(p, q, 6 * p, 1.0)[q].view(p * 2, 3)
                rs = torch.empty(2, 3)
                h_scatter = comm.reduce_scatter_tensor(rs, _expected(p, r, 6 * p, 1.0)[r].view(p * 2, 3),
                                                       async_op=True)
                strided = torch.full((4, 5), float(r)).t()          # [5, 4], not contiguous
                h_reduce = comm.all_reduce(strided, async_op=True)
                for h in (h_gather, h_scatter, h_reduce):
                    h.wait()
                    assert h.is_completed()
                assert torch.equal(out, torch.cat(mine)), (backend, out)
                assert torch.equal(rs, summed[2 * r:2 * r + 2]), (backend, rs)
                assert torch.equal(strided, torch.full((5, 4), float(sum(range(p))))), (backend, strided)
                nxt, prv = (r + 1) % p, (r - 1) % p
                got_fwd, got_bwd = torch.empty(3), torch.empty(3)
                fwd = comm.exchange(torch.full((3,), 100.0 + r), nxt, got_fwd, prv, tag=11)
                bwd = comm.exchange(torch.full((3,), 200.0 + r), prv, got_bwd, nxt, tag=12)
                bwd.wait()
                fwd.wait()
                assert torch.equal(got_fwd, torch.full((3,), 100.0 + prv)), (backend, got_fwd)
                assert torch.equal(got_bwd, torch.full((3,), 200.0 + nxt)), (backend, got_bwd)
            calls = {k: v["calls"] for k, v in stats.summary().items() if v["calls"]}
            assert calls == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1, "send": 2, "recv": 2}, calls
            transport = comm.torch_transport()
            assert transport.backend == "torch" and transport.torch_transport() is transport
            got = torch.empty(2, 2)
            transport.exchange(torch.full((2, 2), float(r)), nxt, got, prv, tag=5).wait()
            assert torch.equal(got, torch.full((2, 2), float(prv)))
            report[backend] = calls
    return report


def typed_layouts_equal_unsharded(ctx, name: str, default_config: bool = False, overlap: bool = False) -> dict:
    """The zoo model `name` under split-gather SP: the built-in policy asks
    for every SequenceParallelRegion in the typed vocabulary (layouts=, no
    role string reaches the hooks), and the sharded model matches the
    unsharded one from the same seed (forward, loss, every gradient, after a
    step; tests/checks/parity.py).  default_config: the plain ShardConfig()
    (the world as the group); overlap: enable_sequence_overlap (a typed
    block with overlap)."""
    import copy

    import zoo
    from checks import parity
    from checks.sequence import SP, cut_sequence
    from shardformer import ShardConfig, ShardFormer
    from shardformer.layer import sequence as seq

    region = seq.SequenceParallelRegion
    original = region.__dict__["prepare_native_module"]
    typed = []

    def prepare(cls, module, process_group=None, plan=None, role=None, layouts=None, **kwargs):
        assert role is None and isinstance(layouts, seq.SequenceLayouts), \
            f"{name}: a region asked for by role={role!r}, layouts={layouts!r}"
        typed.append(layouts)
        return original.__func__(cls, module, process_group, plan=plan, layouts=layouts, **kwargs)

    config = {**SP, "enable_sequence_overlap": overlap}
    cfg = ShardConfig(**config) if default_config else ShardConfig(tensor_parallel_process_group=ctx.group, **config)
    torch.manual_seed(0)
    model = zoo.build(name).train()
    ref = copy.deepcopy(model)
    region.prepare_native_module = classmethod(prepare)
    try:
        ShardFormer(cfg).optimize(model)
    finally:
        region.prepare_native_module = original
    hooks = [layouts for layouts in typed if layouts.layer]
    assert typed and hooks, f"{name}: {len(typed)} typed regions, {len(hooks)} of them layers"
    report = parity.compare_sharded(model, ref, cut_sequence(zoo.make_inputs(name), 7), f"{name} (typed layouts)")
    return {**report, "regions": len(typed)}
