"""Rank-side checks of checkpoints of a sharded model (tests/test_checkpoints.py):
HF's save_pretrained writes a full checkpoint that plain transformers loads,
gather_full_state_dict's rank0_only / contiguity contracts, and full state
dicts gathered at one TP size and loaded at another.  Each function runs on
every rank of the pool."""
from __future__ import annotations

import copy
import os

import torch

import zoo
from checks import parity
from shardformer import ShardConfig, ShardFormer
from shardformer.checkpoint import _shard_info, gather_full_state_dict, load_full_state_dict


def _trained_pair(ctx, name: str):
    """(sharded, unsharded) after one identical SGD step, so that a checkpoint
    holding the initial weights would not pass."""
    model = zoo.build(name)
    inputs = zoo.make_inputs(name)
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    for m in (model, ref):
        probe = {}
        parity.loss_of(m(**inputs), probe).backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    return model.eval(), ref.eval(), inputs


def save_and_reload(ctx, name: str, directory: str) -> dict:
    """model.save_pretrained(dir) on every rank of the group; rank 0 then
    loads dir with plain transformers (no shardformer involved) and compares
    with the unsharded model after the same step: weights and outputs."""
    import safetensors.torch
    import transformers

    model, ref, inputs = _trained_pair(ctx, name)
    model.save_pretrained(directory)
    files = sorted(os.listdir(directory))
    leftovers = [f for f in os.listdir(os.path.dirname(directory)) if ".partial-" in f]
    assert not leftovers, f"temporary directories left beside the checkpoint: {leftovers}"
    if ctx.rank != 0:
        return {"files": files}
    assert "config.json" in files and any(f.endswith(".safetensors") for f in files), files
    # The files hold the full (HF) shapes, nothing of one rank's shard.
    shapes = {}
    for f in files:
        if f.endswith(".safetensors"):
            with safetensors.safe_open(os.path.join(directory, f), "pt") as fh:
                shapes.update({k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()})
    exp_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    wrong = {k: (s, exp_shapes[k]) for k, s in shapes.items() if k in exp_shapes and s != exp_shapes[k]}
    assert not wrong, f"{name}: saved shapes differ from the unsharded model's: {wrong}"
    # The kernels the unsharded reference runs with (eager attention; its experts
    # implementation: from_pretrained would pick grouped_mm, which our odd sizes do not fit).
    impl = {"attn_implementation": ref.config._attn_implementation}
    if getattr(ref.config, "_experts_implementation", None):
        impl["experts_implementation"] = ref.config._experts_implementation
    loaded = getattr(transformers, type(ref).__name__).from_pretrained(directory, **impl)
    loaded.eval()
    got_sd, exp_sd = loaded.state_dict(), ref.state_dict()
    assert got_sd.keys() == exp_sd.keys(), sorted(set(got_sd) ^ set(exp_sd))
    for k in exp_sd:
        parity.assert_close(f"{name} reloaded {k}", got_sd[k], exp_sd[k], parity.TOL[torch.float32])
    with torch.no_grad():
        errs = parity.check_outputs(f"{name} reloaded", loaded(**inputs), ref(**inputs),
                                    parity.TOL[torch.float32])
    return {"files": files, "err": max(errs.values()) if errs else 0.0, "tensors": len(shapes)}


def save_shard_refused(ctx, name: str, directory: str) -> str:
    """save_pretrained(state_dict=model.state_dict()) with a rank's shards is
    refused on every rank, before anything is written."""
    model, _, _ = _trained_pair(ctx, name)
    try:
        model.save_pretrained(directory, state_dict=model.state_dict())
    except ValueError as e:
        msg = str(e)
    else:
        raise AssertionError("a rank's shards were accepted as a full state dict")
    assert not os.path.exists(directory) or not os.listdir(directory), os.listdir(directory)
    return msg


