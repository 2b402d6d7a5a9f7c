"""Rank-side checks of sequence parallelism for the multimodal models (BLIP-2,
Gemma 3 multimodal, SAM) and ChatGLM2 (tests/test_sequence_parallel_mm.py).
The comparisons are checks.parity's; the mode configs are those of
checks.sequence (split_gather, over the TP group) and
checks.sequence_attention (all_to_all / ring_attn, TP off)."""
from __future__ import annotations

import copy

import torch

import zoo
from checks import parity
from checks.sequence import SP, _with_dropout
from checks.sequence_attention import sp_config
from shardformer import ShardConfig, ShardFormer
from shardformer.layer import sequence_attention as sa

# The layers whose input is split, per zoo name: (path of the ModuleList, dimension of the sequence).
LAYERS = {
    "Gemma3ForConditionalGeneration": ("model.language_model.layers", 1),
    "Gemma3Model": ("language_model.layers", 1),
    "Gemma3ForSequenceClassification": ("model.language_model.layers", 1),
    "Blip2ForConditionalGeneration": ("language_model.model.decoder.layers", 1),
    "Blip2Model": ("language_model.model.decoder.layers", 1),
    "Blip2ForConditionalGeneration/t5": ("language_model.encoder.block", 1),
    "SamVisionModel": ("vision_encoder.layers", 1),
    "SamModel": ("vision_encoder.layers", 1),
    "ChatGLMForConditionalGeneration": ("transformer.encoder.layers", 0),
    "ChatGLMModel": ("encoder.layers", 0),
}

# the inputs that run along the text sequence (cut to odd lengths)
_SEQ_KEYS = ("input_ids", "token_type_ids", "attention_mask")


def config_for(mode: str) -> dict:
    """ShardConfig kwargs of `mode`: split_gather over the TP group, the
    other modes over the same group with TP off."""
    return dict(SP) if mode == "split_gather" else sp_config(mode)


def mm_inputs(name: str, seq: int | None = None, overrides: dict | None = None) -> dict:
    """zoo.make_inputs(name) with the text sequence cut to `seq` tokens
    (image placeholders come first in the zoo's prompts and stay whole);
    SamVisionModel built with another image_size: pixels of that size."""
    inputs = zoo.make_inputs(name)
    size = (overrides or {}).get("image_size")
    if size is not None:
        g = torch.Generator().manual_seed(1)
        inputs["pixel_values"] = torch.randn(*inputs["pixel_values"].shape[:2], size, size, generator=g)
    if seq is None:
        return inputs
    ids = inputs["input_ids"]
    for key in _SEQ_KEYS:
        if key in inputs:
            inputs[key] = inputs[key][:, :seq].contiguous()
    labels = inputs.get("labels")
    if isinstance(labels, torch.Tensor) and labels.shape == ids.shape:     # per-token (causal LM) labels
        inputs["labels"] = labels[:, :seq].contiguous()
    return inputs


