"""ParallelModule: the base of every layer the sharder puts into a model."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import _C
from ..distributed.mappings import _split_dim
from ..layout import DimShard


def group_size_and_rank(process_group) -> tuple[int, int]:
    """(tp_size, rank) of `process_group` (None = the default group; 1 process
    without torch.distributed initialized)."""
    if not dist.is_available() or not dist.is_initialized():
        if process_group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialized")
        return 1, 0
    return dist.get_world_size(process_group), dist.get_rank(process_group)


def shard_of(full: torch.Tensor, dim: int, shard: DimShard) -> torch.Tensor:
    """A new tensor holding this rank's shard of `full` along `dim`.

    CPU tensors are cut by the C layout kernel (strided source, no
    temporaries); other devices use torch's narrow/cat.
    """
    full = full.detach()
    if full.device.type != "cpu":
        return _split_dim(full, dim, shard).clone()
    shape = list(full.shape)
    shape[dim] = shard.length
    out = torch.empty(shape, dtype=full.dtype, device=full.device)
    _C.copy_shard(full, out, dim, shard.ranges)
    return out


class ParallelModule(nn.Module):
    """A module whose parameters are sharded over a tensor-parallel group.

    `sharded_params` maps a parameter's local name to (dim, DimShard): which
    dimension is split and how; the checkpoint helpers use it to gather full
    HuggingFace-shaped tensors and to cut shards of any TP size.
    """

    def __init__(self, process_group=None):
        super().__init__()
        self.process_group = process_group
        self.tp_size, self.tp_rank = group_size_and_rank(process_group)
        self.sharded_params: dict[str, tuple[int, DimShard]] = {}

    @classmethod
    def plan_shard(cls, module: nn.Module, tp_size: int, rank: int, **kwargs):
        """Check that `module` can be sharded this way and compute the layout,
        without changing anything.  The sharder calls this for every
        replacement before it applies any of them."""
        return None

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, **kwargs) -> nn.Module:
        raise NotImplementedError(f"{cls.__name__} does not implement from_native_module")


def check_param(module: nn.Module, name: str, ndim: int, cls_name: str) -> torch.Tensor:
    t = getattr(module, name, None)
    if not isinstance(t, torch.Tensor) or t.dim() != ndim:
        got = "missing" if t is None else f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(
            f"{cls_name} needs a module with a {ndim}-D '{name}', "
            f"got {type(module).__name__} with '{name}' {got}"
        )
    return t
