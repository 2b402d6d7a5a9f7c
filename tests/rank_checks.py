"""Rank-side functions for test_sharder / test_layers (run through the rank pool)."""
from __future__ import annotations

import copy
import os

import torch
import torch.nn.functional as F

import custom_models
import model_check
import model_zoo
from shardformer import ModulePolicyDescription, Policy, ShardConfig, ShardFormer
from shardformer import SubModuleReplacementDescription as Sub
from shardformer.checkpoint import gather_full_state_dict, load_full_state_dict
from shardformer.layer import Linear1D_Col


def custom_policy(ctx, which: str):
    policy = {"block": custom_models.ToyPolicy, "star": custom_models.ToyStarPolicy}[which]()
    return model_check.check_sharded(ctx, lambda: custom_models.ToyModel(), custom_models.toy_inputs(),
                                     name=f"ToyModel/{which}", policy=policy)


def _snapshot(model):
    return repr(model), {k: v.clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model, snap, inputs, ref_out):
    text, state = snap
    assert repr(model) == text, "module tree changed after a failed optimize()"
    now = model.state_dict()
    assert now.keys() == state.keys()
    for k in state:
        assert torch.equal(now[k], state[k]), f"{k} changed after a failed optimize()"
    assert not getattr(model, "_shardformer_sharded", False)
    out = model(**inputs)
    assert torch.equal(out.logits, ref_out), "model output changed after a failed optimize()"


def bad_shard_leaves_model_unchanged(ctx, name: str, overrides: dict, policy_name: str | None = None):
    """optimize() must raise before changing anything; returns the message."""
    model = model_zoo.build(name, **overrides)
    inputs = {"input_ids": torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(0))}
    with torch.no_grad():
        ref_out = model(**inputs).logits.clone()
    snap = _snapshot(model)
    policy = None
    if policy_name == "missing_suffix":
        policy = MissingSuffixPolicy()
    try:
        ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model, policy=policy)
    except (ValueError, TypeError) as e:
        message = str(e)
    else:
        raise AssertionError("optimize() did not raise")
    with torch.no_grad():
        _assert_unchanged(model, snap, inputs, ref_out)
    return message


class MissingSuffixPolicy(Policy):
    """A valid replacement followed by one naming a sub-module that does not exist."""

    def module_policy(self):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaModel

        return {
            LlamaModel: ModulePolicyDescription(sub_module_replacement=[Sub("embed_tokens.missing", Linear1D_Col)]),
            LlamaDecoderLayer: ModulePolicyDescription(
                sub_module_replacement=[Sub("mlp.gate_proj", Linear1D_Col), Sub("mlp.gate_projj", Linear1D_Col)]
            ),
        }