def expected_rows(mode: str, length: int, p: int) -> int:
    """The rows each rank holds between the layers."""
    multiple = 2 * p if mode == "ring_attn" else p
    return -(-length // multiple) * multiple // p


def watch_rows(model, name: str) -> list:
    """The sequence length entering every layer after the first (a list
    filled by forward pre-hooks, in call order)."""
    path, dim = LAYERS[name]
    seen: list = []

    def pre(_m, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        seen.append(x.shape[dim])

    for layer in list(model.get_submodule(path))[1:]:
        layer.register_forward_pre_hook(pre, with_kwargs=True)
    return seen


def _sequence_length(name: str, inputs: dict) -> int:
    """The length of the sequence the split layers see."""
    if name.startswith("Sam"):
        return inputs["pixel_values"].shape[-2] // zoo.vision.SAM_VISION["patch_size"]   # rows of patches
    return inputs["input_ids"].shape[1]


def right_padded(inputs: dict, pad: int) -> dict:
    """Batch row 0's last `pad` text tokens made padding (attention_mask 0,
    labels -100): every query still sees a real key, so all positions compare."""
    mask = torch.ones_like(inputs["input_ids"])
    mask[0, -pad:] = 0
    out = dict(inputs, attention_mask=mask)
    labels = inputs.get("labels")
    if isinstance(labels, torch.Tensor) and labels.shape == mask.shape:
        out["labels"] = labels.masked_fill(mask == 0, -100)
    return out


def mm_equals_unsharded(ctx, name: str, mode: str, seq: int | None = None, overrides: dict | None = None,
                        pad: int = 0, extra: dict | None = None) -> dict:
    """The model sharded with `mode` over ctx.group equals the unsharded one
    (checks.parity.compare_sharded: forward, loss, every gradient, outputs
    after an SGD step); the split layers saw this rank's rows only, and in
    the all_to_all / ring_attn modes the split attention ran (counted).
    pad: row 0 right-padded by that many tokens; extra: more ShardConfig
    kwargs (enable_sequence_overlap, enable_all_optimization; with overlap,
    on the shared-memory backend the overlapped gathers ran: counted, in
    both forwards and the backward, so a multiple of 3)."""
    from shardformer.distributed import backend_for
    from shardformer.layer.linear import GatherRowsLinear

    torch.manual_seed(0)
    model = zoo.build(name, **(overrides or {})).train()
    ref = copy.deepcopy(model)
    config = {**config_for(mode), **(extra or {})}
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **config)).optimize(model)
    seen = watch_rows(model, name)
    inputs = mm_inputs(name, seq, overrides)
    if pad:
        inputs = right_padded(inputs, pad)
    before, overlapped = dict(sa.CALLS), GatherRowsLinear.overlapped
    # Gemma3Model's rounding-level gradients (zoo.gemma3mm.FP64_FLOOR): judged against float64 as check_sharded does
    fp64 = name in getattr(zoo.module_of(name), "FP64_FLOOR", ())
    ref64 = copy.deepcopy(ref).double() if fp64 else None
    report = parity.compare_sharded(model, ref, inputs, f"{name} ({mode}, SP={ctx.tp_size})", ref64=ref64,
                                    inputs64=parity._double(inputs) if ref64 is not None else None)
    rows = expected_rows(mode, _sequence_length(name, inputs), ctx.tp_size)
    assert seen and all(s == rows for s in seen), f"{name}: layer inputs of {seen} rows, expected {rows}"
    if mode != "split_gather":
        calls = sa.CALLS[mode] - before[mode]
        assert calls > 0, f"{name}: the {mode} attention never ran"
        report["split_calls"] = calls
    if config.get("enable_sequence_overlap"):
        ran, backend = GatherRowsLinear.overlapped - overlapped, backend_for(torch.empty(1), ctx.group)
        assert backend != "shm" or (ran > 0 and ran % 3 == 0), f"{name}: {ran} overlapped passes"
        report.update(overlapped=ran, backend=backend)
    report["rows"] = rows
    return report


def _built_with_dropout(name: str, p: float):
    """The model with every dropout probability p (zoo.chatglm2's: its hidden_dropout)."""
    if name.startswith("ChatGLM"):
        return zoo.build(name, hidden_dropout=p)
    return _with_dropout(name, p)


def mm_eval_with_dropout(ctx, name: str, mode: str, p: float = 0.3) -> dict:
    """eval() with every dropout probability p > 0 equals the unsharded model
    (and in train() the dropout is live: two forwards differ)."""
    model = _built_with_dropout(name, p).train()
    inputs = zoo.make_inputs(name)
    with torch.no_grad():
        a, b = (parity.output_tensors(model(**inputs)) for _ in range(2))
    assert any(not torch.equal(a[k], b[k]) for k in a), f"{name}: dropout {p} changes nothing in train()"
    model.eval()
    for m in model.modules():         # a composed language model's own config (OPT: layerdrop refused with SP)
        if isinstance(getattr(getattr(m, "config", None), "layerdrop", None), float):
            m.config.layerdrop = 0.0
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **config_for(mode))).optimize(model)
    assert not model.training
    return parity.compare_sharded(model, ref, zoo.make_inputs(name), f"{name} ({mode}, eval, dropout {p})")


