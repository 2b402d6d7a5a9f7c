"""Rank-side checks that a sharded model keeps the run-time state of the model
it came from (tests/test_runtime_state.py): eval/train, frozen parameters,
hooks, HF flags, gradient checkpointing.  Each function runs on every rank of
the pool."""
from __future__ import annotations

import copy
import warnings

import torch

import zoo
from checks import parity
from shardformer import ShardConfig, ShardFormer

DROPOUT = 0.25


def build_with_dropout(name: str, p: float = DROPOUT):
    """zoo.build_with_dropout with this module's default probability."""
    return zoo.build_with_dropout(name, p)


def eval_matches(ctx, names: list[str]) -> dict:
    """model.eval() before optimize(): with every dropout > 0 in the config,
    the sharded model's outputs equal the unsharded model's in eval mode, and
    no module of the sharded model is left in training mode."""
    report = {}
    for name in names:
        model = build_with_dropout(name)
        inputs = zoo.make_inputs(name)
        model.eval()
        ref = copy.deepcopy(model)
        ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
        training = [n for n, m in model.named_modules() if m.training]
        assert not training, f"{name}: modules left in training mode after optimize(): {training[:8]}"
        with torch.no_grad():
            got, exp = model(**inputs), ref(**inputs)
        errs = parity.check_outputs(f"{name} (eval, dropout {DROPOUT})", got, exp, parity.TOL[torch.float32])
        report[name] = max(errs.values()) if errs else 0.0
    return report


def train_eval_follow(ctx, name: str) -> dict:
    """optimize() in training mode; later eval()/train() reach every module,
    and eval() gives the unsharded eval outputs.  In training mode the dropout
    masks differ, so the outputs must differ from eval's (dropout is live)."""
    model = build_with_dropout(name)
    inputs = zoo.make_inputs(name)
    model.train()
    ref = copy.deepcopy(model).eval()
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    assert all(m.training for m in model.modules())
    model.eval()
    assert not any(m.training for m in model.modules())
    with torch.no_grad():
        got, exp = model(**inputs), ref(**inputs)
        parity.check_outputs(name, got, exp, parity.TOL[torch.float32])
        model.train()
        assert all(m.training for m in model.modules())
        noisy = parity.output_tensors(model(**inputs))
    key = next(k for k in noisy if k in parity.output_tensors(exp))
    diff = parity.rel_err(noisy[key], parity.output_tensors(exp)[key])
    assert diff > 1e-3, f"{name}: training-mode output equals eval output ({diff:.2e}): dropout is not running"
    return {"train_vs_eval": diff}


def frozen_stay_frozen(ctx) -> dict:
    """Parameters frozen before optimize() stay frozen (their shards too), get
    no gradient; the trainable ones still match the unsharded gradients."""
    model = zoo.build("LlamaForCausalLM")
    inputs = zoo.make_inputs("LlamaForCausalLM")
    frozen = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.0.mlp.down_proj.weight", "model.norm.weight")
    for n, p in model.named_parameters():
        if n in frozen:
            p.requires_grad_(False)
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    wrong = [n for n, f in flags.items() if f == (n in frozen)]
    assert not wrong, f"requires_grad not carried over for {wrong}"
    model(**inputs).loss.backward()
    ref(**inputs).loss.backward()
    for n, p in model.named_parameters():
        assert (p.grad is None) == (n in frozen), f"{n}: grad {'missing' if p.grad is None else 'present'}"
    return {"frozen": sorted(n for n, f in flags.items() if not f)}


