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


# inputs whose dim 1 is not the (encoder) sequence: Whisper's mel bins; the decoder's inputs of an
# encoder-decoder keep their own (odd) length
_NOT_TRIMMED = ("input_features", "decoder_input_ids", "decoder_attention_mask")


def _trim(inputs: dict, seq: int | None) -> dict:
    """The first `seq` positions of the (encoder) sequence inputs."""
    if seq is None:
        return inputs
    keep = _NOT_TRIMMED + (("labels",) if "decoder_input_ids" in inputs else ())   # seq2seq labels: the decoder's
    return {k: v[:, :seq].contiguous() if isinstance(v, torch.Tensor) and v.dim() >= 2 and k not in keep
            else v for k, v in inputs.items()}


def sp_config(mode: str, **extra) -> dict:
    """Pure sequence parallelism over the test's group (TP off)."""
    return {"enable_tensor_parallelism": False, "enable_sequence_parallelism": True,
            "sequence_parallelism_mode": mode, **extra}


def equals_unsharded(ctx, name: str, mode: str, seq: int | None = None, config=None, padded: bool = False,
                     overrides: dict | None = None, device=None) -> dict:
    """check_sharded (forward, loss, every gradient, outputs after a step)
    with the sequence split over ctx.group (TP off); the split attention ran
    once per layer per forward (counted).  padded: one batch row left-padded.
    overrides: of the zoo config (a variant of the family); its key
    "attn_implementation" is set on the built model's config instead.
    device: where it runs (check_sharded's)."""
    inputs = _trim(zoo.make_inputs(name), seq)
    if name == "T5ForSequenceClassification":
        inputs["input_ids"][:, -1] = 1                # the EOS whose decoder state is pooled, cut by _trim
    if padded:
        mask = torch.ones_like(inputs["input_ids"])
        mask[0, :2] = 0
        inputs["attention_mask"] = mask
    before = sa.CALLS[mode]
    report = parity.check_sharded(ctx, lambda: _build(name, overrides), inputs, name=name,
                                  config=sp_config(mode, **(config or {})), device=device)
    calls = sa.CALLS[mode] - before
    assert calls > 0, f"{name}: the {mode} attention never ran"
    report["split_calls"] = calls
    return report


def _build(name: str, overrides: dict | None):
    overrides = dict(overrides or {})
    implementation = overrides.pop("attn_implementation", None)
    model = zoo.build(name, **overrides)
    if implementation is not None:
        model.config._attn_implementation = implementation
    return model


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
    """Dropout 0.3 everywhere, model in eval(): equal to the unsharded eval
    model, through the split attention (counted)."""
    model = zoo.build_with_dropout(name, 0.3).eval()
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **sp_config(mode))).optimize(model)
    assert not model.training
    inputs = zoo.make_inputs(name)
    before = sa.CALLS[mode]
    with torch.no_grad():
        got, exp = model(**inputs).logits, ref(**inputs).logits
    assert sa.CALLS[mode] > before, f"{name}: the {mode} attention never ran"
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


def _kernel_reference(model):
    """(a copy of `model` whose attention is the C kernel, a context manager
    under which that copy runs): through transformers' registry
    (shardformer.attention.enable), or at the family's seam (enable_seam),
    where the kernel draws the attention dropout itself while the context is
    open (seam_kernel_reason's dropout refusal lifted: it keeps such calls on
    the model's own attention otherwise)."""
    from contextlib import contextmanager

    from shardformer import attention as sf_attention
    from shardformer.autopolicy import get_autopolicy

    ref = copy.deepcopy(model)
    seam = getattr(get_autopolicy(ref), "attention_seam", None)
    if seam is None:
        sf_attention.enable(ref)
    else:
        assert sf_attention.enable_seam(ref, seam), f"{type(ref).__name__}: no seam module took the kernel"

    @contextmanager
    def drawing():
        reason = sf_attention.seam_kernel_reason
        sf_attention.seam_kernel_reason = lambda module, tensors, dropout=0.0, weights=False: \
            reason(module, tensors, 0.0, weights)
        try:
            yield
        finally:
            sf_attention.seam_kernel_reason = reason

    return ref, drawing