def mm_generate_matches(ctx, name: str, mode: str, new_tokens: int = 5, overrides: dict | None = None) -> list:
    """Greedy generate() of the sequence-parallel model equals the unsharded
    model's (the prompt's image included)."""
    if name.startswith("Blip2") and overrides is None:     # weights whose greedy tokens vary (zoo.vision)
        overrides = zoo.vision.blip2_wide_init(name)
    model = zoo.build(name, **(overrides or {})).eval()
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **config_for(mode))).optimize(model)
    inputs = {k: v for k, v in zoo.make_inputs(name).items() if k != "labels"}
    if not hasattr(model, "generate"):          # zoo.chatglm2: its own greedy loop (full forwards, no cache)
        got, exp = model.greedy(inputs["input_ids"], new_tokens), ref.greedy(inputs["input_ids"], new_tokens)
        assert torch.equal(got, exp), f"{name}: greedy tokens differ:\n{got}\n{exp}"
        return got.tolist()
    return parity.greedy_matches(model, ref, inputs, name, new_tokens).tolist()


def _refused_unchanged(ctx, model, config: dict, words: tuple, group=None) -> str:
    """optimize(model) with `config` (over ctx.group, or `group`) raises
    NotImplementedError containing every one of `words`, and leaves every
    tensor and module of the model as it was; returns the message."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = [type(m) for m in model.modules()]
    try:
        ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group if group is None else group,
                                **config)).optimize(model)
    except NotImplementedError as e:
        message = str(e)
    else:
        raise AssertionError(f"{type(model).__name__} with {config}: not refused")
    assert all(w in message for w in words), (words, message)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "the refusal changed weights"
    assert [type(m) for m in model.modules()] == modules, "the refusal replaced modules"
    return message


def mm_refused(ctx, name: str, mode: str, what: str, overrides: dict | None = None) -> str:
    """optimize() with `mode` is refused naming the model class, the mode and
    `what` (the module path or the reason), the model unchanged."""
    model = zoo.build(name, **(overrides or {}))
    return _refused_unchanged(ctx, model, config_for(mode), (type(model).__name__, repr(mode), what))


def mm_refused_in_stages(ctx, name: str) -> str:
    """split_gather with a pipeline_stage_manager (TP=2 x PP=2, mesh) is refused
    naming the class, the mode and pipeline parallelism, the model unchanged."""
    from shardformer import mesh
    from shardformer.pipeline import PipelineStageManager

    m = mesh(pp=2, tp=2)
    model = zoo.build(name)
    config = {**SP, "pipeline_stage_manager": PipelineStageManager(m.pp)}
    return _refused_unchanged(ctx, model, config, (type(model).__name__, "'split_gather'", "pipeline parallelism"),
                              group=m.tp)


def mm_hidden_states_refused(ctx, name: str, mode: str, hows: tuple = ("call", "config")) -> str:
    """output_hidden_states=True (in the call, or in the top-level config)
    raises NotImplementedError naming the model rather than returning one
    rank's rows of the split layers' hidden states; the plain call still
    works.  (Gemma 3 multimodal and BLIP-2 read their top-level config's
    output_hidden_states for no output: only the call asks for them.)"""
    model = zoo.build(name).eval()
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **config_for(mode))).optimize(model)
    inputs = zoo.make_inputs(name)
    message = ""
    for how in hows:
        try:
            with torch.no_grad():
                if how == "call":
                    model(**inputs, output_hidden_states=True)
                else:
                    model.config.output_hidden_states = True
                    model(**inputs)
        except NotImplementedError as e:
            assert "output_hidden_states" in str(e), str(e)
            message = str(e)
        else:
            raise AssertionError(f"{name} ({mode}): output_hidden_states=True ({how}) was not refused")
        finally:
            model.config.output_hidden_states = False
    with torch.no_grad():
        model(**inputs)
    return message


def mm_hidden_states_equal(ctx, name: str, mode: str) -> dict:
    """output_hidden_states=True in the call: every hidden state the language
    model records (Gemma 3: the model's hidden_states; BLIP-2: its
    language_model_outputs' states, both stacks of T5) is the full-sequence
    tensor of the unsharded model, in eval mode; the split gathered them
    (shardformer.layer.sequence.RECORDED_GATHERS counted)."""
    from shardformer.layer import sequence as seq_mod

    torch.manual_seed(0)
    model = zoo.build(name).eval()
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **config_for(mode))).optimize(model)
    inputs = zoo.make_inputs(name)
    before = seq_mod.RECORDED_GATHERS["count"]
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
        exp = ref(**inputs, output_hidden_states=True)

    def states(o) -> list:
        inner = getattr(o, "language_model_outputs", None) or o
        found = []
        for field in ("hidden_states", "encoder_hidden_states", "decoder_hidden_states"):
            value = getattr(inner, field, None)
            if isinstance(value, (tuple, list)):
                found += list(value)
        return found

    got, want = states(out), states(exp)
    assert want and len(got) == len(want), f"{name} ({mode}): {len(got)} recorded states, expected {len(want)}"
    worst = 0.0
    for i, (a, b) in enumerate(zip(got, want)):
        worst = max(worst, parity.assert_close(f"{name} ({mode}) hidden state {i}", a, b, parity.TOL[torch.float32]))
    gathered = seq_mod.RECORDED_GATHERS["count"] - before
    assert gathered > 0, f"{name} ({mode}): no recorded state was gathered"
    return {"states": len(got), "gathered": gathered, "worst": worst}


def gemma3_image_blocks_equal(ctx, name: str, mode: str, seq: int | None = None) -> dict:
    """The image tokens' bidirectional block (from token_type_ids) changes
    the unsharded model's output (so the mask is in force in the zoo's
    prompt), and the model sharded with `mode` equals the unsharded one
    with it (mm_equals_unsharded)."""
    inputs = mm_inputs(name, seq)
    model = zoo.build(name).eval()
    with torch.no_grad():
        with_blocks = parity.output_tensors(model(**inputs))
        causal_only = parity.output_tensors(model(**{k: v for k, v in inputs.items() if k != "token_type_ids"}))
    key = "logits" if "logits" in with_blocks else "last_hidden_state"
    assert not torch.allclose(with_blocks[key], causal_only[key]), f"{name}: token_type_ids change nothing"
    return mm_equals_unsharded(ctx, name, mode, seq)


# BLIP-2 without a language model: the vision encoder's and the Q-Former's layers split (policies/blip2.py).
# The stacks whose layer inputs are counted, and what each Q-Former call of one forward holds: (queries, text).
_BLIP2_STACKS = {"vision": "encoder.layers", "qformer": "encoder.layer"}
_BLIP2_QFORMER_CALLS = {
    "Blip2VisionModel": (), "Blip2VisionModelWithProjection": ((4, 0),), "Blip2QFormerModel": ((3, 0),),
    "Blip2ForImageTextRetrieval": ((4, 5),), "Blip2ForImageTextRetrieval/itc": ((4, 0), (0, 5)),
    "Blip2TextModelWithProjection": ((0, 5),),
}


def _blip2_inputs(name: str) -> dict:
    """zoo.make_inputs(name); Blip2QFormerModel's query_embeds cut to 3 rows (uneven over 2 and 4 ranks)."""
    inputs = zoo.make_inputs(name)
    if name == "Blip2QFormerModel":
        inputs["query_embeds"] = inputs["query_embeds"][:, :3].contiguous()
    return inputs


