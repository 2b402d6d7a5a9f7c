"""Rank-side checks of packed sequences (tests/test_packed_sequences.py):
position_ids that restart or jump, no attention_mask.  transformers masks
such documents block-diagonally only when the forward has no KV cache
(shardformer.packing), so the unsharded model called with its defaults
(config.use_cache True) and with use_cache=False give different logits; every
staged or split forward must give the one of the unsharded model called the
same way.  Under ring_attn the block-diagonal case goes into the ring
kernel's blocks (ring_attention's documents)."""
from __future__ import annotations

import copy
import dataclasses

import torch

import zoo
from checks import parity
from checks import pipeline as pipe
from checks.sequence_attention import mesh_groups
from shardformer import ShardConfig, ShardFormer
from shardformer.pipeline import p2p

TOL = parity.TOL[torch.float32]


def position_ids(kind: str, rows: int, seq: int) -> torch.Tensor:
    """[rows, seq] position ids: "packed" documents restarting at 0 (lengths
    differ per row), "gaps" positions jumping forward inside the row."""
    out = []
    for r in range(rows):
        if kind == "packed":
            cut = 3 + r % (seq - 4)
            out.append(torch.cat([torch.arange(cut), torch.arange(seq - cut)]))
        elif kind == "gaps":
            out.append(torch.cat([torch.arange(4), torch.arange(7 + r, 7 + r + seq - 4)]))
        else:
            raise ValueError(kind)
    return torch.stack(out)


def _source(name: str):
    """(build, make_inputs) of `name`: the zoo's, or for "derived:Arch" the
    tiny model of checks.derived_policy (a policy derived from its TP plan)."""
    if name.startswith("derived:"):
        from checks import derived_policy as DP

        arch = name.split(":", 1)[1]
        return (lambda: DP.build(arch)), (lambda: DP.make_inputs(arch))
    return (lambda: zoo.build(name)), (lambda: zoo.make_inputs(name))


def packed_inputs(name: str, kind: str, use_cache=None, rows: int | None = None) -> dict:
    """The batch of `name` (_source; input_ids, labels; `rows` rows:
    checks.pipeline.batch_of) with `kind` position ids, no attention_mask;
    use_cache passed when not None."""
    inputs = _source(name)[1]() if rows is None else pipe.batch_of(name, rows)
    inputs.pop("attention_mask", None)
    B, S = inputs["input_ids"].shape
    inputs["position_ids"] = position_ids(kind, B, S)
    if use_cache is not None:
        inputs["use_cache"] = use_cache
    return inputs


def masking_matters(name: str, inputs: dict) -> None:
    """The unsharded model's logits with and without the block-diagonal mask
    differ (with the cache: causal across documents; without: per document),
    so a forward that takes the other decision cannot pass."""
    model = _source(name)[0]().eval()
    ids = {k: v for k, v in inputs.items() if k in ("input_ids", "position_ids")}
    with torch.no_grad():
        cached, uncached = model(**ids, use_cache=True).logits, model(**ids, use_cache=False).logits
    assert not torch.allclose(cached, uncached, rtol=1e-3, atol=1e-3), \
        f"{name}: the packed-sequence mask changes nothing on these inputs"


def _sp_config(mode: str, tp: int, sp_group=None) -> dict:
    if mode == "split_gather":       # split over the TP group, TP on (with tp=1 over the whole group: TP on too)
        return {"enable_sequence_parallelism": True, "sequence_parallelism_mode": "split_gather"}
    config = {"enable_sequence_parallelism": True, "sequence_parallelism_mode": mode}
    if tp == 1:
        config["enable_tensor_parallelism"] = False
    else:
        config["sequence_parallel_process_group"] = sp_group
    return config


def sp_equals_unsharded(ctx, name: str, mode: str, kind: str, use_cache=None, tp: int = 1,
                        training: bool = True, default_group: bool = False, checkpointing: bool = False) -> dict:
    """check_sharded (forward, loss, every gradient, outputs after a step)
    with `kind` position ids and no attention_mask, the model and the
    unsharded reference called the same way (use_cache as given; None: the
    default).  tp > 1 (all_to_all / ring_attn): TP over {0,1},{2,3}, the
    sequence split over {0,2},{1,3}.  training=False: one eval forward under
    no_grad against the eval reference.  default_group: ShardConfig() with
    no group (the world).  checkpointing: gradient checkpointing on (in
    training the unsharded model then makes no cache: masks per document)."""
    inputs = packed_inputs(name, kind, use_cache)
    masking_matters(name, inputs)
    sub, sp_group = ctx, None
    if tp > 1 and mode != "split_gather":
        tp_group, sp_group = mesh_groups(ctx, tp)
        sub = dataclasses.replace(ctx, tp_size=tp, group=tp_group)
    config = _sp_config(mode, tp, sp_group)
    build = _source(name)[0]
    if checkpointing:
        def build(plain=build):
            model = plain()
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return model
    if training:
        if default_group:
            sub = dataclasses.replace(ctx, group=None)
        return parity.check_sharded(sub, build, inputs, name=name, config=config)
    torch.manual_seed(0)
    model = build().eval()
    ref = copy.deepcopy(model)
    group = None if default_group else sub.group
    ShardFormer(ShardConfig(tensor_parallel_process_group=group, **config)).optimize(model)
    with torch.no_grad():
        got, exp = model(**inputs), ref(**inputs)
    return {"logits": parity.assert_close(f"{name} eval logits ({mode}, {kind})", got.logits, exp.logits, TOL),
            "loss": parity.assert_close(f"{name} eval loss ({mode}, {kind})", got.loss, exp.loss, TOL)}


