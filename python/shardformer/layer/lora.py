"""PEFT LoRA adapters on tensor-parallel linear layers.

PEFT's lora.Linear adds, for every active adapter a, a low-rank term to its
base layer:

    Y = base(X) + s_a B_a A_a drop_a(X)      A_a [r, in], B_a [out, r], s_a = alpha / r (rsLoRA: / sqrt r)

On a column-parallel base (Linear1D_Col: Y_i = X W_i^T + b_i, output
features split) rank i holds A whole and B_i, B's rows of its output
features in the base's layout (uneven, fused, replicated KV rows alike):

    Y_i = X W_i^T + b_i + s B_i A drop(X)
    dX: the adapter reads X inside the base's region (after its
        copy_to_tp_region), so its partial s drop'(dY_i B_i A) joins the
        base's dY_i W_i in the one all-reduce
    dA = sum_i s (dY_i B_i)^T drop(X): A enters through copy_to_tp_region
        (identity forward, all-reduce of dA backward); rows of B that
        several ranks hold get their gradients summed (sync_replicated_grad)
    drop: the same mask on every rank (DropoutForReplicatedInput), as X is
        the same on every rank

On a row-parallel base (Linear1D_Row: Y = sum_i X_i W_i^T + b, input
features split) rank i holds A_i, A's columns of its input features, and B
whole:

    Y = reduce(X_i W_i^T + s B A_i drop_i(X_i)) + b
        the adapter's partial product joins the base's before its one
        reduction (all-reduce, or reduce-scatter with sequence parallelism)
    dA_i = s (dY B)^T drop_i(X_i) is local; dB = sum_i s dY^T (A_i drop_i(X_i)):
        B enters through copy_to_tp_region
    drop_i: a mask per rank over its features (DropoutForParallelInput), the
        rank's slice of one mask over X

B_i A (column) and B A_i (row) are exactly this rank's shard of the full
B A, so PEFT's own get_delta_weight, merge, unmerge and merge_and_unload
work on the shards unchanged.  lora_A / lora_B become LoraFactor modules
(nn.Linear with `sharded_params`), so the checkpoint helpers gather and cut
them like any sharded parameter.

Imported only where peft is installed (shardformer.lora).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
try:                                        # the optional extra: pip install "shardformer[peft]"
    from peft.tuners.lora import layer as peft_lora
except ModuleNotFoundError as e:            # e.g. pkgutil.walk_packages over an install without it
    raise ModuleNotFoundError("shardformer.layer.lora (LoRA on sharded models) needs peft, which is not "
                              "installed: pip install 'shardformer[peft]' (or peft>=0.21.2)") from e
from torch import nn

from .. import distributed as D
from ..distributed.mappings import copy_to_tp_region, sync_replicated_grad
from .dropout import DropoutForParallelInput, DropoutForReplicatedInput
from .linear import Linear1D_Col, Linear1D_Row, VocabParallelLMHead1D
from .lora_config import check_config
from .parallel_module import ParallelModule, shard_of

class LoraFactor(nn.Linear, ParallelModule):
    """lora_A or lora_B of an adapter on a parallel layer: the nn.Linear PEFT
    built, holding this rank's shard of the factor along `split_dim` (None:
    the whole factor, replicated).  PEFT reads `.weight`; the layer's forward
    does the math (the factor's own forward is not called)."""

    split_dim: int | None = None
    shard = None

    @property
    def sharded_params(self):
        return {} if self.split_dim is None else {"weight": (self.split_dim, self.shard)}

    @classmethod
    def adopt(cls, linear: nn.Linear, base: nn.Module, split_dim: int | None) -> "LoraFactor":
        """Turn PEFT's full-size `linear` into this rank's factor, cut along
        `split_dim` by the base layer's feature layout (in place: the same
        module object, a new weight Parameter keeping requires_grad)."""
        if type(linear) is not nn.Linear or linear.bias is not None:
            raise TypeError(f"LoraFactor: expected PEFT's bias-free nn.Linear factor, got {linear!r}")
        linear.__class__ = cls
        linear.process_group, linear.shard_plan = base.process_group, base.shard_plan
        linear.tp_size, linear.tp_rank = base.tp_size, base.tp_rank
        linear.split_dim, linear.shard = split_dim, base.shard if split_dim is not None else None
        if split_dim is not None:
            w = linear.weight
            linear.weight = nn.Parameter(shard_of(w, split_dim, base.shard), requires_grad=w.requires_grad)
            linear.out_features, linear.in_features = linear.weight.shape
        return linear


class _ParallelLoraLinear(peft_lora.Linear):
    """PEFT's lora.Linear on a Linear1D_Col / Linear1D_Row base.  Built two
    ways: from a lora.Linear whose base optimize() replaced (adopt, the
    adapters cut from the full ones), or by PEFT itself on an already-sharded
    layer (shardformer.lora.get_peft_model: update_layer cuts each new
    adapter after PEFT initialized it full size, identically on every rank)."""

    base_class: type = nn.Module
    dropout_class: type = nn.Module
    a_dim: int | None = None          # the dimension of lora_A's weight cut by the base's layout
    b_dim: int | None = None          # the dimension of lora_B's weight cut by the base's layout

    @classmethod
    def adopt(cls, layer: peft_lora.Linear, broadcast: bool = False) -> "_ParallelLoraLinear":
        """Switch `layer` (a lora.Linear whose base_layer is now a parallel
        layer) to this class and cut every adapter it has."""
        layer.__class__ = cls
        for adapter in list(layer.lora_A.keys()):
            layer._cut_adapter(adapter, broadcast)
        return layer

    def _get_in_out_features(self, module):
        return module.in_features, module.out_features      # the full sizes: PEFT builds full factors

    def _cut_adapter(self, adapter: str, broadcast: bool) -> None:
        base = self.get_base_layer()
        a, b = self.lora_A[adapter], self.lora_B[adapter]
        if broadcast and base.tp_size > 1:                 # rank 0's full factors: the same adapter everywhere
            with torch.no_grad():
                for f in (a, b):
                    D.broadcast(f.weight.data, 0, base.process_group)
        LoraFactor.adopt(a, base, self.a_dim)
        LoraFactor.adopt(b, base, self.b_dim)
        drop = self.lora_dropout[adapter]
        if isinstance(drop, nn.Dropout) and drop.p > 0:
            with torch.random.fork_rng(devices=[]):     # its seed draw leaves torch's generator where PEFT's is
                self.lora_dropout[adapter] = self.dropout_class(drop.p, process_group=base.process_group)

    def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs):
        """PEFT adding an adapter to an already-sharded layer: refused unless
        vanilla LoRA with a weight-free initialization (see check_config),
        then cut like the adapters of adopt()."""
        base = self.get_base_layer()
        where = f"{type(base).__name__} (adapter {adapter_name!r})"
        check_config(config, where, added=True)
        if isinstance(base, VocabParallelLMHead1D) or getattr(base, "gather_input", False):
            raise NotImplementedError(f"{where}: LoRA on a vocabulary-parallel LM head or a gather_input layer "
                                      f"is not supported; leave it out of target_modules")
        super().update_layer(adapter_name, r, lora_alpha, config, **kwargs)
        self._cut_adapter(adapter_name, broadcast=True)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        if kwargs.pop("adapter_names", None) is not None:
            raise NotImplementedError(f"{type(self).__name__}: adapter_names= (a different adapter per row of the "
                                      f"batch) is not supported on a sharded model; use set_adapter()")
        for key in peft_lora.VARIANT_KWARG_KEYS:
            kwargs.pop(key, None)
        if self.disable_adapters and self.merged:
            self.unmerge()
        active = [a for a in self.active_adapters if a in self.lora_A] if not self.disable_adapters else []
        if self.merged or not active:
            return self.base_layer(x, *args, **kwargs)
        return self.base_layer(x, *args, addend=functools.partial(self._adapters, active), **kwargs)

    def _adapters(self, active: list[str], x: torch.Tensor) -> torch.Tensor:
        """The sum of the active adapters' terms on this rank (see the module
        doc), in the base layer's dtype."""
        dtype = self.get_base_layer().weight.dtype
        total = None
        for adapter in active:
            a, b = self._factors(adapter)
            h = self.lora_dropout[adapter](self._cast_input_dtype(x, a.dtype))
            term = (F.linear(F.linear(h, a), b) * self.scaling[adapter]).to(dtype)
            total = term if total is None else total + term
        return total

    def _factors(self, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class ColumnLoraLinear(_ParallelLoraLinear):
    """LoRA on a column-parallel base: A whole, B_i this rank's output rows."""

    base_class = Linear1D_Col
    dropout_class = DropoutForReplicatedInput
    b_dim = 0

    def _factors(self, adapter):
        base = self.get_base_layer()
        a = copy_to_tp_region(self.lora_A[adapter].weight, base.process_group)      # dA summed over ranks
        b = sync_replicated_grad(self.lora_B[adapter].weight, 0, base.shard, base.process_group)
        return a, b


class RowLoraLinear(_ParallelLoraLinear):
    """LoRA on a row-parallel base: A_i this rank's input columns, B whole."""

    base_class = Linear1D_Row
    dropout_class = DropoutForParallelInput
    a_dim = 1

    def _factors(self, adapter):
        base = self.get_base_layer()
        return self.lora_A[adapter].weight, copy_to_tp_region(self.lora_B[adapter].weight, base.process_group)


#: the parallel base layers that take adapters, and the class their lora.Linear becomes
LORA_CLASSES = (ColumnLoraLinear, RowLoraLinear)


def lora_class_for(base: nn.Module) -> type | None:
    """The class of the adapters on `base` (None: a layer optimize() left
    alone, whose lora.Linear stays as it is)."""
    for cls in LORA_CLASSES:
        if isinstance(base, cls.base_class):
            return cls
    return None
