"""Rank-side checks of the streamed, atomic save_pretrained and of
save_sharded / load_sharded (tests/test_save.py).  Each function runs on
every rank of the pool's group; `child` runs in a subprocess of the test
(a TP=1 save that the test SIGKILLs at a chosen point)."""
from __future__ import annotations

import copy
import json
import os
import sys
import time
import weakref

import torch

import zoo
from checks import parity
from shardformer import ShardConfig, ShardFormer
from shardformer.checkpoint import atomic, gather_full_state_dict, load_sharded, save, save_sharded
from shardformer.checkpoint import sharded as sharded_mod

TOL = parity.TOL[torch.float32]


def _config(ctx, extra: dict | None = None, default_group: bool = False) -> ShardConfig:
    """ShardConfig over ctx.group, or with default_group the plain
    ShardConfig() (the default group: the whole world of the pool)."""
    if default_group:
        assert ctx.world_size == ctx.tp_size, "ShardConfig() shards over the world: run on a pool of tp ranks"
        return ShardConfig(extra_kwargs=extra or {})
    return ShardConfig(tensor_parallel_process_group=ctx.group, extra_kwargs=extra or {})


def _pair(ctx, name: str, overrides: dict | None = None, extra: dict | None = None, seed: int = 0,
          default_group: bool = False):
    """(sharded, unsharded, inputs) after one identical SGD step."""
    model = zoo.build(name, seed=seed, **(overrides or {}))
    ref = copy.deepcopy(model)
    inputs = zoo.make_inputs(name)
    ShardFormer(_config(ctx, extra, default_group)).optimize(model)
    for m in (model, ref):
        parity.loss_of(m(**inputs), {}).backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
        m.zero_grad(set_to_none=True)
    return model.eval(), ref.eval(), inputs


class PeakMeter:
    """The largest set of full tensors the writing rank holds at once:
    every tensor _gather_to_root returns and every tensor handed to
    _write_file is followed by a weak reference; at each of those events the
    distinct storages still alive are summed."""

    def __init__(self):
        self.live: dict[int, tuple[weakref.ref, int]] = {}
        self.peak = 0
        self.largest = 0
        self._orig = (save._gather_to_root, save._write_file)

    def _track(self, t):
        st = t.untyped_storage()
        self.live[id(t)] = (weakref.ref(t), st.data_ptr(), st.nbytes())
        self.largest = max(self.largest, t.numel() * t.element_size())

    def _measure(self):
        alive = {}
        for key, (ref, ptr, nbytes) in list(self.live.items()):
            if ref() is None:
                del self.live[key]
            else:
                alive[ptr] = nbytes
        self.peak = max(self.peak, sum(alive.values()))

    def __enter__(self):
        gather, write = self._orig

        def gather_tracked(*a, **k):
            full = gather(*a, **k)
            if full is not None:
                self._track(full)
                self._measure()
            return full

        def write_tracked(tensors, *a, **k):
            for t in tensors.values():
                self._track(t)
            self._measure()
            return write(tensors, *a, **k)

        save._gather_to_root, save._write_file = gather_tracked, write_tracked
        return self

    def __exit__(self, *exc):
        save._gather_to_root, save._write_file = self._orig


def _impl(ref) -> dict:
    """The kernels the unsharded reference runs with (eager attention; its experts implementation)."""
    impl = {"attn_implementation": ref.config._attn_implementation}
    if getattr(ref.config, "_experts_implementation", None):
        impl["experts_implementation"] = ref.config._experts_implementation
    return impl


def _file_keys(directory: str) -> dict[str, tuple]:
    import safetensors

    shapes = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            with safetensors.safe_open(os.path.join(directory, f), "pt") as fh:
                assert fh.metadata() == {"format": "pt"}, (f, fh.metadata())
                shapes.update({k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()})
    return shapes


def plain_reload(directory: str, ref, inputs: dict, name: str) -> dict:
    """Plain transformers from_pretrained of `directory`: no missing /
    unexpected / mismatched keys, the state dict and the outputs of `ref`."""
    import transformers

    loaded, info = getattr(transformers, type(ref).__name__).from_pretrained(
        directory, output_loading_info=True, **_impl(ref))
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    loaded.eval()
    got, exp = loaded.state_dict(), ref.state_dict()
    assert got.keys() == exp.keys(), sorted(set(got) ^ set(exp))
    for k in exp:
        parity.assert_close(f"{name} reloaded {k}", got[k], exp[k], TOL)
    with torch.no_grad():
        errs = parity.check_outputs(f"{name} reloaded", loaded(**inputs), ref(**inputs), TOL)
    return errs