def ring_dropout_matches_kernel(ctx, name: str, p_drop: float = 0.3, dropout_key: str = "attention_dropout",
                                overrides: dict | None = None) -> dict:
    """Training with attention dropout p_drop (config key `dropout_key`;
    `overrides` of the zoo config) under ring_attn: the logits,
    the loss and every gradient equal the unsharded model whose attention is
    the C kernel (_kernel_reference: the registry's, or the family's seam's),
    with the same dropout draws:
    the ring's blocks draw exactly what one kernel call over the whole
    sequence draws, for the seed that group rank 0 draws (inside a split
    layer torch's generator is the per-rank stream, so the reference kernel
    is handed the ring's seeds, in order; the 8 tokens are a multiple of 2p,
    so the padded sequence is the sequence).  The draws are in force: a
    second seed changes the logits."""
    from shardformer import attention as sf_attention
    from shardformer import ops
    from shardformer.layer import ring_attention as ra

    torch.manual_seed(0)
    model = zoo.build(name, **{dropout_key: p_drop, **(overrides or {})}).train()
    ref, drawing = _kernel_reference(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **sp_config("ring_attn"))).optimize(model)
    inputs = zoo.make_inputs(name)
    assert inputs["input_ids"].shape[1] % (2 * ctx.tp_size) == 0
    before, ring_before = sa.CALLS["ring_attn"], ra.CALLS["forward"]
    seeds, group_seed, kernel = [], ra._group_seed, ops.attention
    ra._group_seed = lambda *a: seeds.append(group_seed(*a)) or seeds[-1]
    try:
        torch.manual_seed(7)
        got = model(**inputs)
    finally:
        ra._group_seed = group_seed
    assert len(seeds) == model.config.num_hidden_layers, f"{name}: {len(seeds)} ring seeds drawn"
    queue = list(seeds)
    ops.attention = lambda *a, seed=None, **k: kernel(*a, seed=queue.pop(0) if seed is None else seed, **k)
    try:
        torch.manual_seed(7)
        kernel_before = sf_attention.CALLS["kernel"]
        with drawing():
            exp = ref(**inputs)
    finally:
        ops.attention = kernel
    assert not queue, f"{name}: the reference took {len(seeds) - len(queue)} of {len(seeds)} seeds"
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


def ring_other_mask_refused(ctx, name: str) -> str:
    """A 4-D attention mask of a pattern the ring does not apply (causal with
    one more key hidden) under ring_attn: NotImplementedError naming the
    model, the mode and all_to_all; the weights are as they were."""
    model = zoo.build(name)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **sp_config("ring_attn"))).optimize(model)
    inputs = zoo.make_inputs(name)
    B, n = inputs["input_ids"].shape
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    mask[n - 1, 1] = False
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        model(**inputs, attention_mask=mask.expand(B, 1, n, n))
    except NotImplementedError as e:
        message = str(e)
        for word in (name, "ring_attn", "attention mask pattern", "all_to_all"):
            assert word in message, message
    else:
        raise AssertionError(f"{name}: a 4-D mask of another pattern was not refused under ring_attn")
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


def recorded_outputs_refused(ctx, name: str, mode: str, inner: str = "eager") -> str:
    """output_attentions in a split forward raises where no weights exist
    (ring_attn; all_to_all over `inner` attention other than eager); under a
    KV cache (unsplit) recorded hidden states work.  (output_hidden_states
    in a split forward comes back full, and all_to_all's eager weights
    gathered: tests/checks/sequence_more.py.)"""
    model = zoo.build(name).eval()
    model.config._attn_implementation = inner
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **sp_config(mode))).optimize(model)
    inputs = zoo.make_inputs(name)
    message = ""
    for what in ("output_attentions",):
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
    return {"grad": parity.compare_grads(model, ref, name, tol)}    # frozen parameters (Whisper's positions): none


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


# ---- encoder-decoders and shared layers (T5, Whisper, ALBERT) -------------------

def _encoder_inputs(name: str) -> dict:
    """The encoder's inputs of an encoder-decoder's zoo inputs (for generate())."""
    return {k: v for k, v in zoo.make_inputs(name).items() if k in ("input_ids", "attention_mask", "input_features")}