def hooks_carried(ctx) -> dict:
    """A forward hook the user put on a module that gets replaced still runs
    (on the parallel layer), sees the same full output for a row-parallel
    layer, and its handle still removes it."""
    model = zoo.build("LlamaForCausalLM").eval()
    inputs = zoo.make_inputs("LlamaForCausalLM")
    seen, ref_seen = [], []
    handle = model.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    ref = copy.deepcopy(model)
    ref.model.layers[1].mlp.down_proj._forward_hooks.clear()
    ref.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, a, out: ref_seen.append(out.detach()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    msgs = [str(w.message) for w in caught if "model.layers.1.mlp.down_proj" in str(w.message)]
    assert msgs, f"no warning about the carried hook; got {[str(w.message) for w in caught]}"
    assert type(model.model.layers[1].mlp.down_proj).__name__ == "Linear1D_Row"
    with torch.no_grad():
        model(**inputs)
        ref(**inputs)
    assert len(seen) == 1 and len(ref_seen) == 1, (len(seen), len(ref_seen))
    parity.assert_close("hooked output", seen[0], ref_seen[0], parity.TOL[torch.float32])
    handle.remove()
    with torch.no_grad():
        model(**inputs)
    assert len(seen) == 1, "handle.remove() did not remove the carried hook"
    return {"calls": len(seen)}


def hf_flags_carried(ctx) -> dict:
    model = zoo.build("LlamaForCausalLM")
    before = {n for n, m in model.named_modules() if getattr(m, "_is_hf_initialized", False)}
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    after = {n for n, m in model.named_modules() if getattr(m, "_is_hf_initialized", False)}
    missing = sorted(before - after)
    assert before and not missing, f"_is_hf_initialized lost on {missing[:8]} ({len(before)} had it)"
    return {"flagged": len(after)}


def patched_forward_refused(ctx) -> dict:
    """A module whose forward was patched on the instance cannot be replaced
    faithfully: optimize() refuses before changing anything."""
    model = zoo.build("LlamaForCausalLM")
    target = model.model.layers[0].self_attn.o_proj
    target.forward = lambda x: x
    before = {n: p for n, p in model.named_parameters()}
    try:
        ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    except ValueError as e:
        msg = str(e)
    else:
        raise AssertionError("optimize() accepted a module with a patched forward")
    assert "model.layers.0.self_attn.o_proj" in msg and "LlamaForCausalLM" in msg, msg
    assert model.model.layers[0].self_attn.o_proj is target
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    return {"message": msg}


def _grads_after_step(model, inputs, seed: int) -> dict[str, torch.Tensor]:
    for m in model.modules():
        if hasattr(m, "step") and hasattr(m, "seed") and hasattr(m, "per_rank_mask"):
            m.step = 0
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(**inputs)
    probe = {}
    parity.loss_of(out, probe).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def checkpointing_matches(ctx, name: str, use_reentrant: bool) -> dict:
    """Gradient checkpointing on a sharded model with live dropout gives the
    same gradients as without it: the recomputed forward must draw the same
    dropout masks as the first (ours from their own generators, HF's from
    torch's, which checkpointing restores)."""
    model = build_with_dropout(name, 0.2)
    inputs = zoo.make_inputs(name)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    # and the masks were live: a different seed for torch's RNG changes HF's dropout
    return {"worst": checkpointed_grads_match(model, inputs, name, use_reentrant)}


def checkpointed_grads_match(model, inputs: dict, name: str, use_reentrant: bool) -> float:
    """The gradients of a training step of the (sharded) `model` equal with
    and without gradient checkpointing (switched on here); returns the
    largest relative difference."""
    model.train()
    plain = _grads_after_step(model, inputs, seed=11)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    ckpt = _grads_after_step(model, inputs, seed=11)
    assert plain.keys() == ckpt.keys(), sorted(set(plain) ^ set(ckpt))
    worst = 0.0
    for n in plain:
        worst = max(worst, parity.assert_close(f"{name} checkpointed grad of {n}", ckpt[n], plain[n],
                                               parity.TOL[torch.float32]))
    return worst


def recompute_without_rng_state_refused(ctx, name: str) -> dict:
    """A checkpoint that does not restore torch's generator
    (preserve_rng_state=False) cannot give our dropouts their first
    forward's masks back: the backward raises, naming the cause, instead of
    computing gradients with other masks."""
    from torch.utils.checkpoint import checkpoint

    model = build_with_dropout(name, 0.2)
    inputs = zoo.make_inputs(name)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    model.train()
    layer = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))[0]
    seen = {}
    handle = layer.register_forward_pre_hook(lambda m, a, k: seen.setdefault("x", (a, k)), with_kwargs=True)
    model(**inputs)
    handle.remove()
    args, kwargs = seen["x"]
    x = args[0].detach().requires_grad_()

    def first(h):
        out = layer(h, *args[1:], **kwargs)
        return out[0] if isinstance(out, tuple) else out

    out = checkpoint(first, x, use_reentrant=False, preserve_rng_state=False)
    try:
        out.sum().backward()
    except RuntimeError as e:
        assert "preserve_rng_state" in str(e), e
        return {"message": str(e)}
    raise AssertionError(f"{name}: a recomputation with other dropout masks was not refused")


