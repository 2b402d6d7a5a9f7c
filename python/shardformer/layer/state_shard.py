"""The values of a sharded parameter in `model.state_dict()`.

A sharded layer's state_dict() holds this rank's shard under the HuggingFace
name, a tensor smaller than the one that name means.  Most consumers want
exactly that (save and resume per rank at the same TP size, load_state_dict
back into the same model), but torch.distributed.checkpoint (DCP) cannot
tell: it takes any plain tensor for a replicated whole tensor, writes one
rank's copy under the name and loads it on every rank, silently wrong.

So the layer hands out each shard as a LocalShard: an ordinary tensor
(same storage, same values, every torch op returns plain tensors, pickles
and saves as a plain tensor) that also answers DCP's planning hooks
(`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`)
by refusing, with the name, the layout and the way that works:
shardformer.checkpoint.get_state_dict.  Both dcp.save and dcp.load plan
every value before touching any file or tensor, and DCP reports a planning
error on every rank, so the refusal comes before anything is written or
loaded.  (model.state_dict(keep_vars=True) returns the parameters
themselves, unmarked.)
"""
from __future__ import annotations

import torch

__all__ = ["LocalShard", "layout_text"]

_WAY = ("use shardformer.checkpoint.get_state_dict(model, optimizer) for dcp.save / dcp.load "
        "(and shardformer.checkpoint.set_state_dict after dcp.load)")


def layout_text(dim: int, shard, group: str = "tensor-parallel") -> str:
    """'dimension d: indices [a, b) ... of F, over N <group> ranks': one rank's part, for messages."""
    ranges = ", ".join(f"[{off}, {off + n})" for off, n in shard.ranges)
    return f"dimension {dim}: indices {ranges} of {shard.full}, split over {shard.tp_size} {group} ranks"


class LocalShard(torch.Tensor):
    """This rank's shard of a split tensor, as model.state_dict() returns it:
    a plain tensor for every purpose except DCP, which it refuses."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: torch.Tensor, key: str, layout: str):
        t = torch.Tensor._make_subclass(cls, data, False)
        t._shardformer_key, t._shardformer_layout = key, layout
        return t

    def _refuse(self, fqn=None):
        # TypeError: DCP rewraps a ValueError of __create_chunk_list__ in a message of its own
        raise TypeError(
            f"torch.distributed.checkpoint on model.state_dict() of a sharded model: "
            f"'{fqn or self._shardformer_key}' is this rank's shard only ({self._shardformer_layout}; "
            f"shape {tuple(self.shape)}), which DCP would take for the whole tensor; {_WAY}")

    def __create_write_items__(self, fqn, obj):
        self._refuse(fqn)

    def __create_chunk_list__(self):
        self._refuse()

    def __get_tensor_shard__(self, index):
        self._refuse(getattr(index, "fqn", None))

    def __reduce_ex__(self, protocol):
        """Pickled (torch.save, multiprocessing) as the plain tensor it is."""
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return self.as_subclass(torch.Tensor).__deepcopy__(memo)
