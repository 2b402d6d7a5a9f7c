"""Tied parameters: one Parameter reachable under several names stays one.

A model may hold one Parameter object under two or more names: an LM head
tied to the input embedding, a projection shared by two layers
(`layers[1].mlp.down_proj.weight = layers[0].mlp.down_proj.weight`), a whole
module shared by two parents.  Training relies on it being one tensor: the
gradients of every use add up into it, W <- W - lr * sum_k dL/dW_k, and one
optimizer state follows it.  The sharder replaces modules one by one, so each
name would get its own copy of its shard and the copies would drift apart
after the first step.

The sharder keeps every tie, for any parameter, in three steps:

  find    before substitution: every parameter object reachable under two
          or more names (`named_parameters(remove_duplicate=False)`);
  check   once the engine has built every replacement, before it swaps any
          in (the `built` callback of _C.sharder_apply): the parameter each
          name will hold afterwards -- the replacement's (a shard, or a whole
          copy), an in-place change's new one, or the original kept -- and
          its layout on this rank: "whole", or split along a dimension by a
          DimShard (the ranges of the full tensor this rank holds).  Names of
          one tie whose layouts differ (one column-, one row-parallel, or one
          split and one kept whole) are refused: ValueError naming both
          module paths and both layouts, raised before anything changes;
  bind    every name of a tie gets one parameter: the original when some
          name keeps it, else the first name's new one.  The binding edits
          the built replacements (and the prepared in-place changes), not
          the model: the swaps then put in tied modules.

A policy may keep a name out of this: `Policy.tie_followers()` lists the
(module, attribute) pairs of modules its plan leaves alone that its
postprocess points at the replacement's parameter (HF keeps a BERT-style
decoder bias also as the prediction head's `bias`, an alias its forward
never reads).  Such a name, still holding the original, is neither checked
nor bound here.

Names of one tie that agree on the layout hold, on every rank, the same
slice of the same full tensor, so binding them to one shard is exact: its
gradient is the sum of every use's gradient of that slice, as unsharded.
A module reachable under several paths and replaced at each keeps one
replacement (the first path's), so module identity survives too.
"""
from __future__ import annotations

from torch import nn

__all__ = ["Ties", "find_ties"]


def _shard_sig(dim: int, shard) -> tuple:
    return ("split", dim, shard.full, shard.length, tuple(shard.ranges))


def _describe(owner: nn.Module, sig: tuple) -> str:
    cls = type(owner).__name__
    if sig[0] == "whole":
        return f"{cls} keeping it whole on every rank"
    _, dim, full, length, ranges = sig
    held = ", ".join(f"[{a}, {a + n})" for a, n in ranges)
    return f"{cls} splitting dim {dim} of {full} (this rank holds {held}, {length} long)"


class _Place:
    """One name of a tied parameter: the module path, the attribute, the
    module holding it before substitution."""

    __slots__ = ("name", "path", "attr", "owner")

    def __init__(self, model: nn.Module, name: str):
        self.name = name
        self.path, _, self.attr = name.rpartition(".")
        self.owner = model.get_submodule(self.path)


