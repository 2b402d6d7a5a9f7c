"""Lazy construction: build a model without allocating its parameters.

    with shardformer.lazy_init():
        model = AutoModelForCausalLM.from_config(cfg)     # no parameter storage
    model, shared = ShardFormer(shard_config=cfg).optimize(model)   # this rank's shards only

Inside the context every parameter a module registers becomes a
LazyParameter: a meta tensor (shape, dtype, requires_grad, no storage) with a
*recipe*, the list of what was done to it since it was created: its initial
value (uninitialized, or the values it was registered with) and every
in-place operation on it or on a view of it (HF's `_init_weights`,
`reset_parameters`, `weight.data[padding_idx].zero_()`, `copy_`, ...).
Materializing replays the recipe on a real tensor.  Buffers (rotary
inv_freq, position ids, causal masks) stay ordinary tensors: they are small
and often computed, not initialized.

Same values as eager, from the same seed.  A random operation (normal_,
uniform_, trunc_normal_, kaiming_uniform_, ...) records the state of the
generator it draws from, and, with exact=True (the default), is also run
once on a scratch tensor of the parameter's size so that the generator moves
on exactly as in eager construction (one parameter's worth of memory at a
time, freed at once).  Replaying restores the recorded state around the
operation, so the tensor a rank materializes is bit for bit the eager one,
and whatever the user draws after construction is unchanged too.  With
exact=False (what ShardFormer.from_pretrained uses: the weights come from the
checkpoint) nothing is drawn at construction: each random operation gets a
seed (one base drawn when the context opens, plus a counter), so every replay
of one parameter gives the same values and broadcast_recipes can give every
rank rank 0's.

A lazy tensor presents itself as the tensor it will be: `.device` is its
future device and `.is_meta` is False (torch.nn.init skips meta tensors, and
HF's init reads values in places: trunc_normal_'s rejection loop, BERT's
bias padding).  Such reads materialize it for that one operation, so the
values they see, and the random numbers they draw, are eager construction's.

optimize() cuts each sharded parameter out of its materialized full tensor
(one full tensor alive at a time, freed once the shard is cut) and
materializes the replicated ones in place at the end: peak memory is this
rank's shards plus the largest single parameter.  A parameter marked
`uninitialized` (it will be loaded) is allocated at its shard's size and
never replayed.

Reading a lazy tensor outside these paths (a forward on a lazy model, a
policy computing from weights) materializes it for that one operation:
correct, and as slow as building the tensor each time.  Such a read with
autograd on, of a parameter that requires grad, is refused (RuntimeError):
the result could only be a copy detached from the parameter, so a training
forward before optimize() would silently train nothing; a forward under
torch.no_grad() is allowed.  `torch.save(model.state_dict())` of a lazy
model writes the materialized values (plain torch.load reads them).  materialize_module()
turns a whole lazy model into an ordinary one.  `model.to(dtype/device)` on a
lazy model stays lazy (the conversion is one more step of each recipe).

Not supported: operations that change a lazy parameter's shape in place
(resize_, set_, t_, ...), and lazy parameters moved between processes
except through broadcast_recipes.  The patching of
nn.Module.register_parameter is process-wide while the context is open:
build models in one thread at a time.
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from .config import concrete_group
from .hashes import tensor_hash

__all__ = ["LazyParameter", "broadcast_recipes", "is_lazy", "lazy_init", "materialize",
           "materialize_module", "mark_uninitialized", "recipe_fingerprint"]

# Operations that change a tensor's shape or storage in place: a recipe cannot replay them.
_REFUSED = frozenset({"resize_", "resize_as_", "set_", "t_", "transpose_", "squeeze_", "unsqueeze_",
                      "as_strided_", "swapdims_", "swapaxes_", "share_memory_"})
# In-place by name but only metadata: applied to the meta tensor, not recorded.
_METADATA_INPLACE = frozenset({"requires_grad_", "retain_grad", "__set__"})
# Aliases of the whole tensor that are not views to autograd.
_ALIASES = frozenset({"data.__get__", "detach"})
# Conversions that keep the tensor lazy: one more step of the recipe.
_CONVERSIONS = frozenset({"to", "float", "half", "bfloat16", "double", "type", "cuda", "cpu"})


def _op_name(func) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        owner = getattr(func, "__self__", None)
        return f"{getattr(owner, '__name__', '?')}.{name}"
    return name


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


class _Step:
    """One recorded operation: func(target, *args, **kwargs) where target is
    the recipe's tensor seen through `chain` (view operations); `out=True`
    passes the target as `out=` instead.  `rng`: the generator state before
    it ran (None: not random, or not yet fixed); `convert`: a dtype/device
    conversion of the whole tensor (chain empty)."""

    __slots__ = ("chain", "func", "args", "kwargs", "out", "rng", "seed", "generator", "random", "convert")

    def __init__(self, chain, func, args, kwargs, out=False, convert=False):
        self.chain, self.func, self.args, self.kwargs = chain, func, args, kwargs
        self.out, self.convert = out, convert
        self.rng = None
        self.seed = None                         # exact=False: the generator is seeded with this
        self.generator = kwargs.get("generator")  # None: the device's default generator
        self.random = True                       # until a scratch run shows it draws nothing


class _Recipe:
    """How to build one lazy tensor: `start` ("empty",) or ("value", tensor),
    then `steps`.  shape/dtype/device describe the result."""

    def __init__(self, shape, dtype, device, start):
        self.shape, self.dtype, self.device = tuple(shape), dtype, torch.device(device)
        self.start = start
        self.steps: list[_Step] = []
        self.exact = True
        self.uninitialized = False   # to be loaded: allocate, never replay

    def derived(self, steps_extra, shape, dtype, device) -> "_Recipe":
        r = _Recipe(shape, dtype, device, self.start)
        r.steps = self.steps + steps_extra
        r.exact, r.uninitialized = self.exact, self.uninitialized
        return r


class _Ref:
    """A lazy tensor used as an argument: its recipe up to `upto` steps, seen through `chain`."""

    __slots__ = ("recipe", "chain", "upto")

    def __init__(self, t):
        self.recipe, self.chain, self.upto = t._sf_recipe, t._sf_chain, len(t._sf_recipe.steps)


def _dispatch(cls, func, types, args, kwargs):
    kwargs = dict(kwargs or {})
    name = _op_name(func)
    if not args and "tensor" in kwargs:          # torch.nn.init.*(tensor=...) through handle_torch_function
        args = (kwargs.pop("tensor"),)
    target = args[0] if args else None
    if name == "__repr__" and is_lazy(target):
        return f"Lazy{'Parameter' if isinstance(target, LazyParameter) else 'Tensor'}(shape={tuple(target.shape)}, " \
               f"dtype={target.dtype}, requires_grad={target.requires_grad})"
    if is_lazy(target) and name in ("is_meta.__get__", "device.__get__"):
        # A lazy tensor presents itself as the tensor it will be: reads
        # materialize it (torch.nn.init skips meta tensors, HF checks devices).
        return False if name == "is_meta.__get__" else target._sf_recipe.device
    out = kwargs.get("out")
    if is_lazy(out) and not is_lazy(target):
        del kwargs["out"]
        _record(out, func, name, args, kwargs, as_out=True)
        return out
    if is_lazy(target):
        if name in _REFUSED:
            raise RuntimeError(f"shardformer.lazy_init: {name} changes the shape or storage of a lazy tensor "
                               f"{tuple(target.shape)} in place; build this module outside lazy_init()")
        if name == "data.__set__":
            _set_data(target, args[1])
            return None
        if _in_place(name):
            _record(target, func, name, args[1:], kwargs)
            return target
        if name in _CONVERSIONS and not target._sf_chain:
            converted = _convert(target, func, args, kwargs)
            if converted is not None:
                return converted
        result = _on_meta(func, args, kwargs)
        if result is _NOT_META:
            pass                                # it computes with real tensors: a read, below
        elif result is target:
            return target                       # metadata changed in place (requires_grad_)
        elif not isinstance(result, (torch.Tensor, tuple, list)):
            return result                       # metadata: sizes, dtype, dim, ...
        elif isinstance(result, torch.Tensor) and (name in _ALIASES or result._is_view()):
            return _view_of(target, func, args[1:], kwargs, result, None)
        elif isinstance(result, (tuple, list)) and result and all(
                isinstance(r, torch.Tensor) and r._is_view() for r in result):
            return type(result)(_view_of(target, func, args[1:], kwargs, r, i) for i, r in enumerate(result))
        elif isinstance(result, (tuple, list)) and not any(isinstance(r, torch.Tensor) for r in result):
            return result
    # Anything else reads a lazy tensor's values: materialize it for this one operation.
    tracked = _grad_tracked(args, kwargs)
    if tracked is not None:                     # refused below if autograd would record it
        meta_args, meta_kwargs = _tree_map(_meta_of, args), _tree_map(_meta_of, kwargs)
    args = _tree_map(_materialized_arg, args)
    kwargs = _tree_map(_materialized_arg, kwargs)
    verdict = _would_track(func, meta_args, meta_kwargs) if tracked is not None else False
    if verdict:
        _refuse_detached(name, tracked)
    result = func(*args, **kwargs)
    if verdict is None and _differentiable(result):
        _refuse_detached(name, tracked)
    return result


def _meta_of(x):
    """`x` as autograd would see it, without values: a lazy tensor is its
    meta self; a real tensor an empty meta one of its shape, strides, dtype
    and requires_grad."""
    if is_lazy(x) or not isinstance(x, torch.Tensor) or x.device.type == "meta":
        return x
    with torch._C.DisableTorchFunctionSubclass():
        meta = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
    return meta.requires_grad_(x.requires_grad) if x.is_floating_point() or x.is_complex() else meta


def _would_track(func, args, kwargs) -> bool | None:
    """Whether autograd would record func on these arguments (any output
    requiring grad), found by running it on meta tensors: a computation
    does, a metadata-only one (empty_like, a size) does not.  None when
    meta tensors cannot run it (the caller judges by its float result)."""
    try:
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
    except Exception:  # noqa: BLE001 - not runnable on meta: judge by what it returns
        return None
    return _requires_grad(out)


def _requires_grad(out) -> bool:
    if isinstance(out, (tuple, list)):
        return any(_requires_grad(o) for o in out)
    return isinstance(out, torch.Tensor) and out.requires_grad


def _grad_tracked(args, kwargs):
    """The first lazy argument autograd would track (requires_grad, grad
    mode on), or None."""
    if not torch.is_grad_enabled():
        return None
    found = []

    def visit(x):
        if not found and is_lazy(x) and x.requires_grad:
            found.append(x)
        return x

    _tree_map(visit, args)
    _tree_map(visit, kwargs)
    return found[0] if found else None


def _differentiable(result) -> bool:
    if isinstance(result, (tuple, list)):
        return any(_differentiable(r) for r in result)
    return isinstance(result, torch.Tensor) and (result.is_floating_point() or result.is_complex())


def _refuse_detached(name: str, t) -> None:
    """A computation on a lazy parameter with autograd on: its result could
    only be a detached copy (no storage, no gradient to hold), so a
    forward before optimize() would train nothing.  Refused by name."""
    raise RuntimeError(
        f"shardformer.lazy_init: {name or 'an operation'} read a lazy parameter {tuple(t.shape)} {t.dtype} "
        f"that requires grad, with autograd on: a model built under lazy_init() has no parameter storage "
        f"until optimize(), so the result would be detached from the parameter and no gradient would reach "
        f"it. Call ShardFormer(...).optimize(model) first (it materializes this rank's shards), or "
        f"shardformer.lazy.materialize_module(model) to build the whole model; a forward under "
        f"torch.no_grad() reads the lazy values (exact, slow)")


_NOT_META = object()


def _real_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and not is_lazy(x) and x.device.type != "meta"


def _on_meta(func, args, kwargs):
    """func on the meta tensors alone (what it returns says whether it is
    metadata, a view or a computation); _NOT_META when real tensors take part."""
    flat = list(args) + list(kwargs.values())
    for x in flat:
        if _real_tensor(x) or (isinstance(x, (list, tuple)) and any(_real_tensor(v) for v in x)):
            return _NOT_META
    try:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    except (RuntimeError, TypeError, NotImplementedError, ValueError):
        return _NOT_META


def _in_place(name: str) -> bool:
    """An operation that writes its first argument (by torch's naming)."""
    return name == "__setitem__" or (name.endswith("_") and not name.endswith("__")
                                     and name not in _METADATA_INPLACE)


def _tree_map(fn, x):
    if isinstance(x, (list, tuple)):
        return type(x)(_tree_map(fn, v) for v in x)
    if isinstance(x, dict):
        return {k: _tree_map(fn, v) for k, v in x.items()}
    return fn(x)


def _materialized_arg(x):
    return materialize(x) if is_lazy(x) else x


def _captured_arg(x):
    """An argument kept in a recipe: lazy tensors by reference (their recipe so
    far), real tensors copied (the caller may change them afterwards)."""
    if is_lazy(x):
        return _Ref(x)
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    return x


def _resolved_arg(x):
    if isinstance(x, _Ref):
        return _apply_chain(_build(x.recipe, x.upto), x.chain)
    return x


def _scratch_arg(x):
    if isinstance(x, _Ref):
        shape = _apply_chain(torch.empty(x.recipe.shape, dtype=x.recipe.dtype, device="meta"), x.chain).shape
        return torch.zeros(shape, dtype=x.recipe.dtype, device=x.recipe.device)
    return x


def _apply_chain(t: torch.Tensor, chain) -> torch.Tensor:
    for func, args, kwargs, index in chain:
        t = func(t, *args, **kwargs)
        if index is not None:
            t = t[index]
    return t


def _view_of(target, func, args, kwargs, meta_result, index):
    view = torch.Tensor._make_subclass(_LazyView, meta_result, meta_result.requires_grad)
    view._sf_recipe = target._sf_recipe
    view._sf_chain = target._sf_chain + ((func, tuple(_captured_arg(a) for a in args), kwargs, index),)
    return view


def _record(target, func, name, args, kwargs, as_out=False) -> None:
    recipe = target._sf_recipe
    step = _Step(target._sf_chain, func, tuple(_captured_arg(a) for a in args),
                 {k: _captured_arg(v) for k, v in kwargs.items()}, out=as_out)
    if recipe.exact and not recipe.uninitialized:
        _advance_like_eager(recipe, step)
    elif not recipe.exact:
        step.seed = _next_seed()
    recipe.steps.append(step)


def _next_seed() -> int:
    """exact=False: a seed per recorded step, so that steps do not repeat
    one another's numbers: the context's base (drawn once from the default
    generator when it opened) plus a counter."""
    if _active:
        mode = _active[-1][1]
        mode.counter += 1
        return mode.base_seed + mode.counter
    return int(torch.randint(0, 2**62, (1,)).item())


def _call(step: _Step, target: torch.Tensor, resolve) -> None:
    args = tuple(resolve(a) for a in step.args)
    kwargs = {k: resolve(v) for k, v in step.kwargs.items()}
    if step.out:
        step.func(*args, out=target, **kwargs)
    else:
        step.func(target, *args, **kwargs)


def _scratch_tensor(recipe: _Recipe) -> torch.Tensor:
    """A tensor of the recipe's shape with garbage values.  On the CPU, one
    buffer per open lazy_init() context, grown to the largest parameter and
    reused: allocating and freeing one per step would fragment the heap
    around the small objects recipes keep (generator states) and let the
    process grow by most of the model."""
    numel = torch.Size(recipe.shape).numel()
    if recipe.device.type != "cpu" or not _active or numel == 0:
        return torch.empty(recipe.shape, dtype=recipe.dtype, device=recipe.device)
    mode = _active[-1][1]
    nbytes = numel * recipe.dtype.itemsize
    if mode.scratch.numel() < nbytes:
        mode.scratch = torch.empty(0, dtype=torch.uint8)     # free the old one first
        mode.scratch = torch.empty(nbytes, dtype=torch.uint8)
    return mode.scratch[:nbytes].view(recipe.dtype).view(recipe.shape)


def _advance_like_eager(recipe: _Recipe, step: _Step) -> None:
    """Run the step once on a scratch tensor: the generator moves on as in
    eager construction.  Records its state before, or that it drew nothing."""
    generator = step.generator if step.generator is not None else _default_generator(recipe.device)
    before = generator.get_state()
    scratch = _apply_chain(_scratch_tensor(recipe), step.chain)
    with torch.no_grad():
        _call(step, scratch, _scratch_arg)
    del scratch
    if torch.equal(generator.get_state(), before):
        step.random = False
    else:
        step.rng = before


def _set_data(target, value) -> None:
    """`lazy.data = value`: the lazy tensor now holds value (a real tensor's
    values, or another lazy tensor's recipe)."""
    if is_lazy(value):
        recipe = value._sf_recipe if not value._sf_chain else None
        if recipe is None:
            raise RuntimeError("shardformer.lazy_init: .data = a view of a lazy tensor is not supported")
    else:
        recipe = _Recipe(value.shape, value.dtype, value.device, ("value", value.detach()))
    with torch._C.DisableTorchFunctionSubclass():
        torch.Tensor.data.__set__(target, torch.empty(recipe.shape, dtype=recipe.dtype, device="meta"))
    target._sf_recipe = recipe


_CAST_DTYPES = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}


