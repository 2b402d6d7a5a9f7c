"""ShardFormer: the user-facing facade."""
from __future__ import annotations

import os
import warnings

from torch import nn

from . import lazy
from .autopolicy import get_autopolicy
from .checkpoint import CheckpointReader
from .checkpoint.pretrained import load_pretrained, mmap_mode, plan_load
from .config import ShardConfig
from .derived_policy import DerivedPolicy
from .lora import LoraSharding, is_peft_model
from .policy import Policy
from .sharder import ModelSharder, SERIAL
from .wrappers import refuse_wrappers


def _plan_policy(model: nn.Module, policy, plan) -> Policy:
    """DerivedPolicy(plan) for optimize(plan=...), after checking that the
    plan is a {str: str} dict and that no policy was passed as well."""
    name = type(model).__name__
    if policy is not None:
        raise TypeError(f"ShardFormer.optimize({name}): pass a policy or a plan, not both")
    if not isinstance(plan, dict) or not plan:
        raise TypeError(f"ShardFormer.optimize({name}): plan must be a non-empty dict {{module path pattern: "
                        f"style}}, got {plan!r}")
    bad = [(k, v) for k, v in plan.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise TypeError(f"ShardFormer.optimize({name}): plan entries must be str: str, got {bad[0]!r}")
    return DerivedPolicy(plan, strict=True)


class ShardFormer:
    """Shard HuggingFace (or custom) models for tensor parallelism.

        model, shared_params = ShardFormer(shard_config=ShardConfig()).optimize(model)

    Every rank of the tensor-parallel group must call optimize() on a model
    built identically (same config, same weights) with the same policy.
    """

    def __init__(self, shard_config: ShardConfig | None = None) -> None:
        if shard_config is not None and not isinstance(shard_config, ShardConfig):
            raise TypeError(f"ShardFormer: shard_config must be a ShardConfig, got {type(shard_config).__name__}")
        self.shard_config = shard_config if shard_config is not None else ShardConfig()

    def optimize(self, model: nn.Module, policy: Policy | None = None, plan: dict[str, str] | None = None):
        """Shard `model` in place; returns (model, shared_params).

        `policy` defaults to the registered policy of the model's class, or
        the model's own tensor-parallel plan.  `plan` instead: a plan in
        transformers' notation, {module path pattern ("model.layers.*.mlp.
        up_proj"): style ("colwise")}, sharded by DerivedPolicy (its styles
        and checks: shardformer.derived_policy); every entry must match a
        module or parameter of the model.  On
        any error (unsupported model, sizes that cannot be split, a policy
        naming modules that do not exist, a replacement failing to build, an
        interrupt) the model is left unchanged; where a change cannot be
        undone (see shardformer.sharder) the model is marked, and every later
        optimize() or forward on it raises "partially sharded ...; rebuild it".
        Calls from several threads run one at a time (sharder.SERIAL); the
        ranks first check that they shard the same model over the same groups
        (RuntimeError naming the ranks otherwise, never a hang).  A PEFT model
        is sharded with its LoRA adapters (shardformer.lora); any other wrapper
        no policy understands (torch.compile, DDP / FSDP; shardformer.wrappers)
        is refused first, never passed through unsharded.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"ShardFormer.optimize: expected a torch.nn.Module, got {type(model).__name__}")
        adapters = None
        if is_peft_model(model):        # the HF model inside is sharded, its LoRA adapters with it
            adapters = LoraSharding(model, self.shard_config)   # refuses the PEFT forms it cannot shard
        target = model if adapters is None else adapters.model
        refuse_wrappers(target, claimed=None if adapters is None else adapters.claims)
        if plan is not None:
            policy = _plan_policy(target, policy, plan)
        if policy is None:
            policy = get_autopolicy(target)
        elif not isinstance(policy, Policy):
            raise TypeError(f"ShardFormer.optimize: policy must be a shardformer.Policy, got {type(policy).__name__}")
        sharder = ModelSharder(target, policy, self.shard_config)
        shared_params = sharder.shard() if adapters is None else adapters.shard(sharder)
        return model, shared_params

    def from_pretrained(self, model_class, path, *, dtype=None, torch_dtype=None, config=None,
                        policy: Policy | None = None, plan: dict[str, str] | None = None,
                        progress: bool | None = None, mmap: bool | str = "rows", **model_kwargs):
        """Build `model_class` from the HF checkpoint directory `path`, shard
        it, and load each rank's slices; returns (model, shared_params), the
        model in eval mode as HF's from_pretrained returns it.

        No rank ever holds the full model: the model is built under
        lazy_init() (no parameter storage), optimize() allocates this rank's
        shards without initializing the ones the checkpoint holds, and
        checkpoint.load_pretrained reads only this rank's slices of them.
        Parameters the checkpoint lacks (e.g. a new classification head) are
        initialized as the model's own init does, with a warning naming
        them, as HF does.  dtype (or HF's older torch_dtype): the model's
        dtype; None or "auto" takes the checkpoint config's dtype (float32 if
        it names none).  config: a config to use instead of the
        checkpoint's.  policy / plan: as optimize()'s.  model_kwargs go to
        `model_class.from_config`.  mmap (default "rows"): a shard that is one
        byte range of a safetensors tensor in the model's dtype (rows: the
        column-parallel weights, replicated tensors) is not copied but mapped
        copy-on-write, as transformers maps the file, and the column shards
        (row-parallel weights) are copied compactly; True maps the column
        shards too, as strided views of the whole mapped tensor (faster to
        load, but each rank's resident set counts the whole tensor, the first
        optimizer step copies every page of it; decoding reads the views in
        place, the skinny kernel included: for inference on a machine short
        of time, not memory); False copies every shard.  Writes never reach the file;
        the model's save_pretrained / save_sharded materialize it before
        replacing the directory; another tool rewriting the file in place
        needs checkpoint.materialize_mapped(model) first: docs/load.md.  Collective over the tensor-parallel group,
        like optimize().  Not with ShardConfig.expert_parallel_process_group
        (NotImplementedError, before anything is read or built): build the
        model, optimize() it, and load_full_state_dict the checkpoint's tensors."""
        if self.shard_config.expert_parallel_process_group is not None:
            raise NotImplementedError(
                f"ShardFormer.from_pretrained({getattr(model_class, '__name__', model_class)}): loading a "
                f"checkpoint's slices into an expert-parallel model (ShardConfig.expert_parallel_process_group) "
                f"is not available; build the model, optimize() it and call "
                f"shardformer.checkpoint.load_full_state_dict with the checkpoint's state dict")

        mmap_mode(mmap, f"ShardFormer.from_pretrained({getattr(model_class, '__name__', model_class)})")
        with SERIAL:        # its broadcast and optimize() together, one call at a time (see sharder.SERIAL)
            return self._from_pretrained(model_class, path, dtype=dtype, torch_dtype=torch_dtype, config=config,
                                         policy=policy, plan=plan, progress=progress, mmap=mmap, **model_kwargs)

    def _from_pretrained(self, model_class, path, *, dtype, torch_dtype, config, policy, plan, progress, mmap,
                         **model_kwargs):
        import torch

        path = _local_checkpoint(os.fspath(path), type(self).__name__)
        if config is None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(path)
        dtype = dtype if dtype is not None else torch_dtype
        if dtype is None or dtype == "auto":
            dtype = getattr(config, "dtype", None) or torch.float32
        dtype = _model_dtype(dtype, getattr(model_class, "__name__", model_class))
        _check_config_class(model_class, config, path)
        build = getattr(model_class, "from_config", None) or getattr(model_class, "_from_config")
        with lazy.lazy_init(exact=False):
            model = build(config, dtype=dtype, **model_kwargs)
        with CheckpointReader(path) as reader:
            provided = {name for item in plan_load(model, reader, strict=False) for name in item.names}
        left = lazy.mark_uninitialized(model, provided)
        if left:                                # initialized here: the same values on every rank (rank 0's seeds)
            lazy.broadcast_recipes(model, self.shard_config.tensor_parallel_process_group)
        model, shared_params = self.optimize(model, policy=policy, plan=plan)
        load_pretrained(model, path, strict=False, progress=progress, mmap=mmap)
        if left:
            warnings.warn(f"{type(model).__name__}: {len(left)} parameters are not in the checkpoint {path} and "
                          f"were newly initialized: {', '.join(left[:10])}{' ...' if len(left) > 10 else ''}",
                          stacklevel=3)
        _load_generation_config(model, path)
        return model.eval(), shared_params


