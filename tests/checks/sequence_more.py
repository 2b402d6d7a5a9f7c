"""Rank-side checks of split-gather sequence parallelism for T5, Whisper and
ALBERT (tests/test_sequence_parallel_more.py); the shared helpers are
tests/checks/sequence.py's."""
from __future__ import annotations

import copy

import torch

import zoo
from checks import parity, sequence
from checks.sequence import SP, _recorder, _with_dropout
from shardformer import ShardConfig, ShardFormer

# the inputs that run along the (encoder) sequence: trimmed to the odd lengths
_SEQ_KEYS = ("input_ids", "attention_mask", "token_type_ids")


def _audio_features(positions: int, mel_bins: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, mel_bins, 2 * positions, generator=g)


def sp_inputs(name: str, seq: int | None = None, overrides: dict | None = None) -> dict:
    """zoo.make_inputs(name) with the encoder sequence cut to `seq` tokens
    (T5, ALBERT: the last dimension of input_ids / attention_mask; T5's
    sequence classification keeps its EOS last) or, for Whisper, input
    features of overrides["max_source_positions"] positions."""
    inputs = zoo.make_inputs(name)
    overrides = overrides or {}
    if "input_features" in inputs and "max_source_positions" in overrides:
        mel = inputs["input_features"].shape[1]
        inputs["input_features"] = _audio_features(overrides["max_source_positions"], mel,
                                                   inputs["input_features"].shape[0])
    if seq is not None:
        # per-token labels (token classification, masked LM) run along the sequence too
        if "labels" in inputs and "input_ids" in inputs and inputs["labels"].shape == inputs["input_ids"].shape:
            inputs["labels"] = inputs["labels"][..., :seq].contiguous()
        for key in _SEQ_KEYS:
            if key in inputs:
                inputs[key] = inputs[key][..., :seq].contiguous()
        if name == "T5ForSequenceClassification":
            inputs["input_ids"][..., -1] = 1          # the EOS whose decoder state is pooled
    return inputs


def sp_equals_unsharded(ctx, name: str, seq: int | None = None, overrides: dict | None = None,
                        config: dict | None = None, dtype_name: str = "float32") -> dict:
    """parity.check_sharded with split-gather SP: forward, loss, every
    gradient and the outputs after a step equal the unsharded model's
    (bfloat16: the forward)."""
    dtype = getattr(torch, dtype_name)
    inputs = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in sp_inputs(name, seq, overrides).items()}
    return parity.check_sharded(ctx, lambda: zoo.build(name, dtype=dtype, **(overrides or {})), inputs, name=name,
                                dtype=dtype, config={**SP, **(config or {})})


def _shard(ctx, model, **config):
    return ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **SP, **config)).optimize(model)[0]


def sp_eval_with_dropout(ctx, name: str, p: float = 0.3) -> dict:
    """eval() with every dropout probability p > 0 equals the unsharded model."""
    model = _with_dropout(name, p).eval()
    ref = copy.deepcopy(model)
    _shard(ctx, model)
    assert not model.training
    return parity.compare_sharded(model, ref, zoo.make_inputs(name), f"{name} (eval, dropout {p})")


def sp_generate_matches(ctx, name: str, new_tokens: int = 5) -> list:
    """Greedy generate() with split-gather SP equals the unsharded model's
    (T5: an encoder prompt of 5 tokens; Whisper: the zoo's input features;
    the decoder's one-token steps: one rank holds the token, the others
    padding)."""
    model = zoo.build(name).eval()
    ref = copy.deepcopy(model)
    _shard(ctx, model)
    inputs = zoo.make_inputs(name)
    if "input_features" in inputs:
        prompt = {"input_features": inputs["input_features"]}
    else:
        prompt = {"input_ids": inputs["input_ids"][:, :5]}
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got, exp = model.generate(**prompt, **kwargs), ref.generate(**prompt, **kwargs)
    got, exp = getattr(got, "sequences", got), getattr(exp, "sequences", exp)
    assert torch.equal(got, exp), f"{name}: generate() differs:\n{got}\n{exp}"
    return got.tolist()


