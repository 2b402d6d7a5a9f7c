"""Rank-side checks of the all_to_all (Ulysses) and ring_attn sequence
parallelism modes (tests/test_sequence_attention.py)."""
from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist

import zoo
from checks import parity
from shardformer import ShardConfig, ShardFormer
from shardformer.layer import sequence_attention as sa

_GROUPS: dict = {}


def mesh_groups(ctx, tp: int):
    """(tp_group, sp_group) of this rank on the ctx.tp_size ranks laid out
    TP innermost: TP {0,1},{2,3} and SP {0,2},{1,3} at 4 ranks, tp=2.  Made
    once per pool (new_group is collective over the world: every rank of the
    pool runs this)."""
    n = ctx.world_size
    key = (n, tp)
    if key not in _GROUPS:
        tps = [dist.new_group(list(range(i, i + tp))) for i in range(0, n, tp)]
        sps = [dist.new_group(list(range(j, n, tp))) for j in range(tp)]
        _GROUPS[key] = (tps, sps)
    tps, sps = _GROUPS[key]
    return tps[ctx.rank // tp], sps[ctx.rank % tp]


def _trim(inputs: dict, seq: int | None) -> dict:
    if seq is None:
        return inputs
    return {k: v[:, :seq].contiguous() if isinstance(v, torch.Tensor) and v.dim() >= 2 else v
            for k, v in inputs.items()}


def sp_config(mode: str, **extra) -> dict:
    """Pure sequence parallelism over the test's group (TP off)."""
    return {"enable_tensor_parallelism": False, "enable_sequence_parallelism": True,
            "sequence_parallelism_mode": mode, **extra}


def equals_unsharded(ctx, name: str, mode: str, seq: int | None = None, config=None, padded: bool = False) -> dict:
    """check_sharded (forward, loss, every gradient, outputs after a step)
    with the sequence split over ctx.group (TP off); the split attention ran
    once per layer per forward (counted).  padded: one batch row left-padded."""
    inputs = _trim(zoo.make_inputs(name), seq)
    if padded:
        mask = torch.ones_like(inputs["input_ids"])
        mask[0, :2] = 0
        inputs["attention_mask"] = mask
    before = sa.CALLS[mode]
    report = parity.check_sharded(ctx, lambda: zoo.build(name), inputs, name=name,
                                  config=sp_config(mode, **(config or {})))
    calls = sa.CALLS[mode] - before
    assert calls > 0, f"{name}: the {mode} attention never ran"
    report["split_calls"] = calls
    return report


def sliding_window_equals_unsharded(ctx, name: str, mode: str, window: int, seq: int | None = None,
                                    padded: bool = False) -> dict:
    """`name` built with sliding_window=window (shorter than the sequence):
    the window changes the unsharded model's logits (so it is in force), and
    the model with the sequence split equals the unsharded one (check_sharded:
    forward, loss, every gradient, after a step).  Under ring_attn the ring
    skipped or masked chunk pairs that causal masking alone would compute
    whole (the window reached ring_attention).  padded: batch row 0 left-padded by 2 tokens,
    compared as padded_batch_real_rows does (logits at the real positions,
    the loss with labels -100 where a padding query predicts, every
    gradient): a query whose every visible key is padding is each
    implementation's own convention."""
    from shardformer.layer import ring_attention as ra

    inputs = _trim(zoo.make_inputs(name), seq)
    if padded:
        mask = torch.ones_like(inputs["input_ids"])
        mask[0, :2] = 0
        labels = inputs["input_ids"].clone()
        labels[0, :3] = -100                      # label t is predicted at t - 1
        inputs.update(attention_mask=mask, labels=labels)
    length = inputs["input_ids"].shape[1]
    assert window < length, f"window {window} is not shorter than the {length} tokens"
    with torch.no_grad():
        windowed = zoo.build(name, sliding_window=window).eval()(**inputs).logits
        plain = zoo.build(name, sliding_window=None).eval()(**inputs).logits
    assert not torch.allclose(windowed, plain), f"{name}: sliding_window={window} changes nothing"
    before, ring_before = sa.CALLS[mode], dict(ra.CALLS)
    if padded:
        torch.manual_seed(0)
        model = zoo.build(name, sliding_window=window).train()
        ref = copy.deepcopy(model)
        ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **sp_config(mode))).optimize(model)
        got, exp = model(**inputs), ref(**inputs)
        tol = parity.TOL[torch.float32]
        real = inputs["attention_mask"].bool()
        report = {"logits": parity.assert_close(f"{name} logits at real positions", got.logits[real],
                                                exp.logits[real], tol),
                  "loss": parity.assert_close(f"{name} loss", got.loss, exp.loss, tol)}
        got.loss.backward()
        exp.loss.backward()
        grads = dict(ref.named_parameters())
        for key, prm in model.named_parameters():
            parity.assert_close(f"{name} grad {key}", prm.grad, grads[key].grad, tol)
    else:
        report = parity.check_sharded(ctx, lambda: zoo.build(name, sliding_window=window), inputs, name=name,
                                      config=sp_config(mode))
    assert sa.CALLS[mode] > before, f"{name}: the {mode} attention never ran"
    if mode == "ring_attn":
        p = ctx.tp_size
        blocks, skipped, masked = (ra.CALLS[k] - ring_before[k] for k in ("blocks", "skipped", "masked"))
        passes = (ra.CALLS["forward"] - ring_before["forward"]) + (ra.CALLS["backward"] - ring_before["backward"])
        # causal alone skips 2p-1 of this rank's 4p pairs per pass and masks none
        assert passes > 0 and (skipped > passes * (2 * p - 1) or masked > 0), \
            f"{name}: {skipped} chunk pairs skipped, {masked} masked over {passes} passes: " \
            f"the window did not reach the ring"
        report["ring_pairs"] = {"blocks": blocks, "skipped": skipped, "masked": masked}
        report["ring_unvisited"] = ra.CALLS["unvisited"] - ring_before["unvisited"]
        report["ring_messages"] = ra.CALLS["messages"] - ring_before["messages"]
        report["ring_passes"] = {k: ra.CALLS[k] - ring_before[k] for k in ("forward", "backward")}
    return report