def paths_ran(ctx, name: str, mode: str, seq: int | None = None) -> dict:
    """One no-grad forward of `name` split over ctx.group: every stack's
    attention took the split path once per layer application (ALBERT: its
    shared layer group num_hidden_layers times), every decoder cross-attention
    the cross path once per layer, T5's self-attention its slice of the
    whole-sequence position bias (all_to_all); each layer application saw
    S'/p rows of its stack's sequence."""
    model = zoo.build(name).eval()
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **sp_config(mode))).optimize(model)
    cfg = model.config
    rows: list = []
    stacks = [m for m in model.modules() if type(m).__name__ in ("T5Stack", "WhisperEncoder", "WhisperDecoder",
                                                                  "AlbertTransformer")]
    assert stacks, f"{name}: no stack found"
    for stack in stacks:
        layers = getattr(stack, "block", None) or getattr(stack, "layers", None) or stack.albert_layer_groups
        layers[0].register_forward_pre_hook(
            lambda m, a, k: rows.append(k.get("hidden_states", a[0] if a else None).shape[1]), with_kwargs=True)
    inputs = _trim(zoo.make_inputs(name), seq)
    before = dict(sa.CALLS)
    with torch.no_grad():
        model(**inputs)
    calls = {k: sa.CALLS[k] - before[k] for k in sa.CALLS}
    if type(model).__name__.startswith("Albert"):
        expected_self, expected_cross, applications = cfg.num_hidden_layers, 0, cfg.num_hidden_layers
    elif type(model).__name__.startswith("T5"):
        decoder = any(getattr(s, "is_decoder", False) for s in stacks)
        expected_self = cfg.num_layers + (cfg.num_decoder_layers if decoder else 0)
        expected_cross, applications = (cfg.num_decoder_layers if decoder else 0), len(stacks)
    else:
        decoder = any(type(s).__name__ == "WhisperDecoder" for s in stacks)
        expected_self = cfg.encoder_layers + (cfg.decoder_layers if decoder else 0)
        expected_cross, applications = (cfg.decoder_layers if decoder else 0), len(stacks)
    assert calls[mode] == expected_self, f"{name}: {calls[mode]} split {mode} calls, expected {expected_self}"
    assert calls["cross"] == expected_cross, f"{name}: {calls['cross']} cross calls, expected {expected_cross}"
    assert calls["unsplit"] == 0, f"{name}: {calls['unsplit']} unsplit attention calls in a split forward"
    if type(model).__name__.startswith("T5"):
        assert calls["bias"] == expected_self, f"{name}: the bias was sliced {calls['bias']} times"
    multiple = 2 * ctx.tp_size if mode == "ring_attn" else ctx.tp_size
    encoder = inputs["input_ids"].shape[1] if "input_ids" in inputs else cfg.max_source_positions
    lengths = [encoder] * applications
    if "decoder_input_ids" in inputs and applications == 2:          # the decoder stack runs second
        lengths[1] = inputs["decoder_input_ids"].shape[1]
    expected = [-(-n // multiple) * multiple // ctx.tp_size for n in lengths]
    assert rows == expected, f"{name}: the first layers saw {rows} rows, expected {expected} (S'/p per stack)"
    return {"calls": calls, "rows": rows}


def shared_layer_hooks_once(ctx, name: str, mode: str) -> dict:
    """ALBERT: two training steps; every parameter of the shared layer group
    carries one gradient hook (the all-reduce), not one per application or
    per forward, and its gradient equals the unsharded model's after both
    (check_sharded covers one step)."""
    torch.manual_seed(0)
    model = zoo.build(name).train()
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **sp_config(mode))).optimize(model)
    inputs = _trim(zoo.make_inputs(name), 7)
    for _ in range(2):
        model(**inputs).loss.backward()
        ref(**inputs).loss.backward()
    shared = model.albert.encoder.albert_layer_groups
    counts = {n: len(p._backward_hooks or {}) for n, p in shared.named_parameters()}
    assert counts and all(c == 1 for c in counts.values()), f"{name}: gradient hooks per parameter {counts}"
    worst = parity.compare_grads(model, ref, name, parity.TOL[torch.float32])
    return {"grad": worst, "hooked": len(counts)}


