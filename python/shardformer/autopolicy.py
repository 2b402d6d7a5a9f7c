"""The policy registry: model class -> policy.

Keys are the model class's full qualified name ("module.QualName"), or a bare
class name for models outside transformers (remote code: the class's module
is a dynamic one that varies per checkpoint).  Values name the policy file in
shardformer.policies and the class in it.

The registry is generated from the families (shardformer.family.Family) that
the policy files declare as FAMILY or FAMILIES: it is built on first use by
importing every file of shardformer.policies (they import transformers only
inside functions), so importing shardformer imports no policy.
`register_policy` adds or overrides an entry.
"""
from __future__ import annotations

import importlib
import importlib.util
import pkgutil

from . import family as _family
from ._versions import check_transformers_version
from .derived_policy import DerivedPolicy, has_tp_plan
from .policy import Policy

_OVERRIDES: dict[str, tuple[str, str]] = {}   # register_policy
DOCS = "docs/writing-policies.md"   # the no-policy error points at its sections (tests/test_wrappers.py checks the anchors)
_GENERATED: dict[str, tuple[str, str]] | None = None


def register_policy(key: str, family: str, policy_class: str) -> None:
    """Register shardformer.policies.<family>.<policy_class> for model class `key`
    ("module.QualName", or a bare class name for remote code)."""
    _OVERRIDES[key] = (family, policy_class)


def families() -> list:
    """Every Family declared by the built-in policy files."""
    from shardformer import policies      # the package of the policy files, which import this module's parents

    found = []
    for info in sorted(pkgutil.iter_modules(policies.__path__), key=lambda i: i.name):
        found.extend(_declared(info.name))
    return found


def _declared(name: str) -> list:
    """The Families policy file shardformer/policies/<name>.py declares."""
    module = importlib.import_module(f"shardformer.policies.{name}")
    declared = getattr(module, "FAMILIES", None) or ((module.FAMILY,) if hasattr(module, "FAMILY") else ())
    return [f for f in declared if isinstance(f, _family.Family)]


def registry() -> dict[str, tuple[str, str]]:
    """{model class key: (family, policy class name)}: the families' classes,
    then register_policy's entries."""
    global _GENERATED
    if _GENERATED is None:
        generated: dict[str, tuple[str, str]] = {}
        for fam in families():
            for key, value in fam.registry().items():
                if key in generated:
                    raise RuntimeError(f"policy registry: {key} is declared twice "
                                       f"({generated[key][0]} and {value[0]})")
                generated[key] = value
        _GENERATED = generated
    return dict(_GENERATED, **_OVERRIDES)


def supported_models() -> list[str]:
    """The model classes with a built-in policy ("module.QualName"; a bare
    class name for remote-code models), sorted."""
    return sorted(registry())


def _key_of(model) -> tuple[str, str]:
    cls = type(model)
    return f"{cls.__module__}.{cls.__qualname__}", cls.__qualname__


def _own_family(full: str) -> tuple[str, str] | None:
    """The registry entry of a transformers class from the policy file named
    after its modeling package (transformers.models.<name>.modeling_x ->
    shardformer/policies/<name>.py) when that file declares it, importing
    that one file instead of all of them (registry(): ~30 files, tens of ms
    in a fresh process); None otherwise (the caller then builds the whole
    registry)."""
    prefix = "transformers.models."
    if not full.startswith(prefix):
        return None
    name = full[len(prefix):].split(".", 1)[0]
    if not name.isidentifier() or importlib.util.find_spec(f"shardformer.policies.{name}") is None:
        return None
    for fam in _declared(name):
        entry = fam.registry().get(full)
        if entry is not None:
            return entry
    return None


def _never_registered(model) -> bool:
    """True when no built-in entry can name `model`'s class, answered without
    importing the ~30 policy files: the policy files declare transformers'
    PreTrainedModel classes by full name, and remote-code models by bare
    name (tests/test_from_pretrained.py checks both), so a class of torch,
    transformers or shardformer that is not a PreTrainedModel (a layer:
    LlamaDecoderLayer, nn.Linear) has none.  register_policy's entries may
    name any class: with any of them the caller looks them up."""
    if _OVERRIDES or type(model).__module__.split(".", 1)[0] not in ("torch", "transformers", "shardformer"):
        return False
    return not any(c.__name__ == "PreTrainedModel" and c.__module__ == "transformers.modeling_utils"
                   for c in type(model).__mro__)


def registered_class(model) -> type | None:
    """The registered Policy class of `model`'s class (the registry, then
    register_policy's entries), or None."""
    if _never_registered(model):
        return None
    full, bare = _key_of(model)
    found = _own_family(full) if _GENERATED is None and not _OVERRIDES else None
    if found is None:
        table = registry()
        found = table.get(full) or table.get(bare)
    if found is None:
        return None
    family, policy_cls = found
    return getattr(importlib.import_module(f"shardformer.policies.{family}"), policy_cls)


def get_autopolicy(model) -> Policy:
    """A fresh policy instance for `model`, found by its class.  The policy is
    given this registry (OptimizeState.policy_of) for the models it composes."""
    check_transformers_version()
    full, bare = _key_of(model)
    cls = registered_class(model)
    if cls is None:
        if not has_tp_plan(model):      # built-in policies win; else the model's own plan
            raise ValueError(
                f"{bare}: no built-in policy for {full}, and the model carries no tensor-parallel plan "
                "(config.base_model_tp_plan or the class's _tp_plan) to derive one from. Shard it with either\n"
                "  - a plan dict in transformers' notation: ShardFormer(shard_config).optimize(model, "
                "plan={'layers.*.mlp.up_proj': 'colwise', 'layers.*.mlp.down_proj': 'rowwise', ...}) "
                f"(shardformer's {DOCS}#models-without-a-built-in-policy-the-models-own-plan), or\n"
                "  - a shardformer.Policy subclass: optimize(model, policy=MyPolicy()) "
                f"(shardformer's {DOCS}#your-own-model-a-policy).\n"
                f"shardformer.supported_models() lists the {len(registry())} model classes with a built-in policy."
            )
        cls = DerivedPolicy
    policy = cls()
    policy.begin(get_autopolicy)
    return policy