def generate_matches(ctx, name: str, new_tokens: int = 6):
    model = model_zoo.build(name)
    model.eval()
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    prompt = torch.randint(3, 90, (2, 5), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = model.generate(prompt, **kwargs)
        exp = ref.generate(prompt, **kwargs)
    assert torch.equal(got, exp), f"{name}: generate() differs:\n{got}\n{exp}"
    # The KV cache holds only this rank's heads: check via one cached step.
    with torch.no_grad():
        out = model(prompt, use_cache=True)
    keys = out.past_key_values.layers[0].keys
    return {"tokens": got.tolist(), "local_kv_heads": keys.shape[1]}


def state_dict_round_trip(ctx, name: str):
    """gather -> full HF state dict equal to the unsharded model's; then load it
    into a freshly sharded model built from another seed, which must then
    match the original outputs."""
    model = model_zoo.build(name)
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    full = gather_full_state_dict(model)
    exp = ref.state_dict()
    assert full.keys() == exp.keys(), set(full) ^ set(exp)
    for k in exp:
        assert full[k].shape == exp[k].shape, (k, full[k].shape, exp[k].shape)
        assert torch.equal(full[k], exp[k]), f"{k}: gathered tensor differs"
    other = model_zoo.build(name, seed=123)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(other)
    load_full_state_dict(other, full)
    inputs = model_zoo.make_inputs(name)
    with torch.no_grad():
        model_check.check_outputs(name, other(**inputs), ref(**inputs), model_check.TOL[torch.float32])
    # and the full dict loads into the plain HF model
    plain = model_zoo.build(name, seed=7)
    plain.load_state_dict(full)
    return len(full)


def gathered_state(ctx, name: str):
    model = model_zoo.build(name)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    # NumPy arrays cross the pool's pipes by value (torch tensors would go
    # through shared-memory handles, which do not survive the worker's reuse).
    full = gather_full_state_dict(model)  # collective: every rank gathers
    return {k: v.numpy() for k, v in full.items()} if ctx.rank == 0 else None


def load_into(ctx, name: str, full: dict):
    """Load a full state dict saved at another TP size; compare with the HF model holding it."""
    full = {k: torch.from_numpy(v) for k, v in full.items()}
    model = model_zoo.build(name, seed=99)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    load_full_state_dict(model, full)
    ref = model_zoo.build(name, seed=98)
    ref.load_state_dict(full)
    inputs = model_zoo.make_inputs(name)
    with torch.no_grad():
        model_check.check_outputs(name, model(**inputs), ref(**inputs), model_check.TOL[torch.float32])
    return True


def dropout_masks(ctx):
    from shardformer.layer import DropoutForParallelInput, DropoutForReplicatedInput

    rep = DropoutForReplicatedInput.from_native_module(torch.nn.Dropout(0.5), ctx.group)
    par = DropoutForParallelInput.from_native_module(torch.nn.Dropout(0.5), ctx.group)
    x = torch.ones(4096)
    torch.manual_seed(ctx.rank)  # global RNG differs per rank and must not matter
    state = torch.get_rng_state()
    r1, r2, p1 = rep(x), rep(x), par(x)
    assert torch.equal(torch.get_rng_state(), state), "dropout touched the global RNG"
    rep.eval()
    assert torch.equal(rep(x), x)
    gathered_r = [torch.empty_like(r1) for _ in range(ctx.tp_size)]
    gathered_p = [torch.empty_like(p1) for _ in range(ctx.tp_size)]
    torch.distributed.all_gather(gathered_r, r1, group=ctx.group)
    torch.distributed.all_gather(gathered_p, p1, group=ctx.group)
    assert all(torch.equal(g, gathered_r[0]) for g in gathered_r), "replicated masks differ across ranks"
    assert not any(torch.equal(gathered_p[0], g) for g in gathered_p[1:]), "parallel masks equal across ranks"
    assert not torch.equal(r1, r2), "mask did not advance between calls"
    kept = (r1 != 0).float().mean().item()
    assert 0.45 < kept < 0.55, kept
    assert set(r1.unique().tolist()) <= {0.0, 2.0}
    return kept


def cross_entropy_matches(ctx, vocab: int, smoothing: float, reduction: str, dtype_name: str = "float32"):
    from shardformer.layer import VocabParallelLMHead1D, cross_entropy_1d

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, vocab, bias=False).to(dtype)
    head = VocabParallelLMHead1D.from_native_module(copy.deepcopy(lin), ctx.group, gather_output=False,
                                                    make_vocab_size_divisible_by=4)
    x = torch.randn(3, 5, 16, dtype=dtype)
    labels = torch.randint(0, vocab, (3, 5))
    labels[0, :2] = -100
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss = cross_entropy_1d(head(x1), labels, vocab_size=vocab, label_smoothing=smoothing, reduction=reduction,
                            process_group=ctx.group)
    ref = F.cross_entropy(lin(x2).flatten(0, 1).float(), labels.flatten(), label_smoothing=smoothing,
                          reduction=reduction)
    if reduction == "none":
        ref = ref.view(3, 5)
    tol = model_check.TOL[dtype]
    model_check.assert_close("loss", loss, ref, tol)
    (loss.sum() if reduction == "none" else loss).backward()
    (ref.sum() if reduction == "none" else ref).backward()
    model_check.assert_close("dx", x1.grad, x2.grad, tol)
    from shardformer.layer.parallel_module import shard_of

    model_check.assert_close("dW", head.weight.grad, shard_of(lin.weight.grad, 0, head.shard), tol)
    return float(loss.detach().sum())


