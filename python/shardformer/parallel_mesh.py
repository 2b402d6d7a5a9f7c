"""mesh(): the process groups of hybrid data x pipeline x sequence x tensor parallelism.

The world's ranks are laid out on a 4-D grid, outermost first:

    (pp, dp, sp, tp)        rank = ((p * DP + d) * SP + s) * TP + t

so the TP ranks of a group are consecutive (one host when TP <= the ranks
per host: its collectives take the shared-memory path), SP next to them,
and DP and PP outermost (across hosts).  Each rank belongs to one group per
dimension: the ranks that differ from it only in that coordinate.  For 8
ranks as dp=2, tp=4:  tp groups {0,1,2,3} {4,5,6,7}, dp groups {0,4} {1,5}
{2,6} {3,7}.

    .tp   the model's tensor-parallel group (ShardConfig.tensor_parallel_process_group)
    .sp   the all_to_all / ring_attn sequence-parallel group
    .pp   the pipeline group (PipelineStageManager(pp_group=...))
    .dp   the data-parallel group: ranks holding the same shard of the same
          stage and seeing different data (DDP / ZeRO over it)
    .replicas  dp x sp: every rank holding the same parameters (the
          sequence-parallel layers already sum their gradients over .sp, so
          DDP runs over .dp; this group is for what spans both, e.g. a
          check that replicas agree)
    .ep   with mesh(..., ep=k): the expert-parallel group, a subgroup of .dp
          (the DP group cut into dp/k blocks of k consecutive DP ranks; ep=dp:
          the whole DP group).  MoE experts are split over it
          (ShardConfig.expert_parallel_process_group, shardformer.layer.
          expert_parallel); None without ep
    .expert_dp  the dp/k ranks of .dp owning the same experts (same position
          in their EP blocks): expert gradients are summed over it
          (shardformer.data_parallel); None without ep
    .device_mesh  torch's DeviceMesh over the same grid, dimensions named
          ("pp", "dp", "sp", "tp"): for FSDP2 (fully_shard(mesh=m.device_mesh["dp"]))
          and DTensor code

Building the groups is collective (every rank calls mesh() with the same
sizes; the ranks first check that they do, through the store, and raise
naming the ranks and sizes that differ instead of waiting on different
groups: shardformer.distributed.agree); calling it again with the same
sizes on the same world returns the same object.  Works under torchrun and under multiprocessing spawn: it only
needs an initialized default group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .config import ShardConfig
from .distributed import teardown
from .distributed.agree import agree
from .pipeline import PipelineStageManager

DIMS = ("pp", "dp", "sp", "tp")
MESHES: dict = {}     # (id(world), sizes, ep, backend) -> (world, Mesh): holds the groups strongly


def forget_meshes() -> None:
    """Drop the cached meshes (and with them the references to their groups);
    the exit teardown calls it (shardformer.distributed.teardown)."""
    MESHES.clear()


teardown.on_release(forget_meshes)


@dataclass(frozen=True, eq=False)
class Mesh:
    """The groups of one (pp, dp, sp, tp) layout of the world (see the module doc)."""

    sizes: dict
    coords: dict
    dp: Any
    pp: Any
    sp: Any
    tp: Any
    replicas: Any
    device_mesh: Any
    ep: Any = None
    expert_dp: Any = None
    ep_size: int = 1

    def ranks(self, dim: str) -> list[int]:
        """The global ranks of this rank's group along `dim`, in group order."""
        return _group_ranks(self.sizes, self.coords, (dim,))

    def shard_config(self, **switches):
        """A ShardConfig using these groups: tensor_parallel_process_group =
        .tp; with pp > 1 a PipelineStageManager over .pp (switches may carry
        num_model_chunks / num_layers_per_stage / pipeline_layout, the
        manager's layout: "v" for ZeroBubbleVSchedule); with sp > 1 sequence
        parallelism over .sp (sequence_parallelism_mode, default
        "all_to_all"); with ep > 1 expert parallelism over .ep.  Other switches go to ShardConfig as they are."""
        switches = dict(switches)
        chunks = switches.pop("num_model_chunks", 1)
        per_stage = switches.pop("num_layers_per_stage", None)
        layout = switches.pop("pipeline_layout", "loop")
        if self.sizes["pp"] > 1:
            switches["pipeline_stage_manager"] = PipelineStageManager(self.pp, num_model_chunks=chunks,
                                                                      num_layers_per_stage=per_stage, layout=layout)
        if self.sizes["sp"] > 1:
            switches.setdefault("enable_sequence_parallelism", True)
            switches.setdefault("sequence_parallelism_mode", "all_to_all")
            switches.setdefault("sequence_parallel_process_group", self.sp)
        if self.ep is not None and self.ep_size > 1:
            switches.setdefault("expert_parallel_process_group", self.ep)
        return ShardConfig(tensor_parallel_process_group=self.tp, **switches)

    def __repr__(self):
        layout = " x ".join(f"{d}={self.sizes[d]}" for d in DIMS) + (f" (ep={self.ep_size})" if self.ep else "")
        where = ", ".join(f"{d}={self.coords[d]}" for d in DIMS)
        return f"Mesh({layout}; this rank at {where})"


def _coords(rank: int, sizes: dict) -> dict:
    out = {}
    for dim in reversed(DIMS):
        out[dim] = rank % sizes[dim]
        rank //= sizes[dim]
    return out


