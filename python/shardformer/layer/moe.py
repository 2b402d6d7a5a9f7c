"""Mixture-of-experts feed-forward with every expert split by tensor parallelism.

HF stores the E experts of a sparse MoE block as fused 3-D parameters
(Mixtral, Qwen2-MoE style):

    gate_up_proj [E, 2I, H]   rows [gate | up] of every expert
    down_proj    [E, H, I]

For token x routed to expert e with weight w:  y += w * W2_e (act(G_e x) * U_e x).

FusedExperts1D splits the intermediate features I of every expert over the
p ranks, like a column-parallel gate/up followed by a row-parallel down:
rank i keeps G_e[I_i], U_e[I_i] (its slice of each fused segment) and
W2_e[:, I_i], and computes a partial y_i; reduce_from_tp_region sums them
(all-reduce forward, identity backward).  The router stays replicated, so
every rank sends the same tokens to the same experts; the hidden states and
the routing weights enter through copy_to_tp_region (identity forward,
all-reduce of the gradient backward), because each rank's gradient of them
only sees its partial y_i.

Split-gather sequence parallelism (shardformer.layer.sequence): the MoE
block is a "block" region: its input tokens are all-gathered along the
sequence, the router runs on the gathered tokens (replicated: every rank
routes every token alike), FusedExperts1D(sequence_parallel=True) returns
the partial y_i over all tokens and the block's output reduce-scatter sums
them into this rank's rows.  Backward, the gradients of the hidden states
and of the routing weights are left partial (no copy_to_tp_region): the
block's input reduce-scatter sums dX over the ranks, including the
router's share of it, and the router's weight gradient, partial too, is
all-reduced (RouterInSequenceParallel).  The router logits the block hands
out for the load-balancing loss are replicated, so their gradient, the
same on every rank, is divided by p on the way back in (summed over the
ranks it counts once).

A module the plan leaves replicated beside the experts whose output the
block adds to theirs (a shared expert, SharedExpertInSequenceParallel)
computes the same full output y on every rank from the gathered tokens;
it hands the block y / p, so the reduce-scatter sums the p copies back to
y.  Backward, its output gradient is the all-gathered G / p on every rank:
its parameter gradients, 1/p of the full ones, are all-reduced (summed),
and its input gradient, 1/p of the full one, is summed by the block's
input reduce-scatter like the experts' partial ones.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.mappings import copy_to_tp_region, reduce_from_tp_region
from ..layout import Fused, Split
from .parallel_module import ParallelModule, ShardPlan, check_param, plan_directly, shapes_only
from .replicated import ReplicatedInParallelRegion


class FusedExperts1D(ParallelModule):
    """E experts with fused [gate | up] and down weights, intermediate features split.

    forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H],
    the signature of HF's experts modules.  `sequence_parallel=True` (inside
    a split-gather block): the input and weights are not copied into the
    region and the partial sums are returned for the block's reduce-scatter.
    """

    split_params = {"gate_up_proj": (1, "gate_up"), "down_proj": (2, "down")}

    @classmethod
    def plan_shard(cls, module, tp_size, rank, **kwargs) -> ShardPlan:
        name = type(module).__name__
        gate_up = check_param(module, "gate_up_proj", 3, cls.__name__)
        down = check_param(module, "down_proj", 3, cls.__name__)
        experts, two_inter, hidden = gate_up.shape
        if down.shape[0] != experts or down.shape[1] != hidden or 2 * down.shape[2] != two_inter:
            raise ValueError(f"{cls.__name__}: {name}.gate_up_proj {tuple(gate_up.shape)} and down_proj "
                             f"{tuple(down.shape)} are not [E, 2I, H] and [E, H, I]")
        if getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True):
            raise ValueError(f"{cls.__name__}: {name} stores its experts transposed or with gate/up "
                             "interleaved; only [E, 2I, H] with [gate | up] rows is supported")
        if getattr(module, "has_bias", False) or getattr(module, "gate_up_proj_bias", None) is not None:
            raise ValueError(f"{cls.__name__}: {name} has expert biases, which this layer does not support")
        return (ShardPlan(tp_size, rank)
                .split("gate_up", Fused.equal(2), two_inter, what="gate_up_proj features")
                .split("down", Split(), down.shape[2], what="down_proj intermediate features"))

    @classmethod
    def native_args(cls, module):
        gate_up, down = module.gate_up_proj, module.down_proj
        return dict(num_experts=gate_up.shape[0], hidden_dim=gate_up.shape[2], intermediate_dim=down.shape[2],
                    act_fn=module.act_fn, dtype=gate_up.dtype, device=gate_up.device)

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, act_fn: nn.Module,
                 process_group=None, plan: ShardPlan | None = None, dtype=None, device=None,
                 sequence_parallel: bool = False, **kwargs):
        if plan is None:   # not from the sharder: plan experts of these sizes
            plan = self.plan_for(shapes_only(gate_up_proj=(num_experts, 2 * intermediate_dim, hidden_dim),
                                             down_proj=(num_experts, hidden_dim, intermediate_dim)), process_group)
        super().__init__(plan, process_group)
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        self.act_fn = act_fn
        self.sequence_parallel = sequence_parallel
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, plan["gate_up"].length, hidden_dim,
                                                     dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, plan["down"].length,
                                                  dtype=dtype, device=device))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        # hidden [T, H]; top_k_index, top_k_weights [T, k]
        if self.sequence_parallel:    # the block's gather sums dX and d(weights) over the ranks
            x, weights = hidden_states, top_k_weights
        else:
            x = copy_to_tp_region(hidden_states, self.process_group)
            weights = copy_to_tp_region(top_k_weights, self.process_group)
        out = torch.zeros_like(x)
        for e in torch.unique(top_k_index).tolist():
            if not 0 <= e < self.num_experts:
                continue
            token_idx, slot = torch.where(top_k_index == e)
            y = self.expert_ffn(e, x[token_idx])
            out.index_add_(0, token_idx, (y * weights[token_idx, slot, None]).to(out.dtype))
        if self.sequence_parallel:
            return out
        return reduce_from_tp_region(out, self.process_group)

    def expert_ffn(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """down_e(act(gate_e rows) * up_e rows) with this rank's features of
        local expert e: [n, H] -> [n, H], partial over the TP group."""
        gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, self.down_proj[e])

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, "
                f"intermediate={self.intermediate_dim}, local={self.down_proj.shape[2]}, "
                f"tp={self.tp_rank}/{self.tp_size}")


class _ShareGrad(torch.autograd.Function):
    """Identity forward; backward the gradient divided by `n`."""

    @staticmethod
    def forward(ctx, x, n):
        ctx.n = n
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.n, None


class RouterInSequenceParallel:
    """The router of a MoE block under split-gather sequence parallelism
    (module kept): its parameter gradients are all-reduced over the group
    (each rank's is partial, see the module docstring), and the router
    logits it returns (its output's first tensor: the load-balancing
    loss's input, replicated) pass back 1/p of their gradient.  The logits
    hook runs before any other forward hook of the module (HF's output
    recorder reads the scaled tensor)."""

    @classmethod
    def plan_shard(cls, module: nn.Module, tp_size: int, rank: int, **kwargs) -> ShardPlan:
        return ReplicatedInParallelRegion.plan_shard(module, tp_size, rank)

    @classmethod
    def prepare_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                              **kwargs) -> "_SyncAndOutputHook":
        if plan is None:
            plan = plan_directly(cls, module, process_group)
        sync = ReplicatedInParallelRegion.prepare_native_module(module, process_group, plan=plan)
        return _SyncAndOutputHook(module, sync, plan.tp_size)

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                           **kwargs) -> nn.Module:
        return cls.prepare_native_module(module, process_group, plan=plan).commit()


class SharedExpertInSequenceParallel:
    """A module the plan leaves replicated inside a split-gather MoE block,
    whose output the block adds to the experts' partial sums (a shared
    expert; module kept): its output divided by p (the block's
    reduce-scatter sums the p copies back to one), its parameter gradients
    all-reduced over the group (each rank's is 1/p of the full one; see
    the module docstring)."""

    @classmethod
    def plan_shard(cls, module: nn.Module, tp_size: int, rank: int, **kwargs) -> ShardPlan:
        return ReplicatedInParallelRegion.plan_shard(module, tp_size, rank)

    @classmethod
    def prepare_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                              **kwargs) -> "_SyncAndOutputHook":
        if plan is None:
            plan = plan_directly(cls, module, process_group)
        sync = ReplicatedInParallelRegion.prepare_native_module(module, process_group, plan=plan)
        return _SyncAndOutputHook(module, sync, plan.tp_size, _scale_output)

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                           **kwargs) -> nn.Module:
        return cls.prepare_native_module(module, process_group, plan=plan).commit()


def _share_logits_grad(output, n: int):
    """A router's output: its logits (first tensor) pass back 1/n of their gradient."""
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (_ShareGrad.apply(output[0], n),) + tuple(output[1:])
    return None


def _scale_output(output, n: int):
    """A shared expert's output tensor divided by n."""
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"a shared expert in a sequence-parallel MoE block returned {type(output).__name__}, "
                        "not a tensor")
    return output / n


class _SyncAndOutputHook:
    """Gradient sync of a module's parameters plus a forward hook `change`
    (output, n) -> new output or None, run first among its hooks."""

    def __init__(self, module: nn.Module, sync, tp_size: int, change=_share_logits_grad):
        self.module, self.sync, self.tp_size, self.change = module, sync, tp_size, change
        self.handle = None

    def commit(self) -> nn.Module:
        self.sync.commit()
        if self.tp_size > 1:
            self.handle = self.module.register_forward_hook(self.change_output, prepend=True)
        return self.module

    def change_output(self, _module, _args, output):
        """The forward hook: `change` (a module-level function) applied to the
        output; a method, so that the model pickles."""
        return self.change(output, self.tp_size)

    def rollback(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        self.sync.rollback()