def _watch_stacks(model) -> dict:
    """{stack: the row counts entering each of its layers after the first}, filled by pre-hooks."""
    seen = {}
    for module in model.modules():
        kind = {"Blip2VisionModel": "vision", "Blip2QFormerModel": "qformer"}.get(type(module).__name__)
        if kind is None:
            continue
        rows = seen.setdefault(kind, [])
        for layer in list(module.get_submodule(_BLIP2_STACKS[kind]))[1:]:
            layer.register_forward_pre_hook(lambda _m, a, k, rows=rows: rows.append(a[0].shape[1]), with_kwargs=True)
    return seen


def blip2_parts_equal_unsharded(ctx, names: list, overlap: bool = False, plain: bool = False) -> dict:
    """The BLIP-2 classes without a language model under split_gather (and
    enable_sequence_overlap) equal the unsharded model (compare_sharded:
    forward, loss, every gradient, outputs after an SGD step), sharded with
    the plain ShardConfig (`plain`: ctx.group is the world) or ctx.group.
    Between the layers each rank held its rows only: the vision encoder's
    17 patch tokens as ceil(17 / p); each Q-Former call's Q queries and T
    text tokens as ceil(Q / p) + ceil(T / p).  With overlap on the
    shared-memory backend, every gathering column layer (the vision mlp.fc1,
    the Q-Former's intermediate_query / intermediate.dense) that the
    forward reaches ran one overlapped pass in each of the two forwards and
    one in the backward, as the ViT / BERT checks count them.  On 4 ranks
    with the plain ShardConfig and no overlap, split_gather with pipeline
    stages is refused too (mm_refused_in_stages)."""
    from shardformer.distributed import backend_for
    from shardformer.layer import Linear1D_Col
    from shardformer.layer.linear import GatherRowsLinear

    assert not plain or ctx.world_size == ctx.tp_size, "the plain ShardConfig splits over the world"
    p, reports = ctx.tp_size, {}
    group = {} if plain else {"tensor_parallel_process_group": ctx.group}
    for name in names:
        torch.manual_seed(0)
        model = zoo.build(name).train()
        ref = copy.deepcopy(model)
        config = ShardConfig(**group, **SP, enable_sequence_overlap=overlap)
        ShardFormer(config).optimize(model)
        seen = _watch_stacks(model)
        before = GatherRowsLinear.overlapped
        report = parity.compare_sharded(model, ref, _blip2_inputs(name), f"{name} (split_gather, TP={p})")
        calls = _BLIP2_QFORMER_CALLS[name]
        if name.startswith(("Blip2Vision", "Blip2ForImageTextRetrieval")):
            assert set(seen["vision"]) == {-(-17 // p)}, f"{name}: vision layer inputs of {seen['vision']} rows"
        want = sorted(-(-q // p) + -(-t // p) for q, t in calls for _ in range(2))     # 2 forwards, 1 later layer
        if calls:
            assert sorted(seen["qformer"]) == want, f"{name}: Q-Former layer inputs of {seen['qformer']}, expected {want}"
        if overlap:
            gathering = [n for n, m in model.named_modules() if isinstance(m, Linear1D_Col) and m.overlap]
            reached = [n for n in gathering if ref.get_submodule(n).weight.grad is not None]
            expected_reached = 2 * (name.startswith(("Blip2Vision", "Blip2ForImageTextRetrieval"))
                                    + any(q for q, _ in calls) + any(t for _, t in calls))
            assert len(reached) == expected_reached, f"{name}: gathering layers reached {reached}"
            ran, backend = GatherRowsLinear.overlapped - before, backend_for(torch.empty(1), ctx.group)
            assert backend != "shm" or ran == 3 * len(reached), \
                f"{name}: {ran} overlapped passes, expected {3 * len(reached)} ({len(reached)} layers)"
            report.update(overlapped=ran, backend=backend)
        reports[name] = report
    if plain and not overlap and ctx.world_size == 4:       # the same ranks as TP=2 x PP=2
        reports["in_stages"] = mm_refused_in_stages(ctx, "Blip2ForImageTextRetrieval")
    return reports
