"""Rank-side checks of shardformer.comm_stats() (tests/test_comm_stats.py).

Each check runs one training step of the zoo's tiny Llama (2 layers, hidden
96, 6 heads / 2 KV heads, vocabulary 101 padded to 64 * tp, batch 2, seq 8)
sharded one way, under a ledger, and asserts the ledger's calls and bytes
per kind equal what that layout must send (counted from the model's
structure, see each function), while the step's loss and gradients equal the
unsharded model's from the same seed."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
import torch.distributed as dist

import zoo
from checks import parity
from checks import pipeline as pipeline_checks
import shardformer
from shardformer import ShardConfig, ShardFormer
from shardformer import distributed as D
from shardformer import input_check, replica_drift
from shardformer.distributed import communicator, ledger, shm
from shardformer.layer import dropout, sequence
from shardformer.pipeline import OneForwardOneBackwardSchedule

NAME = "LlamaForCausalLM"
TOL = parity.TOL[torch.float32]
F32 = 4


def _expect(summary: dict, want: dict, what: str) -> None:
    """Every kind's calls and bytes as `want` ({kind: (calls, bytes)}); the others zero."""
    got = {k: (v["calls"], v["bytes"]) for k, v in summary.items() if v["calls"] or v["bytes"]}
    want = {k: v for k, v in want.items() if v != (0, 0)}
    assert got == want, f"{what}: the ledger has {got}, expected {want}"


def _sizes(model, x, tp: int) -> SimpleNamespace:
    """N: bytes of the [b, s, h] hidden states; h: of one norm weight; logits: of
    this rank's [b, s, vocabulary rows]; kv_ar / kv_bytes: with more ranks than
    KV heads (TP=4 > 2), every k_proj / v_proj row is also another rank's, and
    their weight gradients are summed over the group in backward
    (mappings.sync_replicated_grad, the whole [kv * d, h] tensor): 2 per layer.
    loss_bytes: the LM loss on the vocabulary shards (lm_loss, with gathered
    logits too): ONE all-gather of each rank's per-row (max, sum-exp at that
    max, target logit), 3 floats per token from this rank, forward only
    (layer/loss.py)."""
    cfg = model.config
    b, s = x["input_ids"].shape
    vocab_local = model.get_output_embeddings().weight.shape[0]     # this rank's (padded) vocabulary rows
    L, kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    kv_ar = 2 * L if tp > kv else 0
    return SimpleNamespace(L=L, N=b * s * cfg.hidden_size * F32, h=cfg.hidden_size * F32,
                           logits=b * s * vocab_local * F32, kv_ar=kv_ar,
                           kv_bytes=kv_ar * kv * cfg.head_dim * cfg.hidden_size * F32,
                           loss_bytes=3 * b * s * F32, drift=_drift_due(model))


def _drift_due(model) -> int:
    """1 when the next forward starts with the whole-parameter check (shardformer.replica_drift: ONE all-gather of
    two int64 over the model's group, before forward call 2 and every check_inputs_every -- the measured step here is call 2),
    else 0."""
    check = model.__dict__.get(input_check.CHECK_ATTR)
    return int(check is not None and replica_drift.due(check.calls + 1, check.every))


def _assert_no_hooks() -> None:
    """No ledger active: every hooked method and function is the original."""
    assert not ledger.hooked()
    assert "recorded" not in communicator.TorchCommunicator.all_reduce.__name__
    assert dist.all_reduce is dist.distributed_c10d.all_reduce
    assert shm.ShmCommunicator.all_gather.__name__ == "all_gather"
    assert not hasattr(communicator.ShmBackend.all_reduce, "__wrapped_by_ledger__")


def _step(model, ref, x, name: str):
    """One forward + backward: forward under an outer ledger, backward under
    an inner one nested in it; loss and gradients against `ref`'s.
    Returns (outer summary, inner summary, outer ledger)."""
    with shardformer.comm_stats() as outer:
        out = model(**x)
        with shardformer.comm_stats() as inner:
            assert ledger.hooked()
            out.loss.backward()
        assert ledger.hooked()        # the outer one is still active
    _assert_no_hooks()
    exp = ref(**x)
    parity.assert_close(f"{name} loss", out.loss, exp.loss, TOL)
    exp.loss.backward()
    parity.compare_grads(model, ref, name, TOL)
    return outer.summary(), inner.summary(), outer


