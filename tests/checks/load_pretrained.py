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


# ------------------------------------------------------------ mapped (aliased) shards
def _maps(path: str) -> bool:
    """Whether this process has `path` (a file) mapped (/proc/self/maps)."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return any(line.rstrip("\n").endswith(" " + real) for line in f)


def _sha(path_or_fd) -> str:
    import hashlib

    h = hashlib.sha256()
    if isinstance(path_or_fd, int):
        os.lseek(path_or_fd, 0, os.SEEK_SET)
        while chunk := os.read(path_or_fd, 1 << 20):
            h.update(chunk)
    else:
        with open(path_or_fd, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def _cfg(ctx, default_group: bool) -> ShardConfig:
    return ShardConfig() if default_group else ShardConfig(tensor_parallel_process_group=ctx.group)


def mapped_rows_only(ctx, directory: str) -> dict:
    """from_pretrained(mmap="rows"): the row shards and replicated tensors
    alias the file, the column shards (o_proj, down_proj) are compact
    copies; every tensor equals its slice of the unsharded model.  A bad
    mmap value is refused by name before anything is read or built."""
    import transformers

    name = "LlamaForCausalLM"
    _save_hf(ctx, name, directory)
    cfg = ShardConfig()
    try:
        ShardFormer(cfg).from_pretrained(transformers.LlamaForCausalLM, directory + "-absent", mmap="columns")
        raise AssertionError("mmap='columns' was accepted")
    except ValueError as e:
        assert "mmap='columns'" in str(e) and "docs/load.md" in str(e), str(e)
    model, _ = ShardFormer(cfg).from_pretrained(transformers.LlamaForCausalLM, directory,
                                                attn_implementation="eager", mmap="rows")
    from shardformer.checkpoint import mapped

    file = os.path.realpath(os.path.join(directory, "model.safetensors"))
    aliased = set(mapped.mapped_files(model).get(file, []))
    expected = _expected_aliased(model, rows_only=True)
    assert aliased == expected, (f"{name} mmap='rows': aliased {sorted(aliased - expected)} unexpectedly, "
                                 f"copied {sorted(expected - aliased)} that could be mapped")
    o_proj = dict(model.named_parameters())["model.layers.0.self_attn.o_proj.weight"]
    assert o_proj.is_contiguous(), f"o_proj under mmap='rows' has strides {o_proj.stride()}: not a compact copy"
    _holds(name, model, zoo.build(name).eval())
    return {"aliased": len(aliased)}


def _expected_aliased(model, rows_only: bool = False) -> set[str]:
    """The tensors whose shard is one contiguous range of one dimension of
    the file's tensor: the replicated ones, and shards (rows or columns)
    without padding whose ranges are back to back."""
    info, out = _shard_info(model), set()
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) not in info:
            out.add(key)
            continue
        dim, shard, _ = info[id(t)]
        runs = all(s == shard.ranges[0][0] + sum(n for _, n in shard.ranges[:i])
                   for i, (s, _) in enumerate(shard.ranges))
        if shard.length == shard.real and runs and (dim == 0 or not rows_only):
            out.add(key)
    return out


def ctx_full_width(model, key: str) -> int:
    """The unsharded width (input features) of linear weight `key`."""
    module = model.get_submodule(key.rsplit(".", 1)[0])
    return module.in_features


def mapped_shards_equal_slices(ctx, directory: str, default_group: bool) -> dict:
    """ShardFormer.from_pretrained (Llama, vocabulary 101: padded at TP=2
    and 4) maps the checkpoint instead of copying the shards that are one
    contiguous range of one dimension of it: the file is in this process's
    mappings, exactly the replicated tensors and the unpadded row and
    column shards alias it (a column shard of o_proj / down_proj as a
    strided view: its rows' stride is the full input width), and every
    tensor equals its slice of the unsharded model (padding zero).  The
    padded vocabulary shard is copied, by several threads at once.  Outputs
    and every gradient equal the unsharded model's."""
    import transformers

    name = "LlamaForCausalLM"
    _save_hf(ctx, name, directory)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)               # the column shards read by 3 threads
    try:
        model, _ = ShardFormer(_cfg(ctx, default_group)).from_pretrained(
            transformers.LlamaForCausalLM, directory, attn_implementation="eager", mmap=True)
    finally:
        torch.set_num_threads(threads)
    file = os.path.join(directory, "model.safetensors")
    assert _maps(file), f"{name}: {file} is not mapped: every shard was copied"
    from shardformer.checkpoint import mapped

    aliased = set(mapped.mapped_files(model).get(os.path.realpath(file), []))
    expected = _expected_aliased(model)
    assert aliased == expected, (f"{name}: aliased {sorted(aliased - expected)} unexpectedly, "
                                 f"copied {sorted(expected - aliased)} that could be mapped")
    assert any(".q_proj." in k for k in aliased) and any(".o_proj." in k for k in aliased), sorted(aliased)
    params = dict(model.named_parameters())
    for key in ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        w, full = params[key], ctx_full_width(model, key)
        assert w.stride() == (full, 1) and not w.is_contiguous(), (
            f"{key}: a column shard {tuple(w.shape)} should be a view of the mapped ({w.shape[0]}, {full}) "
            f"tensor (strides ({full}, 1)), got strides {w.stride()}")
    ref = zoo.build(name).eval()
    _holds(name, model, ref)
    report = _same_as(name, model.train(), ref.train(), zoo.make_inputs(name))
    report["aliased"] = sorted(aliased)
    return report


