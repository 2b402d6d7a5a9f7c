"""Rank-side checks on CUDA (tests/test_gpu.py): the CPU checks of tests/checks/
run with device="cuda" on ranks sharing the one GPU (two processes, gloo with
CUDA tensors: NCCL refuses two ranks on one device).

Each entry point first calls `cuda_rank`: this rank's GPU (rank r on GPU
r mod the count, so every rank shares GPU 0 on a one-GPU machine) and
float32 matmuls and convolutions without TF32, so the fp32 tolerances of the
CPU checks hold unchanged (TF32 rounds inputs to 10 mantissa bits).
"""
from __future__ import annotations

import copy

import torch

import zoo
from checks import parity, pipeline, sequence, sequence_attention


def cuda_rank(ctx) -> torch.device:
    """This rank's CUDA device, made current; TF32 off."""
    device = torch.device("cuda", ctx.rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return device


def family(ctx, name: str) -> dict:
    """check_sharded of the zoo's `name` on CUDA: forward, loss, every
    gradient, outputs after an SGD step, against the unsharded model."""
    device = cuda_rank(ctx)
    report = parity.check_sharded(ctx, lambda: zoo.build(name), zoo.make_inputs(name), name=name, device=device)
    report["device"] = torch.cuda.get_device_name(device)
    return report


def default_group(ctx, name: str) -> dict:
    """The plain ShardConfig() (the default group: the pool's world) on CUDA."""
    from shardformer import ShardConfig, ShardFormer

    device = cuda_rank(ctx)
    torch.manual_seed(0)
    model = zoo.build(name).to(device).train()
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig()).optimize(model)
    return parity.compare_sharded(model, ref, parity.to_device(zoo.make_inputs(name), device), name)


def lazy_pretrained(ctx, name: str, directory: str) -> dict:
    """A model built under lazy_init(), moved to CUDA while still lazy,
    sharded (each rank's shards allocated on the GPU, never the whole
    model) and loaded with checkpoint.load_pretrained (each rank's slices
    copied into its CUDA shards), against transformers' from_pretrained of
    the same checkpoint moved to CUDA: logits, loss, every gradient."""
    import transformers

    from shardformer import ShardConfig, ShardFormer, lazy_init
    from shardformer.checkpoint import load_pretrained
    from checks.lazy import _impl

    device = cuda_rank(ctx)
    cls = getattr(transformers, name)
    config = transformers.AutoConfig.from_pretrained(directory)
    build = getattr(cls, "from_config", None) or cls._from_config      # transformers 5.x: _from_config
    torch.manual_seed(0)                   # the ranks' recipes agree (optimize() checks the replicas)
    with lazy_init():
        model = build(config, **_impl(name))
    model.to(device)
    model, _ = ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    on = {p.device for p in model.parameters()}
    assert on == {device}, f"{name}: parameters on {on} after a lazy model was moved to {device}"
    load_pretrained(model, directory)
    ref = cls.from_pretrained(directory, **_impl(name)).to(device)
    return parity.compare_sharded(model.train(), ref.train(), parity.to_device(zoo.make_inputs(name), device), name)


def sp(ctx, name: str, mode: str, seq: int | None = 7) -> dict:
    """Sequence parallelism on CUDA: split_gather (with TP) through
    sp_equals_unsharded, all_to_all / ring_attn (TP off) through
    sequence_attention.equals_unsharded."""
    device = cuda_rank(ctx)
    if mode == "split_gather":
        return sequence.sp_equals_unsharded(ctx, name, seq, device=device)
    return sequence_attention.equals_unsharded(ctx, name, mode, seq, device=device)


def sp_overlap(ctx, name: str, seq: int | None = 7) -> dict:
    """enable_sequence_overlap on CUDA: every gathering pass ran with its
    collective in flight, and the result equals the unsharded model's."""
    return sequence.sp_overlap_equals_unsharded(ctx, name, seq, device=cuda_rank(ctx))


def pp(ctx, name: str, schedule: str, m: int) -> dict:
    """A pipeline of ctx.tp_size stages on CUDA (activations and gradients
    between stages through the group's CUDA communicator)."""
    return pipeline.equals_unsharded(ctx, name, ctx.tp_size, schedule, m, device=cuda_rank(ctx))