def seq2seq_generate_matches(ctx, name: str, mode: str) -> list:
    """Greedy generate() of an encoder-decoder: the encoder runs split, the
    decoder's cached steps unsplit; the tokens equal the unsharded model's."""
    model = zoo.build(name).eval()
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **sp_config(mode))).optimize(model)
    before = dict(sa.CALLS)
    got = parity.greedy_matches(model, ref, _encoder_inputs(name), name, 5)
    assert sa.CALLS["unsplit"] > before["unsplit"], "the decoder's cached steps did not run unsplit"
    assert sa.CALLS[mode] > before[mode], "the encoder did not run split in generate()"
    return got.tolist()


def refused_model_unchanged(ctx, name: str, mode: str, match: str, **overrides) -> str:
    """optimize() raises NotImplementedError naming the model class, the mode
    and `match`, and leaves the model as it was."""
    model = zoo.build(name, **overrides)
    call = lambda: ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group,  # noqa: E731
                                           **sp_config(mode))).optimize(model)
    impl = model.config._attn_implementation
    message = parity.refused_unchanged(model, call, f"{name} {mode}", error=NotImplementedError,
                                        structure=True)
    assert type(model).__name__ in message and match in message, message
    assert model.config._attn_implementation == impl, "the refusal switched the attention implementation"
    return message


def variant_equals_unsharded(ctx, name: str, mode: str, seq: int | None = None, overrides: dict | None = None) -> dict:
    """check_sharded of `name` built with config `overrides` (other layer
    counts and groups, Whisper's encoder length), inputs as the split_gather
    checks cut them (sequence_more.sp_inputs), the sequence split over
    ctx.group in `mode`; the split attention ran."""
    from checks import sequence_more

    before = sa.CALLS[mode]
    report = parity.check_sharded(ctx, lambda: zoo.build(name, **(overrides or {})),
                                  sequence_more.sp_inputs(name, seq, overrides), name=name, config=sp_config(mode))
    assert sa.CALLS[mode] > before, f"{name}: the {mode} attention never ran"
    return report


def checkpointing_equals_unsharded(ctx, name: str, mode: str, use_reentrant: bool) -> dict:
    """Gradient checkpointing on (the layers recomputed in backward, their
    hooks running again): forward, loss, every gradient and the step equal
    the unsharded model's."""
    def build():
        model = zoo.build(name)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        return model

    before = sa.CALLS[mode]
    report = parity.check_sharded(ctx, build, _trim(zoo.make_inputs(name), 7), name=name, config=sp_config(mode))
    assert sa.CALLS[mode] > before, f"{name}: the {mode} attention never ran"
    return report


def decoder_padding_equals_unsharded(ctx, name: str, mode: str, seq: int | None = 7) -> dict:
    """An encoder-decoder whose decoder batch row 1 ends in 2 padding tokens
    (decoder_attention_mask), beside the encoder's own padding: forward,
    loss, every gradient and the step equal the unsharded model's."""
    inputs = _trim(zoo.make_inputs(name), seq)
    mask = torch.ones_like(inputs["decoder_input_ids"])
    mask[1, -2:] = 0
    inputs["decoder_attention_mask"] = mask
    before = sa.CALLS[mode]
    report = parity.check_sharded(ctx, lambda: zoo.build(name), inputs, name=name, config=sp_config(mode))
    assert sa.CALLS[mode] > before, f"{name}: the {mode} attention never ran"
    return report
def refused_unchanged(ctx, name: str, mode: str, match: str, overrides: dict | None = None) -> str:
    """optimize() raises NotImplementedError naming the class, the mode and
    `match`, and the model is left as it was: its tensors, its modules'
    classes, no split state or replaced method on any module."""
    message = refused_unchanged_model(ctx, zoo.build(name, **(overrides or {})), name, mode)
    assert match in message, message
    return message


def refused_unchanged_model(ctx, model, name: str, mode: str) -> str:
    """optimize(model) under `mode` raises NotImplementedError naming the
    class and the mode, and leaves the model as it was (see refused_unchanged)."""
    classes = [type(m) for m in model.modules()]
    message = parity.refused_unchanged(
        model, lambda: ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group,
                                               **sp_config(mode))).optimize(model),
        f"{name} {mode}", error=NotImplementedError)
    assert name in message and mode in message, message
    assert [type(m) for m in model.modules()] == classes, f"{name}: modules replaced by a refused optimize()"
    touched = [n for n, m in model.named_modules()
               if "_shardformer_sequence_split" in m.__dict__ or "forward" in m.__dict__ or "_attn" in m.__dict__]
    assert not touched, f"{name}: a refused optimize() left the split on {touched}"
    return message