def sp_hidden_states_refused(ctx, name: str) -> str:
    """output_hidden_states=True raises NotImplementedError naming the model."""
    model = zoo.build(name).eval()
    _shard(ctx, model)
    inputs = zoo.make_inputs(name)
    try:
        with torch.no_grad():
            model(**inputs, output_hidden_states=True)
    except NotImplementedError as e:
        assert "output_hidden_states" in str(e) and type(model).__name__ in str(e), str(e)
        message = str(e)
    else:
        raise AssertionError(f"{name}: output_hidden_states=True was not refused")
    with torch.no_grad():
        model(**inputs)
    return message


def _stacks(model) -> list[list]:
    """The layer lists whose first layer splits and last gathers: T5's
    encoder / decoder blocks, Whisper's encoder / decoder layers, ALBERT's
    shared AlbertLayer modules (every call of them sees rows)."""
    out = []
    for module in model.modules():
        cls = type(module).__name__
        if cls == "T5Stack":
            out.append(list(module.block))
        elif cls in ("WhisperEncoder", "WhisperDecoder"):
            out.append(list(module.layers))
    return out


def sp_activations_are_split(ctx, name: str, seq: int | None = None, overrides: dict | None = None) -> dict:
    """Between the blocks each rank holds only its rows: every layer but the
    first of each stack (T5, Whisper: encoder and decoder) and every call of
    ALBERT's shared layers gets ceil(S / tp) rows; the stacks' outputs are
    the full sequence."""
    model = zoo.build(name, **(overrides or {}))
    _shard(ctx, model)
    inputs = sp_inputs(name, seq, overrides)
    seen: dict[str, list] = {}

    def record(tag):
        def pre(_m, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            seen.setdefault(tag, []).append(x.shape[1])
        return pre

    stacks = _stacks(model)
    for i, layers in enumerate(stacks):
        for layer in layers[1:]:
            layer.register_forward_pre_hook(record(f"stack{i}"), with_kwargs=True)
    albert = [m for m in model.modules() if type(m).__name__ == "AlbertLayer"]
    for layer in albert:
        layer.register_forward_pre_hook(record("albert"), with_kwargs=True)
    full: dict[str, list] = {}
    for module in model.modules():
        if type(module).__name__ in ("T5Stack", "WhisperEncoder", "WhisperDecoder", "AlbertTransformer"):
            module.register_forward_hook(
                lambda m, a, out: full.setdefault(type(m).__name__, []).append(out[0].shape[1]))
    with torch.no_grad():
        model(**inputs)
    assert seen, f"{name}: no layer after the first ran"
    expected = {}
    lengths = _lengths(model, inputs)
    for tag, rows in seen.items():
        length = lengths[tag]
        want = -(-length // ctx.tp_size)
        assert all(r == want for r in rows), f"{name} {tag}: layer inputs of {rows} rows, expected {want} of {length}"
        expected[tag] = (length, want)
    if "albert" in seen:
        assert len(seen["albert"]) == model.config.num_hidden_layers * model.config.inner_group_num, seen
    for cls, rows in full.items():
        assert all(r in {v[0] for v in expected.values()} for r in rows), f"{name}: {cls} returned {rows} rows"
    return expected


def _lengths(model, inputs) -> dict:
    """{tag: the full sequence length} of the stacks of sp_activations_are_split."""
    cfg = model.config
    out = {}
    if "input_features" in inputs:
        out["stack0"] = inputs["input_features"].shape[-1] // 2
        if "decoder_input_ids" in inputs:
            out["stack1"] = inputs["decoder_input_ids"].shape[-1]
        return out
    enc = inputs["input_ids"].shape[-1]
    out["stack0"] = out["albert"] = enc
    if getattr(cfg, "is_encoder_decoder", False):
        dec = inputs.get("decoder_input_ids")
        out["stack1"] = dec.shape[-1] if dec is not None else enc     # T5 classification: shifted input_ids
    return out


def t5_position_bias_full_length(ctx, name: str, seq: int) -> dict:
    """T5's relative position bias, built in block 0 of each stack and passed
    on, covers the full sequence (the attention sees the gathered rows):
    every later block receives [1, local heads, S, S] (the decoder's
    cross-attention bias [1, local heads, S_dec, S_enc]), equal to the
    unsharded model's bias for this rank's heads."""
    from shardformer.checkpoint import _shard_info
    from shardformer.layer.parallel_module import shard_of

    model = zoo.build(name).eval()
    ref = copy.deepcopy(model)
    _shard(ctx, model)
    inputs = sp_inputs(name, seq)

    def capture(m):
        got = {}
        for i, stack in enumerate(_stacks(m)):
            def pre(_m, args, kwargs, i=i):
                got[f"self{i}"] = args[2] if len(args) > 2 else kwargs.get("position_bias")
                cross = args[5] if len(args) > 5 else kwargs.get("encoder_decoder_position_bias")
                if cross is not None:
                    got[f"cross{i}"] = cross
            stack[-1].register_forward_pre_hook(pre, with_kwargs=True)
        return got

    got, exp = capture(model), capture(ref)
    with torch.no_grad():
        model(**inputs)
        ref(**inputs)
    info = _shard_info(model)
    table = next(m.relative_attention_bias.weight for m in model.modules()
                 if type(m).__name__ == "T5Attention" and getattr(m, "has_relative_attention_bias", False))
    _, shard, _ = info[id(table)]
    assert got.keys() == exp.keys() and got, (sorted(got), sorted(exp))
    shapes = {}
    for key in exp:
        want = shard_of(exp[key], 1, shard)
        parity.assert_close(f"{name} position bias {key}", got[key], want, parity.TOL[torch.float32])
        shapes[key] = tuple(got[key].shape)
    return shapes


def sp_refused_by_config(ctx, name: str, overrides: dict, what: str) -> str:
    """optimize() with split-gather SP raises NotImplementedError naming the
    model, the mode and the setting, and leaves the model unchanged."""
    model = zoo.build(name, **overrides)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        _shard(ctx, model)
    except NotImplementedError as e:
        message = str(e)
    else:
        raise AssertionError(f"{name} with {overrides}: split_gather was not refused")
    assert type(model).__name__ in message and "split_gather" in message and what in message, message
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), \
        "the refused optimize() changed weights"
    return message


def sp_checkpointing_matches(ctx, name: str, use_reentrant: bool, p: float = 0.2) -> dict:
    """Gradient checkpointing with SP and live dropout gives the gradients of
    the same sharded model without it (the recomputed blocks split, gather
    and reduce-scatter again, with their own stack's length)."""
    from checks.runtime_state import checkpointed_grads_match

    model = _with_dropout(name, p)
    inputs = zoo.make_inputs(name)
    _shard(ctx, model)
    return {"worst": checkpointed_grads_match(model, inputs, name, use_reentrant)}


def sp_regathers_in_backward(ctx, name: str) -> dict:
    """Each block keeps only its rows of the gathered input for backward and
    all-gathers them once when backward needs them, none in no_grad
    forwards: per layer 2 (T5 / Whisper encoder: attention, feed-forward),
    3 in the decoders (with the cross attention), 2 per repetition of
    ALBERT's shared layer."""
    model = zoo.build(name)
    _shard(ctx, model)
    got = sequence.backward_regathers(model, zoo.make_inputs(name))
    expected = 0
    for module in model.modules():
        cls = type(module).__name__
        if cls == "T5Stack":
            expected += len(module.block) * (3 if module.is_decoder else 2)
        elif cls == "WhisperEncoder":
            expected += 2 * len(module.layers)
        elif cls == "WhisperDecoder":
            expected += 3 * len(module.layers)
        elif cls == "AlbertTransformer":
            expected += 2 * model.config.num_hidden_layers * model.config.inner_group_num
    assert got == expected, f"{name}: {got} re-gathers in backward, expected {expected}"
    return {"regathers": got}


def sp_overlap_refused(ctx, name: str, reason: str) -> str:
    """enable_sequence_overlap where the policy does not implement it: refused
    naming the model class, the policy and its reason (`reason`, a fragment of
    the policy's sequence_overlap_refusal), before anything changes."""
    from shardformer.autopolicy import get_autopolicy

    message = sp_mode_refused_unchanged(ctx, name, "split_gather", True)
    policy = type(get_autopolicy(zoo.build(name))).__name__
    assert policy in message and reason in message, (policy, reason, message)
    return message


def sp_dropout_masks_differ(ctx, name: str, p: float = 0.5) -> dict:
    """Training with dropout: the residual dropouts on this rank's rows (T5's
    layer.*.dropout, Whisper's out_proj / fc2 output_dropout, ALBERT's
    attention.output_dropout) draw a different mask on every rank; the
    gathered outputs are the same on every rank; the loss is finite and
    backward runs.  (T5's DenseReluDense.dropout and Whisper's fc2
    input_dropout act on this rank's features of the gathered rows: a mask
    per rank as under TP, of a size that may differ per rank.)"""

    from shardformer.layer import DropoutForParallelInput

    model = _with_dropout(name, p).train()
    _shard(ctx, model)
    masks = {}
    for mname, module in model.named_modules():
        if isinstance(module, DropoutForParallelInput) and not mname.endswith(("DenseReluDense.dropout",
                                                                               "input_dropout")):
            module.register_forward_hook(_recorder(masks, mname))
    return sequence.check_split_dropout_step(ctx, name, masks, model(**zoo.make_inputs(name)))


def sp_overlap_equals_unsharded(ctx, name: str, overrides: dict | None = None, seq: int | None = None) -> dict:
    """enable_sequence_overlap (Whisper's fc1, ALBERT's ffn gather their rows
    themselves; T5's attention and feed-forward blocks gather once for their
    column layers): the guarantees of sp_equals_unsharded, and on the
    shared-memory backend every call of a gathering layer or block (ALBERT's
    shared ffn: once per repetition) ran its collectives in flight, forward
    and backward."""
    from shardformer.distributed import backend_for
    from shardformer.layer import Linear1D_Col
    from shardformer.layer.linear import GatherRowsLinear

    torch.manual_seed(0)
    model = zoo.build(name, **(overrides or {})).train()
    ref = copy.deepcopy(model)
    _shard(ctx, model, enable_sequence_overlap=True)
    calls = []
    # the gathering layers (Whisper's fc1, ALBERT's ffn) and the overlapped blocks (T5's regions) of every call
    units = [m for m in model.modules() if isinstance(m, Linear1D_Col) and getattr(m, "overlap", False)]
    units += [m for m in model.modules()
              if type(m).__name__ in ("T5Attention", "T5DenseActDense", "T5DenseGatedActDense")]
    for m in units:
        m.register_forward_hook(lambda *a: calls.append(1))
    assert units, f"{name}: no column layer gathers its input with overlap"
    before = GatherRowsLinear.overlapped
    report = parity.compare_sharded(model, ref, sp_inputs(name, seq, overrides), f"{name} (overlap)")
    ran = GatherRowsLinear.overlapped - before
    backend = backend_for(torch.empty(1), ctx.group)
    per_forward = len(calls) // 2              # two forwards (before and after the step), one backward
    if backend == "shm":
        assert ran == 3 * per_forward, f"{name}: {ran} overlapped passes, expected {3 * per_forward}"
    return {**report, "overlapped": ran, "backend": backend}


def sp_moe_aux_loss_after_a_forward(ctx, name: str = "MixtralForCausalLM") -> dict:
    """The load-balancing loss with SP on a model that ran before sharding
    (HF's output recorders already hooked on the routers): the router's
    logits hook runs first, so the recorded logits pass back 1/p of their
    gradient and every gradient equals the unsharded model's."""
    overrides = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
    torch.manual_seed(0)
    model = zoo.build(name, **overrides).train()
    inputs = sp_inputs(name, 7)
    with torch.no_grad():
        model(**inputs)
    ref = copy.deepcopy(model)
    _shard(ctx, model)
    return parity.compare_sharded(model, ref, inputs, f"{name} (aux loss, recorders hooked first)")


# ---- BEiT, Swin, Swinv2: split-gather over the patch tokens ----

def vision_inputs(name: str, image: int, seed: int = 1) -> dict:
    """zoo.make_inputs(name) for `image` x `image` pixels (the zoo's are 32):
    pixel values, and the labels / masked patches of the head, sized for the
    (image / patch)^2 patches."""
    from zoo import vision

    _, _, cfg, kind = vision.MODELS[name]
    g = torch.Generator().manual_seed(seed)
    x = {"pixel_values": torch.randn(vision.BATCH, vision.CHANNELS, image, image, generator=g)}
    patches = (image // cfg["patch_size"]) ** 2
    if kind == "image_cls":
        x["labels"] = torch.randint(0, cfg["num_labels"], (vision.BATCH,), generator=g)
    elif kind in ("mim", "beit_mim"):
        x["bool_masked_pos"] = torch.rand(vision.BATCH, patches, generator=g) < 0.5
        if kind == "beit_mim":
            x["labels"] = torch.randint(0, cfg["vocab_size"], (int(x["bool_masked_pos"].sum()),), generator=g)
    return x


def _count_rows(model, kinds: tuple[str, ...]) -> list:
    """Forward pre-hooks on the modules of classes `kinds` recording the rows
    (dim 1) of their first input; returns the list they fill."""
    seen: list = []
    for module in model.modules():
        if type(module).__name__ in kinds:
            module.register_forward_pre_hook(
                lambda m, a, k: seen.append((type(m).__name__, (a[0] if a else k["hidden_states"]).shape[1])),
                with_kwargs=True)
    return seen


def sp_vision_equals_unsharded(ctx, name: str, image: int | None = None, overrides: dict | None = None,
                               extra: dict | None = None, overlap: bool = False) -> dict:
    """check_sharded with split-gather SP for a vision model at `image` pixels
    (config image_size too), `extra` call kwargs (interpolate_pos_encoding):
    forward, loss, every gradient and after a step equal the unsharded
    model.  Then, no_grad, proves the split ran: every block (BEiT's layers,
    Swin's blocks of every stage) got ceil(S / tp) rows, S its stage's token
    count; Swinv2 (whole blocks): every block but a stage's last returned
    ceil(S / tp) rows, the last the full S.  `overlap`: with
    enable_sequence_overlap; report["overlapped"] counts the overlapped
    passes of check_sharded (two forwards, one backward) on the shared-memory
    backend, report["unused"] the projections computed and not asked for."""
    from shardformer.distributed import backend_for
    from shardformer.layer.linear import GatherRowsLinear

    overrides = dict(overrides or {})
    if image is not None:
        overrides.setdefault("image_size", image)
    inputs = vision_inputs(name, image) if image is not None else zoo.make_inputs(name)
    inputs.update(extra or {})
    # Swinv2Model's float32 rounding floor (zoo.vision.FP64_FLOOR): judged against float64 as its TP test is
    fp64 = name in getattr(zoo.module_of(name), "FP64_FLOOR", ())
    config = {**SP, "enable_sequence_overlap": True} if overlap else dict(SP)
    before, unused = GatherRowsLinear.overlapped, GatherRowsLinear.unused
    report = parity.check_sharded(ctx, lambda: zoo.build(name, **overrides), inputs, name=name,
                                  config=config, fp64_floor=fp64)
    if overlap:
        report.update(overlapped=GatherRowsLinear.overlapped - before, unused=GatherRowsLinear.unused - unused,
                      backend=backend_for(torch.empty(1), ctx.group))
    model = zoo.build(name, **overrides)
    if overlap and ctx.tp_size == ctx.world_size:     # the plain ShardConfig(): the default group, the world
        torch.manual_seed(0)
        model = zoo.build(name, **overrides).train()
        ref = copy.deepcopy(model)
        ShardFormer(ShardConfig(enable_sequence_overlap=True, **SP)).optimize(model)
        ref64 = copy.deepcopy(ref).double() if fp64 else None
        parity.compare_sharded(model, ref, inputs, f"{name} (overlap, default group)", ref64=ref64,
                               inputs64=parity._double(inputs) if fp64 else None)
    else:
        _shard(ctx, model, **({"enable_sequence_overlap": True} if overlap else {}))
    if "Swinv2" in name:
        return {**report, **_swinv2_rows(ctx, model, inputs)}
    seen = _count_rows(model, ("BeitLayer", "SwinLayer"))
    with torch.no_grad():
        model(**inputs)
    side = inputs["pixel_values"].shape[-1] // model.config.patch_size
    if "Beit" in name:
        full = [side * side + 1] * model.config.num_hidden_layers
    else:
        full = []
        for depth in model.config.depths:
            full += [side * side] * depth
            side = (side + 1) // 2
    # hooks registered after the split's: a stage's first block is seen split too
    expected = [-(-s // ctx.tp_size) for s in full]
    got = [rows for _, rows in seen]
    assert got == expected, f"{name}: blocks got {got} rows, expected {expected} (tokens {full}, tp {ctx.tp_size})"
    return {**report, "rows": got, "tokens": full}


def _swinv2_rows(ctx, model, inputs: dict) -> dict:
    """The rows (dim 1) each Swinv2Layer returned in a no_grad forward of
    the sharded `model`: ceil(S / tp) for every block but a stage's last
    (the activations kept between blocks are this rank's rows), S for the
    last (patch merging reads the full map)."""
    seen: list = []
    for module in model.modules():
        if type(module).__name__ == "Swinv2Layer":
            module.register_forward_hook(lambda m, a, out: seen.append(out[0].shape[1]))
    with torch.no_grad():
        model(**inputs)
    side = inputs["pixel_values"].shape[-1] // model.config.patch_size
    full, expected = [], []
    for depth in model.config.depths:
        full += [side * side] * depth
        expected += [-(-side * side // ctx.tp_size)] * (depth - 1) + [side * side]
        side = (side + 1) // 2
    assert seen == expected, f"Swinv2: blocks returned {seen} rows, expected {expected} (tokens {full})"
    return {"rows": seen, "tokens": full}


def sp_mode_refused_unchanged(ctx, name: str, mode: str, overlap: bool = False) -> str:
    """optimize() with sequence parallelism `mode` (or enable_sequence_overlap)
    raises NotImplementedError naming the model, the mode (or the switch) and
    a module path, before any parameter or module of the model changes."""
    model = zoo.build(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = [type(m) for m in model.modules()]
    config = {"sequence_parallelism_mode": mode, **({"enable_sequence_overlap": True} if overlap else {})}
    if mode != "split_gather":           # the sequence over the whole group, no TP
        config["enable_tensor_parallelism"] = False
    try:
        _shard(ctx, model, **config)
    except NotImplementedError as e:
        message = str(e)
    else:
        raise AssertionError(f"{name}: {config} was not refused")
    assert type(model).__name__ in message, message
    assert ("enable_sequence_overlap" if overlap else mode) in message, message
    assert overlap or ".layers." in message, message
    assert [type(m) for m in model.modules()] == kinds, f"{name}: the refused optimize() replaced modules"
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), \
        f"{name}: the refused optimize() changed weights"
    return message


# ---- output_hidden_states=True under every sequence-parallel mode ----

def _hidden_states_config(ctx, mode: str) -> ShardConfig:
    """split_gather over the TP group; all_to_all / ring_attn over the group, TP off."""
    from checks.sequence_attention import sp_config

    if mode == "split_gather":
        return ShardConfig(tensor_parallel_process_group=ctx.group, **SP)
    return ShardConfig(tensor_parallel_process_group=ctx.group, **sp_config(mode))


def _projected(states, what: str, probe: dict) -> torch.Tensor:
    """sum_i <P_i, h_i>: a fixed random projection of every recorded state."""
    total = 0.0
    for i, h in enumerate(states):
        key = f"{what}{i}"
        if key not in probe:
            probe[key] = torch.randn(h.shape, generator=torch.Generator().manual_seed(99 + i))
        total = total + (h * probe[key]).sum()
    return total


def _real_rows(tensors: tuple, real) -> tuple:
    """The rows [B, S, ...] at the real (not padding) positions, or the
    tensors as they are (real None).  What a padding query attends to when
    every key it may see is masked is each attention implementation's own
    convention (uniform in eager, 0 in the ring kernel) and reaches nothing
    real: checks.sequence_attention.padded_batch_real_rows."""
    return tensors if real is None else tuple(t[real] for t in tensors)


def _recorded_states(out, return_dict: bool) -> dict:
    """{field: tuple of recorded states}: every *hidden_states field of a
    ModelOutput (T5 and Whisper: the encoder's and the decoder's), or the
    tuples of tensors of a tuple output."""
    if return_dict:
        return {k: v for k, v in out.items() if k.endswith("hidden_states") and isinstance(v, tuple)}
    # by order among them: a split forward returns no cache, so the tuples' positions may differ
    tuples = [v for v in out if isinstance(v, tuple) and v and all(isinstance(t, torch.Tensor) for t in v)]
    return {f"tuple{i}": v for i, v in enumerate(tuples)}


def recorded_hidden_states_equal(ctx, name: str, mode: str, seq: int | None = None,
                                 return_dict: bool = True, overrides: dict | None = None,
                                 padded: bool = False, overlap: bool = False) -> dict:
    """output_hidden_states=True under sequence parallelism `mode`: every
    recorded hidden state is the full-sequence tensor of the unsharded model
    (same fields, count, shapes, values; padding trimmed, ring_attn's zigzag
    undone), the model's outputs and loss too, and differentiating through
    all of them (a random projection of each state added to the loss) gives
    every gradient of the unsharded model.  Proves the recorded rows were
    gathered (shardformer.layer.sequence.RECORDED_GATHERS: all but at most
    the first and last of each field's states, which some models record
    full; Swin: none, its stages' outputs are full) and, for all_to_all /
    ring_attn, that the split attention ran."""
    from shardformer.layer import sequence as seq_mod
    from shardformer.layer import sequence_attention as sa

    inputs = sp_inputs(name, seq, overrides)
    real = None
    if padded:       # the first row's first two tokens are padding; no label is predicted from them
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        inputs["attention_mask"][0, :2] = 0
        inputs["labels"][0, :3] = -100
        real = inputs["attention_mask"].bool()
    torch.manual_seed(0)
    model = zoo.build(name, **(overrides or {})).train()
    ref = copy.deepcopy(model)
    config = _hidden_states_config(ctx, mode)
    if overlap:
        config = ShardConfig(tensor_parallel_process_group=ctx.group, enable_sequence_overlap=True, **SP)
    ShardFormer(config).optimize(model)
    gathers, calls = seq_mod.RECORDED_GATHERS["count"], dict(sa.CALLS)
    out = model(**inputs, output_hidden_states=True, return_dict=return_dict)
    exp = ref(**inputs, output_hidden_states=True, return_dict=return_dict)
    tol = parity.TOL[torch.float32]
    got_fields, exp_fields = _recorded_states(out, return_dict), _recorded_states(exp, return_dict)
    assert exp_fields and sorted(got_fields) == sorted(exp_fields), f"{name}: fields {sorted(got_fields)}"
    got_states, exp_states = [], []
    for field in sorted(exp_fields):
        got, want = got_fields[field], exp_fields[field]
        assert len(got) == len(want), f"{name}: {len(got)} {field}, expected {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.shape == b.shape, \
                f"{name} ({mode}): {field}[{i}] of shape {tuple(a.shape)}, expected {tuple(b.shape)}"
            parity.assert_close(f"{name} ({mode}) {field}[{i}]", *_real_rows((a, b), real), tol)
        got_states += [_real_rows((h,), real)[0] for h in got]
        exp_states += [_real_rows((h,), real)[0] for h in want]
    gathered = seq_mod.RECORDED_GATHERS["count"] - gathers
    if name.startswith("Swin"):          # recorded at the stages' outputs, which are gathered: nothing to mark
        assert gathered == 0, f"{name}: {gathered} recorded states gathered, expected none (full stage outputs)"
    else:
        least = max(len(exp_states) - 2 * len(exp_fields), 1)
        assert gathered >= least, f"{name} ({mode}): {gathered} recorded states gathered, expected >= {least}"
    if mode != "split_gather":
        assert sa.CALLS[mode] > calls[mode], f"{name}: the {mode} attention never ran"
    probe: dict = {}
    if return_dict and real is None:
        parity.check_outputs(f"{name} ({mode})", out, exp, tol)
    elif return_dict:
        parity.assert_close(f"{name} ({mode}) logits at real positions", *_real_rows((out.logits, exp.logits), real),
                            tol)
    loss = parity.loss_of(out, probe) + _projected(got_states, "h", probe)
    ref_loss = parity.loss_of(exp, probe) + _projected(exp_states, "h", probe)
    parity.assert_close(f"{name} ({mode}) loss", loss, ref_loss, tol)
    loss.backward()
    ref_loss.backward()
    worst = parity.compare_grads(model, ref, f"{name} ({mode})", tol)
    return {"states": len(got_states), "gathered": gathered, "grad": worst}


def recorded_attentions_equal(ctx, name: str, seq: int | None = None) -> dict:
    """output_attentions=True under all_to_all (eager attention, TP off): every
    layer's weights are the unsharded model's [B, H, S, S] (gathered over the
    heads, padded rows / keys and appended heads dropped), and
    differentiating through them (a random projection of each added to the
    loss) gives every gradient of the unsharded model; the split attention ran."""
    from shardformer.layer import sequence_attention as sa

    inputs = sp_inputs(name, seq)
    torch.manual_seed(0)
    model = zoo.build(name).train()
    ref = copy.deepcopy(model)
    ShardFormer(_hidden_states_config(ctx, "all_to_all")).optimize(model)
    calls = sa.CALLS["all_to_all"]
    out = model(**inputs, output_attentions=True)
    exp = ref(**inputs, output_attentions=True)
    assert sa.CALLS["all_to_all"] > calls, f"{name}: the all_to_all attention never ran"
    tol = parity.TOL[torch.float32]
    got, want = out.attentions, exp.attentions
    assert want and len(got) == len(want), f"{name}: {len(got)} attention weights, expected {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, f"{name}: attentions[{i}] of shape {tuple(a.shape)}, expected {tuple(b.shape)}"
        parity.assert_close(f"{name} attentions[{i}]", a, b, tol)
    probe: dict = {}
    loss = parity.loss_of(out, probe) + _projected(got, "a", probe)
    ref_loss = parity.loss_of(exp, probe) + _projected(want, "a", probe)
    loss.backward()
    ref_loss.backward()
    return {"layers": len(got), "grad": parity.compare_grads(model, ref, f"{name} (attentions)", tol)}


def generate_hidden_states_equal(ctx, name: str, new_tokens: int = 4) -> dict:
    """Greedy generate(output_hidden_states=True, return_dict_in_generate=True)
    under split_gather equals the unsharded model: the tokens, and every
    step's recorded states (the prompt's, then one token per step: one rank
    holds it, the others padding)."""
    model = zoo.build(name).eval()
    ref = copy.deepcopy(model)
    _shard(ctx, model)
    prompt = {"input_ids": parity.prompt_ids()}
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, output_hidden_states=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        got, exp = model.generate(**prompt, **kwargs), ref.generate(**prompt, **kwargs)
    assert torch.equal(got.sequences, exp.sequences), f"{name}: generate() differs"
    assert len(got.hidden_states) == len(exp.hidden_states) == new_tokens
    tol = parity.TOL[torch.float32]
    for step, (a_states, b_states) in enumerate(zip(got.hidden_states, exp.hidden_states)):
        assert len(a_states) == len(b_states), f"{name}: step {step}: {len(a_states)} states"
        for i, (a, b) in enumerate(zip(a_states, b_states)):
            assert a.shape == b.shape, f"{name}: step {step} state {i}: {tuple(a.shape)} != {tuple(b.shape)}"
            parity.assert_close(f"{name} generate step {step} state {i}", a, b, tol)
    return {"steps": len(got.hidden_states)}
