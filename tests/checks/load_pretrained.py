"""Rank-side checks of shardformer.checkpoint.load_pretrained
(tests/test_load_pretrained.py): a checkpoint written by plain HF
save_pretrained from a model built from seed 0, loaded into a model built from
another seed and sharded by optimize(), gives the seed-0 model's outputs and
gradients; dtype conversion equals HF from_pretrained(dtype=...); bad
checkpoints are refused with every bad key listed and the model untouched;
each rank reads only its slices.  Each function runs on every rank of the pool."""
from __future__ import annotations

import io
import os
import sys

import torch
import torch.distributed as dist

import zoo
from checks import parity
from shardformer import ShardConfig, ShardFormer
from shardformer.checkpoint import _shard_info, load_pretrained
from shardformer.checkpoint.reader import CheckpointReader
from shardformer.layer.parallel_module import shard_of


def _sharded(ctx, name: str, seed: int, dtype=torch.float32, **overrides):
    model = zoo.build(name, dtype, seed=seed, **overrides).eval()
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    return model


def _written_by_rank0(ctx, write) -> None:
    """write() on rank 0, then every rank goes on once it is done."""
    if ctx.rank == 0:
        write()
    dist.barrier(group=ctx.group)


def _save_bin(model, directory: str, files: int) -> None:
    """What HF 4 wrote with safe_serialization=False (transformers 5 writes
    safetensors only): pytorch_model.bin, or `files` of them and an index."""
    import json

    model.config.save_pretrained(directory)
    sd = model.state_dict()
    if files == 1:
        torch.save(sd, os.path.join(directory, "pytorch_model.bin"))
        return
    keys, weight_map = list(sd), {}
    for i in range(files):
        fname = f"pytorch_model-{i + 1:05d}-of-{files:05d}.bin"
        part = keys[i * len(keys) // files:(i + 1) * len(keys) // files]
        torch.save({k: sd[k] for k in part}, os.path.join(directory, fname))
        weight_map.update(dict.fromkeys(part, fname))
    with open(os.path.join(directory, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


SAVES = {"single": {}, "index": {"max_shard_size": "20KB"}}


def _save_hf(ctx, name: str, directory: str, dtype=torch.float32, overrides=None, layout: str = "single"):
    """Rank 0 builds `name` from seed 0 and saves it with plain HF save_pretrained
    (layout "single" / "index"), or as torch pickles ("bin" / "bin-index")."""
    def write():
        model = zoo.build(name, dtype, **(overrides or {}))
        if layout.startswith("bin"):
            _save_bin(model, directory, 1 if layout == "bin" else 2)
        else:
            model.save_pretrained(directory, **SAVES[layout])
    _written_by_rank0(ctx, write)


def _same_as(name: str, model, ref, inputs: dict) -> dict:
    """Outputs, loss and every gradient of `model` (sharded) equal `ref`'s (unsharded)."""
    tol = parity.TOL[torch.float32]
    out, exp = model(**inputs), ref(**inputs)
    errs = parity.check_outputs(name, out, exp, tol)
    probe = {}
    loss, ref_loss = parity.loss_of(out, probe), parity.loss_of(exp, probe)
    loss.backward()
    ref_loss.backward()
    info, ref_params = _shard_info(model), dict(ref.named_parameters())
    worst = 0.0
    for pname, p in model.named_parameters():
        expected = ref_params[pname].grad
        if expected is None or p.grad is None:
            assert expected is None and p.grad is None, f"{name}: {pname}: gradient on one side only"
            continue
        if id(p) in info:
            dim, shard, _ = info[id(p)]
            expected = shard_of(expected, dim, shard)
        worst = max(worst, parity.assert_close(f"{name} grad of {pname}", p.grad, expected, tol))
    return {"forward": max(errs.values()), "grad": worst}


def _holds(name: str, model, ref) -> None:
    """Every tensor of the sharded model is exactly its shard of ref's (its
    vocabulary padding zeros)."""
    info, ref_sd = _shard_info(model), ref.state_dict()
    for key, t in model.state_dict(keep_vars=True).items():
        exp = ref_sd[key]
        if id(t) in info:
            dim, shard, _ = info[id(t)]
            exp = shard_of(exp, dim, shard)
            pad = t.detach().narrow(dim, shard.real, shard.length - shard.real)
            assert not pad.any(), f"{name}: {key}: padding is not zero"
        assert torch.equal(t.detach(), exp.to(t.dtype)), f"{name}: {key} differs from the saved model's"


def _files(directory: str) -> list[str]:
    return sorted(f for f in os.listdir(directory) if f.endswith((".safetensors", ".bin", ".json")))


def load_equals_saved(ctx, name: str, directory: str, layout: str, overrides: dict) -> dict:
    """HF save_pretrained (seed 0) -> load_pretrained into a seed-1 model
    sharded at ctx.tp_size: outputs and gradients equal the seed-0 model's."""
    _save_hf(ctx, name, directory, overrides=overrides, layout=layout)
    ref = zoo.build(name, **overrides).eval()
    model = _sharded(ctx, name, seed=1, **overrides)
    inputs = zoo.make_inputs(name)
    with torch.no_grad():        # the test can fail: before the load the outputs differ
        before = parity.output_tensors(model(**inputs))
        exp = parity.output_tensors(ref(**inputs))
        assert any(not torch.allclose(before[k], exp[k]) for k in exp), f"{name}: seeds 0 and 1 give the same model"
        for t in model.state_dict().values():     # and whatever the load does not write stays NaN
            if t.is_floating_point():
                t.fill_(float("nan"))
    load_pretrained(model, directory)
    _holds(name, model, ref)
    report = _same_as(name, model, ref, inputs)
    report["files"] = _files(directory)
    report["tied"] = len({id(p) for p in model.parameters()}) < len(list(model.named_parameters(
        remove_duplicate=False)))
    return report


def dtype_conversion(ctx, name: str, directory: str, saved: str, loaded: str) -> dict:
    """A `saved`-dtype checkpoint loaded into a `loaded`-dtype sharded model
    holds exactly HF from_pretrained(dtype=loaded)'s weights (this rank's
    shard of them); in float32 its outputs and gradients match too."""
    import transformers

    saved_dtype, loaded_dtype = getattr(torch, saved), getattr(torch, loaded)
    _save_hf(ctx, name, directory, dtype=saved_dtype)
    impl = {"attn_implementation": "eager"}
    ref = getattr(transformers, name).from_pretrained(directory, dtype=loaded_dtype, **impl).eval()
    model = _sharded(ctx, name, seed=1, dtype=loaded_dtype)
    load_pretrained(model, directory)
    assert all(t.dtype == loaded_dtype for t in model.state_dict().values() if t.is_floating_point())
    _holds(f"{name} {saved}->{loaded}", model, ref)
    if loaded_dtype == torch.float32:
        return _same_as(name, model, ref, zoo.make_inputs(name))
    return {}


def _edit_checkpoint(directory: str, edit) -> None:
    import safetensors.torch

    path = os.path.join(directory, "model.safetensors")
    tensors = safetensors.torch.load_file(path)
    edit(tensors)
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})


def bad_checkpoint_refused(ctx, name: str, directory: str) -> str:
    """A checkpoint with a key missing, an unexpected key and a wrongly shaped
    tensor: one ValueError naming the model class, the path and all three
    keys; the model's tensors are unchanged."""
    def write():
        zoo.build(name).save_pretrained(directory)

        def edit(sd):
            del sd["model.layers.0.mlp.up_proj.weight"]
            sd["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
            sd["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(24, 96)
        _edit_checkpoint(directory, edit)

    _written_by_rank0(ctx, write)
    model = _sharded(ctx, name, seed=1)
    return parity.refused_unchanged(model, lambda: load_pretrained(model, directory), "load of a bad checkpoint")


def tied_under_either_name(ctx, directory: str) -> dict:
    """Tied embeddings stored under the LM head's name only (HF writes the
    embedding's): still found, not missing."""
    name, tied = "LlamaForCausalLM", {"tie_word_embeddings": True}

    def write():
        zoo.build(name, **tied).save_pretrained(directory)

        def edit(sd):
            sd["lm_head.weight"] = sd.pop("model.embed_tokens.weight")
        _edit_checkpoint(directory, edit)

    _written_by_rank0(ctx, write)
    ref = zoo.build(name, **tied).eval()
    model = _sharded(ctx, name, seed=1, **tied)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    load_pretrained(model, directory)
    return _same_as(name, model, ref, zoo.make_inputs(name))


def reads_only_slices(ctx, name: str, directory: str, layout: str) -> dict:
    """Count the elements every read hands back (CheckpointReader._view is the
    one place data is read): exactly this rank's real shard elements plus the
    replicated tensors, not the full tensors."""
    _save_hf(ctx, name, directory, layout=layout)
    model = _sharded(ctx, name, seed=1)
    counted = {"read": 0}
    original = CheckpointReader._view

    def counting(self, key, index, touch):
        piece = original(self, key, index, touch)
        counted["read"] += piece.numel()
        return piece

    CheckpointReader._view = counting
    try:
        load_pretrained(model, directory)
    finally:
        CheckpointReader._view = original
    info, expected, seen = _shard_info(model), 0, set()
    for _, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        if id(t) in info:
            dim, shard, _ = info[id(t)]
            expected += t.numel() // t.shape[dim] * shard.real
        else:
            expected += t.numel()
    with CheckpointReader(directory) as reader:
        total = sum(reader.nbytes(k) // reader.dtype(k).itemsize for k in reader.keys())
    assert counted["read"] == expected, (counted["read"], expected)
    return {"read": counted["read"], "total": total}


def progress_bar(ctx, directory: str, progress) -> str:
    """What load_pretrained writes to stderr with progress=`progress`."""
    _save_hf(ctx, "LlamaForCausalLM", directory)
    model = _sharded(ctx, "LlamaForCausalLM", seed=1)
    saved_env, saved_err = os.environ.pop("TQDM_DISABLE", None), sys.stderr
    sys.stderr = io.StringIO()
    try:
        load_pretrained(model, directory, progress=progress)
        return sys.stderr.getvalue()
    finally:
        sys.stderr = saved_err
        if saved_env is not None:
            os.environ["TQDM_DISABLE"] = saved_env


def minilm(ctx, model_dir: str) -> dict:
    """The pretrained all-MiniLM-L6-v2 loaded into a BertModel built from its
    config and sharded equals HF BertModel.from_pretrained(dir)."""
    import transformers

    ref = transformers.BertModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    cfg._attn_implementation = "eager"
    torch.manual_seed(1)
    model = transformers.BertModel(cfg).eval()
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    load_pretrained(model, model_dir)
    g = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(1000, 20000, (2, 12), generator=g),
              "attention_mask": torch.ones(2, 12, dtype=torch.long)}
    inputs["attention_mask"][1, 9:] = 0
    return _same_as("all-MiniLM-L6-v2", model, ref, inputs)