def round_trip(ctx, name: str, directory: str, hf_directory: str, max_shard_size, overrides=None, extra=None) -> dict:
    """save_pretrained on every rank (peak of the writing rank measured);
    rank 0 then checks the files against HF's own save_pretrained of the
    unsharded model (names, shapes, file naming, index) and reloads them with
    plain transformers."""
    model, ref, inputs = _pair(ctx, name, overrides, extra)
    with PeakMeter() as meter:
        model.save_pretrained(directory, max_shard_size=max_shard_size)
    files = sorted(os.listdir(directory))
    if ctx.rank != 0:
        return {"files": files, "peak": meter.peak}
    parent = os.path.dirname(directory)
    assert not [f for f in os.listdir(parent) if f.startswith(".")], os.listdir(parent)
    ref.save_pretrained(hf_directory, max_shard_size=max_shard_size)      # HF's own writer, unsharded
    ours, theirs = _file_keys(directory), _file_keys(hf_directory)
    assert ours == theirs, {"only ours": sorted(set(ours) - set(theirs)), "only HF": sorted(set(theirs) - set(ours)),
                            "shapes": {k: (ours[k], theirs[k]) for k in ours if k in theirs and ours[k] != theirs[k]}}
    weight_files = [f for f in files if f.endswith(".safetensors")]
    limit = save._parse_size(max_shard_size, name)
    index = os.path.join(directory, "model.safetensors.index.json")
    if len(weight_files) > 1:
        assert weight_files == [f"model-{i:05d}-of-{len(weight_files):05d}.safetensors"
                                for i in range(1, len(weight_files) + 1)], weight_files
        with open(index) as f:
            idx = json.load(f)
        with open(os.path.join(hf_directory, "model.safetensors.index.json")) as f:
            hf_idx = json.load(f)
        assert idx["metadata"] == hf_idx["metadata"], (idx["metadata"], hf_idx["metadata"])
        assert set(idx["weight_map"]) == set(ours) and set(idx["weight_map"].values()) == set(weight_files)
    else:
        assert weight_files == ["model.safetensors"] and not os.path.exists(index), files
    for f in weight_files:
        size = os.path.getsize(os.path.join(directory, f))
        keys = [k for k in ours if len(weight_files) == 1 or idx["weight_map"][k] == f]
        assert len(keys) == 1 or size <= limit + 64 * 1024, (f, size, limit)   # + the JSON header
    for extra_file in ("config.json", "generation_config.json") if ref.can_generate() else ("config.json",):
        assert extra_file in files, files
    errs = plain_reload(directory, ref, inputs, name)
    assert meter.peak <= limit + meter.largest, (meter.peak, limit, meter.largest)
    return {"files": files, "peak": meter.peak, "largest": meter.largest, "limit": limit,
            "err": max(errs.values()) if errs else 0.0, "model_bytes": sum(t.numel() * t.element_size()
                                                                           for t in ref.state_dict().values())}


def overwrite(ctx, directory: str) -> dict:
    """Saving over an existing checkpoint: first several files (small
    max_shard_size), a tokenizer-like file added by the user, then one file:
    the old shard files and index are gone, the user's file is kept, plain
    transformers loads the second model."""
    first, _, _ = _pair(ctx, "LlamaForCausalLM", seed=0)
    first.save_pretrained(directory, max_shard_size="60KB")
    if ctx.rank == 0:
        with open(os.path.join(directory, "tokenizer.json"), "w") as f:
            f.write('{"kept": true}')
        os.makedirs(os.path.join(directory, "runs"))
        with open(os.path.join(directory, "runs", "log.txt"), "w") as f:
            f.write("kept too")
    before = sorted(os.listdir(directory))
    second, ref, inputs = _pair(ctx, "LlamaForCausalLM", seed=5)
    second.save_pretrained(directory)
    after = sorted(os.listdir(directory))
    if ctx.rank != 0:
        return {}
    assert any(f.startswith("model-0") for f in before) and "model.safetensors.index.json" in before, before
    assert after == sorted(["config.json", "generation_config.json", "model.safetensors", "runs", "tokenizer.json"]), after
    with open(os.path.join(directory, "runs", "log.txt")) as f:
        assert f.read() == "kept too"
    plain_reload(directory, ref, inputs, "LlamaForCausalLM over an old checkpoint")
    assert not [f for f in os.listdir(os.path.dirname(directory)) if f.startswith(".")]
    return {"before": before, "after": after}


def failing_write(ctx, directory: str) -> str:
    """The writing rank's second output file fails: every rank raises, the
    previous checkpoint stays as it was, no temporary directory is left."""
    first, ref, inputs = _pair(ctx, "LlamaForCausalLM", seed=0)
    first.save_pretrained(directory)
    second, _, _ = _pair(ctx, "LlamaForCausalLM", seed=5)
    write, calls = save._write_file, []

    def broken(tensors, path, *a, **k):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return write(tensors, path, *a, **k)

    save._write_file = broken
    try:
        second.save_pretrained(directory, max_shard_size="60KB")
    except (OSError, RuntimeError) as e:
        msg = f"{type(e).__name__}: {e}"
    else:
        raise AssertionError("a failed save did not raise")
    finally:
        save._write_file = write
    if ctx.rank == 0:
        assert not [f for f in os.listdir(os.path.dirname(directory)) if f.startswith(".")]
        plain_reload(directory, ref, inputs, "LlamaForCausalLM after a failed save")
    return msg


# ---------------------------------------------------------------- save_sharded / load_sharded

