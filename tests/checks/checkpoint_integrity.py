"""Rank-side checks of checkpoint integrity (tests/test_checkpoint_integrity.py):
damaged or mislabelled save_sharded checkpoints refused on every rank with
the model untouched; a save that supersedes a checkpoint of another format;
saves through a symbolic link; broadcast_weights with the default group.
Each function runs on every rank of the pool's group."""
from __future__ import annotations

import os
import time

import torch

import zoo
from checks import parity
from checks.save import TOL, _config, _pair, plain_reload
from shardformer import ShardConfig, ShardFormer
from shardformer.checkpoint import gather_full_state_dict, load_sharded, save_sharded


def refused_everywhere(ctx, directory: str, default_group: bool = False) -> dict:
    """load_sharded of a damaged checkpoint raises on this rank (ValueError
    where the damage was seen, a RuntimeError naming those ranks elsewhere)
    and leaves the model as it was; returns the message and the seconds."""
    model = zoo.build("LlamaForCausalLM", seed=99)
    ShardFormer(_config(ctx, None, default_group)).optimize(model)
    start = time.monotonic()
    msg = parity.refused_unchanged(model, lambda: load_sharded(model, directory), "load of a damaged checkpoint",
                                   error=(ValueError, RuntimeError))
    return {"msg": msg, "seconds": time.monotonic() - start}


def _files(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


def _user_files(ctx, directory: str) -> None:
    if ctx.rank == 0:
        for f, text in (("notes.txt", "mine"), ("tokenizer.json", "{}")):
            with open(os.path.join(directory, f), "w") as fh:
                fh.write(text)


def _holds_only_sharded(directory: str) -> None:
    files = _files(directory)
    stale = [f for f in files if f.startswith(("model", "pytorch_model"))]
    assert not stale, f"save_sharded left the previous checkpoint's files: {stale} (all: {files})"
    assert "notes.txt" in files and "tokenizer.json" in files, files


def _holds_only_hf(directory: str, weights: str) -> None:
    files = _files(directory)
    stale = [f for f in files if f.startswith("rank") or f == "shardformer_manifest.json"
             or (f.startswith(("model", "pytorch_model")) and f != weights)]
    assert not stale, f"save_pretrained left the previous checkpoint's files: {stale} (all: {files})"
    assert weights in files and "notes.txt" in files and "tokenizer.json" in files, files


def formats_supersede(ctx, directory: str) -> dict:
    """HF checkpoint in several files -> save_sharded -> save_pretrained as
    .bin -> save_pretrained as safetensors, into one directory: after each
    save the directory holds that checkpoint only (and the user's files),
    and it loads as the model last saved."""
    import transformers

    first, _, _ = _pair(ctx, "LlamaForCausalLM", seed=0)
    first.save_pretrained(directory, max_shard_size="60KB")
    _user_files(ctx, directory)
    second, _, inputs = _pair(ctx, "LlamaForCausalLM", seed=5)
    save_sharded(second, directory)
    _holds_only_sharded(directory)
    if ctx.rank == 0:       # plain transformers finds no HF weights: not the first model's, silently
        try:
            transformers.LlamaForCausalLM.from_pretrained(directory)
        except OSError:
            pass
        else:
            raise AssertionError("plain transformers loaded HF weights from a directory saved by save_sharded")
    fresh = zoo.build("LlamaForCausalLM", seed=99)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(fresh)
    load_sharded(fresh, directory)
    got, exp = gather_full_state_dict(fresh), gather_full_state_dict(second)      # exactly what was saved
    assert all(torch.equal(got[k], exp[k]) for k in exp), [k for k in exp if not torch.equal(got[k], exp[k])]
    third, ref3, _ = _pair(ctx, "LlamaForCausalLM", seed=7)
    third.save_pretrained(directory, safe_serialization=False)
    _holds_only_hf(directory, "pytorch_model.bin")
    if ctx.rank == 0:
        plain_reload(directory, ref3, inputs, "LlamaForCausalLM .bin over a sharded checkpoint")
    fourth, ref4, _ = _pair(ctx, "LlamaForCausalLM", seed=9)
    fourth.save_pretrained(directory)
    _holds_only_hf(directory, "model.safetensors")
    if ctx.rank == 0:
        plain_reload(directory, ref4, inputs, "LlamaForCausalLM safetensors over a .bin checkpoint")
    return {"files": _files(directory)}


def save_through_symlink(ctx, link: str) -> dict:
    """save_pretrained and save_sharded into a symbolic link to a directory
    write into that directory and leave the link a link."""
    model, ref, inputs = _pair(ctx, "LlamaForCausalLM", seed=3)
    model.save_pretrained(link)
    assert os.path.islink(link), "the link was replaced"
    if ctx.rank == 0:
        plain_reload(link, ref, inputs, "LlamaForCausalLM saved through a link")
    save_sharded(model, link)
    assert os.path.islink(link), "the link was replaced"
    fresh = zoo.build("LlamaForCausalLM", seed=99)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(fresh)
    load_sharded(fresh, link)
    with torch.no_grad():
        parity.check_outputs("loaded through a link", fresh.eval()(**inputs), ref(**inputs), TOL)
    return {"files": _files(os.path.realpath(link))}


def broadcast_weights_default_group(ctx) -> dict:
    """ShardConfig(extra_kwargs={'broadcast_weights': True}) with the default
    group: every rank built its model from another seed; after optimize()
    each holds rank 0's weights (equal to the unsharded model of seed 0)."""
    model = zoo.build("LlamaForCausalLM", seed=ctx.rank)
    ref = zoo.build("LlamaForCausalLM", seed=0).eval()
    ShardFormer(ShardConfig(extra_kwargs={"broadcast_weights": True})).optimize(model)
    got, exp = gather_full_state_dict(model), ref.state_dict()
    assert all(torch.equal(got[k], exp[k]) for k in exp), [k for k in exp if not torch.equal(got[k], exp[k])]
    inputs = zoo.make_inputs("LlamaForCausalLM")
    with torch.no_grad():
        parity.check_outputs("broadcast_weights", model.eval()(**inputs), ref(**inputs), TOL)
    return {"tensors": len(got)}
