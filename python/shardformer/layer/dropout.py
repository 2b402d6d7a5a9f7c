"""Dropout that is correct under tensor parallelism.

A replicated activation (the output of a row-parallel layer, the residual
stream) must be dropped with the *same* mask on every rank, or the ranks'
copies drift apart.  A parallel activation (each rank's heads or features)
needs *different* masks, or the ranks' slices are correlated.  Both layers
draw from their own generator, seeded once per module from a seed agreed over
the group (broadcast from rank 0) and advanced per call, so they neither read
nor disturb torch's global RNG:

    DropoutForReplicatedInput   seed(step)          same mask on every rank
    DropoutForParallelInput     seed(step, rank)    a different mask per rank

With split-gather sequence parallelism (shardformer.layer.sequence) a
residual / hidden dropout that plain TP sees replicated runs on this rank's
rows of the sequence only: different rows, so the policies give it a
DropoutForParallelInput (rank r's rows get their own mask, as the unsharded
model draws an independent mask for every row).  Dropout on the attention
probabilities of this rank's heads stays DropoutForParallelInput.

Gradient checkpointing runs a layer's forward a second time inside backward
and needs the same masks as the first time.  Our generators are keyed by
`step`, agreed over the group, so the recomputation must find each call's
step again.  The order of recomputation is no guide: layers are recomputed
in reverse, the calls inside one layer in forward order, and a module can be
called several times per layer (ViT's attention-probability dropout and its
output dropout share nothing, but BEiT / Swin / ALBERT reuse modules).  What
every checkpoint implementation does restore is torch's CPU generator (it is
how nn.Dropout gets its masks back).  So a call made where a recomputation
can follow (under a checkpoint's saved-tensor hooks, or with grad disabled as
the reentrant checkpoint runs its forward) files its step under a 62-bit key
drawn from torch's CPU generator; the recomputation draws the same key at the
same point and takes that step back (and leaves it on file: a checkpoint
nested in another, e.g. Swin's blocks inside its checkpointed stages, is
recomputed once for each level).  Every call draws its key, filed or not,
so torch's generator (and with it the masks of HF's own dropouts) moves the
same way with checkpointing on or off.  The key only finds the
step: the mask itself never depends on torch's generator, so ranks whose
global RNG differs still drop alike.  A recomputation whose key is not on
file (a checkpoint with preserve_rng_state=False) raises rather than drawing
a mask that the first forward did not use.
"""
from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import torch
import torch.distributed as dist

from .parallel_module import ParallelModule, ShardPlan

_MASK64 = (1 << 63) - 1
_REPLAY_DEPTH = 4096   # steps on file per module for recomputation (oldest dropped first)


def _in_backward() -> bool:
    """True while the autograd engine runs (a checkpointed forward being
    recomputed), False in an ordinary forward."""
    return torch._C._current_graph_task_id() != -1


def _may_be_recomputed() -> bool:
    """Whether a forward call can be run again by a checkpoint: the
    non-reentrant checkpoint runs it under its saved-tensor hooks, the
    reentrant one with grad disabled.  A plain training forward (grad on, no
    hooks) files nothing."""
    return not torch.is_grad_enabled() or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _replay_key() -> int:
    """One draw of torch's CPU generator: the same value at the same point
    of a checkpoint's recomputation, which restores that generator."""
    return int(torch.randint(0, 2**62, (1,)).item())


def _agreed_seed(process_group, tp_size: int) -> int:
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    if tp_size > 1:
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        dist.broadcast(seed, src, group=process_group)
    return int(seed.item())