def _convert(target, func, args, kwargs):
    """model.to(dtype / device) on a lazy tensor: a new lazy tensor whose
    recipe ends with the conversion (None: not a conversion we keep lazy)."""
    recipe, name = target._sf_recipe, _op_name(func)
    dtype, device = recipe.dtype, recipe.device
    if name == "to":
        try:
            parsed_device, parsed_dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        except (RuntimeError, TypeError):
            return None
        dtype = parsed_dtype if parsed_dtype is not None else dtype
        device = torch.device(parsed_device) if parsed_device is not None else device
    elif name in _CAST_DTYPES:
        dtype = _CAST_DTYPES[name]
    elif name == "cuda":
        index = args[1] if len(args) > 1 and args[1] is not None else kwargs.get("device")
        device = torch.device("cuda", torch.cuda.current_device() if index is None else torch.device(index).index or 0)
    elif name == "cpu":
        device = torch.device("cpu")
    else:
        return None
    if dtype == recipe.dtype and device == recipe.device:
        return target
    step = _Step((), torch.Tensor.to, (), {"dtype": dtype, "device": device}, convert=True)
    step.random = False
    out = LazyParameter._from_recipe(recipe.derived([step], recipe.shape, dtype, device), target.requires_grad)
    return out if isinstance(target, nn.Parameter) else out.detach()