def _rank_of(coords: dict, sizes: dict) -> int:
    rank = 0
    for dim in DIMS:
        rank = rank * sizes[dim] + coords[dim]
    return rank


def _group_ranks(sizes: dict, coords: dict, dims: tuple[str, ...]) -> list[int]:
    """Ranks sharing every coordinate of `coords` except those in `dims`."""
    ranks = [dict(coords)]
    for dim in dims:
        ranks = [dict(c, **{dim: i}) for c in ranks for i in range(sizes[dim])]
    return sorted(_rank_of(c, sizes) for c in ranks)


def _new_groups(sizes: dict, dims: tuple[str, ...], mine: dict, backend):
    """new_group for every group along `dims` (every rank creates every
    group, in one order, as torch requires); returns this rank's."""
    others = [d for d in DIMS if d not in dims]
    found = None
    seen = set()
    for rank in range(_size(sizes)):
        c = _coords(rank, sizes)
        members = tuple(_group_ranks(sizes, c, dims))
        if members in seen:
            continue
        seen.add(members)
        group = dist.new_group(list(members), backend=backend)
        if all(c[d] == mine[d] for d in others):
            found = group
    return found


def _size(sizes: dict) -> int:
    n = 1
    for d in DIMS:
        n *= sizes[d]
    return n


def mesh(dp: int | None = None, pp: int = 1, tp: int = 1, sp: int = 1, *, ep: int | None = None,
         backend: str | None = None) -> Mesh:
    """The process groups of a dp x pp x sp x tp layout of the initialized
    world (see the module doc).  dp=None: whatever the others leave
    (world / (pp * sp * tp)).  ep: the expert-parallel group size, dividing
    dp (None: no .ep / .expert_dp groups).  Raises ValueError when the sizes
    do not multiply to the world size."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("shardformer.mesh: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first, or launch with torchrun)")
    world = dist.get_world_size()
    # the arguments as given, before anything that could raise on one rank only
    agree("shardformer.mesh", {"dp": dp, "pp": pp, "tp": tp, "sp": sp, "ep": ep, "backend": backend})
    for name, value in (("pp", pp), ("tp", tp), ("sp", sp)) + ((("dp", dp),) if dp is not None else ()):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"shardformer.mesh: {name} must be an int >= 1, got {value!r}")
    rest = pp * tp * sp
    if dp is None:
        if world % rest:
            raise ValueError(f"shardformer.mesh: pp={pp} x sp={sp} x tp={tp} = {rest} does not divide the world "
                             f"size {world}")
        dp = world // rest
    if dp * rest != world:
        raise ValueError(f"shardformer.mesh: dp={dp} x pp={pp} x sp={sp} x tp={tp} = {dp * rest} ranks, but the "
                         f"world has {world}")
    if ep is not None and (not isinstance(ep, int) or isinstance(ep, bool) or ep < 1 or dp % ep):
        raise ValueError(f"shardformer.mesh: ep must be an int >= 1 dividing dp={dp} (the expert-parallel group "
                         f"is a subgroup of the data-parallel group), got {ep!r}")
    sizes = {"pp": pp, "dp": dp, "sp": sp, "tp": tp}
    key = (id(dist.group.WORLD), tuple(sizes[d] for d in DIMS), ep, backend)
    cached = MESHES.get(key)
    if cached is not None and cached[0] is dist.group.WORLD:
        return cached[1]
    coords = _coords(dist.get_rank(), sizes)
    groups = {d: _new_groups(sizes, (d,), coords, backend) for d in DIMS}
    replicas = _new_groups(sizes, ("dp", "sp"), coords, backend)
    experts = _expert_groups(sizes, coords, ep, backend) if ep is not None else (None, None)
    built = Mesh(sizes=sizes, coords=coords, dp=groups["dp"], pp=groups["pp"], sp=groups["sp"], tp=groups["tp"],
                 replicas=replicas, device_mesh=_device_mesh(sizes), ep=experts[0], expert_dp=experts[1],
                 ep_size=ep or 1)
    MESHES[key] = (dist.group.WORLD, built)
    return built


def _expert_groups(sizes: dict, mine: dict, ep: int, backend):
    """(this rank's EP group, its expert_dp group): every DP group's ranks
    (in DP order) cut into blocks of `ep` consecutive ranks; expert_dp joins
    the ranks at the same position of each block.  Every rank creates every
    group in one order."""
    found = {}
    seen = set()
    for rank in range(_size(sizes)):
        dp_ranks = _group_ranks(sizes, _coords(rank, sizes), ("dp",))
        if tuple(dp_ranks) in seen:
            continue
        seen.add(tuple(dp_ranks))
        blocks = [dp_ranks[i:i + ep] for i in range(0, len(dp_ranks), ep)]
        across = [dp_ranks[i::ep] for i in range(ep)]
        for kind, members_list in (("ep", blocks), ("expert_dp", across)):
            for members in members_list:
                group = dist.new_group(members, backend=backend)
                if _rank_of(mine, sizes) in members:
                    found[kind] = group
    return found["ep"], found["expert_dp"]


def _device_mesh(sizes: dict):
    """torch's DeviceMesh over the same grid (None where this torch has none)."""
    import torch

    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:       # pragma: no cover - torch without DeviceMesh
        return None
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    grid = torch.arange(_size(sizes)).reshape(*(sizes[d] for d in DIMS))
    return DeviceMesh(device, grid, mesh_dim_names=DIMS)