def _prepared(ctx, config: dict, default_group: bool):
    """(sharded model, unsharded copy, inputs) after one untimed step with no
    ledger active (the first forward's one-off checks; nothing recorded)."""
    torch.manual_seed(0)
    model = zoo.build(NAME)
    ref = copy.deepcopy(model)
    cfg = ShardConfig(**config) if default_group else ShardConfig(tensor_parallel_process_group=ctx.group, **config)
    model, _ = ShardFormer(shard_config=cfg).optimize(model)
    x = zoo.make_inputs(NAME)
    idle = shardformer.comm_stats()                   # made but never entered: records nothing
    _assert_no_hooks()
    model(**x).loss.backward()
    assert idle.total("calls") == 0 and idle.total("bytes") == 0, idle.summary()
    model.zero_grad(set_to_none=True)
    return model, ref, x


def tp_llama(ctx, default_group: bool = False) -> dict:
    """Megatron TP: forward, one all-reduce of [b, s, h] after the vocabulary-
    parallel embedding and after each layer's o_proj and down_proj (1 + 2L),
    one all-gather of the logits (b * s * this rank's vocabulary rows), the
    loss's one all-gather of row statistics on the vocabulary shards (_sizes);
    backward, one all-reduce of dX per column-parallel linear fed by the
    replicated hidden states -- q, k, v, gate, up: 5 per layer -- and one
    for the LM head (5L + 1).  And, this being forward call 2, the whole
    parameters' check (one all-gather of 16 bytes, shardformer.replica_drift).
    Nothing else."""
    model, ref, x = _prepared(ctx, dict(enable_flash_attention=True), default_group)
    n = _sizes(model, x, ctx.tp_size)
    both, back, s = _step(model, ref, x, f"{NAME} tp={ctx.tp_size}")
    fwd_ar, bwd_ar = 1 + 2 * n.L, 5 * n.L + 1
    _expect(back, {"all_reduce": (bwd_ar + n.kv_ar, bwd_ar * n.N + n.kv_bytes)}, "backward")
    _expect(both, {"all_reduce": (fwd_ar + bwd_ar + n.kv_ar, (fwd_ar + bwd_ar) * n.N + n.kv_bytes),
                   "all_gather": (2 + n.drift, n.logits + n.loss_bytes + 16 * n.drift)}, "forward + backward")
    ranks = tuple(range(ctx.tp_size))
    groups = s.summary(by_group=True)
    assert list(groups) == [ranks], f"groups {list(groups)}, expected [{ranks}]"
    assert groups[ranks]["all_reduce"]["calls"] == fwd_ar + bwd_ar + n.kv_ar, groups
    assert all(v["seconds"] > 0 for v in groups[ranks].values()), groups
    table = str(s)
    assert "all_reduce" in table and f"[{','.join(map(str, ranks))}]" in table, table
    return {"calls": s.total("calls"), "bytes": s.total("bytes")}


def split_gather(ctx) -> dict:
    """split_gather SP (p = tp ranks, n = N / p, the [b, s/p, h] rows):
    forward, the embedding's all-reduce of N; per block (attention, MLP) an
    all-gather of n in and a reduce-scatter of n out; an all-gather of n
    before the LM head and of the logits.  Backward: the LM head's dX
    all-reduce of N; per block the all-gather of the saved rows again (for
    dW), the all-gather of the output gradient and the reduce-scatter of dX,
    plus an all-reduce of the norm weight's gradient (h floats) per block;
    and the embedding rows' gradient all-gathered (n)."""
    model, ref, x = _prepared(ctx, dict(enable_flash_attention=True, enable_sequence_parallelism=True,
                                        sequence_parallelism_mode="split_gather"), False)
    n = _sizes(model, x, ctx.tp_size)
    rows = n.N // ctx.tp_size
    blocks = 2 * n.L
    both, back, _ = _step(model, ref, x, f"{NAME} split_gather tp={ctx.tp_size}")
    _expect(back, {"all_reduce": (1 + blocks + n.kv_ar, n.N + blocks * n.h + n.kv_bytes),
                   "all_gather": (2 * blocks + 1, (2 * blocks + 1) * rows),
                   "reduce_scatter": (blocks, blocks * rows)}, "backward")
    _expect(both, {"all_reduce": (2 + blocks + n.kv_ar, 2 * n.N + blocks * n.h + n.kv_bytes),
                   "all_gather": (3 * blocks + 4 + n.drift,
                                  (3 * blocks + 2) * rows + n.logits + n.loss_bytes + 16 * n.drift),
                   "reduce_scatter": (2 * blocks, 2 * blocks * rows)}, "forward + backward")
    return {"blocks": blocks}


