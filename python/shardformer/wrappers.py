"""Wrappers optimize() does not see through: refused by name, never passed through.

A policy is found by the model's class and matches sub-modules by path and
class.  A model handed over inside a wrapper defeats both without an error:
the wrapper's class has no policy, its attribute forwarding (PEFT, torch.
compile) makes the model's own tensor-parallel plan visible under paths that
match nothing, and the model came back unsharded; a LoRA layer wrapping a
Linear that the policy splits was replaced by the parallel layer, its
adapters dropped.  So before anything else optimize() looks for the classes
listed here, anywhere in the model's tree (the model itself included), and
raises ValueError naming the module path, the wrapper and the fix.

Classes are named, not imported ("module.QualName" of the class or of a base
class), so checking costs no import of peft, accelerate or torch._dynamo.

Support for a wrapper (the LoRA work) bypasses the refusal in one place:
append a predicate to SUPPORTED, `predicate(path, module) -> bool`, True for
the modules it shards itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

_OPTIMIZE_FIRST = "optimize() the bare model first, then wrap the sharded model"
_NO_LORA = ("optimize() the PeftModel itself (what get_peft_model returned): LoRA on linear layers is sharded with "
            "the model (shardformer's docs/lora.md); other PEFT tuners and wrappers are not supported")
_DP_FIX = ("optimize() the bare model first, then wrap it over the data-parallel group only: "
           "shardformer.data_parallel(model, shardformer.mesh(tp=...)) (DDP over mesh.dp), or FSDP2's "
           "fully_shard(model, mesh=mesh.device_mesh['dp'])")


@dataclass(frozen=True)
class Wrapper:
    """A known wrapper class: `cls` is "module.QualName" of it or of a base
    class; `what` says what it is; `fix` what to do instead."""

    cls: str
    what: str
    fix: str


KNOWN_WRAPPERS: tuple[Wrapper, ...] = (
    Wrapper("peft.peft_model.PeftModel", "a PEFT model (get_peft_model)", _NO_LORA),
    Wrapper("peft.tuners.tuners_utils.BaseTuner", "a PEFT tuner model", _NO_LORA),
    Wrapper("peft.tuners.tuners_utils.BaseTunerLayer", "a PEFT adapter layer",
            "the parallel layer replacing it would drop its adapters; " + _NO_LORA),
    Wrapper("peft.utils.other.AuxiliaryTrainingWrapper", "a PEFT modules_to_save / trainable-tokens wrapper",
            _NO_LORA),
    Wrapper("torch._dynamo.eval_frame.OptimizedModule", "a torch.compile'd module",
            "call optimize() on the uncompiled model (compiled._orig_mod), then torch.compile the sharded "
            "model"),
    Wrapper("torch.nn.parallel.distributed.DistributedDataParallel", "a DistributedDataParallel wrapper", _DP_FIX),
    Wrapper("torch.nn.parallel.data_parallel.DataParallel", "an nn.DataParallel wrapper", _OPTIMIZE_FIRST),
    Wrapper("torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel", "an FSDP wrapper",
            _DP_FIX),
    Wrapper("torch.distributed.fsdp.FSDPModule", "an FSDP2 module (fully_shard)", _DP_FIX),
    Wrapper("deepspeed.runtime.engine.DeepSpeedEngine", "a DeepSpeed engine", _OPTIMIZE_FIRST),
)

#: Predicates `(path, module) -> bool` of the wrappers that some code shards
#: itself (their modules are not refused).
SUPPORTED: list[Callable[[str, nn.Module], bool]] = []

_BY_CLASS: dict[type, Wrapper | None] = {}


def wrapper_of(module: nn.Module) -> Wrapper | None:
    """The KNOWN_WRAPPERS entry of `module`'s class (or of a base class), or None."""
    cls = type(module)
    if cls not in _BY_CLASS:
        names = {f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__}
        _BY_CLASS[cls] = next((w for w in KNOWN_WRAPPERS if w.cls in names), None)
    return _BY_CLASS[cls]


def unsupported_wrappers(model: nn.Module, claimed: Callable[[str, nn.Module], bool] | None = None
                         ) -> list[tuple[str, nn.Module, Wrapper]]:
    """(path, module, entry) of every known wrapper in `model`'s tree ("" for
    the model itself) that neither a SUPPORTED predicate nor `claimed` (this
    call's own, e.g. the LoRA layers optimize() shards with a PeftModel)
    claims, outermost first; the modules inside a refused wrapper are not
    listed again."""
    found: list[tuple[str, nn.Module, Wrapper]] = []
    for path, module in model.named_modules():
        entry = wrapper_of(module)
        if entry is None or any(ok(path, module) for ok in SUPPORTED) or (claimed is not None and claimed(path, module)):
            continue
        if any(path.startswith(p + ".") or p == "" for p, _, _ in found):
            continue
        found.append((path, module, entry))
    return found


def refuse_wrappers(model: nn.Module, claimed: Callable[[str, nn.Module], bool] | None = None) -> None:
    """ValueError naming the first unsupported wrapper in `model` (and how
    many more there are), what it is and the fix; nothing has changed yet."""
    found = unsupported_wrappers(model, claimed)
    if not found:
        return
    path, module, entry = found[0]
    cls = type(module)
    where = "the model itself" if path == "" else f"{path!r}"
    more = f" (and {len(found) - 1} more: {', '.join(p for p, _, _ in found[1:4])}" \
           f"{' ...' if len(found) > 4 else ''})" if len(found) > 1 else ""
    raise ValueError(f"{type(model).__name__}: {where} is {entry.what} ({cls.__module__}.{cls.__qualname__}){more}; "
                     f"optimize() does not see through it and would leave the model unsharded or drop what it "
                     f"adds. Fix: {entry.fix}")
