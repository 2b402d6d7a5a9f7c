"""Rank-side checks of pipeline parallelism (tests/test_pipeline.py).

The reference is the unsharded HF model built from the same seed with 4
layers (so PP=4 gives every stage one), run on the whole batch: the
pipelined loss equals its loss, and after one SGD step the full state dict
gathered from the stages equals the reference's after the same step."""
from __future__ import annotations

import copy
import inspect

import torch
import torch.distributed as dist

import zoo
from zoo import gemma3mm, vision
from checks import parity
from checks.optimizations import counting_kernels
from shardformer import ShardConfig, ShardFormer
from shardformer.checkpoint import gather_full_state_dict
from shardformer.layer import sequence, sequence_attention
from shardformer.pipeline import (GPipeSchedule, InterleavedSchedule, OneForwardOneBackwardSchedule,
                                  PipelineStageManager)
from shardformer.pipeline import p2p
from shardformer.pipeline import schedule as schedule_module
from shardformer.pipeline import stages as stages_module
from shardformer.pipeline.stages import runtime_of

SCHEDULES = {"gpipe": GPipeSchedule, "1f1b": OneForwardOneBackwardSchedule, "interleaved": InterleavedSchedule}
TOL = parity.TOL[torch.float32]
_GROUPS: dict = {}

def groups(ctx, pp: int, tp: int = 1):
    """(tp_group, pp_group) of this rank, every rank of the pool running this
    (new_group is collective over the world): ranks laid out TP innermost,
    then PP, then replicas: rank = replica * pp * tp + stage * tp + t.  At 4
    ranks, pp=2, tp=2: TP {0,1},{2,3}, PP {0,2},{1,3}; pp=2, tp=1: two
    pipelines {0,1} and {2,3}."""
    n = ctx.world_size
    assert ctx.tp_size == n and n % (pp * tp) == 0, (n, pp, tp)
    key = (n, pp, tp)
    if key not in _GROUPS:
        tps, pps = {}, {}
        for base in range(0, n, pp * tp):
            for s in range(pp):
                ranks = [base + s * tp + t for t in range(tp)]
                g = dist.new_group(ranks)
                tps.update({r: g for r in ranks})
            for t in range(tp):
                ranks = [base + s * tp + t for s in range(pp)]
                g = dist.new_group(ranks)
                pps.update({r: g for r in ranks})
        _GROUPS[key] = (tps, pps)
    tps, pps = _GROUPS[key]
    return tps[ctx.rank], pps[ctx.rank]


