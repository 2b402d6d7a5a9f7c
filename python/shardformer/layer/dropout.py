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
and needs the same masks as the first time.  torch restores its global RNG
for that; our generators are keyed by `step`, so each module remembers the
steps it drew (most recent last) and a forward that runs inside the
autograd engine (a recomputation) takes the most recent one back instead of
drawing a new step: backward recomputes layers in reverse order, so even a
module shared by several layers (ALBERT) gets each layer's step back.
"""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import torch
import torch.distributed as dist

from .parallel_module import ParallelModule, ShardPlan

_MASK64 = (1 << 63) - 1
_REPLAY_DEPTH = 4096   # steps remembered per module for recomputation


def _in_backward() -> bool:
    """True while the autograd engine runs (a checkpointed forward being
    recomputed), False in an ordinary forward."""
    return torch._C._current_graph_task_id() != -1


def _agreed_seed(process_group, tp_size: int) -> int:
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    if tp_size > 1:
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        dist.broadcast(seed, src, group=process_group)
    return int(seed.item())


class _SeededDropout(ParallelModule):
    per_rank_mask = False

    def __init__(self, p: float = 0.5, inplace: bool = False, process_group=None, seed: int | None = None,
                 plan: ShardPlan | None = None, **kwargs):
        if plan is None:   # not from the sharder
            plan = self.plan_for(SimpleNamespace(p=p), process_group)
        super().__init__(plan, process_group)
        self.p, self.inplace = p, inplace
        self.seed = _agreed_seed(process_group, self.tp_size) if seed is None else seed
        self.step = 0
        self._drawn: deque[int] = deque(maxlen=_REPLAY_DEPTH)

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
        if _in_backward() and self._drawn:
            return self._drawn.pop()            # recomputation: the same mask again
        self.step += 1
        self._drawn.append(self.step)
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


class DropoutForReplicatedInput(_SeededDropout):
    """Dropout on a tensor replicated over the TP group: the same mask on every rank."""

    per_rank_mask = False


class DropoutForParallelInput(_SeededDropout):
    """Dropout on a tensor split over the TP group: a different mask on each rank."""

    per_rank_mask = True
