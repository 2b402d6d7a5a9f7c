"""PipelineStageManager: which stage this rank is, and which layers each stage holds.

A pipeline of p ranks (the ranks of `pp_group`, in group-rank order) runs the
model's layers as a chain of stages.  With `num_model_chunks` = v > 1
(interleaved schedules) every rank holds v chunks, and the chain has v*p
*virtual* stages: virtual stage k = c*p + s is chunk c of the rank at stage
s, so the chain visits stage 0, 1, ..., p-1, then stage 0 again for the next
chunk.  The first virtual stage also holds the modules before the layers
(embeddings), the last one the modules after them (final norm, heads).

Layers are split over the virtual stages in order: `num_layers_per_stage`
(one count per virtual stage, summing to the model's layer count) when
given, else evenly, with the remainder going to the stages nearest the
middle of the chain (the first stage also runs the embeddings and the last
one the head, so they get the fewer layers).

`layout="v"` (two chunks per rank, for ZeroBubbleVSchedule) folds the chain
into a V instead: chunk 0 of stage s is virtual stage s, chunk 1 is virtual
stage 2p-1-s, so the chain goes down the stages and comes back up, and
stage 0 holds both the first virtual stage (embeddings) and the last (head).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..config import StageManager, check_process_group, group_size_and_rank
from ..distributed import backend_for
from ..distributed.agree import agree, members

__all__ = ["PipelineStageManager"]


class PipelineStageManager(StageManager):
    """The pipeline over `pp_group` (None: the default group), as seen by this rank.

    stage           this rank's stage, 0 .. num_stages - 1 (its rank in pp_group)
    num_stages      p, the size of pp_group
    num_model_chunks  v, the chunks (virtual stages) each rank holds
    num_layers_per_stage  None, or the layer count of each of the v*p virtual stages
    layout          "loop" (chunk c of stage s is virtual stage c*p + s) or
                    "v" (2 chunks: s, then 2p-1-s; see the module docstring)

    Made by every rank of pp_group at the same point (it sets up the
    group's point-to-point transport, a collective over the group); the
    ranks first check that they pass the same group, chunks and layer
    counts (shardformer.distributed.agree), raising naming the ranks that
    differ rather than waiting."""

    def __init__(self, pp_group=None, num_model_chunks: int = 1, num_layers_per_stage=None,
                 layout: str = "loop") -> None:
        if pp_group is not None:
            check_process_group(pp_group)
        if isinstance(num_model_chunks, bool) or not isinstance(num_model_chunks, int) or num_model_chunks < 1:
            raise ValueError(f"PipelineStageManager: num_model_chunks must be an int >= 1, got {num_model_chunks!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"PipelineStageManager: layout must be one of {LAYOUTS}, got {layout!r}")
        if layout == "v" and num_model_chunks != 2:
            raise ValueError(f"PipelineStageManager: layout='v' folds the chain once: it needs num_model_chunks=2, "
                             f"got {num_model_chunks} (docs/pipeline.md#zero-bubble-schedules)")
        if dist.is_available() and dist.is_initialized():    # before anything waits on the group
            agree("PipelineStageManager", {"pp_group": members(pp_group), "num_model_chunks": num_model_chunks,
                                           "num_layers_per_stage": _plain(num_layers_per_stage),
                                           "layout": layout}, pp_group)
        self.layout = layout
        self.group = pp_group
        self.num_stages, self.stage = group_size_and_rank(pp_group)
        self.num_model_chunks = num_model_chunks
        if num_layers_per_stage is not None:
            counts = list(num_layers_per_stage)
            if len(counts) != self.num_virtual_stages or any(
                    isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
                raise ValueError(f"PipelineStageManager: num_layers_per_stage must hold {self.num_virtual_stages} "
                                 f"ints >= 1 (one per stage{' and chunk' if num_model_chunks > 1 else ''}: "
                                 f"{self.num_stages} stages x {num_model_chunks} chunks), got {num_layers_per_stage!r}")
            num_layers_per_stage = tuple(counts)
        self.num_layers_per_stage = num_layers_per_stage
        if dist.is_available() and dist.is_initialized() and self.num_stages > 1:
            backend_for(torch.zeros(1), pp_group)   # the group's CPU communicator, for send / recv

    def __repr__(self) -> str:
        return (f"PipelineStageManager(stage={self.stage}, num_stages={self.num_stages}, "
                f"num_model_chunks={self.num_model_chunks}{', layout=v' if self.layout == 'v' else ''})")

    @property
    def num_virtual_stages(self) -> int:
        return self.num_stages * self.num_model_chunks

    def virtual_stage(self, chunk: int = 0) -> int:
        """The position in the chain of this rank's chunk `chunk`: chunk * p + stage
        (layout "v": stage for chunk 0, 2p - 1 - stage for chunk 1)."""
        return chain_position(self.stage, chunk, self.num_stages, self.layout)

    def is_first_stage(self, chunk: int = 0) -> bool:
        """Whether this rank's `chunk` is the chain's first virtual stage (it runs the embeddings)."""
        return self.virtual_stage(chunk) == 0

    def is_last_stage(self, chunk: int | None = None) -> bool:
        """Whether this rank's `chunk` (default: its last) is the chain's last virtual stage (the head)."""
        chunk = self.num_model_chunks - 1 if chunk is None else chunk
        return self.virtual_stage(chunk) == self.num_virtual_stages - 1

    def stage_of(self, virtual_stage: int) -> int:
        """The stage (rank in pp_group) that runs `virtual_stage`."""
        return stage_running(virtual_stage, self.num_stages, self.layout)

    def distribute_layers(self, num_layers: int, where: str = "model") -> list[int]:
        """The layer count of each virtual stage (see the module docstring);
        ValueError when the layers cannot give every virtual stage one."""
        V = self.num_virtual_stages
        if self.num_layers_per_stage is not None:
            if sum(self.num_layers_per_stage) != num_layers:
                raise ValueError(f"{where}: num_layers_per_stage={list(self.num_layers_per_stage)} sums to "
                                 f"{sum(self.num_layers_per_stage)}, but the model has {num_layers} layers")
            return list(self.num_layers_per_stage)
        if num_layers < V:
            raise ValueError(f"{where}: {num_layers} layers cannot be split over {V} pipeline stages "
                             f"({self.num_stages} stages x {self.num_model_chunks} chunks); every stage needs a layer")
        counts = [num_layers // V] * V
        middle_first = sorted(range(V), key=lambda k: (abs(k - (V - 1) / 2), k))
        for k in middle_first[:num_layers % V]:
            counts[k] += 1
        return counts

    def layer_ranges(self, num_layers: int, where: str = "model") -> list[range]:
        """The layers of each of this rank's chunks (global layer indices), chunk order."""
        counts = self.distribute_layers(num_layers, where)
        starts = [sum(counts[:k]) for k in range(len(counts))]
        return [range(starts[k], starts[k] + counts[k])
                for k in (self.virtual_stage(c) for c in range(self.num_model_chunks))]


LAYOUTS = ("loop", "v")


def chain_position(stage: int, chunk: int, p: int, layout: str = "loop") -> int:
    """The virtual stage of `chunk` on `stage` among p stages."""
    if layout == "v":
        return stage if chunk == 0 else 2 * p - 1 - stage
    return chunk * p + stage


def stage_running(virtual_stage: int, p: int, layout: str = "loop") -> int:
    """The stage that runs `virtual_stage` (the inverse of chain_position over the chunks)."""
    if layout == "v":
        return virtual_stage if virtual_stage < p else 2 * p - 1 - virtual_stage
    return virtual_stage % p


def _plain(value):
    """num_layers_per_stage as a plain value the ranks can compare (a tuple of ints stays one)."""
    try:
        return tuple(value) if value is not None else None
    except TypeError:
        return repr(value)
