"""Expert parallelism: the E experts of a MoE block split over the ranks of an
expert-parallel (EP) group, every expert still split over TP inside.

Groups.  The EP group is a subgroup of the data-parallel group: ranks that
hold the same TP shard of the same stage and see different tokens
(shardformer.mesh(dp=, tp=, ep=k): the DP group cut into dp/k consecutive
blocks of k ranks; ep=dp, the whole DP group, is the usual choice).
`.expert_dp` joins the ranks of different EP groups that own the same
experts (dp/ep of them): expert parameters are replicated over it only.
ShardConfig(expert_parallel_process_group=mesh.ep) switches the layer on.

Ownership.  EP rank r of P owns a contiguous block of the E experts, the
first E mod P ranks one more (E=5 over 2 ranks: experts 0-2 and 3-4); E < P
is refused.  Each owned expert is split by its intermediate features over
TP exactly as FusedExperts1D does (same ShardPlan, same expert_ffn): the
local parameters are gate_up_proj [E_r, 2I/tp, H] and down_proj
[E_r, H, I/tp].

Forward, with T tokens, top-k routing (top_k_index, top_k_weights [T, k]):

  1. the T*k (token, slot) pairs are sorted by the EP rank owning their
     expert; n_j pairs go to rank j.  A capacity c = max over the EP group
     of max_j n_j (one all-reduce of a scalar, max) pads every destination's
     chunk to c rows, so the exchange has equal dim-0 chunks.
  2. dispatch: all_to_all over the EP group of the [P*c, H] rows (chunk j ->
     rank j; gradient: the same all_to_all, which is its own adjoint:
     mappings.all_to_all_along with scatter = gather = dim 0), and, without
     gradient, of the [P*c] local expert ids (-1 marks padding).
  3. each rank runs its experts on the rows it received (partial over TP).
  4. combine: the all_to_all back (its gradient, the dispatch exchange),
     then y[t] = sum over slots s of w[t, s] * expert_out[t, s], summed over
     TP by reduce_from_tp_region (all-reduce forward, identity backward) as
     in FusedExperts1D; hidden states and weights enter through
     copy_to_tp_region (identity forward, all-reduce of the gradient).

No token is dropped (the capacity is the largest actual load), so the output
equals the unsharded block's.  The exchanges are collective over the EP
group: every EP rank must run the model forward the same number of times
(a generate() that stops early on one rank's prompts but not another's
would leave the others waiting; use the same max_new_tokens with no early
stop, or generate on a model sharded without an EP group).  Backward, an expert's weight gradient sums
the contributions of the tokens every EP rank sent it: the gradient of the
sum over the EP group of the ranks' losses.  The data-parallel average
(shardformer.data_parallel / average_gradients) therefore leaves expert
parameters out of the DP all-reduce, sums them over `.expert_dp` and divides
by the DP size, which equals the unsharded model's gradient of the mean loss.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from .. import _C
from ..config import group_size_and_rank
from ..distributed import collectives as C
from ..distributed.mappings import all_to_all_along, copy_to_tp_region, reduce_from_tp_region
from ..layout import DimShard, Split
from ..lazy import is_uninitialized, materialize
from .moe import FusedExperts1D
from .parallel_module import ShardPlan, shapes_only
from .state_shard import layout_text

#: Parameters of an expert-parallel layer carry this attribute: the EP group
#: their experts are split over (data_parallel / average_gradients /
#: clip_grad_norm_ read it).
EXPERT_GROUP_ATTR = "_shardformer_expert_group"


def expert_shard(num_experts: int, ep_size: int, ep_rank: int) -> DimShard:
    """The experts dimension split over the EP group: layout.Split(), so
    contiguous blocks, the first num_experts % ep_size ranks one expert more
    (the same DimShard the checkpoint gather uses along dim 0)."""
    plan = ShardPlan(ep_size, ep_rank).split("experts", Split(), num_experts, what="experts")
    return _C.resolve_plan(plan)["experts"]


def expert_block(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """(first expert, count) owned by EP rank `ep_rank`."""
    shard = expert_shard(num_experts, ep_size, ep_rank)
    return shard.ranges[0][0], shard.length


def expert_owner(shard: DimShard) -> torch.Tensor:
    """[E] int64: the EP rank owning each expert."""
    owner = torch.empty(shard.full, dtype=torch.int64)
    for r, ranges in enumerate(shard.all_ranges):
        for start, n in ranges:
            owner[start:start + n] = r
    return owner


def _capacity(counts: torch.Tensor, group, device) -> int:
    """The largest per-destination load over the EP group (at least 1)."""
    top = torch.tensor([int(counts.max()) if counts.numel() else 0], dtype=torch.int64, device=device)
    C.all_reduce(top, group, op="max")
    return max(int(top.item()), 1)


class ExpertParallelExperts(FusedExperts1D):
    """FusedExperts1D whose experts are also split over an EP group (see the
    module doc).  forward(hidden [T, H], top_k_index [T, k], top_k_weights
    [T, k]) -> [T, H]; `exchanges` counts the dispatch all_to_alls run."""

    @classmethod
    def plan_shard(cls, module, tp_size, rank, expert_group=None, **kwargs) -> ShardPlan:
        plan = super().plan_shard(module, tp_size, rank, **kwargs)
        experts = module.gate_up_proj.shape[0]
        ep_size, _ = group_size_and_rank(expert_group)
        if experts < ep_size:
            raise ValueError(f"{cls.__name__}: {type(module).__name__} has {experts} experts, fewer than the "
                             f"{ep_size} ranks of expert_parallel_process_group; every EP rank must own at "
                             "least one expert (use a smaller ep)")
        return plan

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, act_fn: nn.Module,
                 process_group=None, plan: ShardPlan | None = None, dtype=None, device=None,
                 expert_group=None, **kwargs):
        if kwargs.get("sequence_parallel"):
            raise ValueError(f"{type(self).__name__}: expert parallelism with split-gather sequence parallelism "
                             "is not supported")
        if plan is None:
            plan = self.plan_for(shapes_only(gate_up_proj=(num_experts, 2 * intermediate_dim, hidden_dim),
                                             down_proj=(num_experts, hidden_dim, intermediate_dim)),
                                 process_group, expert_group=expert_group)
        self.ep_size, self.ep_rank = group_size_and_rank(expert_group)
        shard = expert_shard(num_experts, self.ep_size, self.ep_rank)
        first, count = shard.ranges[0][0], shard.length
        super().__init__(count, hidden_dim, intermediate_dim, act_fn, process_group=process_group, plan=plan,
                         dtype=dtype, device=device)
        self.total_experts, self.first_expert = num_experts, first
        self.expert_group, self.expert_shard = expert_group, shard
        self.owner = expert_owner(shard)     # not buffers: no state-dict entries
        self.block_firsts = torch.tensor([ranges[0][0] for ranges in shard.all_ranges], dtype=torch.int64)
        self.exchanges = 0
        for p in (self.gate_up_proj, self.down_proj):
            setattr(p, EXPERT_GROUP_ATTR, expert_group)

    def partial_params(self) -> dict[str, str]:
        """Every expert parameter holds this rank's experts only (and, over TP, its part of each)."""
        tp = super().partial_params()
        if self.ep_size == 1:
            return tp
        experts = layout_text(0, self.expert_shard, "expert-parallel")
        return {name: "; ".join(filter(None, (experts, tp.get(name)))) for name in self.split_params}

    def load_native(self, module: nn.Module) -> None:
        """This rank's block of experts, each cut over TP as FusedExperts1D does."""
        block = slice(self.first_expert, self.first_expert + self.num_experts)
        super().load_native(SimpleNamespace(**{name: _rows(getattr(module, name, None), block)
                                               for name in self.split_params}))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp_region(hidden_states, self.process_group)
        weights = copy_to_tp_region(top_k_weights, self.process_group)
        pairs, rows, ids = self._route(top_k_index)
        tokens = pairs // top_k_index.shape[1]
        send = x.new_zeros((ids.shape[0], x.shape[1])).index_copy(0, rows, x[tokens])
        recv_ids = torch.empty_like(ids)
        C.all_to_all_single(recv_ids, ids, self.expert_group)          # no gradient: expert ids
        recv = all_to_all_along(send, 0, 0, self.expert_group)          # dispatch (backward: its adjoint)
        self.exchanges += 1
        back = all_to_all_along(self._run_local(recv, recv_ids), 0, 0, self.expert_group)    # combine
        y = back[rows] * weights.reshape(-1)[pairs, None]
        out = torch.zeros_like(x).index_add(0, tokens, y.to(x.dtype))
        return reduce_from_tp_region(out, self.process_group)

    def _route(self, top_k_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where each (token, slot) pair goes: (pairs: flat indices t*k+s of
        the pairs with a real expert, sorted by owning EP rank; rows: each
        pair's row of the [P*cap] send buffer, its owner's chunk then arrival
        order; ids [P*cap]: the owner-local expert id of each row, -1 for
        padding).  cap is agreed over the EP group (one all-reduce, max)."""
        flat = top_k_index.reshape(-1)
        pairs = torch.nonzero((flat >= 0) & (flat < self.total_experts)).squeeze(1)
        dest = self.owner.to(flat.device)[flat[pairs]]
        order = torch.argsort(dest, stable=True)
        pairs, dest = pairs[order], dest[order]
        local = flat[pairs] - self.block_firsts.to(flat.device)[dest]
        counts = torch.bincount(dest, minlength=self.ep_size)
        cap = _capacity(counts, self.expert_group, flat.device)
        starts = torch.cumsum(counts, 0) - counts
        rows = dest * cap + (torch.arange(dest.numel(), device=dest.device) - starts[dest])
        ids = torch.full((self.ep_size * cap,), -1, dtype=torch.int64, device=flat.device)
        ids[rows] = local
        return pairs, rows, ids

    def _run_local(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts on the rows it received ([P*cap, H]; id -1: padding, output 0)."""
        out = torch.zeros_like(rows)
        # every local expert runs, on zero rows if none came: the autograd graph (and so the
        # order of the gradient hooks data_parallel puts on the experts) is the same on every rank
        for e in range(self.num_experts):
            where = torch.nonzero(local_ids == e).squeeze(1)
            out = out.index_copy(0, where, self.expert_ffn(e, rows[where]).to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + self.num_experts - 1} of "
                f"{self.total_experts}, ep={self.ep_rank}/{self.ep_size}, " + super().extra_repr())