def _model_dtype(dtype, who: str):
    """A torch.dtype from a torch.dtype or its name ("bfloat16", "torch.float16");
    ValueError listing the floating dtypes for anything else."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.removeprefix("torch.") if isinstance(dtype, str) else None
    found = getattr(torch, name, None) if name else None
    if isinstance(found, torch.dtype):
        return found
    valid = sorted({n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)
                    and getattr(torch, n).is_floating_point and not n.startswith("float8")})
    raise ValueError(f"ShardFormer.from_pretrained({who}): dtype={dtype!r} is not a torch dtype; one of "
                     f"{', '.join(valid)} (a name or torch.<dtype>), or 'auto' / None for the checkpoint's")


def _check_config_class(model_class, config, path: str) -> None:
    """The checkpoint's config must be the one `model_class` is built from
    (a GPT-2 checkpoint does not build a Llama): ValueError naming both
    model types, before anything is built."""
    wanted = getattr(model_class, "config_class", None)
    if not isinstance(wanted, type) or isinstance(config, wanted):
        return
    have = getattr(config, "model_type", type(config).__name__)
    raise ValueError(f"ShardFormer.from_pretrained({model_class.__name__}): {path} holds a {have!r} checkpoint "
                     f"({type(config).__name__}); {model_class.__name__} is a {wanted.model_type!r} model "
                     f"({wanted.__name__}).  Pick the {have} class (e.g. AutoModelForCausalLM resolves it), or "
                     f"pass config= to build another model")


def _local_checkpoint(path: str, who: str) -> str:
    """`path` itself when it exists; else a Hub repo id, downloaded (or found
    in the local Hub cache) with huggingface_hub.snapshot_download."""
    if os.path.exists(path):
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.bin", "*.txt", "*.model"])
    except Exception as e:  # noqa: BLE001 - not a repo, offline, no access: one clear error
        raise FileNotFoundError(
            f"{who}.from_pretrained: {path!r} is not a local checkpoint directory, and fetching it as a Hub repo "
            f"id failed ({type(e).__name__}: {e})") from e


def _load_generation_config(model: nn.Module, path: str) -> None:
    """The checkpoint's generation_config.json, as HF's from_pretrained loads it."""
    if getattr(model, "generation_config", None) is None or \
            not os.path.isfile(os.path.join(path, "generation_config.json")):
        return
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig.from_pretrained(path)