def gather_modes(ctx, name: str) -> dict:
    """rank0_only: rank 0 gets every tensor, equal to the default gather's,
    the other ranks {}; every tensor is contiguous and owns its memory (not
    a view of the model), and safetensors saves rank 0's dict."""
    import safetensors.torch

    model, ref, _ = _trained_pair(ctx, name)
    everywhere = gather_full_state_dict(model)
    root_only = gather_full_state_dict(model, rank0_only=True, offload_to_cpu=True)
    exp = ref.state_dict()
    assert everywhere.keys() == exp.keys(), sorted(set(everywhere) ^ set(exp))
    params = {p.data_ptr() for p in model.parameters()}
    for k, t in everywhere.items():
        assert t.is_contiguous(), f"{k} is not contiguous"
        assert t.data_ptr() not in params, f"{k} shares memory with the model"
        parity.assert_close(f"{name} gathered {k}", t, exp[k], parity.TOL[torch.float32])
    if ctx.rank != 0:
        assert root_only == {}, f"rank {ctx.rank} got {len(root_only)} tensors with rank0_only"
        return {"n": 0}
    assert root_only.keys() == everywhere.keys()
    for k, t in root_only.items():
        assert t.is_contiguous() and torch.equal(t, everywhere[k]), k
    # safetensors refuses shared tensors: drop tied duplicates as HF does
    seen, unique = set(), {}
    for k, t in root_only.items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            unique[k] = t
    blob = safetensors.torch.save(unique)
    back = safetensors.torch.load(blob)
    assert all(torch.equal(back[k], unique[k]) for k in unique)
    sharded = sum(1 for _ in _shard_info(model))
    return {"n": len(root_only), "sharded": sharded}


def failed_save_leaves_nothing(ctx, directory: str) -> str:
    """A write that fails on rank 0 (here: an unwritable tensor type) raises
    on every rank and leaves no directory under the name."""
    model, _, _ = _trained_pair(ctx, "LlamaForCausalLM")
    hf_save = type(model).save_pretrained

    def broken(self, d, **kwargs):
        with open(os.path.join(d, "config.json"), "w") as f:
            f.write("{")                         # half of a checkpoint ...
        raise OSError("disk full")               # ... then the failure

    type(model).save_pretrained = broken
    try:
        model.save_pretrained(directory)
    except (OSError, RuntimeError) as e:
        msg = f"{type(e).__name__}: {e}"
    else:
        raise AssertionError("a failed save did not raise")
    finally:
        type(model).save_pretrained = hf_save
    assert not os.path.exists(directory), os.listdir(directory)
    assert not [f for f in os.listdir(os.path.dirname(directory)) if ".partial-" in f]
    return msg


def state_dict_round_trip(ctx, name: str):
    """gather -> full HF state dict equal to the unsharded model's; then load it
    into a freshly sharded model built from another seed, which must then
    match the original outputs."""
    model = zoo.build(name)
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    full = gather_full_state_dict(model)
    exp = ref.state_dict()
    assert full.keys() == exp.keys(), set(full) ^ set(exp)
    for k in exp:
        assert full[k].shape == exp[k].shape, (k, full[k].shape, exp[k].shape)
        assert torch.equal(full[k], exp[k]), f"{k}: gathered tensor differs"
    other = zoo.build(name, seed=123)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(other)
    load_full_state_dict(other, full)
    inputs = zoo.make_inputs(name)
    with torch.no_grad():
        parity.check_outputs(name, other(**inputs), ref(**inputs), parity.TOL[torch.float32])
    # and the full dict loads into the plain HF model
    plain = zoo.build(name, seed=7)
    plain.load_state_dict(full)
    return len(full)


def gathered_state(ctx, name: str):
    model = zoo.build(name)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    # NumPy arrays cross the pool's pipes by value (torch tensors would go
    # through shared-memory handles, which do not survive the worker's reuse).
    full = gather_full_state_dict(model)  # collective: every rank gathers
    return {k: v.numpy() for k, v in full.items()} if ctx.rank == 0 else None


def load_into(ctx, name: str, full: dict):
    """Load a full state dict saved at another TP size; compare with the HF model holding it."""
    full = {k: torch.from_numpy(v) for k, v in full.items()}
    model = zoo.build(name, seed=99)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    load_full_state_dict(model, full)
    ref = zoo.build(name, seed=98)
    ref.load_state_dict(full)
    inputs = zoo.make_inputs(name)
    with torch.no_grad():
        parity.check_outputs(name, model(**inputs), ref(**inputs), parity.TOL[torch.float32])
    return True
