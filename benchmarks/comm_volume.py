"""Communication volume per training step against the theoretical minimum, per parallel mode.

For each mode, one training step (forward + backward, plus the gradient
average the layout needs before an optimizer step) of a small Llama (an
8-expert Mixtral for EP) runs on R CPU ranks (default 2) under
shardformer.comm_stats(); the bytes each rank sends are compared with the
least any implementation of that layout must send, written out below as a
formula, and the ratio printed.  Bytes are the ledger's payload (see
docs/comm_stats.md) turned into WIRE bytes, what a rank sends under the
bandwidth-optimal algorithms (ledger.wire_factor: ring all-reduce 2(p-1)/p
of the tensor, all-gather / reduce-scatter (p-1) blocks, all-to-all
(p-1)/p of the input, send 1x), for the measured and the minimum alike.

Notation: b batch rows per rank (per micro-batch for PP), s sequence, h
hidden, L layers, V the vocabulary, e = 4 bytes (float32), p ranks,
N = b*s*h*e (one [b, s, h] activation), n = N/p (its sequence shard),
P = the gradient bytes of the parameters a rank holds.

Minimum per rank and step (wire bytes):

  tp            Megatron TP with a vocabulary-parallel embedding and head
                (parallel_output: the loss on each rank's vocabulary shard):
                per layer 2 all-reduces of N forward (attention and MLP
                outputs) + 2 backward (their inputs' gradients); the
                embedding's all-reduce forward, the head input's gradient
                all-reduce backward; the loss's max and sum-exp/target
                all-reduces over b*s rows (3 floats a row):
                    AR((4L + 2) N + 3 b s e)          AR(x) = 2 (p-1)/p x
  split_gather  the same layout with the activations sequence-split: every
                all-reduce of N becomes a reduce-scatter + all-gather of n,
                so the same wire bytes, plus the norms' weight gradients
                summed over the split (2 per layer, h e each):
                    (4L + 2) (RS(N) + AG(n)) + AR(3 b s e + 2L h e)
                with RS(N) = AG(n) = (p-1) n on the wire
  all_to_all    Ulysses (pure SP over p ranks): per layer q, k, v and the
                attention output change layout (heads <-> sequence) forward and
                back; the layers' weights are replicated, so their gradients
                are summed over the group (shardformer does it in backward);
                the embedding and the head run on the whole sequence, so the
                embedding's rows are split (all-gather of the gradient) and the
                head's input gathered:
                    2L (p-1)/p (q + k + v + o bytes of b*s/p rows)
                    + AR(P_layers) + 2 AG(N/p)
  ring_attn     ring attention (pure SP): per layer the K/V of every other
                rank forward and again backward, and the partial dK/dV of
                every other rank's keys back to it (float32):
                    L ((p-1) KV + (p-1) KV + (p-1) dKV) + AR(P_layers) + 2 AG(N/p)
                with KV = 2 b (s/p) h_kv d e, dKV the same in float32
  pp_1f1b       2 stages, m micro-batches: each micro-batch's activation
                [b, s, h] one way and its gradient back; each rank sends m N
  dp            one all-reduce of every gradient: AR(P)  (average_gradients)
  ep            expert parallelism over the p ranks (mesh(dp=p, ep=p)): per
                MoE layer the (token, slot) pairs routed to other ranks'
                experts go there and come back, forward and backward (counted
                from the router's choices on this rank's tokens), and the
                parameters outside the experts are averaged:
                    4 (pairs routed away) h e + AR(P_dense)

The excess in each mode is listed in the output, each item with its size
(what the ledger saw beyond the formula and why); "unexplained" is what is
left of the measured bytes after the minimum and the items: 0 in every mode.  Projection: the step time on a link of
--link-gbps (default 25 GB/s, a PCIe 4.0 x16 / 200 Gb/s network class
ring bus bandwidth) with --latency-us per call: measured compute (the step's
wall time minus the ledger's communication seconds) + calls x latency +
wire bytes / bandwidth, for the measured bytes and for the minimum.

Run:  .venv/bin/python benchmarks/comm_volume.py [--quick] [--ranks 2]
Results: benchmarks/results/comm_volume.json (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("tp", "split_gather", "all_to_all", "ring_attn", "pp_1f1b", "dp", "ep")
E = 4  # float32


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2, help="rows per rank (per micro-batch for PP)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3, help="measured steps (the median is reported)")
    ap.add_argument("--link-gbps", type=float, default=25.0)
    ap.add_argument("--latency-us", type=float, default=10.0)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--quick", action="store_true", help="smaller model, 1 step")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "comm_volume.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.hidden, args.intermediate, args.seq, args.vocab, args.iters = 128, 256, 32, 512, 1
    return args


def _config(args, moe: bool = False):
    import transformers

    common = dict(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                  max_position_embeddings=args.seq, tie_word_embeddings=False)
    if moe:
        return transformers.MixtralConfig(**common, num_local_experts=args.experts,
                                          num_experts_per_tok=args.top_k, router_jitter_noise=0.0)
    return transformers.LlamaConfig(**common)


def _model(args, moe: bool = False):
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = _config(args, moe)
    cfg._attn_implementation = "eager"
    return (transformers.MixtralForCausalLM if moe else transformers.LlamaForCausalLM)(cfg)


# ---- the minimum of each layout and the excess explained (wire bytes per rank and step) --------

def _ar(x: float, p: int) -> float:
    return 2 * (p - 1) / p * x


def accounting(mode: str, a, p: int, m: dict) -> tuple[float, str, list]:
    """(minimum wire bytes, its formula, [(excess explained, wire bytes)]) of
    `mode`; m: the rank's measured facts (gradient bytes, routing) -- see the
    module docstring for the notation."""
    b, s, h, L = a.batch, a.seq, a.hidden, a.layers
    N = b * s * h * E
    d = h // a.heads
    loss = 3 * b * s * E                           # vocabulary-parallel loss: max, sum-exp, target per row
    # the loss's statistics travel as ONE all-gather (each rank's 3 floats per row, (p - 1) 3bs e on the wire)
    # where two all-reduces would carry AR(3bs e): equal at p = 2, more bytes for one collective fewer above
    loss_gather = ("the loss's row statistics are all-gathered in one collective (layer/loss.py) instead of "
                   "two all-reduces: AG(3bs e) - AR(3bs e)", (p - 1) * loss - _ar(loss, p))
    if mode == "tp":
        return (_ar((4 * L + 2) * N + loss, p), "AR((4L+2) N + 3bs e)",
                [("backward all-reduces dX once per column-parallel linear fed by the replicated input "
                  "(q, k, v; gate, up: 5 per layer) instead of once per block (2): 3L AR(N)", _ar(3 * L * N, p)),
                 loss_gather])
    if mode == "split_gather":
        rs_ag = 2 * (p - 1) / p * N                # a reduce-scatter of N + an all-gather of N/p
        return ((4 * L + 2) * rs_ag + _ar(loss + 2 * L * h * E, p), "(4L+2) (RS(N) + AG(N/p)) + AR(3bs e + 2L h e)",
                [("each block's saved input rows are all-gathered again in backward for dW (memory for "
                  "bytes): 2L AG(N/p)", 2 * L * (p - 1) / p * N),
                 ("the embedding reduces with an all-reduce of N and then splits, not a reduce-scatter",
                  _ar(N, p) - (p - 1) / p * N),
                 ("the LM head's input gradient is all-reduced (N) before its split, not reduce-scattered",
                  _ar(N, p) - (p - 1) / p * N),
                 loss_gather])
    if mode in ("all_to_all", "ring_attn"):
        rows = b * s / p
        around = 2 * (p - 1) / p * N              # the embedding's rows split (AG backward) and the head's gather
        shape_check = (p - 1) * 4 * 8             # _check_same_input: 4 int64 all-gathered per forward
        if mode == "all_to_all":
            qkvo = rows * (2 * a.heads + 2 * a.kv_heads) * d * E
            formula = "2L (p-1)/p (q+k+v+o of bs/p rows) + AR(P_layers) + 2 AG(N/p)"
            exchange = 2 * L * (p - 1) / p * qkvo
            extra = []
        else:
            kv = 2 * rows * a.kv_heads * d * E    # one K/V message: [2, b, h_kv, s/p, d]
            dkv = 2 * rows * a.kv_heads * d * 4   # the dK/dV accumulators, float32
            formula = "L ((p-1) KV fwd + (p-1) KV bwd + (p-1) dKV) + AR(P_layers) + 2 AG(N/p)"
            exchange = L * (p - 1) * (2 * kv + dkv)
            extra = [("the dK/dV accumulators travel p hops (back to their owner), not p-1: L dKV", L * dkv)]
        return (exchange + _ar(m["layer_grad_bytes"], p) + around, formula,
                extra + [("the SP group's input-shape agreement, one all-gather of 4 int64 per forward",
                          shape_check)])
    if mode == "pp_1f1b":
        return (a.microbatches * N, "m N (activations one way, gradients the other)",
                [("the schedule's agreement on the step (6 int64 all-gathered) and the loss broadcast "
                  "(1 float32) from the last stage", (p - 1) * 6 * 8 + (p - 1) / p * 4)])
    if mode == "dp":
        return _ar(m["grad_bytes"], p), "AR(P)", []
    if mode == "ep":
        routed = m["routed_away"]                  # (token, slot) pairs this rank sent to other ranks' experts
        padded = m["padded_rows"]                  # rows it sent: (p-1) chunks of the capacity c, per layer
        ids = sum(L_c * 8 for L_c in m["capacities"]) * (p - 1)
        return (4 * routed * h * E + _ar(m["grad_bytes"], p), "4 (pairs routed away) h e + AR(P_dense)",
                [("every exchange pads each destination's chunk to the largest load c over the group "
                  "(equal all-to-all chunks): 4 ((p-1) c - routed) h e", 4 * (padded - routed) * h * E),
                 ("the expert ids travel with the rows (c int64 per destination and layer)", ids),
                 ("the capacity c is agreed by an all-reduce (max) of one int64 per layer", _ar(8 * L, p))])
    raise ValueError(mode)


# ---- one mode on every rank ---------------------------------------------------------------

def _batch(args, rows: int, seed: int):
    import torch

    ids = torch.randint(0, args.vocab, (rows, args.seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _grad_bytes(model, keep=lambda name, p: True) -> int:
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if p.requires_grad and keep(name, p))


class _Routing:
    """Forward hooks on every MoE router: this rank's (token, slot) pairs per
    destination EP rank, per layer, of the last forward."""

    def __init__(self, model, p: int, rank: int, experts: int):
        from shardformer.layer.expert_parallel import expert_block

        self.p, self.rank, self.loads = p, rank, {}
        self.owner = [r for r in range(p) for _ in range(expert_block(experts, p, r)[1])]
        for name, mod in model.named_modules():
            if type(mod).__name__.endswith("TopKRouter"):
                mod.register_forward_hook(self._hook(name))

    def _hook(self, name):
        def hook(_mod, _args, out):
            import torch

            owners = torch.tensor(self.owner)[out[2].flatten()]
            self.loads[name] = torch.bincount(owners, minlength=self.p)
        return hook

    def facts(self) -> dict:
        """routed_away (pairs sent to other ranks), padded_rows ((p-1) c per layer, c the
        group's largest load: what the exchange sends), capacities."""
        import torch
        import torch.distributed as dist

        routed = sum(int(v.sum() - v[self.rank]) for v in self.loads.values())
        caps = torch.stack([v.max() for v in self.loads.values()])
        dist.all_reduce(caps, op=dist.ReduceOp.MAX)
        return {"routed_away": routed, "padded_rows": (self.p - 1) * int(caps.sum()), "capacities": caps.tolist()}


def _setup(mode: str, args):
    """(step function, model, facts() -> the measured facts accounting() reads)."""
    import torch.distributed as dist

    from shardformer import ShardFormer, average_gradients, mesh

    p, rank = dist.get_world_size(), dist.get_rank()
    # check_inputs_every=0: the ranks' agreement checks (the batch's fingerprint, and the whole parameters'
    # one 16-byte all-gather before forward call 2 and every 100th: shardformer.replica_drift)
    # are not the layout's communication, and would make the measured steps differ from each other
    opt = dict(enable_flash_attention=True, check_inputs_every=0)
    if mode == "pp_1f1b":
        from shardformer.pipeline import OneForwardOneBackwardSchedule
        from shardformer.pipeline.stages import runtime_of

        model, _ = ShardFormer(mesh(pp=p).shard_config(**opt)).optimize(_model(args))
        runner = OneForwardOneBackwardSchedule(runtime_of(model).manager, num_microbatches=args.microbatches)
        batch = _batch(args, args.batch * args.microbatches, 0)
        return (lambda: runner.forward_backward_step(model, batch)), model, dict
    if mode in ("tp", "split_gather"):
        extra = dict(parallel_output=True)
        if mode == "split_gather":
            extra.update(enable_sequence_parallelism=True, sequence_parallelism_mode="split_gather")
        model, _ = ShardFormer(mesh(tp=p).shard_config(**opt, **extra)).optimize(_model(args))
        batch = _batch(args, args.batch, 0)
        return (lambda: model(**batch).loss.backward()), model, dict
    if mode in ("all_to_all", "ring_attn"):
        # the layers' weights are replicated and summed over the SP group in backward by shardformer
        # itself (layer/replicated.py); embedding and head run on the whole sequence on every rank
        model, _ = ShardFormer(mesh(sp=p).shard_config(**opt, sequence_parallelism_mode=mode)).optimize(_model(args))
        batch = _batch(args, args.batch, 0)
        layers = _grad_bytes(model, lambda name, _: ".layers." in name)
        return (lambda: model(**batch).loss.backward()), model, lambda: {"layer_grad_bytes": layers}
    if mode == "dp":
        m = mesh(dp=p)
        model, _ = ShardFormer(m.shard_config(**opt)).optimize(_model(args))
        batch = _batch(args, args.batch, 1 + rank)

        def step():
            model(**batch).loss.backward()
            average_gradients(model, m)
        grads = _grad_bytes(model)
        return step, model, lambda: {"grad_bytes": grads}
    if mode == "ep":
        from shardformer.layer.expert_parallel import is_expert_param

        m = mesh(dp=p, ep=p)
        model, _ = ShardFormer(m.shard_config(**opt)).optimize(_model(args, moe=True))
        routing = _Routing(model, p, rank, args.experts)
        batch = _batch(args, args.batch, 1 + rank)

        def step():
            model(**batch).loss.backward()
            average_gradients(model, m)
        dense = _grad_bytes(model, lambda _, t: not is_expert_param(t))
        return step, model, lambda: dict(routing.facts(), grad_bytes=dense)
    raise ValueError(mode)


def rank_main(rank: int, args, mode: str) -> dict:
    import statistics

    import torch.distributed as dist

    import shardformer

    step, model, facts = _setup(mode, args)
    step()                                   # warm-up: first-forward checks, pipeline headers
    model.zero_grad(set_to_none=True)
    walls, ledgers = [], []
    for _ in range(args.iters):
        dist.barrier()
        with shardformer.comm_stats(trace=True) as s:
            t0 = time.perf_counter()
            step()
            walls.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        ledgers.append(s)
    s = ledgers[-1]
    wire = [x.wire_bytes() for x in ledgers]
    assert len(set(wire)) == 1, f"{mode}: the steps sent different bytes: {wire}"
    p = dist.get_world_size()
    minimum, formula, explained = accounting(mode, args, p, facts())
    return {"mode": mode, "rank": rank, "step_s": statistics.median(walls),
            "comm_s": statistics.median(x.total("seconds") for x in ledgers),
            "summary": s.summary(), "calls": s.total("calls"), "payload_bytes": s.total("bytes"),
            "wire_bytes": s.wire_bytes(), "minimum_bytes": minimum, "formula": formula,
            "explained": explained, "ratio": s.wire_bytes() / minimum,
            "unexplained_bytes": s.wire_bytes() - minimum - sum(b for _, b in explained)}


def _project(r: dict, args) -> tuple[float, float]:
    """(projected step s with the measured bytes, with the minimum's) on the named link."""
    compute = max(r["step_s"] - r["comm_s"], 0.0)
    latency = r["calls"] * args.latency_us * 1e-6
    bw = args.link_gbps * 1e9
    return compute + latency + r["wire_bytes"] / bw, compute + latency + r["minimum_bytes"] / bw


def main(argv=None) -> dict:
    args = _args(argv)
    from shardformer.launch import spawn

    link = f"{args.link_gbps:g} GB/s per rank, {args.latency_us:g} us per call"
    print(f"comm_volume: {args.ranks} ranks; Llama h={args.hidden} L={args.layers} s={args.seq} b={args.batch} "
          f"V={args.vocab} heads={args.heads}/{args.kv_heads}; Mixtral for EP: {args.experts} experts, "
          f"top-{args.top_k}; projection on a link of {link}\n")
    rows = []
    for mode in args.modes.split(","):
        per_rank = spawn(rank_main, args.ranks, args=(args, mode), timeout_s=900)
        worst = max(per_rank, key=lambda r: r["ratio"])
        proj, proj_min = _project(worst, args)
        rows.append({"mode": mode, "ratio": worst["ratio"], "ratios": [r["ratio"] for r in per_rank],
                     "wire_bytes": [r["wire_bytes"] for r in per_rank],
                     "minimum_bytes": [r["minimum_bytes"] for r in per_rank],
                     "payload_bytes": [r["payload_bytes"] for r in per_rank],
                     "calls": [r["calls"] for r in per_rank], "formula": worst["formula"],
                     "explained": worst["explained"], "unexplained_bytes": [r["unexplained_bytes"] for r in per_rank],
                     "step_s": worst["step_s"], "comm_s": worst["comm_s"],
                     "projected_step_s": proj, "projected_minimum_step_s": proj_min,
                     "summary": {k: v for k, v in worst["summary"].items() if v["calls"]}})
        r = rows[-1]
        wire = ", ".join(f"{w:.0f}" for w in r["wire_bytes"])
        least = ", ".join(f"{w:.0f}" for w in r["minimum_bytes"])
        print(f"{mode:<13} {r['ratio']:.3f}x the minimum  (wire bytes per rank: {wire}; minimum {least} = "
              f"{r['formula']})")
        for what, extra in r["explained"]:
            print(f"    excess {extra:>10.0f} B: {what}")
        left = max(abs(u) for u in r["unexplained_bytes"])
        print(f"    unexplained: {left:.0f} B;  step {r['step_s'] * 1e3:.1f} ms here "
              f"(comm {r['comm_s'] * 1e3:.1f} ms); "
              f"projected on the link: {proj * 1e3:.2f} ms (at the minimum {proj_min * 1e3:.2f} ms)")
    result = {"args": vars(args), "link": link, "machine": platform.platform(), "modes": rows,
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwritten to {os.path.relpath(args.out, ROOT)}")
    return result


if __name__ == "__main__":
    main()