class SeededDropout(ParallelModule):
    per_rank_mask = False

    def __init__(self, p: float = 0.5, inplace: bool = False, process_group=None, seed: int | None = None,
                 plan: ShardPlan | None = None, **kwargs):
        if plan is None:   # not from the sharder
            plan = self.plan_for(SimpleNamespace(p=p), process_group)
        super().__init__(plan, process_group)
        self.p, self.inplace = p, inplace
        self.seed = _agreed_seed(process_group, self.tp_size) if seed is None else seed
        self.step = 0
        self._filed: OrderedDict[int, int] = OrderedDict()   # replay key -> step

    @classmethod
    def plan_shard(cls, module, tp_size, rank, **kwargs) -> ShardPlan:
        p = getattr(module, "p", None)
        if p is None:
            raise TypeError(f"{cls.__name__} needs a module with a dropout probability 'p', "
                            f"got {type(module).__name__}")
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, got {p}")
        return ShardPlan(tp_size, rank)

    @classmethod
    def native_args(cls, module):
        return dict(p=module.p, inplace=getattr(module, "inplace", False))

    def _next_step(self) -> int:
        if _in_backward():                      # a checkpoint recomputing this call
            key = _replay_key()
            step = self._filed.get(key)        # kept: a nested checkpoint recomputes twice
            if step is None:
                raise RuntimeError(
                    f"{type(self).__name__}(p={self.p}): a forward recomputed inside backward (gradient "
                    f"checkpointing) does not match any call of the first forward, so its dropout mask "
                    f"cannot be the same; checkpoint with preserve_rng_state=True (the default), or set "
                    f"the dropout probability to 0")
            return step
        self.step += 1
        key = _replay_key()                     # drawn on every call: checkpointing on or off, torch's
        if _may_be_recomputed():                # generator moves alike, and so do HF's own dropouts
            self._filed[key] = self.step
            if len(self._filed) > _REPLAY_DEPTH:
                self._filed.popitem(last=False)
        return self.step

    def _generator(self, device) -> torch.Generator:
        step = self._next_step()
        mix = self.seed * 1_000_003 + step * 7919
        if self.per_rank_mask:
            mix += (self.tp_rank + 1) * 104_729_999
        g = torch.Generator(device=device)
        g.manual_seed(mix & _MASK64)
        return g

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p == 1.0:
            return x.zero_() if self.inplace else torch.zeros_like(x)
        keep = torch.empty_like(x).bernoulli_(1.0 - self.p, generator=self._generator(x.device))
        scale = 1.0 / (1.0 - self.p)
        if self.inplace:
            return x.mul_(keep).mul_(scale)
        return x * keep * scale

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}"


_SeededDropout = SeededDropout   # the name tests import (the class was private)


class DropoutForReplicatedInput(SeededDropout):
    """Dropout on a tensor replicated over the TP group: the same mask on every rank."""

    per_rank_mask = False


class DropoutForParallelInput(SeededDropout):
    """Dropout on a tensor split over the TP group: a different mask on each rank."""

    per_rank_mask = True


class RankStream:
    """torch's global generator (CPU, and the CUDA device of the hidden
    states) switched to a stream of this rank's own while a layer runs (a
    split layer of sequence parallelism; a layer of a stack with layerdrop
        under TP, shardformer.layer.layerdrop): seed = mix(one 63-bit draw of
    the shared stream, the rank in the group), so it differs per rank, layer
    and forward while every rank's shared stream moves on alike (whatever the
    layer draws: its shapes may differ per rank); close() puts the shared
    stream back where that draw left it."""

    def __init__(self, rank: int, device: torch.device):
        draw = int(torch.randint(0, 2**62, (1,)).item())
        seed = (draw * 0x9E3779B97F4A7C15 + rank + 1) % (1 << 63)
        cuda = [device] if device.type == "cuda" else []
        self._fork = torch.random.fork_rng(devices=cuda)
        self._fork.__enter__()
        torch.default_generator.manual_seed(seed)
        for d in cuda:
            index = d.index if d.index is not None else torch.cuda.current_device()
            torch.cuda.default_generators[index].manual_seed(seed)

    def close(self) -> None:
        self._fork.__exit__(None, None, None)


def may_draw(layer: torch.nn.Module, config) -> bool:
    """Whether a layer in training can draw from torch's generator: an
    nn.Dropout with p > 0 in it, or a dropout probability > 0 in the model's
    config or one of its sub-configs (functional dropouts read it there,
    e.g. Falcon's hidden_dropout, BLIP-2's vision attention_dropout)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in layer.modules()):
        return True
    return _config_drops(config, set())


def _config_drops(config, seen: set) -> bool:
    if config is None or id(config) in seen or not hasattr(config, "__dict__"):
        return False
    seen.add(id(config))
    for key, value in vars(config).items():
        if isinstance(value, float) and value > 0 and ("dropout" in key or "drop" == key[-4:]):
            return True
        if type(value).__name__[-6:] == "Config" and _config_drops(value, seen):  # (str.endswith: a graph break)
            return True
    return False