# What materialization did in this process (tests read it): full tensors
# built from their recipes, and tensors only allocated (marked uninitialized).
# Reads during construction (inside an open context) are counted apart.
stats = {"built": 0, "built_bytes": 0, "allocated": 0, "allocated_bytes": 0,
         "built_in_construction": 0, "built_in_construction_bytes": 0}


def _count(kind: str, t: torch.Tensor) -> torch.Tensor:
    if kind == "built" and _active:
        kind = "built_in_construction"
    stats[kind] += 1
    stats[kind + "_bytes"] += t.numel() * t.element_size()
    return t


def _build(recipe: _Recipe, upto: int | None = None) -> torch.Tensor:
    """The tensor the recipe describes (its first `upto` steps)."""
    if recipe.uninitialized:
        return _count("allocated", torch.empty(recipe.shape, dtype=recipe.dtype, device=recipe.device))
    steps = recipe.steps if upto is None else recipe.steps[:upto]
    if recipe.start[0] == "value":
        t = recipe.start[1].detach().clone()
    else:                                    # ("empty", shape, dtype, device): before any conversion
        _, shape, dtype, device = recipe.start
        t = torch.empty(shape, dtype=dtype, device=device)
    with torch.no_grad():
        for step in steps:
            if step.convert:
                t = t.to(dtype=step.kwargs["dtype"], device=step.kwargs["device"])
                continue
            target = _apply_chain(t, step.chain)
            if not step.random:
                _call(step, target, _resolved_arg)
                continue
            generator = step.generator if step.generator is not None else _default_generator(target.device)
            saved = generator.get_state()
            if step.rng is not None:
                generator.set_state(step.rng)
            elif step.seed is not None:
                generator.manual_seed(step.seed)
            else:                           # recorded with nothing to go by: fix the state now
                step.rng = saved
            try:
                _call(step, target, _resolved_arg)
            finally:
                generator.set_state(saved)
    return _count("built", t)


