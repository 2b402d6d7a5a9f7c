"""torch's generator under tensor parallelism: one shared stream that moves
alike on every rank, a stream of each rank's own for its heads, and
layerdrop skipping the same layers on every rank.

HF draws dropout masks from torch's global generator.  On a replicated
activation (the residual stream) every rank must draw the same mask, which
it does when the ranks' generators agree and have moved alike.  On this
rank's heads (the attention probabilities [B, H_r, S_q, S_k], dropped by a
functional dropout inside the attention) the masks must differ per rank,
and the number of values drawn is H_r-dependent: with heads split unevenly
it would move the ranks' generators apart, and every later replicated mask
with them.  So the attention that projects this rank's query heads runs on
a stream of the rank's own (RankStream: one draw of the shared stream mixed
with the rank), and the shared stream moves by one draw per attention call
on every rank.  A family whose attention module also drops a replicated
tensor (BLOOM's dropout_add of the residual) names it in
`Policy.attention_draws_replicated` and keeps the shared stream there.

Layerdrop: in training, a stack with layerdrop p > 0 (OPT's decoder,
Whisper's encoder and decoder, the OPT inside BLIP-2) skips layer i when
`torch.rand([])` falls below p.  Each layer of a sharded stack runs
collectives, so a rank that skips a layer its peers run hands its peers the
wrong collective.  The draws agree when the ranks' generators agree as the
stack starts: the user's seeding (`torch.manual_seed(s)` on every rank),
checked at each training forward of the stack by a max-all-reduce of (crc,
-crc) of the generator state over the TP group (16 bytes), and refused with
a clear error when they differ.

Under a checkpointed layer the stream is opened inside the checkpoint (a
forward pre-hook of the attention), so the recomputation, which restores
torch's generator, opens the same stream.
"""
from __future__ import annotations

import zlib

import torch
from torch import nn

from .. import distributed as D
from .attention_weights import projects_query_heads
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


def guard_random_streams(model: nn.Module, group, rank: int, name: str,
                         draws_replicated: tuple[str, ...] = ()) -> int:
    """Install the per-rank stream on every attention projecting this rank's
    query heads (but the classes in `draws_replicated`), and the generator
    check on each stack with layerdrop; returns the number of attentions
    given a stream."""
    config = getattr(model, "config", None)
    attentions = [m for m in model.modules() if not getattr(m, _GUARD_MARK, False)
                  and type(m).__name__ not in draws_replicated and projects_query_heads(m)]
    for attention in attentions:
        _stream_per_layer(attention, rank, config)
        object.__setattr__(attention, _GUARD_MARK, True)
    for path, stack, _ in stacks_with_layerdrop(model):
        if getattr(stack, _GUARD_MARK, False):
            continue
        stack.register_forward_pre_hook(_LayerdropCheck(group, name, path))
        object.__setattr__(stack, _GUARD_MARK, True)
    return len(attentions)


class _LayerdropCheck:
    """Forward pre-hook of a stack with layerdrop: in training, the generator
    check over the TP group (a module-level class, so the model pickles)."""

    def __init__(self, group, name: str, path: str):
        self.group, self.name, self.path = group, name, path

    def __call__(self, module, _args) -> None:
        if module.training:
            check_generators_agree(self.group, self.name, self.path)


class _StreamPerLayer:
    """The pair of hooks of one attention: opened (forward pre-hook) enters
    the rank's stream when the layer trains and may draw, closed (forward
    hook, always called) leaves it.  `streams` holds the streams of the
    forwards in progress (nested under recomputation); it is empty between
    forwards and is not pickled."""

    #: shardformer.decode's fast step may skip this hook (see decode._foreign_hooks)
    INERT_IN_DECODE = True

    def __init__(self, rank: int, config):
        self.rank, self.config = rank, config
        self.streams: list[RankStream] = []

    def __getstate__(self) -> dict:
        return {"rank": self.rank, "config": self.config}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, streams=[])

    def opened(self, module, args, kwargs) -> None:
        if module.training and may_draw(module, self.config):
            x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            self.streams.append(RankStream(self.rank, x.device if x is not None else torch.device("cpu")))

    def closed(self, module, _args, _kwargs, _output) -> None:
        if self.streams:
            self.streams.pop().close()


def _stream_per_layer(layer: nn.Module, rank: int, config) -> None:
    hooks = _StreamPerLayer(rank, config)
    layer.register_forward_pre_hook(hooks.opened, with_kwargs=True)
    layer.register_forward_hook(hooks.closed, with_kwargs=True, always_call=True)