def pipeline_p2p(ctx) -> dict:
    """PP=2 (two pipelines of 2 stages on 4 ranks), 1F1B, 2 micro-batches of
    2 rows: per step stage 0 sends each micro-batch's activations [2, 8, h]
    and receives their gradients, stage 1 the reverse; the first step also
    sends each key's header (19 int64) and runs the replica check.  Besides: the schedule's agreement
    (an all-gather of 6 int64) and the loss broadcast (1 float32)."""
    ref, model, sm, _ = pipeline_checks.pipelined(ctx, NAME, 2, 1)
    batch = pipeline_checks.batch_of(NAME, 4)
    runner = OneForwardOneBackwardSchedule(sm, num_microbatches=2)
    act = 2 * batch["input_ids"].shape[1] * model.config.hidden_size * F32
    header = (3 + 2 * 8) * 8
    ranks = tuple(sorted(dist.get_process_group_ranks(sm.group)))
    first_out, then = ("send", "recv") if sm.stage == 0 else ("recv", "send")
    results = []
    for step in range(2):
        model.zero_grad(set_to_none=True)
        with shardformer.comm_stats() as s:
            out = runner.forward_backward_step(model, batch)
        h = 2 if step == 0 else 0             # headers: activations one way, gradients the other
        want = {first_out: (2 + h // 2, 2 * act + header * (h // 2)), then: (2 + h // 2, 2 * act + header * (h // 2)),
                "all_gather": (1, 6 * 8), "broadcast": (1, F32)}
        if step == 0:                         # the first forward's replica check (3 int64, shardformer.replicas)
            want["all_gather"] = (2, 6 * 8 + 3 * 8)
        _expect(s.summary(), want, f"pipeline step {step} stage {sm.stage}")
        assert list(s.summary(by_group=True)) == [ranks]
        results.append(s.total("bytes"))
    exp = ref(**batch)
    parity.assert_close(f"{NAME} pipelined loss", out["loss"], exp.loss, TOL)
    return {"bytes": results}


def collectives(ctx) -> dict:
    """The bytes convention of every kind, on the group's communicator and on
    the other paths the ledger hooks: an shm async_op all-gather (the SP
    overlap's), a torch.distributed broadcast made by a shardformer module
    (the dropout seed's), and the user's own dist.all_reduce (not counted)."""
    g, p, r = ctx.group, ctx.tp_size, ctx.rank
    t = torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5) + r      # 120 bytes
    # the group's communicator first: its set-up (the shm segment's object collectives, counted
    # too when a ledger is active) is not what this check counts
    backend = D.backend_for(t, g)
    with shardformer.comm_stats() as s:
        D.all_reduce(t.clone(), g)
        D.all_gather_into_tensor(torch.empty(6 * p, 5), t, g)
        D.reduce_scatter_tensor(torch.empty(4, 5, dtype=torch.float64), torch.ones(4 * p, 5, dtype=torch.float64), g)
        D.all_to_all_single(torch.empty(4 * p, 3), torch.ones(4 * p, 3), g)
        D.broadcast(torch.ones(7, dtype=torch.int64), 0, g)
        if r < 2:
            if r == 0:
                D.send(torch.ones(3, 2, dtype=torch.float16), 1, g)
            else:
                D.recv(torch.empty(3, 2, dtype=torch.float16), 0, g)
        handle, _ = sequence.start_all_gather(torch.empty(2 * p, 3), torch.ones(2, 3), g)
        handle.wait()
        dropout._agreed_seed(g, p)
        dist.all_reduce(torch.ones(100), group=g)                    # the user's: not counted
    want = {"all_reduce": (1, 120), "all_gather": (2, 120 + 2 * 3 * F32), "reduce_scatter": (1, 4 * 5 * 8),
            "all_to_all": (1, 4 * p * 3 * F32), "broadcast": (2, 7 * 8 + 8)}
    if r == 0:
        want["send"] = (1, 12)
    elif r == 1:
        want["recv"] = (1, 12)
    _expect(s.summary(), want, f"collectives on {p} ranks, rank {r}")
    return {"backend": backend}


def benchmark_accounting(ctx, modes: list) -> dict:
    """benchmarks/comm_volume.py's step of each mode (--quick sizes) on the
    pool's ranks: every byte the ledger saw is the layout's minimum plus the
    excess the script explains (nothing unexplained), and never less than
    the minimum."""
    import os
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import comm_volume

    args = comm_volume._args(["--quick"])
    out = {}
    for mode in modes:
        r = comm_volume.rank_main(ctx.rank, args, mode)
        assert r["unexplained_bytes"] == 0, (f"{mode}: {r['unexplained_bytes']} of {r['wire_bytes']} wire bytes "
                                             f"unexplained (minimum {r['minimum_bytes']}, {r['explained']})")
        assert r["ratio"] >= 1.0, (mode, r["ratio"])
        out[mode] = r["ratio"]
    return out