class LazyParameter(nn.Parameter):
    """A parameter with no storage yet (meta) and the recipe that builds it."""

    _sf_chain = ()

    def __new__(cls, data=None, requires_grad=True):
        raise TypeError("LazyParameter is created by shardformer.lazy_init(), not directly")

    @classmethod
    def _from_recipe(cls, recipe: _Recipe, requires_grad: bool) -> "LazyParameter":
        meta = torch.empty(recipe.shape, dtype=recipe.dtype, device="meta")
        p = torch.Tensor._make_subclass(cls, meta, requires_grad)
        p._sf_recipe = recipe
        return p

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _dispatch(cls, func, types, args, kwargs)

    def __deepcopy__(self, memo):
        r = self._sf_recipe                      # the copy records its own steps from here on
        copy = LazyParameter._from_recipe(r.derived([], r.shape, r.dtype, r.device), self.requires_grad)
        copy.__dict__.update({k: v for k, v in self.__dict__.items() if not k.startswith("_sf_")})
        memo[id(self)] = copy
        return copy

    def __reduce_ex__(self, protocol):
        raise TypeError("a lazy parameter cannot be pickled; materialize it first "
                        "(shardformer.lazy.materialize_module)")


class _LazyView(torch.Tensor):
    """A view of a lazy tensor (an indexing, .data, .t(), ...): in-place
    operations on it are recorded on the lazy tensor it views.

    Pickled (torch.save of a lazy model's state_dict(), whose tensors are
    such views), it is written as the ordinary tensor it stands for,
    materialized then, so that plain torch.load reads the file; one whose
    values are still to be loaded (mark_uninitialized) has none to write
    and is refused."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _dispatch(cls, func, types, args, kwargs)

    def __reduce_ex__(self, protocol):
        if self._sf_recipe.uninitialized:
            raise TypeError(f"a lazy tensor {tuple(self.shape)} whose values are still to be loaded "
                            f"(from_pretrained marks them so) cannot be saved: it has no values yet; "
                            f"load the checkpoint (optimize() / from_pretrained) before saving")
        real = materialize(self)
        with torch._C.DisableTorchFunctionSubclass():
            return real.__reduce_ex__(protocol)


def is_lazy(t) -> bool:
    return isinstance(t, (LazyParameter, _LazyView))


def is_uninitialized(t) -> bool:
    """A lazy tensor marked to be loaded (mark_uninitialized): it has no values yet."""
    return is_lazy(t) and t._sf_recipe.uninitialized


def materialize(t: torch.Tensor) -> torch.Tensor:
    """The full tensor a lazy tensor stands for (a new, ordinary tensor; for a
    view, the view of the materialized tensor).  Other tensors come back as they are."""
    if not is_lazy(t):
        return t
    with torch._C.DisableTorchFunctionSubclass():
        return _apply_chain(_build(t._sf_recipe), t._sf_chain)


def materialize_like(t: torch.Tensor, shape) -> torch.Tensor | None:
    """An uninitialized tensor of `shape` when `t` is a lazy tensor marked
    uninitialized (it will be loaded; no need to build it whole); else None."""
    if is_lazy(t) and t._sf_recipe.uninitialized:
        r = t._sf_recipe
        return _count("allocated", torch.empty(tuple(shape), dtype=r.dtype, device=r.device))
    return None


def mark_uninitialized(model: nn.Module, names) -> list[str]:
    """Mark the lazy parameters of `model` named in `names` (state_dict names)
    as to be loaded: they are allocated, never initialized.  Returns the
    lazy parameters left to initialize (not named)."""
    names = set(names)
    left = []
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if not is_lazy(p):
            continue
        if name in names:
            p._sf_recipe.uninitialized = True
            seen.add(id(p))
    for name, p in model.named_parameters():
        if is_lazy(p) and id(p) not in seen:
            left.append(name)
    return left


@torch.no_grad()
def materialize_module(model: nn.Module) -> nn.Module:
    """Replace every lazy parameter of `model` by an ordinary one with its
    values (tied parameters stay tied; attributes set on the parameter are
    kept).  Builds everything before changing anything."""
    built: dict[int, nn.Parameter] = {}
    places = []
    for module in model.modules():
        for name, p in module._parameters.items():
            if is_lazy(p):
                if id(p) not in built:
                    built[id(p)] = _real_parameter(p)
                places.append((module, name, built[id(p)]))
    for module, name, real in places:
        module._parameters[name] = real
    return model


def _real_parameter(p: "LazyParameter") -> nn.Parameter:
    """An ordinary parameter with p's values, requires_grad, attributes and
    tensor hooks (register_hook, register_post_accumulate_grad_hook: the
    same hook dicts, so existing handles still remove them)."""
    real = nn.Parameter(materialize(p), requires_grad=p.requires_grad)
    real.__dict__.update({k: v for k, v in p.__dict__.items() if not k.startswith("_sf_")})
    with torch._C.DisableTorchFunctionSubclass():
        hooks = p._backward_hooks
        post = getattr(p, "_post_accumulate_grad_hooks", None)
    if hooks:
        real._backward_hooks = hooks
    if post:
        real._post_accumulate_grad_hooks = post
    return real


def recipe_fingerprint(t: torch.Tensor) -> int:
    """64-bit fingerprint of how a lazy tensor is built (its shape, dtype,
    start, steps and their recorded generator states): two ranks whose lazy
    models would materialize differently get different fingerprints."""
    h = hashlib.blake2b(digest_size=8)

    def feed(x):
        if isinstance(x, _Ref):
            feed(("ref", x.recipe.shape, str(x.recipe.dtype), x.upto, len(x.chain)))
        elif isinstance(x, torch.Tensor):
            h.update(f"T{tuple(x.shape)}{x.dtype}".encode())
            h.update((recipe_fingerprint(x) if is_lazy(x) else tensor_hash(x)).to_bytes(8, "little"))
        elif isinstance(x, (tuple, list)):
            for v in x:
                feed(v)
        elif isinstance(x, dict):
            for k in sorted(x):
                feed((k, x[k]))
        else:
            h.update(repr(x).encode())

    r = t._sf_recipe
    feed((r.shape, str(r.dtype), r.start[0], r.uninitialized, t._sf_chain and len(t._sf_chain)))
    if r.uninitialized:                     # to be loaded: how it would have been built does not matter
        return int.from_bytes(h.digest(), "little")
    if r.start[0] == "value":
        feed(r.start[1])
    for s in r.steps:
        feed((_op_name(s.func), s.args, {k: v for k, v in s.kwargs.items() if k != "generator"}, len(s.chain),
              s.out, s.random))
        if s.rng is not None:
            feed(s.rng)
        feed(("seed", s.seed))
    return int.from_bytes(h.digest(), "little")


def broadcast_recipes(model: nn.Module, group) -> None:
    """Give every rank of `group` rank 0's recipes for the lazy parameters
    (collective): what broadcast_weights does for materialized weights."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    group = concrete_group(group)       # None: the world (get_global_rank needs the group itself)
    lazy = [p for p in dict.fromkeys(model.parameters()) if is_lazy(p)]
    payload = [None]
    if dist.get_rank(group) == 0:
        payload = [[_portable(p._sf_recipe) for p in lazy]]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    recipes = payload[0]
    if len(recipes) != len(lazy):
        raise ValueError(f"broadcast_weights: rank 0 has {len(recipes)} lazy parameters, this rank {len(lazy)}")
    for p, recipe in zip(lazy, recipes):
        if recipe.shape != tuple(p.shape) or recipe.dtype != p.dtype:
            raise ValueError(f"broadcast_weights: a lazy parameter of rank 0 is {recipe.shape} {recipe.dtype}, "
                             f"this rank's {tuple(p.shape)} {p.dtype}")
        p._sf_recipe = recipe