SPLIT_MODES = ("split_gather", "all_to_all", "ring_attn")


def sp_modes_equal_unsharded(ctx, name: str, kind: str, tp: int = 1, training: bool = True,
                             default_group: bool = False, explicit: bool = True, checkpointing: bool = False) -> dict:
    """Every SP mode in turn (sp_equals_unsharded), called with the default
    use_cache (the unsharded model keeps its cache: causal across the
    documents); explicit: then with use_cache=False (the unsharded model masks
    per document; ring_attn and-s the documents into each block's mask), and
    in eval with use_cache=True too (an unsplit forward)."""
    explicit_values = ((False, True) if not training else (False,)) if explicit else ()
    report = {}
    for mode in SPLIT_MODES:
        for use_cache in (None,) + explicit_values:
            report[f"{mode} use_cache={use_cache}"] = sp_equals_unsharded(
                ctx, name, mode, kind, use_cache, tp, training, default_group, checkpointing)
    return report


def pipeline_variants_equal_unsharded(ctx, name: str, schedule: str, kind: str, variants, **kwargs) -> dict:
    """pipeline_equals_unsharded for each (use_cache, checkpointing) of `variants`."""
    return {f"use_cache={u}, checkpointing={c}": pipeline_equals_unsharded(ctx, name, schedule, kind, u,
                                                                           checkpointing=c, **kwargs)
            for u, c in variants}


def pipeline_equals_unsharded(ctx, name: str, schedule: str, kind: str, use_cache=None, pp: int = 2,
                              chunks: int = 1, m: int = 2, sp_mode: str | None = None, tp: int = 1,
                              checkpointing: bool = False) -> dict:
    """One forward_backward_step with `kind` position ids and no
    attention_mask: its loss equals the unsharded model's on the whole batch
    called the same way (use_cache as in the batch; None: the default), and
    the gathered state after one SGD step equals the reference's.
    checkpointing: gradient checkpointing on both (the unsharded model then
    runs without a cache in training)."""
    from checks.pipeline import SCHEDULES

    batch = packed_inputs(name, kind, use_cache, rows=4)
    masking_matters(name, batch)
    layers = 4 * chunks if chunks > 1 else 4
    ref, model, sm, _ = pipe.pipelined(ctx, name, pp, tp, chunks, layers, sp_mode=sp_mode)
    if checkpointing:
        for mdl in (ref, model):
            mdl.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    exp = ref(**batch)
    sent = dict(p2p.COUNTS)
    out = SCHEDULES[schedule](sm, num_microbatches=m).forward_backward_step(model, batch)
    assert p2p.COUNTS["sent"] > sent["sent"], f"{name}: nothing went between the stages"
    err = parity.assert_close(f"{name} pipelined loss ({schedule}, {kind}, use_cache={use_cache})", out["loss"],
                              exp.loss.detach(), TOL)
    exp.loss.backward()
    return {"loss": err, "state": pipe.stepped_states_equal(model, ref, name)}


def sp_lengths_disagree(ctx, name: str, mode: str) -> str:
    """Each SP rank fed a different sequence length (7 and 8 pad to the same
    S' under ring_attn at SP=2, so the ring's exchanges alone match): the
    split raises ValueError on every rank, naming each rank's shape, within
    seconds.  The input check (shardformer.input_check, test_batch_agreement)
    would name the disagreement first on the checked calls; it is off here
    so that the split's own check, which runs on every call, is the one seen."""
    import time

    torch.manual_seed(0)
    model = zoo.build(name)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, check_inputs_every=0,
                            **_sp_config(mode, 1))).optimize(model)
    inputs = zoo.make_inputs(name)
    seq = inputs["input_ids"].shape[1] - (ctx.rank % 2)
    inputs = {k: v[:, :seq] for k, v in inputs.items()}
    start = time.monotonic()
    try:
        model(**inputs)
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError(f"{name}: SP ranks with different sequence lengths were not noticed ({mode})")
    took = time.monotonic() - start
    assert took < 10, f"the disagreement took {took:.1f} s to raise"
    full = inputs["input_ids"].shape[1] + (ctx.rank % 2)
    for words in (name, mode, "rank 0", "rank 1", f"sequence length {full}", f"sequence length {full - 1}"):
        assert words in message, (words, message)
    return message
