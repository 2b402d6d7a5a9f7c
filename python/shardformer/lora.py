"""PEFT LoRA models through optimize(), and LoRA added to a sharded model.

    peft_model = peft.get_peft_model(model, LoraConfig(...))
    ShardFormer(cfg).optimize(peft_model)      # base layers and adapters sharded together
    peft_model.save_pretrained(dir)            # on every rank: rank 0 writes the full adapter

optimize() of a PeftModel shards the HF model inside it with that model's own
policy, exactly as without PEFT: each lora.Linear is taken out of the tree
(its base layer put at its path) while the policy's plan is made and
applied, then put back around whatever replaced the base, its adapters cut
to match (shardformer.layer.lora has the math).  The plan is checked first:
an adapter whose base the plan turns into anything but a column- or
row-parallel linear (the vocabulary-parallel LM head, a layer inside a
module replaced whole, ...) is refused by path before anything changes; a
base the plan leaves alone keeps its adapter as it is (replicated, like the
base).  Every PEFT module of the model must be a plain LoRA lora.Linear:
other tuners (IA3, prefix tuning, ...), LoRA on embeddings or convolutions,
modules_to_save, DoRA and the other LoRA variants are refused by name, never
left unsharded; so are pipeline parallelism and the all_to_all / ring_attn
sequence modes (split_gather works: the adapters' terms join the layers'
partial products before the block's reduce-scatter).

get_peft_model(sharded_model, config) (this module's) adds LoRA after
optimize(): PEFT builds each adapter full size on a Linear1D_Col /
Linear1D_Row (LoraConfig's custom-module mapping), rank 0's initialization
is broadcast and every rank keeps its cut.
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from .layer.lora_config import check_config
from .sharder import SHARDED_MARK, mark_broken


def is_peft_model(model: nn.Module) -> bool:
    """Whether any module of `model` is PEFT's (no import of peft)."""
    return any(type(m).__module__.split(".", 1)[0] == "peft" for m in model.modules())


def _parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    head, _, leaf = path.rpartition(".")
    return (model.get_submodule(head) if head else model), leaf


class LoraSharding:
    """optimize() of a PeftModel: checks on construction (nothing changes),
    then shard(sharder) runs the sharder on the HF model inside with the
    LoRA layers taken out, and puts them back, sharded."""

    def __init__(self, model: nn.Module, shard_config):
        import peft
        from peft.tuners.lora import layer as peft_lora

        name = type(model).__name__
        if not isinstance(model, peft.PeftModel) or isinstance(model, peft.PeftMixedModel):
            raise NotImplementedError(
                f"{name}: holds PEFT modules; optimize() the PeftModel itself (what get_peft_model or "
                f"PeftModel.from_pretrained returned): its save_pretrained must gather the sharded adapters")
        sequence = shard_config.enable_sequence_parallelism and shard_config.sequence_parallelism_mode
        if shard_config.pipeline_stage_manager is not None or sequence not in (False, "split_gather"):
            what = "pipeline" if shard_config.pipeline_stage_manager is not None else f"{sequence} sequence"
            raise NotImplementedError(f"{name}: LoRA adapters with {what} parallelism are not supported; "
                                      f"tensor parallelism is, and split_gather sequence parallelism")
        for adapter, config in model.peft_config.items():
            check_config(config, f"{name} adapter {adapter!r}")
        self.peft_model, self.shard_config = model, shard_config
        self.model = model.get_base_model()
        self.name = f"{name}({type(self.model).__name__})"
        self.layers: dict[str, peft_lora.Linear] = {}
        for path, m in self.model.named_modules():
            if type(m).__module__.split(".", 1)[0] != "peft":
                continue
            if type(m) is not peft_lora.Linear:
                raise NotImplementedError(
                    f"{self.name}: {path} is PEFT's {type(m).__qualname__} ({type(m).__module__}); only LoRA on "
                    f"linear layers (lora.Linear) can be sharded; leave this module out of target_modules")
            variants = sorted({type(v).__name__ for v in m.lora_variant.values()})
            if variants or any(m.lora_bias.values()):
                raise NotImplementedError(f"{self.name}: {path}: {', '.join(variants) or 'lora_bias'} is not "
                                          f"supported on a sharded model")
            self.layers[path] = m

    def claims(self, path: str, module: nn.Module) -> bool:
        """Whether `module` at `path` of the HF model is one of the LoRA layers
        shard() cuts (shardformer.wrappers refuses every other wrapper)."""
        return self.layers.get(path) is module

    def check_plan(self, ops: list) -> None:
        """Every adapter's base is replaced by a column- or row-parallel
        linear, or left alone (ModelSharder calls this with the plan, before
        the model changes)."""
        from .layer.linear import VocabParallelLMHead1D
        from .layer.lora import LORA_CLASSES

        subs = {op.path: op for op in ops if op.kind == "sub"}
        for path in self.layers:
            outer = [p for p in subs if path.startswith(p + ".")          # hooks on a kept module are fine
                     and not hasattr(subs[p].target, "prepare_native_module")]
            if outer:
                raise NotImplementedError(
                    f"{self.name}: {path}: the policy replaces {outer[0]} whole "
                    f"({getattr(subs[outer[0]].target, '__name__', subs[outer[0]].target)}), so the LoRA adapter inside "
                    f"it cannot be kept; leave {path} out of target_modules")
            op = subs.get(path)
            if op is None:
                continue
            target, kwargs = op.target, op.kwargs or {}
            usable = isinstance(target, type) and any(issubclass(target, c.base_class) for c in LORA_CLASSES) \
                and not issubclass(target, VocabParallelLMHead1D) and not kwargs.get("gather_input")
            if not usable:
                how = getattr(target, "__name__", repr(target)) + (" with gather_input" if kwargs.get(
                    "gather_input") else "")
                raise NotImplementedError(
                    f"{self.name}: {path}: a LoRA adapter on a layer the policy replaces by {how} is not "
                    f"supported (adapters go on column- and row-parallel linear layers); leave {path} out of "
                    f"target_modules")

    def _put(self, lora: bool) -> None:
        for path, layer in self.layers.items():
            parent, leaf = _parent(self.model, path)
            setattr(parent, leaf, layer if lora else layer.base_layer)

    def shard(self, sharder) -> list:
        """Run `sharder` (a ModelSharder of self.model) with the LoRA layers
        out of the tree; put them back (sharded) after, or as they were when
        it fails."""
        from .layer.lora import lora_class_for

        sharder.check_plan = self.check_plan
        self._put(lora=False)
        try:
            shared = sharder.shard()
        except BaseException:
            self._put(lora=True)
            raise
        broadcast = self.shard_config.option("broadcast_weights")
        try:
            for path, layer in self.layers.items():
                base = sharder.model.get_submodule(path)
                layer.base_layer = base
                cls = lora_class_for(base)
                if cls is not None:
                    cls.adopt(layer, broadcast=broadcast)
            self._put(lora=True)
            self.peft_model.save_pretrained = GatheredSave(self.peft_model)
        except BaseException as e:
            mark_broken(self.model, self.name, e)
            raise
        return shared