def _portable(recipe: _Recipe) -> _Recipe:
    for step in recipe.steps:
        if step.generator is not None:
            raise ValueError("broadcast_weights: a lazy parameter was initialized with an explicit "
                             "torch.Generator, which cannot be sent to the other ranks")
    return recipe


# ---------------------------------------------------------------- the context

class _FreshTensors(TorchFunctionMode):
    """Tracks the storages of tensors created uninitialized (torch.empty &
    co.) inside the context and not written since: a parameter registered on
    one starts "empty" instead of holding on to its (meaningless) memory.
    Keyed by storage (torch keeps one Python object per storage), so
    nn.Parameter(torch.empty(...)) is recognised."""

    _EMPTY = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})

    def __init__(self):
        super().__init__()
        self.fresh: dict[int, weakref.ref] = {}
        self.scratch = torch.empty(0, dtype=torch.uint8)   # see _scratch_tensor
        self.base_seed, self.counter = 0, 0                  # see _next_seed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = _op_name(func)
        if name in self._EMPTY and isinstance(result, torch.Tensor) and not is_lazy(result) \
                and result.device.type != "meta":
            storage = result.untyped_storage()
            self.fresh[id(storage)] = weakref.ref(storage)
        elif args and _in_place(name):
            self._written(args[0])
        self._written(kwargs.get("out"))
        return result

    def _written(self, t) -> None:
        if isinstance(t, torch.Tensor) and not is_lazy(t) and t.device.type != "meta" and self.fresh:
            self.fresh.pop(id(t.untyped_storage()), None)

    def is_fresh(self, t: torch.Tensor) -> bool:
        if is_lazy(t) or t.device.type == "meta":
            return False
        storage = t.untyped_storage()
        ref = self.fresh.get(id(storage))
        return ref is not None and ref() is storage