def layerdrop_ranks_agree(ctx, name: str, same_seed: bool) -> dict:
    """layerdrop > 0 under TP: with torch seeded alike on every rank, the
    ranks skip the same layers in every training step (and some layers are
    skipped, some run); seeded differently, the forward is refused with a
    clear error before any layer runs a collective."""
    model = zoo.build_with_dropout(name, 0.5)
    inputs = zoo.make_inputs(name)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    model.train()
    ran = []
    for i, layer in enumerate(m for m in model.modules()
                              if type(m).__name__.endswith("DecoderLayer")):
        layer.register_forward_pre_hook(lambda m, a, i=i: ran.append(i))
    torch.manual_seed(5 if same_seed else 5 + ctx.rank)
    if not same_seed:
        try:
            model(**inputs)
        except RuntimeError as e:
            assert "layerdrop" in str(e) and "torch.manual_seed" in str(e) and not ran, (str(e), ran)
            return {"message": str(e)}
        raise AssertionError(f"{name}: ranks seeded differently were not refused")
    runs = []
    for _ in range(8):
        ran.clear()
        parity.loss_of(model(**inputs), {}).backward()
        runs.append(list(ran))
    everyone = [None] * ctx.tp_size
    torch.distributed.all_gather_object(everyone, runs, group=ctx.group)
    assert all(r == everyone[0] for r in everyone), everyone
    layers = {i for r in runs for i in r}
    assert any(len(r) < len(layers) for r in runs) and layers, runs   # some skipped, some ran
    return {"runs": runs}


def _hidden_states(out) -> list[torch.Tensor]:
    """Every hidden-states tensor of an output, nested outputs included."""
    found = []
    for key, value in (out.items() if hasattr(out, "items") else ()):
        if hasattr(value, "items"):
            found += _hidden_states(value)
        elif "hidden_states" in key and isinstance(value, tuple):
            found += [h for h in value if isinstance(h, torch.Tensor)]
    return found


def ranks_agree_in_training(ctx, name: str) -> dict:
    """A training forward with every dropout > 0 gives the same (replicated,
    gathered) outputs on every rank, three steps running: the residual
    stream's masks are equal across ranks, and nothing a rank draws on its
    own heads (uneven at TP=4) moves its generator away from its peers'."""
    model = zoo.build_with_dropout(name, 0.2)
    inputs = zoo.make_inputs(name)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    model.train()
    torch.manual_seed(7)
    worst = 0.0
    for step in range(3):
        # the hidden states, not only the outputs: an LM head's gathered logits are equal on every
        # rank by construction, while each rank's hidden states are its own copy
        result = model(**inputs, output_hidden_states=True)
        out = {f"hidden_states[{i}]": h for i, h in enumerate(_hidden_states(result))}
        out.update(parity.output_tensors(result))
        assert any(k.startswith("hidden_states") for k in out), f"{name}: no hidden states returned"
        for key, t in sorted(out.items()):
            everyone = [torch.empty_like(t) for _ in range(ctx.tp_size)]
            torch.distributed.all_gather(everyone, t.contiguous(), group=ctx.group)
            for r, other in enumerate(everyone):
                if not torch.equal(other, t):
                    raise AssertionError(f"{name}: step {step}, output {key} of rank {r} differs from rank "
                                         f"{ctx.rank}'s by {(other - t).abs().max().item():.3g}")
    return {"worst": worst}