def mappings_round_trip(ctx):
    """gather/scatter over uneven, fused and padded layouts invert each other,
    forward and backward."""
    from shardformer.distributed import gather_from_tp_region, scatter_to_tp_region
    from shardformer.layout import Fused, Heads, Split, Vocab

    kv = 3 if ctx.tp_size == 3 else 2
    specs = [(Split(), 11), (Split(3), 15), (Heads(6, kv, 4).qkv, 24 + 8 * kv), (Vocab(4), 37), (Fused.equal(2), 14)]
    for spec, n in specs:
        shard = spec.resolve(n, ctx.tp_size, ctx.rank)
        full = torch.arange(2 * n, dtype=torch.float32).view(2, n).requires_grad_()
        local = scatter_to_tp_region(full, -1, shard, ctx.group)
        assert local.shape[-1] == shard.length
        back = gather_from_tp_region(local, -1, shard, ctx.group)
        assert torch.equal(back, full.detach()), (spec, back, full)
        (back * torch.arange(2 * n, dtype=torch.float32).view(2, n)).sum().backward()
        # d/dfull = weights, gathered from every rank's slice
        assert torch.equal(full.grad, torch.arange(2 * n, dtype=torch.float32).view(2, n)), spec
    return True


def collectives_match(ctx):
    from shardformer import distributed as D

    r, n = ctx.rank, ctx.tp_size
    t = torch.full((5,), float(r + 1))
    D.all_reduce(t, ctx.group)
    assert torch.equal(t, torch.full((5,), float(n * (n + 1) / 2)))
    m = torch.tensor([float(r)])
    D.all_reduce(m, ctx.group, op="max")
    assert m.item() == n - 1
    out = torch.empty(3 * n)
    D.all_gather_into_tensor(out, torch.full((3,), float(r)), ctx.group)
    assert torch.equal(out, torch.arange(n).float().repeat_interleave(3))
    rs = torch.empty(2)
    D.reduce_scatter_tensor(rs, torch.arange(2 * n, dtype=torch.float32), ctx.group)
    assert torch.equal(rs, torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) * n)
    b = torch.full((4,), float(r))
    D.broadcast(b, 1, ctx.group)
    assert torch.equal(b, torch.ones(4))
    if r == 0:
        D.send(torch.arange(4.0), 1, ctx.group)
    elif r == 1:
        got = D.recv(torch.empty(4), 0, ctx.group)
        assert torch.equal(got, torch.arange(4.0))
    # CPU ranks of one host share a segment: the C shared-memory backend serves them
    assert D.backend_for(t, ctx.group) == ("torch" if os.environ.get("SHARDFORMER_COMM") == "torch" else "shm")
    return True


def sequence_region_pair(ctx):
    from shardformer.distributed import gather_from_sequence_region, reduce_scatter_to_sequence_region

    n = ctx.tp_size
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(ctx.rank)).requires_grad_()
    full = gather_from_sequence_region(x, 1, ctx.group)
    assert full.shape == (2, 3 * n, 4)
    assert torch.equal(full[:, 3 * ctx.rank:3 * ctx.rank + 3], x.detach())
    back = reduce_scatter_to_sequence_region(full, 1, ctx.group)
    assert torch.allclose(back, x.detach() * n)
    back.sum().backward()
    # Backward: reduce-scatter's backward all-gathers the ones of every rank,
    # all-gather's backward reduce-scatters them: n on every element of x.
    assert torch.equal(x.grad, torch.full_like(x, float(n))), x.grad
    return True