def build(name: str, layers: int, **overrides):
    """The zoo's model with `layers` layers."""
    key = "n_layer" if name.startswith("GPT2") else "num_layers" if name.startswith("ChatGLM") else "num_hidden_layers"
    if name.startswith("GPTNeo"):             # one attention type per layer
        key, overrides = "num_layers", dict(overrides, attention_types=[[["global", "local"], layers // 2]])
    if name.startswith("T5"):                 # encoder + decoder blocks: the stages split both
        encoder_only = name in ("T5EncoderModel", "T5ForTokenClassification")
        encoder = overrides.pop("encoder_layers", layers if encoder_only else layers // 2)
        key, overrides = "num_layers", dict(overrides, num_decoder_layers=layers - encoder)
        layers = encoder
    if name.startswith("Whisper"):            # the stack(s) the class runs get the layers
        encoder = overrides.pop("encoder_layers", {"WhisperForAudioClassification": layers,
                                                   "WhisperForCausalLM": 1}.get(name, layers // 2))
        decoder = layers if name == "WhisperForCausalLM" else 1 if encoder == layers else layers - encoder
        key, overrides, layers = "encoder_layers", dict(overrides, decoder_layers=decoder), encoder
    if name == "SamModel":                    # the vision encoder's layers: the stack
        key, layers = "vision_config", dict(vision.SAM_VISION, num_hidden_layers=layers)
    if name.startswith("Blip2") and name not in ("Blip2VisionModel", "Blip2QFormerModel"):
        cfg = vision.MODELS[name][2]          # the vision encoder's layers, or the Q-Former's without one
        key = "qformer_config" if name == "Blip2TextModelWithProjection" else "vision_config"
        layers = dict(cfg[key], num_hidden_layers=layers)
    if name in gemma3mm.MODELS:               # the text model's layers
        key, layers = "text_config", dict(overrides.pop("text_config", {}), num_hidden_layers=layers)
    model = zoo.build(name, **{key: layers}, **overrides)
    # a config's dtype does not reach every module's weights (BEiT's masked image modelling)
    return model.to(overrides["dtype"]) if overrides.get("dtype") is not None else model


def batch_of(name: str, rows: int = 4) -> dict:
    """`rows` rows: the zoo's 2-row batches from seeds 1, 2, ..., concatenated."""
    parts = [zoo.make_inputs(name, seed=1 + k) for k in range(rows // 2)]
    return {k: torch.cat([p[k] for p in parts], 0) if isinstance(parts[0][k], torch.Tensor) else parts[0][k]
            for k in parts[0]}      # a flag (BLIP-2 retrieval's use_image_text_matching_head) as it is


def pipelined(ctx, name: str, pp: int, tp: int = 1, chunks: int = 1, layers: int = 4, num_layers_per_stage=None,
              config=None, sp_mode: str | None = None, default: bool = False, **overrides):
    """(reference, pipelined model, stage manager, shared params).  sp_mode:
    sequence parallelism in each stage over the inner group of `tp` ranks
    ("split_gather": with TP over it; "all_to_all" / "ring_attn": TP off).
    default: PipelineStageManager() over the world and a plain ShardConfig
    (its default group), TP off."""
    tp_group, pp_group = (None, None) if default else groups(ctx, pp, tp)
    assert not default or (pp == ctx.world_size and tp == 1 and sp_mode is None), (pp, tp, sp_mode)
    torch.manual_seed(0)
    model = build(name, layers, **overrides)
    model.train()
    ref = copy.deepcopy(model)
    sm = PipelineStageManager(pp_group, num_model_chunks=chunks, num_layers_per_stage=num_layers_per_stage)
    config = dict(config or {})
    tensor_parallel = tp > 1
    if sp_mode is not None:
        config.update(enable_sequence_parallelism=True, sequence_parallelism_mode=sp_mode)
        if sp_mode != "split_gather":
            config["sequence_parallel_process_group"], tensor_parallel = tp_group, False
    if default:
        cfg = ShardConfig(pipeline_stage_manager=sm, enable_tensor_parallelism=False, **config)
    else:
        cfg = ShardConfig(tensor_parallel_process_group=tp_group, pipeline_stage_manager=sm,
                          enable_tensor_parallelism=tensor_parallel, **config)
    model, shared = ShardFormer(shard_config=cfg).optimize(model)
    return ref, model, sm, shared


def equals_unsharded(ctx, name: str, pp: int, schedule: str, m: int, tp: int = 1, chunks: int = 1,
                     layers: int = 4, padded: bool = False, rows: int = 4, config=None, sp_mode: str | None = None,
                     seq: int | None = None, num_layers_per_stage=None, default: bool = False, device=None,
                     **overrides) -> dict:
    """Loss of one forward_backward_step equals the unsharded model's
    full-batch loss; after one SGD step on both, the gathered full state dict
    equals the reference's.  Messages between stages were sent (counted).
    sp_mode: sequence parallelism inside the stages (see pipelined); seq:
    the batch cut to its first `seq` tokens; device: where the stages, the
    reference and the batch run (None: CPU; both models are built on CPU
    from the seed, then moved).  A model normalizing over its batch
    (BATCH_NORM) is compared with the unsharded model run on the same
    micro-batches in turn (its loss the mean of theirs), which is what
    micro-batching means for it, on micro-batches of 2 rows at least."""
    if name in BATCH_NORM:
        rows = max(rows, 2 * m)
    batch = batch_of(name, rows)
    if seq is not None:
        batch, overrides = cut_to(name, batch, seq, overrides)
    # The model's own loss where it is one mean of equally weighted micro-batches; else a fixed
    # projection of the outputs, in float64 (a sum over every output: float32 rounding would show).
    own_loss = "labels" in batch and not any(k in name for k in ("DoubleHeads", "MaskedImageModeling"))
    ref, model, sm, shared = pipelined(ctx, name, pp, tp, chunks, layers, num_layers_per_stage, config=config,
                                       sp_mode=sp_mode, default=default, dtype=torch.float32 if own_loss else torch.float64,
                                       **overrides)
    if device is not None:
        ref.to(device)
        model.to(device)
        batch = parity.to_device(batch, device)
    if not own_loss:
        batch = {k: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                 for k, t in batch.items()}
        # labels of the selected positions only (BEiT's masked patches) do not split into micro-batches;
        # the projection criterion does not read them
        if "labels" in batch and batch["labels"].shape[0] != rows:
            del batch["labels"]
    if padded:                                   # uneven label counts per micro-batch
        batch["labels"] = batch["labels"].clone()
        batch["labels"][0, :5] = -100
        batch["labels"][-1, 2:4] = -100
    # the schedule runs the stages with use_cache=False; so does the reference (transformers 5.15's
    # WhisperForCausalLM sizes a default cache from the config and fails with fewer decoder layers)
    no_cache = {"use_cache": False} if "use_cache" in inspect.signature(type(ref).forward).parameters else {}
    if name in BATCH_NORM:
        micro = [{k: t.chunk(m)[i] if isinstance(t, torch.Tensor) else t for k, t in batch.items()} for i in range(m)]
        exp = None
        ref_loss = sum(parity.loss_of(ref(**mb, **no_cache), {}) for mb in micro) / m
        criterion = None
    else:
        exp = ref(**batch, **no_cache)
    if exp is None:
        pass
    elif own_loss:
        criterion, ref_loss = None, parity.loss_of(exp, {})
    else:
        probe = _probe(exp)
        criterion, ref_loss = _probe_criterion(probe, m), _project(exp, probe)
    before = dict(p2p.COUNTS)
    positions_before = stages_module.COUNTS["chunk_positions"]
    replicated_before = schedule_module.COUNTS["held"]
    split_before = dict(sequence_attention.CALLS)
    regathers_before = _regathers()
    runner = SCHEDULES[schedule](sm, num_microbatches=m)
    with counting_kernels() as calls:
        out = runner.forward_backward_step(model, batch, criterion=criterion)
    if sp_mode is not None and sm.stage > 0 and not runtime_of(model).plan.layer_shadows:   # not Swin's shapes
        _received_rows(name, model, runner.link, batch, sp_mode, tp)
    if sp_mode in sequence_attention.MODES:
        assert sequence_attention.CALLS[sp_mode] > split_before[sp_mode], f"{name}: the {sp_mode} attention never ran"
        if runtime_of(model).plan.tuples:
            _split_attention_calls(name, model, split_before, m, sp_mode)
    # the blocks' saved rows gathered again in backward (Swinv2's post-norm blocks run whole: their input is
    # gathered in forward and its gradient split, nothing saved in rows)
    if sp_mode == "split_gather" and not name.startswith("Swinv2"):
        assert _regathers() > regathers_before, f"{name}: no split_gather block ran on stage {sm.stage}"
    if (config or {}).get("enable_all_optimization"):
        assert sum(calls.values()) > 0, f"{name}: no fused kernel ran on stage {sm.stage}"
    sent = p2p.COUNTS["sent"] - before["sent"]
    if sm.num_stages > 1:
        assert sent > 0, f"{name}: no activation or gradient went between stages"
    _check_repeated_calls(model, sm, name, replicated_before)
    positions = _check_layer_count(model, m, name, positions_before)
    ref_loss.backward()
    err = parity.assert_close(f"{name} pipelined loss ({schedule}, pp={pp}, m={m})", out["loss"], ref_loss.detach(),
                              TOL)
    lr = 0.1
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
        for p in ref.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    full = gather_full_state_dict(model)
    expected = ref.state_dict()
    missing = sorted(set(expected) - set(full))
    assert not missing, f"{name}: gathered state dict lacks {missing[:5]}"
    worst = 0.0
    for key, t in expected.items():
        worst = max(worst, parity.assert_close(f"{name} {key} after a step", full[key], t, TOL))
    # messages of several tensors (position biases, the encoder output) sent or received under a key
    tuples = len([k for k in set(runner.link._sent) | set(runner.link._shapes) if k[-1] == "n"])
    return {"loss": err, "state": worst, "sent": sent, "shared": len(shared), "tuples": tuples,
            "positions": positions, "replicated": len(runtime_of(model).replicated_params)}


# Models with BatchNorm in training (BEiT's segmentation heads): statistics over the micro-batch.
BATCH_NORM = {"BeitForSemanticSegmentation"}


def stepped_states_equal(model, ref, name: str, lr: float = 0.1) -> float:
    """One SGD step (lr) on the pipelined `model` and the unsharded `ref`
    from their gradients; the full state dict gathered from the stages
    equals ref's (TOL).  Returns the worst relative error."""
    with torch.no_grad():
        for mdl in (model, ref):
            for p in mdl.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
    full = gather_full_state_dict(model)
    worst = 0.0
    for key, t in ref.state_dict().items():
        worst = max(worst, parity.assert_close(f"{name} {key} after a step", full[key], t, TOL))
    return worst


def _check_layer_count(model, m: int, name: str, before: int) -> int:
    """A split whose forward loops over a layer count (StageSplit.count,
    ChatGLM2's num_layers): every layer this rank ran was got by its chunk
    position (one per layer and micro-batch), and the count is the model's
    again after the step.  Returns the positions counted."""
    plan = runtime_of(model).plan
    positions = stages_module.COUNTS["chunk_positions"] - before
    if not plan.count:
        assert positions == 0, (name, positions)
        return 0
    assert positions == m * sum(len(r) for r in plan.chunks), (name, positions, m, plan.chunks)
    holder, attr = stages_module._count_holder(model.get_submodule(plan.stacks[0].module), plan.count)
    assert getattr(holder, attr) == plan.total, (name, getattr(holder, attr), plan.total)
    return positions


def _regathers() -> int:
    """Backward re-gathers of split_gather blocks' saved rows in this process
    (the plain region's, and enable_sequence_overlap's gather_block_input)."""
    from shardformer.layer import linear

    return sequence._Regathered.gathers + linear.GatherRowsLinear.regathers


def cut_to(name: str, batch: dict, seq: int, overrides: dict) -> tuple[dict, dict]:
    """(batch, config overrides) with the (first stack's) sequence cut to its
    first `seq` positions: the token inputs (checks.sequence_attention._trim:
    an encoder-decoder's decoder inputs keep their own length), or Whisper's
    2 * seq mel frames with max_source_positions=seq (its encoder checks the
    frame count)."""
    from checks.sequence_attention import _trim

    batch = _trim(batch, seq)
    if name == "T5ForSequenceClassification":
        batch["input_ids"][:, -1] = 1                # the EOS whose decoder state is pooled, cut by _trim
    if "input_features" in batch:
        batch["input_features"] = batch["input_features"][..., :2 * seq].contiguous()
        overrides = dict(overrides, max_source_positions=seq)
    return batch, overrides


def _stack_lengths(batch: dict, stacks: int) -> list[int]:
    """The unsplit sequence length of each stack the stages run: the first
    stack's (Whisper's encoder: half the mel frames, after conv2's stride),
    then the decoder's (its own inputs, or T5's shifted input_ids)."""
    first = batch["input_features"].shape[-1] // 2 if "input_features" in batch else batch["input_ids"].shape[1]
    second = batch.get("decoder_input_ids", batch.get("input_ids"))
    return [first, second.shape[1] if second is not None else first][:stacks]


def _received_rows(name: str, model, link, batch: dict, sp_mode: str, tp: int) -> None:
    """A later stage received this rank's rows of the padded sequence only
    (each message's hidden states, the first tensor of a tuple), of the stack
    the sending chunk ended in; the first stack's output whole (the message at
    the boundary of two stacks, and the last tensor of every second-stack
    message).  Every received activation is checked."""
    plan = runtime_of(model).plan
    lengths = _stack_lengths(batch, len(plan.stacks))
    p = 2 * tp if sp_mode == "ring_attn" else tp

    def rows(S: int) -> int:
        return -(-S // p) * p // tp

    checked = 0
    for key, value in link._shapes.items():
        msg, part = key if isinstance(key[0], tuple) else (key, 0)
        if msg[0] != "act" or part == "n":
            continue
        n = link._shapes.get((msg, "n"), 1)
        shape = value[0]
        end = sum(plan.counts[:msg[1] + 1])                # the sender's chunk ends before layer `end`
        stack = next(k for k, st in enumerate(plan.stacks) if end <= st.stop)
        if len(plan.stacks) > 1 and end == plan.stacks[0].stop:
            assert n == 1 and shape[1] == lengths[0], f"{name}: the first stack's output came as {shape}"
        elif part == 0:       # along the sequence's dimension: 1, or 0 for a sequence-first model (ChatGLM2)
            full = value[2] if len(value) > 2 and value[2] is not None else shape
            d = next((i for i in range(len(shape)) if i < len(full) and shape[i] != full[i]), 1)
            assert shape[d] == rows(lengths[stack]), \
                f"{name}: stage received hidden states {shape} of {lengths[stack]} tokens ({sp_mode})"
        elif stack == 1 and part == n - 1:
            assert shape[1] == lengths[0], f"{name}: the encoder output travelled as {shape}"
        checked += 1
    assert checked, f"{name}: no activation received"


def _split_attention_calls(name: str, model, before: dict, m: int, mode: str) -> None:
    """An encoder-decoder's stage (or T5's one stack, messages with the
    position bias) ran the split attention once per self-attention layer it
    holds per micro-batch, the cross-attention path once per decoder layer
    it holds; T5 added its whole-sequence position bias in every
    self-attention (its slice under all_to_all, per ring block under
    ring_attn)."""
    plan = runtime_of(model).plan
    held = [sum(len(range(max(r.start, st.start), min(r.stop, st.stop))) for r in plan.chunks)
            for st in plan.stacks]
    decoder = held[1] if len(held) > 1 else 0
    calls = {k: sequence_attention.CALLS[k] - before[k] for k in (mode, "cross", "bias")}
    expected = {mode: sum(held) * m, "cross": decoder * m,
                "bias": sum(held) * m if name.startswith("T5") else 0}
    assert calls == expected, f"{name}: split attention calls {calls}, expected {expected} (held {held})"


def _check_repeated_calls(model, sm, name: str, replicated_before: int) -> None:
    """A model whose layer list is called repeatedly (StageSplit.calls, ALBERT):
    the last forward numbered every call, this rank holds exactly the modules
    its calls run, and a module held by several stages had its gradients
    summed over them."""
    from shardformer.pipeline.stages import StageCalls

    rt = runtime_of(model)
    if rt.replicated_params:
        assert schedule_module.COUNTS["held"] > replicated_before, \
            f"{name}: stage {sm.stage} summed no replicated gradient"
    if not isinstance(rt.layers, StageCalls):
        return
    plan = rt.plan
    mine = {c for r in plan.chunks for c in r}
    assert rt.layers.calls_made == max(mine) + 1, (name, rt.layers.calls_made, plan.chunks)
    held = {int(k) for k in rt.layers._modules}
    assert held == {plan.call_module[i] for i in mine}, (name, held, plan.chunks)
    shared = [g for g in held if len(plan.holders[g]) > 1]
    assert bool(shared) == bool(rt.replicated_params), (name, shared, len(rt.replicated_params))
    assert all(sm.stage in plan.holders[g] for g in shared)


def _probe(out) -> dict:
    """A fixed random tensor per float output (the losses excluded)."""
    g = torch.Generator().manual_seed(1234)
    return {k: torch.randn(v.shape, generator=g, dtype=torch.float64)
            for k, v in parity.output_tensors(out).items() if not k.endswith("loss")}


def _project(out, probe: dict, micro: int = 0) -> torch.Tensor:
    """The projection of the float outputs on `probe`, cut to micro-batch
    `micro`'s part where an output is one micro-batch's (_micro_probe)."""
    tensors = parity.output_tensors(out)
    return sum((tensors[k].double() * _micro_probe(p, tensors[k].shape, micro)).sum() for k, p in probe.items())


def _micro_probe(p: torch.Tensor, shape, micro: int) -> torch.Tensor:
    """Micro-batch `micro`'s part of the whole batch's probe `p` for an output
    of `shape`: cut along the one dimension where the two differ (the batch
    dimension, found from the shapes: 0, or 1 for ChatGLM2's sequence-first
    last_hidden_state); `p` itself where none does."""
    dims = [d for d, (a, b) in enumerate(zip(p.shape, shape)) if a != b]
    if not dims:
        return p
    assert len(dims) == 1 and p.dim() == len(shape), (tuple(p.shape), tuple(shape))
    size = shape[dims[0]]
    return p.narrow(dims[0], micro * size, size)


def _probe_criterion(probe: dict, m: int):
    """criterion(outputs, micro_batch): the projection `probe` of the float
    outputs cut to the micro-batch's rows, times m (the schedule's 1/m
    undone), so the micro-batches add up to _project on the whole batch.
    Micro-batches arrive in order on the last stage."""
    seen = [0]

    def criterion(out, micro_batch):
        i = seen[0] % m
        seen[0] += 1
        return _project(out, probe, i) * m
    return criterion


def load_full_round_trip(ctx, name: str, pp: int, tp: int) -> bool:
    """load_full_state_dict of the unsharded model's dict into a pipelined
    model (each stage takes its part, strict), then gathered back: equal."""
    ref, model, sm, _ = pipelined(ctx, name, pp, tp)
    torch.manual_seed(5)
    other = build(name, 4)
    from shardformer.checkpoint import load_full_state_dict

    load_full_state_dict(model, other.state_dict())
    full = gather_full_state_dict(model)
    for key, t in other.state_dict().items():
        assert torch.equal(full[key], t), key
    return True


def inference_on_every_rank(ctx, name: str, pp: int, tp: int, schedule: str, dropout: float = 0.0,
                            sp_mode: str | None = None, seq: int | None = None) -> float:
    """schedule.forward(): the last stage's logits, on every rank, equal to
    the unsharded model's; in eval mode with dropout p=`dropout` configured;
    sp_mode / seq as in equals_unsharded."""
    overrides = {}
    if dropout:
        overrides = {"attention_dropout": dropout} if name.startswith("Llama") else \
            {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout} if name.startswith("Albert") \
            else {"dropout_rate": dropout} if name.startswith("T5") \
            else {"dropout": dropout} if name.startswith("Whisper") \
            else {"hidden_dropout": dropout} if name.startswith("ChatGLM") \
            else {"text_config": {"attention_dropout": dropout}} if name in gemma3mm.MODELS \
            else {"resid_pdrop": dropout, "embd_pdrop": dropout}
    batch = batch_of(name)
    if seq is not None:
        batch, overrides = cut_to(name, batch, seq, overrides)
    ref, model, sm, _ = pipelined(ctx, name, pp, tp, sp_mode=sp_mode, **overrides)
    ref.eval()
    model.eval()
    out = SCHEDULES[schedule](sm, num_microbatches=2).forward(model, batch)
    exp = ref(**batch)
    assert type(out) is type(exp), (type(out), type(exp))
    got, want = parity.output_tensors(out), parity.output_tensors(exp)
    keys = ["logits"] if "logits" in want else sorted(want)       # a base model: its hidden states
    return max(parity.assert_close(f"{name} {k} on stage {sm.stage}", got[k], want[k], TOL) for k in keys)


def training_dropout_differs(ctx, name: str) -> bool:
    """With dropout on in train mode the pipelined step still runs (a loss on
    every rank, equal across ranks), and its loss differs from the eval loss."""
    ref, model, sm, _ = pipelined(ctx, name, 2, 1, attention_dropout=0.5)
    batch = batch_of(name)
    sched = OneForwardOneBackwardSchedule(sm, num_microbatches=2)
    train_loss = sched.forward_backward_step(model, batch)["loss"]
    model.eval()
    eval_loss = sched.forward_backward_step(model, batch)["loss"]
    ref.eval()
    parity.assert_close("eval loss", eval_loss, ref(**batch).loss.detach(), TOL)
    return bool((train_loss - eval_loss).abs() > 1e-6)


def refusals(ctx) -> list[str]:
    """Clear errors, raised on every rank, before anything changes."""
    msgs = []
    ref, model, sm, _ = pipelined(ctx, "LlamaForCausalLM", 2, 1)
    batch = batch_of("LlamaForCausalLM")
    for call in (lambda: model(**batch),):          # generate() runs: tests/test_pipeline_generate.py
        try:
            call()
        except RuntimeError as e:
            assert "run it through a schedule" in str(e), e
            msgs.append(str(e))
        else:
            raise AssertionError("a pipelined model ran outside a schedule")
    try:                                            # 4 rows into 3 micro-batches
        GPipeSchedule(sm, num_microbatches=3).forward_backward_step(model, batch)
    except ValueError as e:
        assert "does not split into num_microbatches=3" in str(e), e
        msgs.append(str(e))
    else:
        raise AssertionError("an uneven micro-batch split was accepted")
    try:                                            # the stages disagree on the schedule
        GPipeSchedule(sm, num_microbatches=2 if sm.stage == 0 else 4).forward_backward_step(model, batch)
    except ValueError as e:
        assert "disagree" in str(e), e
        msgs.append(str(e))
    else:
        raise AssertionError("stages running different schedules were not caught")
    try:
        GPipeSchedule(sm, num_microbatches=2).forward_backward_step(model, {"input_ids": batch["input_ids"]})
    except ValueError as e:
        assert "labels" in str(e), e
        msgs.append(str(e))
    else:
        raise AssertionError("a batch without labels and no criterion was accepted")
    # too few layers: refused, model unchanged
    tp_group, pp_group = groups(ctx, 4, 1)
    sm4 = PipelineStageManager(pp_group)
    small = build("LlamaForCausalLM", 2)
    names = [n for n, _ in small.named_parameters()]
    try:
        ShardFormer(ShardConfig(tensor_parallel_process_group=tp_group, pipeline_stage_manager=sm4,
                                enable_tensor_parallelism=False)).optimize(small)
    except ValueError as e:
        assert "2 layers cannot be split over 4 pipeline stages" in str(e), e
        msgs.append(str(e))
    else:
        raise AssertionError("2 layers were split over 4 stages")
    assert [n for n, _ in small.named_parameters()] == names
    small(**batch)                                   # still the whole model
    # a policy without a stage split (every built-in family has one): refused by name, model unchanged
    from shardformer.autopolicy import get_autopolicy

    swin = zoo.build("SwinForImageClassification")
    policy = get_autopolicy(swin)
    policy.pipeline_split, policy.pipeline_refusal = None, "a test's policy without a stage split"
    try:
        ShardFormer(ShardConfig(tensor_parallel_process_group=tp_group, pipeline_stage_manager=sm4,
                                enable_tensor_parallelism=False)).optimize(swin, policy=policy)
    except NotImplementedError as e:
        assert "SwinForImageClassification" in str(e) and "without a stage split" in str(e), e
        msgs.append(str(e))
    else:
        raise AssertionError("a policy without a stage split was pipelined")
    assert not any(type(m).__name__ == "StageLayers" for m in swin.modules())
    return msgs


def uneven_layers(ctx, counts) -> list[int]:
    """num_layers_per_stage places the layers as asked; still equal to the unsharded model."""
    ref, model, sm, _ = pipelined(ctx, "LlamaForCausalLM", len(counts), layers=sum(counts),
                                  num_layers_per_stage=counts)
    held = sorted({int(n.split(".")[2]) for n, _ in model.named_parameters() if n.startswith("model.layers.")})
    start = sum(counts[:sm.stage])
    assert held == list(range(start, start + counts[sm.stage])), held
    batch = batch_of("LlamaForCausalLM")
    loss = OneForwardOneBackwardSchedule(sm, num_microbatches=2).forward_backward_step(model, batch)["loss"]
    parity.assert_close("loss", loss, ref(**batch).loss.detach(), TOL)
    return held


def replicas_must_agree(ctx) -> str:
    """Stages built from different seeds: optimize() raises on every rank."""
    tp_group, pp_group = groups(ctx, 2, 1)
    torch.manual_seed(dist.get_rank())
    model = build("LlamaForCausalLM", 4)
    model.model.layers[0].mlp.up_proj.weight.data.normal_(generator=torch.Generator().manual_seed(dist.get_rank()))
    sm = PipelineStageManager(pp_group)
    try:
        ShardFormer(ShardConfig(tensor_parallel_process_group=tp_group, pipeline_stage_manager=sm,
                                enable_tensor_parallelism=False)).optimize(model)
    except ValueError as e:
        assert "pipeline-parallel" in str(e), e
        return str(e)
    raise AssertionError("stages with different weights were pipelined")


def from_pretrained_stages(ctx, pp: int, tp: int, path: str, tied: bool = False,
                           name: str = "LlamaForCausalLM") -> dict:
    """ShardFormer.from_pretrained with a stage manager: each rank reads its
    stage's tensors only (lazy init: the other stages' are never allocated),
    and the pipeline's logits equal HF's from_pretrained."""
    import transformers

    cls = getattr(transformers, name)
    tp_group, pp_group = groups(ctx, pp, tp)
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        overrides = {"tie_word_embeddings": tied} if name.startswith("Llama") else {}
        build(name, 4, **overrides).save_pretrained(path)   # tied: one tensor stored
    dist.barrier()
    sm = PipelineStageManager(pp_group)
    cfg = ShardConfig(tensor_parallel_process_group=tp_group, pipeline_stage_manager=sm,
                      enable_tensor_parallelism=tp > 1)
    model, _ = ShardFormer(shard_config=cfg).from_pretrained(cls, path)
    ref = cls.from_pretrained(path, attn_implementation="eager").eval()
    batch = batch_of(name)
    out = OneForwardOneBackwardSchedule(sm, num_microbatches=2).forward(model, batch)
    err = parity.assert_close("logits", out.logits, ref(**batch).logits, TOL)
    held = sum(p.numel() for p in model.parameters())
    full = sum(p.numel() for p in ref.parameters())
    assert held < full, (held, full)
    # one training step through the pipeline, saved by save_pretrained: plain transformers loads it back
    OneForwardOneBackwardSchedule(sm, num_microbatches=2).forward_backward_step(model, batch)
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    model.eval()
    trained = OneForwardOneBackwardSchedule(sm, num_microbatches=2).forward(model, batch).logits
    model.save_pretrained(path + "-trained")
    dist.barrier()
    back = cls.from_pretrained(path + "-trained", attn_implementation="eager").eval()
    parity.assert_close("reloaded logits", back(**batch).logits, trained, TOL)
    assert not torch.allclose(trained, out.logits)
    dist.barrier()
    return {"err": err, "fraction": held / full}


def checkpointed_equals_unsharded(ctx, name: str, pp: int, tp: int, reentrant: bool) -> float:
    """HF's gradient_checkpointing_enable() on the pipelined model: each layer
    recomputes from the activation it received, so the step still equals the
    unsharded model's (which does not recompute)."""
    ref, model, sm, _ = pipelined(ctx, name, pp, tp)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    batch = batch_of(name)
    out = OneForwardOneBackwardSchedule(sm, num_microbatches=2).forward_backward_step(model, batch)
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    parity.assert_close("loss", out["loss"], ref_loss.detach(), TOL)
    ref_grads = dict(ref.named_parameters(remove_duplicate=False))
    worst = 0.0
    for pname, p in model.named_parameters():
        if not p.requires_grad:                      # frozen (Whisper's sinusoidal encoder positions)
            assert p.grad is None and ref_grads[pname].grad is None, pname
            continue
        if tp == 1:
            worst = max(worst, parity.assert_close(f"{pname}.grad", p.grad, ref_grads[pname].grad, TOL))
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, pname
    return worst


def custom_policy_equals_unsharded(ctx, pp: int, tp: int, schedule: str) -> float:
    """A user's model and Policy (zoo.custom), pipelined with one line of data:
    the loss and the state dict after a step equal the unsharded model's."""
    from shardformer.pipeline import StageSplit
    from zoo.custom import ToyModel, ToyPolicy

    class PipelinedToyPolicy(ToyPolicy):
        pipeline_split = StageSplit("ToyModel", "blocks", last=("head",))

    tp_group, pp_group = groups(ctx, pp, tp)
    torch.manual_seed(0)
    model = ToyModel(layers=4)
    ref = copy.deepcopy(model)
    sm = PipelineStageManager(pp_group)
    cfg = ShardConfig(tensor_parallel_process_group=tp_group, pipeline_stage_manager=sm,
                      enable_tensor_parallelism=tp > 1)
    model, _ = ShardFormer(shard_config=cfg).optimize(model, policy=PipelinedToyPolicy())
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 77, (4, 9), generator=g)
    batch = {"input_ids": ids, "labels": ids}
    out = SCHEDULES[schedule](sm, num_microbatches=2).forward_backward_step(model, batch)
    ref_loss = ref(**batch)["loss"]
    ref_loss.backward()
    err = parity.assert_close("toy loss", out["loss"], ref_loss.detach(), TOL)
    with torch.no_grad():
        for m_ in (model, ref):
            for p in m_.parameters():
                p -= 0.1 * p.grad
    full = gather_full_state_dict(model)
    for key, t in ref.state_dict().items():
        parity.assert_close(f"toy {key}", full[key], t, TOL)
    return err


# ---- a layer list called repeatedly (ALBERT: StageSplit.calls) ------------------------------

def repeated_calls_grad_norm(ctx, pp: int, num_hidden_groups: int, chunks: int = 1) -> float:
    """ALBERT with its layer groups replicated over the stages that call them:
    shardformer.clip_grad_norm_ after one pipelined step (each replicated
    parameter counted once) equals torch's on the unsharded model, and the
    clipped gradients step both models alike."""
    from shardformer import clip_grad_norm_

    name = "AlbertForMaskedLM"
    ref, model, sm, _ = pipelined(ctx, name, pp, chunks=chunks, num_hidden_groups=num_hidden_groups)
    batch = batch_of(name)
    schedule = InterleavedSchedule if chunks > 1 else OneForwardOneBackwardSchedule
    schedule(sm, num_microbatches=2).forward_backward_step(model, batch)
    ref(**batch).loss.backward()
    norm = clip_grad_norm_(model, 0.05)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    err = parity.assert_close("gradient norm", norm, ref_norm, TOL)
    with torch.no_grad():
        for m_ in (model, ref):
            for p in m_.parameters():
                if p.grad is not None:
                    p -= p.grad
    full = gather_full_state_dict(model)
    for key, t in ref.state_dict().items():
        parity.assert_close(f"{name} {key} after a clipped step", full[key], t, TOL)
    return err


def repeated_calls_refusals(ctx) -> list[str]:
    """ALBERT splits refused by name before anything changes: a group count
    that does not divide the calls, and fewer calls than stages."""
    msgs = []
    for pp, overrides, expected in ((2, {"num_hidden_groups": 3}, "4 is not a multiple of 3"),
                                    (4, {}, "2 layers cannot be split over 4 pipeline stages")):
        tp_group, pp_group = groups(ctx, pp, 1)
        layers = 4 if overrides else 2
        model = build("AlbertForMaskedLM", layers, **overrides)
        cfg = ShardConfig(tensor_parallel_process_group=tp_group, pipeline_stage_manager=PipelineStageManager(pp_group),
                          enable_tensor_parallelism=False)
        msg = parity.refused_unchanged(model, lambda: ShardFormer(shard_config=cfg).optimize(model),
                                       "an ALBERT pipeline split", ValueError, structure=True)
        assert "AlbertForMaskedLM" in msg and "albert.encoder.albert_layer_groups" in msg and expected in msg, msg
        batch = batch_of("AlbertForMaskedLM")
        model(**batch)                                   # still the whole model
        msgs.append(msg)
    return msgs


def beit_segmentation_bad_reads(ctx) -> str:
    """BeitForSemanticSegmentation pruned to 2 layers, its out_indices still
    1..4: the decode head would read hidden state 3 of 0..2; refused by name,
    with the numbers, before anything changes.  So is the segmentation model
    with sequence parallelism inside the stages."""
    tp_group, pp_group = groups(ctx, 2, 1)
    model = build("BeitForSemanticSegmentation", 4)
    del model.beit.layers[2:]
    cfg = ShardConfig(tensor_parallel_process_group=tp_group, pipeline_stage_manager=PipelineStageManager(pp_group),
                      enable_tensor_parallelism=False)
    msg = parity.refused_unchanged(model, lambda: ShardFormer(shard_config=cfg).optimize(model),
                                   "a BEiT segmentation pipeline", ValueError, structure=True)
    assert "BeitForSemanticSegmentation" in msg and "beit.layers" in msg and "[3]" in msg and "0..2" in msg, msg
    # with split_gather sequence parallelism (TP=2 x PP=2): refused by name too
    tp_group, pp_group = groups(ctx, 2, 2)
    model = build("BeitForSemanticSegmentation", 4)
    cfg = ShardConfig(tensor_parallel_process_group=tp_group, pipeline_stage_manager=PipelineStageManager(pp_group),
                      enable_sequence_parallelism=True, sequence_parallelism_mode="split_gather")
    sp = parity.refused_unchanged(model, lambda: ShardFormer(shard_config=cfg).optimize(model),
                                  "a BEiT segmentation pipeline with SP", NotImplementedError, structure=True)
    assert "BeitForSemanticSegmentation" in sp and "split_gather" in sp and "[0, 1, 2, 3]" in sp, sp
    return msg + "\n" + sp


def encoder_decoder_refusals(ctx) -> list[str]:
    """Whisper with layerdrop or use_weighted_layer_sum under pipeline
    parallelism (with sequence parallelism too), a second stack whose skip
    keyword the forward lacks: refused by name before anything changes."""
    msgs = []
    tp_group, pp_group = groups(ctx, 2, 2)
    sm = PipelineStageManager(pp_group)
    whisper = build("WhisperForConditionalGeneration", 4, decoder_layerdrop=0.5)
    cfg = ShardConfig(tensor_parallel_process_group=tp_group, pipeline_stage_manager=sm,
                      enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all",
                      sequence_parallel_process_group=tp_group, enable_tensor_parallelism=False)
    msg = parity.refused_unchanged(whisper, lambda: ShardFormer(shard_config=cfg).optimize(whisper),
                                   "Whisper with PP, SP and layerdrop", NotImplementedError, structure=True)
    assert "WhisperForConditionalGeneration" in msg and "decoder_layerdrop" in msg, msg
    msgs.append(msg)
    for name, key in (("WhisperForConditionalGeneration", "decoder_layerdrop"),
                      ("WhisperForAudioClassification", "use_weighted_layer_sum")):
        whisper = build(name, 4, **{key: 0.5 if key.endswith("drop") else True})
        cfg = ShardConfig(tensor_parallel_process_group=tp_group, pipeline_stage_manager=sm)
        msg = parity.refused_unchanged(whisper, lambda: ShardFormer(shard_config=cfg).optimize(whisper),
                                       f"{name} pipelined with {key}", NotImplementedError, structure=True)
        assert name in msg and key in msg and "pipeline" in msg, msg
        msgs.append(msg)
    # a second stack whose `skip` keyword the model's forward does not take: refused, model unchanged
    import dataclasses

    from shardformer.policies.t5 import T5ForConditionalGenerationPolicy

    class WrongSkip(T5ForConditionalGenerationPolicy):
        @property
        def pipeline_split(self):
            split = super().pipeline_split
            return dataclasses.replace(split, then=dataclasses.replace(split.then, skip="encoder_states"))

    t5 = build("T5ForConditionalGeneration", 4)
    cfg = ShardConfig(tensor_parallel_process_group=tp_group, pipeline_stage_manager=sm)
    msg = parity.refused_unchanged(t5, lambda: ShardFormer(shard_config=cfg).optimize(t5, policy=WrongSkip()),
                                   "a skip keyword the forward lacks", ValueError, structure=True)
    assert "encoder_states=" in msg and "T5ForConditionalGeneration.forward" in msg, msg
    msgs.append(msg)
    return msgs


def from_pretrained_encdec(ctx, name: str, pp: int, tp: int, path: str) -> dict:
    """ShardFormer.from_pretrained of an encoder-decoder with a stage manager:
    each stage reads its tensors only (a tied embedding stored once is read
    by every stage holding it under any of its names), no warning about
    parameters missing from the checkpoint, and the pipeline's logits equal
    HF's from_pretrained."""
    import warnings

    import transformers

    cls = getattr(transformers, name)
    tp_group, pp_group = groups(ctx, pp, tp)
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        build(name, 4).save_pretrained(path)
    dist.barrier()
    sm = PipelineStageManager(pp_group)
    cfg = ShardConfig(tensor_parallel_process_group=tp_group, pipeline_stage_manager=sm,
                      enable_tensor_parallelism=tp > 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)          # "newly initialized" would be one
        model, _ = ShardFormer(shard_config=cfg).from_pretrained(cls, path, attn_implementation="eager")
    ref = cls.from_pretrained(path, attn_implementation="eager").eval()
    batch = batch_of(name)
    out = OneForwardOneBackwardSchedule(sm, num_microbatches=2).forward(model, batch)
    err = parity.assert_close(f"{name} logits from_pretrained", out.logits, ref(**batch).logits, TOL)
    held = sum(p.numel() for p in model.parameters())
    full = sum(p.numel() for p in ref.parameters())
    assert held < full, (held, full)
    dist.barrier()
    return {"err": err, "fraction": held / full}


def chatglm2_refusals(ctx) -> list[str]:
    """ChatGLM2's split loops over encoder.num_layers (StageSplit.count):
    a count attribute the model lacks, or one that does not count the
    layers, is refused by name before anything changes; so is p-tuning
    (pre_seq_len) under pipeline parallelism."""
    import dataclasses

    from shardformer.policies.chatglm2 import ChatGLMForConditionalGenerationPolicy

    class MissingCount(ChatGLMForConditionalGenerationPolicy):
        pipeline_split = dataclasses.replace(ChatGLMForConditionalGenerationPolicy.pipeline_split, count="n_blocks")

    msgs = []
    tp_group, pp_group = groups(ctx, 2, 1)
    name = "ChatGLMForConditionalGeneration"
    for policy, expected, change in ((MissingCount(), "transformer.encoder.n_blocks", None),
                                     (None, "transformer.encoder.num_layers", 3)):
        model = build(name, 4)
        if change is not None:                       # the attribute disagrees with the layer list
            model.transformer.encoder.num_layers = change
        cfg = ShardConfig(tensor_parallel_process_group=tp_group, pipeline_stage_manager=PipelineStageManager(pp_group),
                          enable_tensor_parallelism=False)
        msg = parity.refused_unchanged(model, lambda: ShardFormer(shard_config=cfg).optimize(model, policy=policy),
                                       f"a ChatGLM2 split counted by {expected}", ValueError, structure=True)
        assert name in msg and expected in msg and "4 layers of transformer.encoder.layers" in msg, msg
        msgs.append(msg)
    model = build(name, 4, pre_seq_len=3)              # p-tuning: refused by name
    cfg = ShardConfig(tensor_parallel_process_group=tp_group, pipeline_stage_manager=PipelineStageManager(pp_group),
                      enable_tensor_parallelism=False)
    msg = parity.refused_unchanged(model, lambda: ShardFormer(shard_config=cfg).optimize(model),
                                   "a ChatGLM2 pipeline with pre_seq_len", NotImplementedError, structure=True)
    assert name in msg and "pre_seq_len=3" in msg and "transformer.prefix_encoder" in msg, msg
    msgs.append(msg)
    return msgs


# Swin / Swinv2 (StageSplit.shaped_layers): the Swin stages of encoder.layers are the layer list, by the
# number of virtual stages.  2: 3 Swin stages (8x8, 4x4, 2x2 patches), uneven: one pipeline stage holds two,
# the edge after the first patch merging.  4 (PP=4, or PP=2 x 2 chunks): the zoo's "/stages4" models, 4 Swin
# stages (16x16 .. 2x2 patches) of one block, one per virtual stage, so every edge of the chain crosses a
# merging (messages [B, 256, 40], [B, 64, 80], [B, 16, 160]).
SWIN_3STAGES = dict(depths=[2, 1, 1], num_heads=[5, 10, 20], encoder_stride=16)   # 2x2 patches out: x16 = 32 pixels


def swin_classes_equal_unsharded(ctx, classes, schedule: str, tp: int = 1, chunks: int = 1, m: int = 2,
                                 default: bool = False, refusals: bool = False) -> list[dict]:
    """equals_unsharded for each class of `classes` (one pool call, the set-up
    shared), at PP=2 (PP=4 with `default`: PipelineStageManager() and a plain
    ShardConfig over the default group); each stage past the first ran the Swin stages before its
    chunk in shapes only, each chunk's first one took the received message.
    refusals: then the outputs a Swin pipeline cannot give are refused
    (_swin_output_refusals)."""
    reports = []
    pp = ctx.world_size if default else 2
    for name in classes:
        before = stages_module.COUNTS.get("shaped_layers", 0)
        # config.num_hidden_layers is Swin's num_layers: the Swin stage count
        if pp * chunks == 4:
            report = equals_unsharded(ctx, f"{name}/stages4", pp, schedule, m, tp, chunks, 4, default=default)
        else:
            report = equals_unsharded(ctx, name, pp, schedule, m, tp, chunks, 3, default=default, **SWIN_3STAGES)
        shaped = stages_module.COUNTS.get("shaped_layers", 0) - before
        sm_stage = ctx.rank // tp % pp if not default else ctx.rank
        if sm_stage > 0 or chunks > 1:
            assert shaped > 0, f"{name}: stage {sm_stage} ran no Swin stage in shapes only"
        reports.append(dict(report, name=name, shaped=shaped))
    if refusals:
        _swin_output_refusals(ctx, classes[0], schedule, tp)
    return reports


def _swin_output_refusals(ctx, name: str, schedule: str, tp: int) -> None:
    """output_hidden_states / output_attentions (in the batch, or the config)
    raise NotImplementedError naming them on every rank, before any message."""
    _, model, sm, _ = pipelined(ctx, name, 2, tp, layers=3, **SWIN_3STAGES)
    runner = SCHEDULES[schedule](sm, num_microbatches=2)
    sent = p2p.COUNTS["sent"]
    for asked, batch in (("output_hidden_states", dict(batch_of(name), output_hidden_states=True)),
                         ("output_attentions", dict(batch_of(name), output_attentions=True))):
        try:
            runner.forward(model, batch)
        except NotImplementedError as e:
            assert asked in str(e) and name in str(e) and "encoder.layers" in str(e), str(e)
        else:
            raise AssertionError(f"{name}: {asked} under pipeline parallelism was not refused")
    model.config.output_hidden_states = True
    try:
        runner.forward(model, batch_of(name))
    except NotImplementedError as e:
        assert "output_hidden_states" in str(e), str(e)
    else:
        raise AssertionError(f"{name}: config.output_hidden_states under pipeline parallelism was not refused")
    assert p2p.COUNTS["sent"] == sent, f"{name}: a refused step sent messages"


# (class, schedule, tp, chunks, default ShardConfig) per family kind: decoder LMs, an encoder,
# an encoder-decoder, a vision encoder; every schedule, TP=2 x PP=2 and the plain ShardConfig()
PER_LAYER_CASES = (("LlamaForCausalLM", "gpipe", 1, 1, True), ("GPT2LMHeadModel", "1f1b", 2, 1, False),
                   ("BertForMaskedLM", "interleaved", 1, 2, False), ("T5ForConditionalGeneration", "1f1b", 1, 1, False),
                   ("ViTForImageClassification", "zb-h1", 1, 1, False))


def _runner(schedule: str, sm, m: int = 2):
    from shardformer.pipeline import ZeroBubbleSchedule

    cls = ZeroBubbleSchedule if schedule == "zb-h1" else SCHEDULES[schedule]
    return cls(sm, num_microbatches=m)


def per_layer_outputs_refused(ctx) -> list[str]:
    """output_hidden_states / output_attentions under pipeline parallelism
    (the unsharded model returns one entry per layer, the last stage holds
    its own layers' only): for each PER_LAYER_CASES family and schedule, in
    the batch (forward and forward_backward_step) or in the model's config,
    NotImplementedError on every rank naming the class and the flag, before
    any message between the stages and with the parameters untouched.  A
    batch that asks for nothing still runs and its return_dict=False tuple
    equals the unsharded model's with use_cache=False (the stages run without
    a cache: return_dict=False with use_cache=True, from the config too, is
    refused).  Stages that disagree on a flag: ValueError naming the stages."""
    import time

    msgs = []
    for name, schedule, tp, chunks, default in PER_LAYER_CASES:
        pp = ctx.world_size if default else 2
        ref, model, sm, _ = pipelined(ctx, name, pp, tp, chunks, default=default)
        runner = _runner(schedule, sm)
        batch = batch_of(name)
        before = {k: t.detach().clone() for k, t in model.state_dict().items()}
        sent = p2p.COUNTS["sent"]
        asks = [(flag, dict(batch, **{flag: True}), call) for flag in ("output_hidden_states", "output_attentions")
                for call in ("forward", "forward_backward_step")]
        model.config.output_attentions = True
        asks.append(("config.output_attentions", batch, "forward"))
        for flag, b, call in asks:
            try:
                getattr(runner, call)(model, b)
            except NotImplementedError as e:
                assert name in str(e) and f"{flag}=True" in str(e) and "docs/pipeline.md" in str(e), str(e)
                msgs.append(str(e))
            else:
                raise AssertionError(f"{name} ({schedule}): {flag} under pipeline parallelism was not refused ({call})")
        model.config.output_attentions = False
        assert p2p.COUNTS["sent"] == sent, f"{name}: a refused step sent messages"
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), f"{name}: a refused step changed the model"
        # output_hidden_states=False in the batch overrides the config's True, as for the unsharded model
        model.config.output_hidden_states = True
        ref.config.output_hidden_states = True
        plain = dict(batch, output_hidden_states=False, return_dict=False)
        if "use_cache" in inspect.signature(type(model).forward).parameters and model.config.use_cache:
            # the stages run without a cache: a tuple lacking the unsharded model's cache is refused
            try:
                runner.forward(model, plain)
            except NotImplementedError as e:
                assert name in str(e) and "return_dict=False with use_cache=True" in str(e), str(e)
                msgs.append(str(e))
            else:
                raise AssertionError(f"{name}: return_dict=False with the config's use_cache=True was not refused")
            plain["use_cache"] = False
        if name == "GPT2LMHeadModel":                     # one real step per family would cost CI time
            model.eval()
            ref.eval()
            got = runner.forward(model, plain)
            exp = ref(**plain)
            assert isinstance(got, tuple) and len(got) == len(exp), (len(got), len(exp))
            for k, (g, e) in enumerate(zip(got, exp)):
                parity.assert_close(f"{name} return_dict=False [{k}] on stage {sm.stage}", g, e, TOL)
    # the stages disagree (stage 0 asks): every rank raises within seconds, naming the stages
    _, model, sm, _ = pipelined(ctx, "LlamaForCausalLM", ctx.world_size, default=True)
    batch = batch_of("LlamaForCausalLM")
    start = time.monotonic()
    try:
        GPipeSchedule(sm, num_microbatches=2).forward(model, dict(batch, output_hidden_states=sm.stage == 0))
    except ValueError as e:
        assert "disagree" in str(e) and all(f"stage {s}" in str(e) for s in range(sm.num_stages)), str(e)
        msgs.append(str(e))
    else:
        raise AssertionError("stages disagreeing on output_hidden_states were not caught")
    assert time.monotonic() - start < 10, time.monotonic() - start
    return msgs


def swin_sequence_parallel_in_stages(ctx, overlap: bool) -> list[dict]:
    """Swin and Swinv2 at TP=2 x PP=2 with split_gather sequence parallelism
    inside the stages (and enable_sequence_overlap when `overlap`): the loss
    and the state after one SGD step equal the unsharded model's (equals_unsharded;
    Swin stages of 2, 1, 1 blocks: the first stage's blocks on rows)."""
    from shardformer.layer.linear import GatherRowsLinear

    config = {"enable_sequence_overlap": True} if overlap else None
    reports = []
    for name in ("SwinForImageClassification", "Swinv2ForImageClassification"):
        # the rows (dim 1) each Swin block was given and returned, here and in the reference (global hooks
        # run before a block's own: the input before its gather, the output before its split)
        rows: list[int] = []

        def record(module, args, out=None):
            if type(module).__name__ in ("SwinLayer", "Swinv2Layer"):
                rows.extend(t.shape[1] for t in (args[0] if args else None, out[0] if out else None)
                            if isinstance(t, torch.Tensor))
        handles = [torch.nn.modules.module.register_module_forward_pre_hook(record),
                   torch.nn.modules.module.register_module_forward_hook(record)]
        overlapped = GatherRowsLinear.overlapped
        try:
            report = equals_unsharded(ctx, name, 2, "1f1b", 2, 2, 1, 3, False, 4, config, "split_gather",
                                      **SWIN_3STAGES)
        finally:
            for handle in handles:
                handle.remove()
        # the blocks ran on this rank's rows: fewer than the unsharded model's tokens at any Swin stage
        # (Swinv2's post-norm blocks are given rows but for a Swin stage's first: the second pipeline
        # stage's Swin stages of one block run whole, plain TP)
        stage = ctx.rank // 2 % 2
        if not name.startswith("Swinv2") or stage == 0:
            split = [r for r in rows if r not in _swin_tokens(name)]
            assert split, f"{name}: no Swin block on stage {stage} was given rows (rows: {rows})"
        if overlap:
            assert GatherRowsLinear.overlapped > overlapped or stage == 1 and name.startswith("Swinv2"), \
                f"{name}: no overlapped gather ran on stage {stage}"
        reports.append(dict(report, rows=rows))
    return reports


def _swin_tokens(name: str) -> set[int]:
    """The token counts of the Swin stages of the SWIN_3STAGES model at the zoo's image size."""
    config = build(name, 3, **SWIN_3STAGES).config
    side, counts = config.image_size // config.patch_size, set()
    for _ in config.depths:
        counts.add(side * side)
        side = (side + 1) // 2
    return counts
