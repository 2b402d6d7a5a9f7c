"""torch's generator under tensor parallelism: the ranks' shared stream moves
alike, each rank's heads get masks of their own, and layerdrop skips the same
layers on every rank.

In training, a stack with layerdrop p > 0 (OPT's decoder, Whisper's encoder
and decoder, the OPT inside BLIP-2) skips layer i when a draw of torch's CPU
generator, `torch.rand([])`, falls below p.  Each layer of a sharded stack
runs collectives, so a rank that skips a layer its peers run does not just
get a different result: it hands its peers the wrong collective.  The draws
agree when two things hold, and `guard_random_streams` makes sure of both:

- the ranks' CPU generators agree when the stack's forward starts.  This is
  the user's seeding (`torch.manual_seed(s)` on every rank); it is checked at
  each training forward, by a max-all-reduce of (crc, -crc) of the generator
  state over the TP group (16 bytes), and refused with a clear error;
- nothing inside a layer moves one rank's generator differently from its
  peers'.  HF's own dropouts on this rank's heads draw as many numbers as
  the rank holds heads, which differs when heads split unevenly; so each
  layer runs on a stream of the rank's own (RankStream: seeded from one
  draw of the shared stream and the rank), which also gives each rank's
  heads their own masks.  The shared stream moves by one draw per layer on
  every rank, skipped or not.  This holds for every layer of a sharded
  model (an entry of a ModuleList holding a sharded module), with or without
  layerdrop: HF's dropouts outside our layers, e.g. the functional dropout of
  an attention on this rank's heads, would otherwise draw the same masks on
  every rank and move the shared streams apart.

Under a checkpointed layer the stream is opened inside the checkpoint (a
forward pre-hook of the layer), so the recomputation, which restores torch's
generator, opens the same stream.
"""
from __future__ import annotations

import zlib

import torch
from torch import nn

from .. import distributed as D
from .dropout import RankStream, may_draw

_GUARD_MARK = "_shardformer_layerdrop_guard"


def _generator_fingerprint() -> float:
    """crc32 of torch's CPU generator state (exact in a float64)."""
    return float(zlib.crc32(torch.get_rng_state().numpy().tobytes()))


def check_generators_agree(group, name: str, path: str) -> None:
    """Raise when the ranks of `group` hold different CPU generator states."""
    crc = _generator_fingerprint()
    both = torch.tensor([crc, -crc], dtype=torch.float64)
    D.all_reduce(both, group, op="max")
    if both[0].item() != crc or -both[1].item() != crc:
        raise RuntimeError(
            f"{name}: {path} has layerdrop > 0, and the ranks of its tensor-parallel group hold different "
            f"torch random generator states, so they would skip different layers (and hand each other "
            f"different collectives). Seed torch alike on every rank (torch.manual_seed(seed)) before "
            f"training, or set layerdrop to 0")


def stacks_with_layerdrop(model: nn.Module) -> list[tuple[str, nn.Module, nn.ModuleList]]:
    """(path, stack, its `layers`) for every module with a float attribute
    `layerdrop` > 0 and a ModuleList child `layers` (how HF writes it)."""
    found = []
    for path, module in model.named_modules():
        p = getattr(module, "layerdrop", None)
        layers = getattr(module, "layers", None)
        if isinstance(p, float) and p > 0 and isinstance(layers, nn.ModuleList):
            found.append((path or type(model).__name__, module, layers))
    return found


def guard_random_streams(model: nn.Module, group, rank: int, name: str) -> int:
    """Install the per-rank stream on every sharded layer, and the generator
    check on each stack with layerdrop; returns the number of layers given
    a stream."""
    from .parallel_module import ParallelModule

    config = getattr(model, "config", None)
    layers = [layer for module in model.modules() if isinstance(module, nn.ModuleList) for layer in module
              if not getattr(layer, _GUARD_MARK, False)
              and any(isinstance(m, ParallelModule) for m in layer.modules())]
    for layer in layers:
        _stream_per_layer(layer, rank, config)
        object.__setattr__(layer, _GUARD_MARK, True)
    for path, stack, _ in stacks_with_layerdrop(model):
        if getattr(stack, _GUARD_MARK, False):
            continue

        def check(module, _args, path=path):
            if module.training:
                check_generators_agree(group, name, path)

        stack.register_forward_pre_hook(check)
        object.__setattr__(stack, _GUARD_MARK, True)
    return len(layers)


def _stream_per_layer(layer: nn.Module, rank: int, config) -> None:
    streams: list[RankStream] = []

    def opened(module, args, kwargs):
        if module.training and may_draw(module, config):
            x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            streams.append(RankStream(rank, x.device if x is not None else torch.device("cpu")))

    def closed(module, _args, _kwargs, _output):
        if streams:
            streams.pop().close()

    layer.register_forward_pre_hook(opened, with_kwargs=True)
    layer.register_forward_hook(closed, with_kwargs=True, always_call=True)