def tp_sp_equals_unsharded(ctx, name: str, mode: str, tp: int, seq: int | None = None) -> dict:
    """TP over {0,1},{2,3} and the sequence split over {0,2},{1,3}: equal to
    the unsharded model (check_sharded over the TP group)."""
    tp_group, sp_group = mesh_groups(ctx, tp)
    sub = dataclasses.replace(ctx, tp_size=tp, group=tp_group) if dataclasses.is_dataclass(ctx) else ctx
    before = sa.CALLS[mode]
    report = parity.check_sharded(sub, lambda: zoo.build(name), _trim(zoo.make_inputs(name), seq), name=name,
                                  config={"enable_sequence_parallelism": True, "sequence_parallelism_mode": mode,
                                          "sequence_parallel_process_group": sp_group})
    assert sa.CALLS[mode] > before, f"{name}: the {mode} attention never ran"
    return report


def rows_are_split(ctx, name: str, mode: str) -> dict:
    """Between the layers each rank holds S'/p rows (the padded length over
    the group), and the attention's query rows are this rank's."""
    model = zoo.build(name)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **sp_config(mode))).optimize(model)
    seen = []
    base = model.model if hasattr(model, "model") else model
    for layer in base.layers:
        layer.register_forward_pre_hook(
            lambda m, a, k: seen.append(k.get("hidden_states", a[0] if a else None).shape[1]), with_kwargs=True)
    inputs = zoo.make_inputs(name)
    seq = inputs["input_ids"].shape[1]
    with torch.no_grad():
        out = model(**inputs)
    multiple = 2 * ctx.tp_size if mode == "ring_attn" else ctx.tp_size
    expected = -(-seq // multiple) * multiple // ctx.tp_size
    assert seen and all(s == expected for s in seen), f"{name}: layer inputs of {seen} rows, expected {expected}"
    assert out.logits.shape[1] == seq, f"{name}: logits of {out.logits.shape[1]} rows, expected {seq}"
    return {"rows": seen[0], "seq": seq}


def eval_with_dropout(ctx, name: str, mode: str) -> float:
    """Dropout 0.3 everywhere, model in eval(): equal to the unsharded eval model."""
    model = zoo.build_with_dropout(name, 0.3).eval()
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **sp_config(mode))).optimize(model)
    assert not model.training
    inputs = zoo.make_inputs(name)
    with torch.no_grad():
        got, exp = model(**inputs).logits, ref(**inputs).logits
    return parity.assert_close(f"{name} eval logits", got, exp, parity.TOL[torch.float32])