_state = threading.local()
_lock = threading.Lock()
_active: list = []        # stack of (exact, mode) of the open contexts


def _lazy_register_parameter(original):
    def register_parameter(self, name, param):
        if param is None or is_lazy(param) or not _active or not isinstance(param, torch.Tensor):
            return original(self, name, param)
        exact, mode = _active[-1]
        data = param.detach()
        if data.device.type == "meta" or mode.is_fresh(data):
            start = ("empty", tuple(param.shape), param.dtype,
                 data.device if data.device.type != "meta" else torch.device("cpu"))
        else:
            start = ("value", data)
        device = start[3] if start[0] == "empty" else data.device
        recipe = _Recipe(param.shape, param.dtype, device, start)
        recipe.exact = exact
        lazy = LazyParameter._from_recipe(recipe, param.requires_grad)
        lazy.__dict__.update({k: v for k, v in param.__dict__.items() if not k.startswith("_sf_")})
        return original(self, name, lazy)

    return register_parameter


@contextlib.contextmanager
def lazy_init(exact: bool = True):
    """Build models inside this context without parameter storage (see the
    module docstring).  exact=True: materialized values equal eager
    construction from the same seed (the random numbers are drawn once at
    construction to keep the generator's sequence, one tensor at a time);
    exact=False: nothing drawn at construction (for weights that will be
    loaded; the ones that are not are initialized when materialized)."""
    with _lock:
        mode = _FreshTensors()
        if not exact:
            mode.base_seed = int(torch.randint(0, 2**61, (1,)).item())
        if not _active:
            _state.original = nn.Module.register_parameter
            nn.Module.register_parameter = _lazy_register_parameter(_state.original)
        _active.append((bool(exact), mode))
    try:
        with mode:
            yield
    finally:
        with _lock:
            _active.pop()
            if not _active:
                nn.Module.register_parameter = _state.original