def _trained_step(model) -> None:
    """One SGD step on the model's LM loss (every parameter written)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    inputs = zoo.make_inputs("LlamaForCausalLM")
    parity.loss_of(model(**inputs), {}).backward()
    opt.step()
    opt.zero_grad()


def writes_never_reach_the_file(ctx, directory: str, default_group: bool) -> dict:
    """A model loaded mapped: an optimizer step changes its parameters and
    not one byte of the checkpoint file; save_pretrained and then
    save_sharded over the very directory it is mapped from leave the
    model's values alone (no parameter maps the replaced files afterwards)
    and the old file's bytes unchanged (read through a descriptor opened
    before); what was saved loads back equal to the trained model."""
    import transformers

    from shardformer.checkpoint import load_sharded, save_pretrained, save_sharded

    cls, cfg = transformers.LlamaForCausalLM, _cfg(ctx, default_group)
    _save_hf(ctx, "LlamaForCausalLM", directory)
    file = os.path.join(directory, "model.safetensors")
    original = _sha(file)
    model, _ = ShardFormer(cfg).from_pretrained(cls, directory, attn_implementation="eager", mmap=True)
    assert _maps(file), f"{file} is not mapped: every shard was copied"
    from shardformer.checkpoint import mapped

    aliased = mapped.mapped_files(model)[os.path.realpath(file)]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _trained_step(model.train())
    changed = [k for k in aliased if not torch.equal(model.state_dict()[k], before[k])]
    assert changed, "the step changed no mapped parameter"
    assert _sha(file) == original, f"{file} changed on disk after an optimizer step on the mapped model"
    reread, _ = ShardFormer(cfg).from_pretrained(cls, directory, attn_implementation="eager", mmap=False)
    assert all(torch.equal(v, before[k]) for k, v in reread.state_dict().items()), "the file reads back changed"

    for save in ("save_pretrained", "save_sharded"):
        fd = os.open(file, os.O_RDONLY)          # the file the model was mapped from, whatever the save does
        try:
            trained = {k: v.clone() for k, v in model.state_dict().items()}
            save_pretrained(model, directory) if save == "save_pretrained" else save_sharded(model, directory)
            assert _sha(fd) == original, f"{save} over the mapped checkpoint changed the old file's bytes"
        finally:
            os.close(fd)
        now = model.state_dict()
        assert all(torch.equal(now[k], trained[k]) for k in trained), f"{save} changed the model's values"
        assert not mapped.mapped_files(model).get(os.path.realpath(file)), \
            f"{save}: parameters still map the replaced {file}"
        if save == "save_pretrained":
            again, _ = ShardFormer(cfg).from_pretrained(cls, directory, attn_implementation="eager")
        else:
            again = zoo.build("LlamaForCausalLM", seed=1).eval()
            ShardFormer(cfg).optimize(again)
            load_sharded(again, directory)
        got = again.state_dict()
        assert all(torch.equal(got[k], trained[k]) for k in trained), f"{save}: saved values do not load back"
        if save == "save_pretrained":                   # a model mapped from the new files, trained again
            model, file = again, os.path.join(directory, "model.safetensors")
            original = _sha(file)
            _trained_step(model.train())
            assert _sha(file) == original
    return {"aliased": len(aliased), "changed": len(changed)}


def lazy_model_loads_mapped(ctx, directory: str) -> dict:
    """The lazy path by hand: a model built under lazy_init(), optimize()d
    (its shards allocated, never written), then load_pretrained(mmap=True):
    mapped shards, equal outputs and gradients to the unsharded model; a
    meta-device model is still refused by name before anything is read."""
    from shardformer import lazy_init

    name = "LlamaForCausalLM"
    _save_hf(ctx, name, directory)
    with lazy_init():
        model = zoo.build(name, seed=1).eval()
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    load_pretrained(model, directory, mmap=True)
    assert _maps(os.path.join(directory, "model.safetensors"))
    ref = zoo.build(name).eval()
    _holds(name, model, ref)
    report = _same_as(name, model, ref, zoo.make_inputs(name))
    with torch.device("meta"):
        meta = zoo.build(name, seed=1)
    try:
        load_pretrained(meta, directory, mmap=True)
    except ValueError as e:
        assert "meta device" in str(e), str(e)
        report["meta"] = str(e).splitlines()[-1]
    else:
        raise AssertionError("a meta-device model was loaded without a word")
    return report