def generate_matches(ctx, name: str, mode: str) -> list:
    """Greedy generate() (KV cache: each step runs unsplit) equals the unsharded
    model's, and a use_cache=False forward afterwards is split again."""
    model = zoo.build(name).eval()
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **sp_config(mode))).optimize(model)
    before = sa.CALLS["unsplit"]
    got = parity.greedy_matches(model, ref, {"input_ids": parity.prompt_ids()}, name, 5)
    assert sa.CALLS["unsplit"] > before, "generate() did not take the unsplit path"
    split = sa.CALLS[mode]
    with torch.no_grad():
        model(input_ids=parity.prompt_ids())
    assert sa.CALLS[mode] > split, "a plain forward after generate() was not split"
    return got.tolist()


def cached_training_forward_refused(ctx, name: str, mode: str) -> str:
    """A differentiable forward with use_cache=True would run unsplit and have
    its gradients summed over the group: refused with a clear error."""
    model = zoo.build(name)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **sp_config(mode))).optimize(model)
    try:
        model(**zoo.make_inputs(name), use_cache=True)
    except RuntimeError as e:
        assert "use_cache=False" in str(e) and name in str(e), str(e)
        return str(e)
    raise AssertionError("a training forward with use_cache=True was not refused")


def softcap_equals_unsharded(ctx, name: str, mode: str, cap: float, seq: int | None = None) -> dict:
    """`name` built with attn_logit_softcapping=cap, small enough to change
    the unsharded model's logits (so the cap is in force): the model with the
    sequence split equals the unsharded one (check_sharded: forward, loss,
    every gradient, after a step), and under ring_attn every ring call got
    the cap."""
    from shardformer.layer import ring_attention as ra

    inputs = _trim(zoo.make_inputs(name), seq)
    with torch.no_grad():
        capped = zoo.build(name, attn_logit_softcapping=cap).eval()(**inputs).logits
        plain = zoo.build(name, attn_logit_softcapping=None).eval()(**inputs).logits
    assert not torch.allclose(capped, plain, rtol=1e-4, atol=1e-5), f"{name}: softcap={cap} changes nothing"
    caps, real = [], ra.ring_attention

    def recording(*args, **kwargs):
        caps.append(kwargs.get("softcap"))
        return real(*args, **kwargs)

    before = sa.CALLS[mode]
    ra.ring_attention = recording
    try:
        report = parity.check_sharded(ctx, lambda: zoo.build(name, attn_logit_softcapping=cap), inputs, name=name,
                                      config=sp_config(mode))
    finally:
        ra.ring_attention = real
    calls = sa.CALLS[mode] - before
    assert calls > 0, f"{name}: the {mode} attention never ran"
    if mode == "ring_attn":
        assert len(caps) == calls and set(caps) == {cap}, f"{name}: ring calls got softcap {caps}"
    report["split_calls"] = calls
    return report