class Ties:
    """The tied parameters of one model, found before substitution; see the module doc."""

    def __init__(self, model: nn.Module, model_name: str, groups: list[tuple[nn.Parameter, list[_Place]]],
                 followers=()):
        self.model, self.model_name, self.groups = model, model_name, groups
        self.followers = {(id(module), attr) for module, attr in followers}

    def __call__(self, ops: list, builds: list) -> None:
        """The engine's `built` callback: share replacements of one module,
        check the layouts of every tie, and bind it (see the module doc)."""
        self._share_replacements(ops, builds)
        slots, changes = {}, {}
        for build in builds:
            if build.kind != "sub":
                continue
            if build.change is None:
                slots[(id(build.owner), build.name)] = build.value
            elif isinstance(getattr(build.change, "params", None), dict):
                changes[id(build.change.module)] = build.change   # a prepared in-place shard (ShardParams)
        plans = []
        for original, places in self.groups:
            after = [(place, *self._after(place, slots, changes)) for place in places]
            # (not: a name the replacement no longer has; a follower the policy re-ties)
            after = [a for a in after if a[1] is not None and not (
                a[2] is original and (id(a[0].owner), a[0].attr) in self.followers)]
            if len({id(a[2]) for a in after}) <= 1:
                continue                                      # one object still: nothing to bind
            sigs = [(a, self._layout(a[1], a[0].attr, a[2], original, changes)) for a in after]
            first, first_sig = sigs[0]
            for other, sig in sigs[1:]:
                if sig != first_sig or other[2].shape != first[2].shape:
                    raise ValueError(
                        f"{self.model_name}: {first[0].name} and {other[0].name} are one parameter (tied), but "
                        f"the shard plan treats the two differently: {first[0].path} is replaced by "
                        f"{_describe(first[1], first_sig)}, {other[0].path} by {_describe(other[1], sig)}; "
                        f"a tied parameter must be split alike at every name. Untie them (give each module its "
                        f"own parameter) or shard both modules the same way; nothing was changed")
            kept = next((a[2] for a in after if a[2] is original), None)
            plans.append((kept if kept is not None else first[2], after))
        for target, after in plans:
            for place, owner, param in after:
                if param is target:
                    continue
                change = changes.get(id(owner))
                if change is not None and place.attr in change.params:
                    change.params[place.attr] = target
                else:
                    owner._parameters[place.attr] = target

    def _after(self, place: _Place, slots: dict, changes: dict):
        """(the module holding the name once the builds are swapped in, the
        parameter it will hold), or (None, None) when the path is gone."""
        module = self.model
        for part in place.path.split(".") if place.path else ():
            replaced = slots.get((id(module), part))
            module = replaced if replaced is not None else module._modules.get(part)
            if module is None:
                return None, None
        change = changes.get(id(module))
        if change is not None and place.attr in change.params:
            return module, change.params[place.attr]
        param = module._parameters.get(place.attr)
        return (module, param) if param is not None else (None, None)

    @staticmethod
    def _layout(owner: nn.Module, attr: str, param, original, changes: dict) -> tuple:
        """How `param` (at owner.attr once swapped in) holds the original:
        ("whole",) or the split's signature."""
        if param is original:
            return ("whole",)
        change = changes.get(id(owner))
        if change is not None and attr in change.params:
            attrs = getattr(change, "attrs", {})          # what the module becomes (ShardParams)
            split = attrs.get("split_params", {}).get(attr)
            return ("whole",) if split is None else _shard_sig(split[0], attrs["shard_plan"][split[1]])
        sharded = getattr(owner, "sharded_params", None)
        if isinstance(sharded, dict) and attr in sharded:
            dim, shard = sharded[attr]
            return _shard_sig(dim, shard)
        return ("whole",)

    def _share_replacements(self, ops: list, builds: list) -> None:
        """A module replaced at several paths (one object under two parents)
        keeps one replacement: the first path's, when the replacements are
        built alike (same class and layouts); else refused by name."""
        first: dict[int, tuple] = {}
        for i, (op, build) in enumerate(zip(ops, builds)):
            if op.kind != "sub" or build.change is not None:
                continue
            native, replacement = op.native, build.value
            seen = first.get(id(native))
            if seen is None:
                first[id(native)] = (op, replacement)
                continue
            earlier_op, earlier = seen
            if type(earlier) is not type(replacement) or _layouts(earlier) != _layouts(replacement):
                raise ValueError(
                    f"{self.model_name}: {earlier_op.path} and {op.path} are one module ({type(native).__name__}, shared), but the shard "
                    f"plan replaces them differently: {earlier_op.path} by {type(earlier).__name__}, {op.path} by "
                    f"{type(replacement).__name__}{'' if type(earlier) is not type(replacement) else ' with other layouts'}; "
                    f"untie them (give each path its own module) or shard both paths the same way; nothing was changed")
            builds[i] = _with_value(build, earlier)


def _with_value(build, value):
    """The plan record `build` (a _C.PlanOp) with `value` (its replacement)
    changed; a struct sequence is immutable and has no _replace."""
    fields = dict(zip(type(build).__match_args__, build))
    fields["value"] = value
    return type(build)(tuple(fields.values()))


def _layouts(module) -> dict:
    sharded = getattr(module, "sharded_params", None)
    if not isinstance(sharded, dict):
        return {}
    return {name: _shard_sig(dim, shard) for name, (dim, shard) in sharded.items()}


def find_ties(model: nn.Module, model_name: str, followers=()) -> Ties | None:
    """The parameters of `model` reachable under several names (None: no
    tie); `followers`: the policy's tie_followers()."""
    names: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), (p, []))[1].append(name)
    groups = [(p, [_Place(model, n) for n in group]) for p, group in names.values() if len(group) > 1]
    return Ties(model, model_name, groups, followers) if groups else None