class GatheredSave:
    """PeftModel.save_pretrained of a sharded PeftModel, called on every rank:
    the adapters' factors gathered over their tensor-parallel groups, then
    PEFT's own save_pretrained writes them on global rank 0 only (the file
    PeftModel.from_pretrained loads into the unsharded model)."""

    def __init__(self, peft_model: nn.Module):
        self.peft_model = peft_model

    def __call__(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        from .checkpoint.full import gather_dim_to_root, shard_info

        model = self.peft_model
        if "state_dict" in kwargs:
            raise ValueError(f"{type(model).__name__}.save_pretrained: state_dict= is not supported on a sharded "
                             f"model (the adapters are gathered from the shards)")
        info = shard_info(model)
        state = {}
        for key, t in model.state_dict(keep_vars=True).items():
            if "lora_" not in key:
                continue
            if id(t) in info:
                dim, shard, group = info[id(t)]
                t = gather_dim_to_root(t, dim, shard, group)
            if t is not None:
                state[key] = t.detach()
        main = is_main_process and (not dist.is_initialized() or dist.get_rank() == 0)
        type(model).save_pretrained(model, save_directory, *args, is_main_process=main,
                                    state_dict=state if main else None, **kwargs)
        for group in {id(g): g for _, _, g in info.values()}.values():
            dist.barrier(group=group)     # rank 0's group returns once the files are written


def get_peft_model(model: nn.Module, config, **kwargs):
    """peft.get_peft_model on a model optimize() already sharded: LoRA on its
    Linear1D_Col / Linear1D_Row layers (and on the layers it left alone),
    each adapter initialized full size as PEFT does, rank 0's values
    broadcast over the tensor-parallel group, and cut like the adapters of a
    PeftModel sharded by optimize().  Collective over the group.  The
    returned PeftModel's save_pretrained gathers (see GatheredSave)."""
    import peft

    if not getattr(model, SHARDED_MARK, False):
        raise ValueError(f"shardformer.lora.get_peft_model: {type(model).__name__} is not sharded; use "
                         f"peft.get_peft_model, then ShardFormer.optimize() the PeftModel")
    check_config(config, type(model).__name__, added=True)
    from .layer.lora import LORA_CLASSES

    config._register_custom_module({cls.base_class: cls for cls in LORA_CLASSES})
    peft_model = peft.get_peft_model(model, config, **kwargs)
    peft_model.save_pretrained = GatheredSave(peft_model)
    return peft_model