def ring_dropout_matches_kernel(ctx, name: str, p_drop: float = 0.3) -> dict:
    """Training with attention_dropout=p_drop under ring_attn: the logits,
    the loss and every gradient equal the unsharded model whose attention is
    the C kernel (shardformer.attention.enable), with the same dropout draws:
    the ring's blocks draw exactly what one kernel call over the whole
    sequence draws, for the seed that group rank 0 takes from torch's
    generator (torch.manual_seed alike before both forwards; the 8 tokens are
    a multiple of 2p, so the padded sequence is the sequence).  The draws are
    in force: a second seed changes the logits."""
    from shardformer import attention as sf_attention
    from shardformer.layer import ring_attention as ra

    torch.manual_seed(0)
    model = zoo.build(name, attention_dropout=p_drop).train()
    ref = copy.deepcopy(model)
    sf_attention.enable(ref)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **sp_config("ring_attn"))).optimize(model)
    inputs = zoo.make_inputs(name)
    assert inputs["input_ids"].shape[1] % (2 * ctx.tp_size) == 0
    before, ring_before = sa.CALLS["ring_attn"], ra.CALLS["forward"]
    torch.manual_seed(7)
    got = model(**inputs)
    torch.manual_seed(7)
    kernel_before = sf_attention.CALLS["kernel"]
    exp = ref(**inputs)
    assert sf_attention.CALLS["kernel"] > kernel_before, "the reference did not run the kernel"
    assert sa.CALLS["ring_attn"] > before and ra.CALLS["forward"] > ring_before, "the ring never ran"
    tol = parity.TOL[torch.float32]
    report = {"logits": parity.assert_close(f"{name} logits", got.logits, exp.logits, tol),
              "loss": parity.assert_close(f"{name} loss", got.loss, exp.loss, tol)}
    got.loss.backward()
    exp.loss.backward()
    grads = dict(ref.named_parameters())
    for key, prm in model.named_parameters():
        parity.assert_close(f"{name} grad {key}", prm.grad, grads[key].grad, tol)
    torch.manual_seed(8)
    other = model(**inputs).logits
    assert not torch.allclose(other, got.logits), f"{name}: attention dropout {p_drop} changes nothing"
    return report


def ring_packed_mask_refused(ctx, name: str) -> str:
    """Packed sequences (position_ids restarting at 0: HF builds a block-causal
    4-D mask) under ring_attn raise NotImplementedError naming the model and
    the mode at the first layer's attention, and leave the weights as they were."""
    model = zoo.build(name)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **sp_config("ring_attn"))).optimize(model)
    inputs = zoo.make_inputs(name)
    n = inputs["input_ids"].shape[1]
    position_ids = torch.cat([torch.arange(n // 2), torch.arange(n - n // 2)]).expand(inputs["input_ids"].shape[0], n)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        model(**inputs, position_ids=position_ids)
    except NotImplementedError as e:
        assert name in str(e) and "ring_attn" in str(e) and "attention mask pattern" in str(e), str(e)
        message = str(e)
    else:
        raise AssertionError(f"{name}: a packed-sequence mask was not refused under ring_attn")
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert not changed, f"the refused forward changed {changed}"
    return message


def padded_batch_real_rows(ctx, name: str, mode: str, seq: int = 7, pad: int = 2) -> dict:
    """Batch row 0 left-padded by `pad` tokens, labels -100 where a padding
    query predicts: logits at the real positions, the loss and every
    gradient equal the unsharded model's.  (What a padding query attends to
    when every key it may see is masked is each attention implementation's
    own convention -- uniform over all keys in eager, 0 in the flash and ring
    kernels -- and reaches nothing real.)"""
    torch.manual_seed(0)
    model = zoo.build(name).train()
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **sp_config(mode))).optimize(model)
    inputs = _trim(zoo.make_inputs(name), seq)
    mask = torch.ones_like(inputs["input_ids"])
    mask[0, :pad] = 0
    labels = inputs["input_ids"].clone()
    labels[0, : pad + 1] = -100                      # label t is predicted at t - 1
    inputs.update(attention_mask=mask, labels=labels)
    got, exp = model(**inputs), ref(**inputs)
    tol = parity.TOL[torch.float32]
    real = mask.bool()
    parity.assert_close(f"{name} logits at real positions", got.logits[real], exp.logits[real], tol)
    parity.assert_close(f"{name} loss", got.loss, exp.loss, tol)
    got.loss.backward()
    exp.loss.backward()
    grads = dict(ref.named_parameters())
    for key, p in model.named_parameters():
        parity.assert_close(f"{name} grad {key}", p.grad, grads[key].grad, tol)
    return {"loss": float(got.loss)}


def recorded_outputs_refused(ctx, name: str, mode: str) -> str:
    """output_hidden_states / output_attentions in a split forward raise
    (they would hold one rank's rows); under a KV cache (unsplit) they work."""
    model = zoo.build(name).eval()
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **sp_config(mode))).optimize(model)
    inputs = zoo.make_inputs(name)
    message = ""
    for what in ("output_hidden_states", "output_attentions"):
        try:
            with torch.no_grad():
                model(**inputs, **{what: True})
        except NotImplementedError as e:
            assert what in str(e), str(e)
            message = str(e)
        else:
            raise AssertionError(f"{what}=True was not refused")
    with torch.no_grad():
        got = model(**inputs, output_hidden_states=True, use_cache=True).hidden_states
        exp = ref(**inputs, output_hidden_states=True, use_cache=True).hidden_states
    for i, (a, b) in enumerate(zip(got, exp)):
        parity.assert_close(f"{name} hidden state {i}", a, b, parity.TOL[torch.float32])
    return message