# the split layers of the models whose layers are not `transformer.h`
_DROPOUT_LAYERS = {"ChatGLMForConditionalGeneration": "transformer.encoder.layers"}


def training_dropout_masks(ctx, name: str, mode: str, p: float = 0.3) -> dict:
    """A training forward with every dropout at p, TP off (the zoo's layers
    under `transformer.h`, or _DROPOUT_LAYERS; every dropout a
    torch.nn.functional.dropout call; zoo.chatglm2's: its hidden_dropout):
    each dropout drawn inside the split layers (this rank's rows, or this
    rank's heads over the whole sequence) has a different mask on every
    rank, while those outside (the embedding dropout on the full sequence,
    which every rank computes) have the same one (where there are any); the
    gathered outputs agree, the loss is finite and backward runs."""
    import torch.nn.functional as F

    from checks.sequence import check_split_dropout_step

    if name.startswith("ChatGLM"):
        model = zoo.build(name, hidden_dropout=p).train()
    else:
        model = zoo.build_with_dropout(name, p).train()
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **sp_config(mode))).optimize(model)
    layers = model.get_submodule(_DROPOUT_LAYERS.get(name, "transformer.h"))
    inside, masks = [False], {"in": [], "out": []}
    layers[0].register_forward_pre_hook(lambda m, a: inside.__setitem__(0, True))
    layers[len(layers) - 1].register_forward_hook(lambda m, a, o: inside.__setitem__(0, False))
    original = F.dropout

    def recording(x, p=0.5, training=True, inplace=False):
        out = original(x, p, training, inplace)
        if training and p > 0:
            masks["in" if inside[0] else "out"].append(out == 0)
        return out

    before = sa.CALLS[mode]
    F.dropout = recording
    try:
        out = model(**zoo.make_inputs(name))
    finally:
        F.dropout = original
    assert sa.CALLS[mode] > before, f"{name}: the {mode} attention never ran"
    assert masks["in"], f"{name}: no dropout ran in the layers"
    for i, mask in enumerate(masks["out"]):
        every = [torch.empty_like(mask, dtype=torch.uint8) for _ in range(ctx.tp_size)]
        dist.all_gather(every, mask.to(torch.uint8).contiguous(), group=ctx.group)
        assert all(torch.equal(e, every[0]) for e in every), f"{name}: dropout {i} outside the layers differs"
    inner = {f"dropout {i} in the layers": m for i, m in enumerate(masks["in"])}
    return check_split_dropout_step(ctx, name, inner, out)


def other_implementation_refused(ctx, name: str, mode: str, seam_class: str) -> str:
    """A model whose attention modules are another implementation class than
    the seam's (simulated: each `seam_class` module's class renamed by a
    subclass, as transformers' flash-attention subclasses are) is refused
    by optimize(), naming the class and the mode, and left unchanged."""
    model = zoo.build(name)
    for m in model.modules():
        if type(m).__name__ == seam_class:
            m.__class__ = type(f"{seam_class}Flash", (type(m),), {})
    message = refused_unchanged_model(ctx, model, name, mode)
    assert seam_class in message and "attn_implementation" in message, message
    return message


def checkpointed_dropout_matches(ctx, name: str, mode: str, use_reentrant: bool = False) -> dict:
    """Training with dropout 0.3 under `mode`, with gradient checkpointing of
    the layers and without, from the same generator state: the same loss
    and every gradient the same (the recomputed layers drew the masks of the
    first forward), through the split attention (counted)."""
    def sharded(checkpointing: bool):
        model = zoo.build_with_dropout(name, 0.3).train()
        ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **sp_config(mode))).optimize(model)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        return model

    plain, checkpointed = sharded(False), sharded(True)
    inputs = zoo.make_inputs(name)
    losses = []
    before = sa.CALLS[mode]
    for model in (plain, checkpointed):
        torch.manual_seed(11)
        loss = model(**inputs).loss
        loss.backward()
        losses.append(loss.detach())
    # the split ran in both forwards and in the recomputation of every layer
    assert sa.CALLS[mode] - before >= 3 * len(plain.get_submodule("transformer.h")), "no recomputation counted"
    tol = parity.TOL[torch.float32]
    parity.assert_close(f"{name} loss with checkpointing", losses[1], losses[0], tol)
    grads = dict(plain.named_parameters())
    worst = 0.0
    for key, prm in checkpointed.named_parameters():
        worst = max(worst, parity.assert_close(f"{name} grad {key} with checkpointing", prm.grad, grads[key].grad, tol))
    return {"loss": float(losses[0]), "grad": worst}