def _rows(t: torch.Tensor | None, block: slice) -> torch.Tensor | None:
    """The experts `block` of a fused expert parameter (dim 0), keeping its
    requires_grad (load_native then cuts the TP dimension of it).  A lazy
    tensor (lazy_init) is built whole first; one marked to be loaded comes
    back as it is (load_native copies nothing from it)."""
    if t is None or is_uninitialized(t):
        return t
    requires_grad = t.requires_grad
    return materialize(t).detach()[block].requires_grad_(requires_grad)


def is_expert_param(t: torch.Tensor) -> bool:
    """Whether `t` is a parameter of an expert-parallel layer (split over an EP group)."""
    return hasattr(t, EXPERT_GROUP_ATTR)


def expert_shards(model: nn.Module) -> dict[int, tuple[DimShard, object]]:
    """id(parameter) -> (its experts' DimShard along dim 0, the EP group) for
    every expert-parallel parameter (the checkpoint gather's data)."""
    return {id(getattr(m, name)): (m.expert_shard, m.expert_group) for m in model.modules()
            if isinstance(m, ExpertParallelExperts) for name in m.split_params}


def refuse_expert_parallel(model: nn.Module, what: str) -> None:
    """NotImplementedError for checkpoint paths that expect every expert on
    every rank of a TP group, naming the model and the module."""
    for path, module in model.named_modules():
        if isinstance(module, ExpertParallelExperts):
            raise NotImplementedError(
                f"{type(model).__name__}: {what} is not available with expert parallelism: {path} holds experts "
                f"{module.first_expert}..{module.first_expert + module.num_experts - 1} of "
                f"{module.total_experts} only (ShardConfig.expert_parallel_process_group)")