def accumulated_forwards(ctx, name: str, mode: str, default_group: bool = False) -> dict:
    """Two forwards of different lengths (7 and 5 tokens) before one backward
    (gradient accumulation): each backward uses its own forward's split, and
    every gradient equals the unsharded model's.  default_group: no group
    given (None: the whole world, ctx.tp_size must be the pool's size)."""
    torch.manual_seed(0)
    model = zoo.build(name).train()
    ref = copy.deepcopy(model)
    group = {} if default_group else {"tensor_parallel_process_group": ctx.group}
    ShardFormer(ShardConfig(**group, **sp_config(mode))).optimize(model)
    batches = [_trim(zoo.make_inputs(name), 7), _trim(zoo.make_inputs(name, seed=2), 5)]
    got = sum(model(**b).loss for b in batches)
    exp = sum(ref(**b).loss for b in batches)
    tol = parity.TOL[torch.float32]
    parity.assert_close(f"{name} summed loss", got, exp, tol)
    got.backward()
    exp.backward()
    grads = dict(ref.named_parameters())
    worst = 0.0
    for key, p in model.named_parameters():
        worst = max(worst, parity.assert_close(f"{name} grad {key}", p.grad, grads[key].grad, tol))
    return {"grad": worst}


def sp_group_replicas_checked(ctx, name: str, mode: str) -> dict:
    """TP {0,1},{2,3} x SP {0,2},{1,3}: weights that agree inside each TP
    group but differ across the SP group are refused on every rank, naming
    the sequence-parallel group; broadcast_weights makes every rank hold
    global rank 0's weights."""
    tp_group, sp_group = mesh_groups(ctx, 2)
    cfg = {"tensor_parallel_process_group": tp_group, "enable_sequence_parallelism": True,
           "sequence_parallelism_mode": mode, "sequence_parallel_process_group": sp_group}
    model = zoo.build(name)
    with torch.no_grad():                          # TP pairs agree, SP pairs do not
        model.get_submodule("model.norm").weight.add_(ctx.rank // 2)
    try:
        ShardFormer(ShardConfig(**cfg)).optimize(model)
    except ValueError as e:
        assert "sequence-parallel group" in str(e), str(e)
    else:
        raise AssertionError("weights differing across the SP group were not refused")
    model = zoo.build(name)
    with torch.no_grad():                          # every rank different: broadcast rank 0's
        model.get_submodule("model.norm").weight.add_(ctx.rank)
    ShardFormer(ShardConfig(**cfg, extra_kwargs={"broadcast_weights": True})).optimize(model)
    norm = model.get_submodule("model.norm").weight
    ours = torch.tensor([float(norm.sum())])
    every = [torch.zeros(1) for _ in range(ctx.world_size)]
    dist.all_gather(every, ours)
    assert all(torch.equal(e, every[0]) for e in every), f"ranks differ after broadcast_weights: {every}"
    return {"norm": float(ours)}