def no_dropout_keeps_generator(ctx, name: str, mode: str) -> dict:
    """A split training forward and backward of a model without dropout
    draws nothing from torch's global generator (as the unsharded model
    does not), through the split attention (counted)."""
    model = zoo.build(name).train()
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **sp_config(mode))).optimize(model)
    inputs = zoo.make_inputs(name)
    before, calls = torch.get_rng_state(), sa.CALLS[mode]
    model(**inputs).loss.backward()
    assert sa.CALLS[mode] > calls, f"{name}: the {mode} attention never ran"
    assert torch.equal(torch.get_rng_state(), before), f"{name}: a training forward without dropout drew"
    return {"calls": sa.CALLS[mode] - calls}


def alibi_ring_bias_ran(ctx, name: str, overrides: dict | None = None, seq: int = 7) -> dict:
    """ALiBi under ring_attn: equal to the unsharded model (equals_unsharded),
    each split attention call adding the bias in the ring (counted), and the
    bias in force: the unsharded model without it (slopes zeroed) gives other
    logits."""
    before_bias, before_ring = sa.CALLS["bias"], sa.CALLS["ring_attn"]
    report = equals_unsharded(ctx, name, "ring_attn", seq, None, False, overrides)
    ring, bias = sa.CALLS["ring_attn"] - before_ring, sa.CALLS["bias"] - before_bias
    assert ring > 0 and bias == ring, f"{name}: {bias} ring calls with the ALiBi bias of {ring}"
    model = _build(name, overrides).eval()
    inputs = _trim(zoo.make_inputs(name), seq)
    base = model.transformer if hasattr(model, "transformer") else model
    with torch.no_grad():
        with_alibi = model(**inputs).logits
        build = type(base).build_alibi_tensor if hasattr(type(base), "build_alibi_tensor") else None
        module = __import__(type(base).__module__, fromlist=["build_alibi_tensor"])
        if build is not None:       # BLOOM: a method of the model
            base.build_alibi_tensor = lambda *a, **k: torch.zeros_like(build(base, *a, **k))
            without = model(**inputs).logits
            del base.build_alibi_tensor
        else:                       # Falcon: a module-level function
            own = module.build_alibi_tensor
            module.build_alibi_tensor = lambda *a, **k: torch.zeros_like(own(*a, **k))
            try:
                without = model(**inputs).logits
            finally:
                module.build_alibi_tensor = own
    change = float((with_alibi - without).abs().max())
    assert change > 100 * parity.TOL[torch.float32][1], f"{name}: ALiBi changes the logits by {change} only"
    report["bias_calls"] = bias
    return report


def seam_generate_with_kernel(ctx, name: str, mode: str) -> list:
    """`mode` with every optimization on, at a seam: greedy generate() (each
    step unsplit, at the seam's C kernel: counted) equals the unsharded
    model's, and a training-shaped forward is split (counted)."""
    from checks.optimizations import counting_kernels

    model = zoo.build(name).eval()
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group,
                            **sp_config(mode, enable_all_optimization=True))).optimize(model)
    before = sa.CALLS["unsplit"]
    with counting_kernels(("attention",)) as calls:
        got = parity.greedy_matches(model, ref, {"input_ids": parity.prompt_ids()}, name, 5)
    unsplit = sa.CALLS["unsplit"] - before
    assert unsplit > 0 and calls["attention"] >= unsplit, f"{name}: {calls} kernel calls for {unsplit} unsplit"
    split = sa.CALLS[mode]
    with torch.no_grad():
        model(input_ids=parity.prompt_ids())
    assert sa.CALLS[mode] > split, "a plain forward after generate() was not split"
    return got.tolist()
