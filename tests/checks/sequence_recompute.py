"""Rank-side checks of ShardConfig(sequence_parallel_recompute="selective")
under split-gather sequence parallelism (tests/test_sequence_parallel_recompute.py)."""
from __future__ import annotations

import copy
import importlib.util
import os

import torch

import zoo
from checks import parity
from shardformer import ShardConfig, ShardFormer
from shardformer.layer import recompute

SELECTIVE = {"enable_sequence_parallelism": True, "sequence_parallel_recompute": "selective"}


def _config(ctx, selective: bool, overlap: bool = False) -> ShardConfig:
    return ShardConfig(tensor_parallel_process_group=ctx.group, enable_sequence_parallelism=True,
                       enable_sequence_overlap=overlap, sequence_parallel_recompute="selective" if selective else None)


def _seq_inputs(name: str, seq: int | None) -> dict:
    inputs = zoo.make_inputs(name)
    if seq is None:
        return inputs
    return {k: v[:, :seq].contiguous() if isinstance(v, torch.Tensor) and v.dim() >= 2 else v
            for k, v in inputs.items()}


def _run(model, inputs: dict, seed: int) -> tuple[dict, dict, dict]:
    """(outputs, gradients, outputs after one SGD step) of one training step,
    the dropout masks drawn from `seed`."""
    torch.manual_seed(seed)
    out = model(**inputs)
    outs = {k: v.detach().clone() for k, v in parity.output_tensors(out).items()}
    parity.loss_of(out, {}).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        after = {k: v.clone() for k, v in parity.output_tensors(model(**inputs)).items()}
    return outs, grads, after


def recompute_bit_exact(ctx, name: str, seq: int | None = None, dropout: float = 0.0, train: bool = True,
                        overrides=None, overlap: bool = False) -> dict:
    """The same model from the same seed under split-gather SP with and
    without selective recompute: every output, the loss, every gradient and
    the outputs after one SGD step are bit-for-bit equal (torch.equal), in
    train() (with `dropout`, masks seeded alike) or eval(); the recompute
    ran: tensors were saved as recipes and recomputed in backward, none in
    a no_grad forward.  `overlap`: both with enable_sequence_overlap."""
    build = (lambda: zoo.build_with_dropout(name, dropout, **(overrides or {}))) if dropout else \
        (lambda: zoo.build(name, **(overrides or {})))
    torch.manual_seed(0)
    plain = build()
    selective = copy.deepcopy(plain)
    for model, on in ((plain, False), (selective, True)):
        ShardFormer(_config(ctx, on, overlap)).optimize(model)
        model.train(train)
    inputs = _seq_inputs(name, seq)
    before = dict(recompute.COUNTS)
    expected = _run(plain, inputs, seed=5)
    assert recompute.COUNTS == before, f"{name}: recompute ran without sequence_parallel_recompute"
    with torch.no_grad():
        selective(**inputs)
    assert recompute.COUNTS == before, f"{name}: a no_grad forward saved recipes"
    got = _run(selective, inputs, seed=5)
    packed = recompute.COUNTS["packed"] - before["packed"]
    recomputed = recompute.COUNTS["recomputed"] - before["recomputed"]
    assert packed > 0 and recomputed >= packed, f"{name}: {packed} recipes saved, {recomputed} recomputed"
    for what, a, b in zip(("output", "gradient", "output after the step"), got, expected):
        assert a.keys() == b.keys(), f"{name}: {what}s {sorted(a)} != {sorted(b)}"
        differ = [k for k in a if not torch.equal(a[k], b[k])]
        assert not differ, f"{name}: {what} differs with selective recompute: {differ}"
    return {"packed": packed, "recomputed": recomputed, "layers": plain.config.num_hidden_layers}


def _heap_in_use():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "benchmarks", "sequence_parallel.py")
    spec = importlib.util.spec_from_file_location("_sp_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._heap_in_use


def _kept_bytes(model, ids, heap) -> int:
    """Heap bytes the forward leaves alive for backward (median of 3)."""
    kept = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        before = heap()
        out = model(input_ids=ids).last_hidden_state
        kept.append(heap() - before)
        out.sum().backward()
        del out
    return sorted(kept)[1]


def recompute_saves_memory(ctx, seq: int = 256) -> dict:
    """LlamaModel (hidden 256, intermediate 704, 4 layers, MHA, SDPA): the
    heap bytes kept from forward to backward under split-gather SP drop by
    at least 90% of what selective recompute leaves out per layer: the two
    norms' x_hat and outputs (4 x S/tp x hidden) and the SiLU output and
    SwiGLU product (2 x S x intermediate/tp), float32; and against TP alone
    the layers keep at most 0.6 of its bytes at tp=2 (Korthikanti et al.'s
    TP count: (10 + 24/tp) sbh per layer)."""
    import transformers

    heap = _heap_in_use()
    hidden, inter, layers = 256, 704, 4
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                   num_attention_heads=8, num_key_value_heads=8, vocab_size=1000,
                                   max_position_embeddings=seq, attn_implementation="sdpa", use_cache=False)
    ids = torch.randint(0, 1000, (1, seq), generator=torch.Generator().manual_seed(seq))
    kept = {}
    for mode, config in (("tp", {}), ("sp", {"enable_sequence_parallelism": True}), ("selective", SELECTIVE)):
        torch.manual_seed(0)
        model = transformers.LlamaModel(cfg).train()
        ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **config)).optimize(model)
        kept[mode] = _kept_bytes(model, ids, heap)
    tp = ctx.tp_size
    rows = -(-seq // tp)
    left_out = layers * 4 * (4 * rows * hidden + 2 * seq * (-(-inter // tp)))
    dropped = kept["sp"] - kept["selective"]
    assert dropped >= 0.9 * left_out, (f"selective recompute kept {kept['selective']} bytes vs {kept['sp']} "
                                       f"without: dropped {dropped}, expected about {left_out}")
    if tp == 2:
        assert kept["selective"] <= 0.6 * kept["tp"], f"selective SP keeps {kept['selective']} > 0.6 x TP {kept['tp']}"
    return {**kept, "left_out": left_out}


def recompute_off_under_checkpointing(ctx, name: str, use_reentrant: bool) -> dict:
    """Gradient checkpointing with selective recompute: the checkpoint's own
    saved-tensor hooks win (no recipe saved inside a checkpointed layer in
    the first forward), and the gradients equal those without checkpointing."""
    from checks.runtime_state import checkpointed_grads_match

    model = zoo.build(name)
    ShardFormer(_config(ctx, True)).optimize(model)
    before = recompute.COUNTS["packed"]
    worst = checkpointed_grads_match(model, zoo.make_inputs(name), name, use_reentrant)
    return {"worst": worst, "packed": recompute.COUNTS["packed"] - before}


def recompute_refused(ctx, name: str) -> str:
    """A policy whose layers open no recompute scope refuses
    sequence_parallel_recompute, naming the model and the setting, before
    the model changes."""
    model = zoo.build(name)
    message = parity.refused_unchanged(model, lambda: ShardFormer(_config(ctx, True)).optimize(model),
                                       f"{name} with sequence_parallel_recompute", NotImplementedError,
                                       structure=True)
    assert name.split("/")[0] in message and "sequence_parallel_recompute" in message, message
    return message