def sharded_save(ctx, name: str, directory: str, overrides=None, extra=None, default_group=False) -> dict | None:
    """save_sharded of a trained model; rank 0 returns the full state dict
    (NumPy) and the reference outputs' inputs name."""
    model, ref, _ = _pair(ctx, name, overrides, extra, default_group=default_group)
    save_sharded(model, directory)
    full = gather_full_state_dict(model)
    files = sorted(os.listdir(directory))
    n = ctx.tp_size
    assert [f for f in files if f.startswith("rank")] == [f"rank{r:05d}-of-{n:05d}.safetensors" for r in range(n)], \
        f"TP={n}: save_sharded wrote {files}"
    assert "config.json" in files and sharded_mod.MANIFEST in files, files
    with open(os.path.join(directory, sharded_mod.MANIFEST)) as f:
        assert json.load(f)["tp_size"] == n
    if ctx.rank != 0:
        return None
    for k, v in ref.state_dict().items():
        parity.assert_close(f"{name} gathered {k}", full[k], v, TOL)
    return {k: v.numpy() for k, v in full.items()}


def sharded_load(ctx, name: str, directory: str, full: dict, overrides=None, extra=None,
                 default_group=False) -> dict:
    """load_sharded into a model built from another seed and sharded at this
    pool's TP size (TP=1: the plain HF model, unsharded): its state equals
    the saved one and its outputs the unsharded model holding it.  Reports
    which saved ranks' files this rank opened."""
    full = {k: torch.from_numpy(v) for k, v in full.items()}
    model = zoo.build(name, seed=99, **(overrides or {}))
    if ctx.tp_size > 1:
        ShardFormer(_config(ctx, extra, default_group)).optimize(model)
    opened = set()
    getitem = sharded_mod._Files.__getitem__

    def spy(self, rank):
        opened.add(rank)
        return getitem(self, rank)

    sharded_mod._Files.__getitem__ = spy
    try:
        load_sharded(model, directory)
    finally:
        sharded_mod._Files.__getitem__ = getitem
    got = gather_full_state_dict(model) if ctx.tp_size > 1 else model.state_dict()
    assert got.keys() == full.keys(), sorted(set(got) ^ set(full))
    for k in full:
        assert torch.equal(got[k], full[k]), f"{name} {k}: loaded tensor differs from the saved one"
    ref = zoo.build(name, seed=98, **(overrides or {}))
    ref.load_state_dict(full)
    inputs = zoo.make_inputs(name)
    with torch.no_grad():
        parity.check_outputs(name, model.eval()(**inputs), ref.eval()(**inputs), TOL)
    # padding rows of a padded vocabulary are zero after the load
    for module in model.modules():
        for pname, (dim, shard) in getattr(module, "sharded_params", {}).items():
            t = getattr(module, pname)
            if shard.length > shard.real:
                assert not t.narrow(dim, shard.real, shard.length - shard.real).any(), pname
    return {"opened": sorted(opened)}


def sharded_refused(ctx, directory: str) -> str:
    """A checkpoint of another configuration is refused with every problem
    listed, and the model is left exactly as it was."""
    model = zoo.build("LlamaForCausalLM", seed=99, vocab_size=103, intermediate_size=88)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    return parity.refused_unchanged(model, lambda: load_sharded(model, directory),
                                    "load of a checkpoint of another shape")


# ---------------------------------------------------------------- killed saves (subprocess)

def child(directory: str, seed: int, mode: str, marker: str) -> None:
    """A TP=1 save of the Llama of `seed` into `directory`.  mode "plain"
    saves; the other modes signal (create `marker`) and sleep at one point
    of the save, for the test to SIGKILL this process there:
      write     - while the second output file is being written
      swap      - every file written and fsynced, before the directory is put in place
      exchanged - right after the directories were exchanged (old one not yet removed)
      fallback  - RENAME_EXCHANGE unavailable: between renaming the old
                  directory aside and the new one in."""
    model = zoo.build("LlamaForCausalLM", seed=seed)

    def stop_here():
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)

    if mode == "write":
        write, calls = save._write_file, []

        def slow(tensors, path, *a, **k):
            calls.append(path)
            if len(calls) == 2:
                with open(path, "wb") as f:
                    f.write(b"half a file")
                stop_here()
            return write(tensors, path, *a, **k)

        save._write_file = slow
    elif mode == "swap":
        exchange = atomic._exchange

        def before(a, b):
            stop_here()
            return exchange(a, b)

        atomic._exchange = before
    elif mode == "exchanged":
        exchange = atomic._exchange

        def after(a, b):
            ok = exchange(a, b)
            stop_here()
            return ok

        atomic._exchange = after
    elif mode == "fallback":
        atomic._exchange = lambda a, b: False
        rename = os.rename

        def renames(a, b):
            rename(a, b)
            if ".old-" in os.fspath(b):
                stop_here()

        atomic.os.rename = renames
    save.save_pretrained(model, directory, max_shard_size="60KB")


def expected_state(seed: int) -> dict:
    return zoo.build("LlamaForCausalLM", seed=seed).state_dict()


if __name__ == "__main__":
    child(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
