"""Rank-side checks of lazy construction (tests/test_lazy.py): a model built
under shardformer.lazy_init() and sharded equals, shard for shard and bit
for bit, the same model built eagerly from the same seed and sharded; it
trains like the unsharded model; its ranks must still agree."""
from __future__ import annotations

import torch

import zoo
from checks import parity
from shardformer import ShardConfig, ShardFormer, lazy_init
from shardformer.lazy import is_lazy


def _sharded(ctx, name: str, lazy: bool, config=None):
    cfg = ShardConfig(tensor_parallel_process_group=ctx.group, **(config or {}))
    if lazy:
        with lazy_init():
            model = zoo.build(name)
    else:
        model = zoo.build(name)
    after = torch.rand(4)         # what the generator gives after construction
    ShardFormer(cfg).optimize(model)
    return model, after


def lazy_equals_eager(ctx, name: str, config=None) -> dict:
    """Every tensor of the state dict (each rank's shards, replicated
    parameters, buffers) equal to the eager model's, bit for bit; no lazy
    tensor left; the generator's sequence after construction unchanged."""
    eager, after_eager = _sharded(ctx, name, lazy=False, config=config)
    lazy, after_lazy = _sharded(ctx, name, lazy=True, config=config)
    left = [n for n, p in lazy.named_parameters() if is_lazy(p)]
    assert not left, f"{name}: parameters still lazy after optimize(): {left[:5]}"
    assert torch.equal(after_eager, after_lazy), f"{name}: lazy_init() changed the random sequence after it"
    e, z = eager.state_dict(), lazy.state_dict()
    assert list(e) == list(z), f"{name}: state dict keys differ: {sorted(set(e) ^ set(z))[:5]}"
    differ = [k for k in e if e[k].shape != z[k].shape or e[k].dtype != z[k].dtype or not torch.equal(e[k], z[k])]
    assert not differ, f"{name}: {len(differ)} of {len(e)} tensors differ from the eager model's, e.g. {differ[:5]}"
    tied_e = {id(p) for p in eager.parameters()}
    tied_z = {id(p) for p in lazy.parameters()}
    assert len(tied_e) == len(tied_z), f"{name}: {len(tied_e)} distinct parameters eager, {len(tied_z)} lazy"
    return {"tensors": len(e), "numel": sum(p.numel() for p in lazy.parameters())}


def lazy_trains_like_unsharded(ctx, name: str) -> dict:
    """check_sharded (forward, loss, every gradient, outputs after a step)
    on a model built under lazy_init(), against the eager unsharded model."""
    def build():
        with lazy_init():
            return zoo.build(name)

    return parity.check_sharded(ctx, build, zoo.make_inputs(name), name=name, reference=zoo.build(name))


def replicas_differ(ctx, name: str) -> str:
    """Ranks that built their lazy models from different seeds are refused
    like eager ones; with broadcast_weights they all get rank 0's."""
    mod = zoo.module_of(name)
    with lazy_init():
        model = mod.build(name, seed=ctx.rank)
    try:
        ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError(f"{name}: lazy models from different seeds were sharded without a word")
    with lazy_init():
        model = mod.build(name, seed=ctx.rank)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group,
                            extra_kwargs={"broadcast_weights": True})).optimize(model)
    eager = mod.build(name, seed=0)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(eager)
    e, z_ = eager.state_dict(), model.state_dict()
    differ = [k for k in e if not torch.equal(e[k], z_[k])]
    assert not differ, f"{name}: broadcast_weights on a lazy model: {differ[:5]} differ from rank 0's seed"
    return message


def _impl(name: str) -> dict:
    """The kernels the unsharded reference runs with: eager attention, and
    eager experts (from_pretrained would pick grouped_mm, which our odd
    sizes do not fit)."""
    return {"attn_implementation": "eager", **({"experts_implementation": "eager"} if "Mixtral" in name else {})}


def save_reference(name: str, directory: str, dtype_name: str = "float32", drop: str | None = None) -> None:
    """The zoo's unsharded model `name` (seed 0), saved by plain HF in
    `dtype_name`; `drop`: a prefix of keys to leave out of the checkpoint."""
    import safetensors.torch

    model = zoo.build(name).to(getattr(torch, dtype_name))
    model.save_pretrained(directory)
    if drop:
        path = f"{directory}/model.safetensors"
        tensors = {k: v for k, v in safetensors.torch.load_file(path).items() if not k.startswith(drop)}
        safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})


def from_pretrained_equals_hf(ctx, name: str, directory: str, dtype_name: str = "float32") -> dict:
    """ShardFormer.from_pretrained at ctx's TP size against transformers'
    from_pretrained of the same checkpoint, unsharded: logits, loss and
    every gradient (check_sharded), in eval mode as HF returns it.  No
    parameter the checkpoint holds is built from its recipe: every one is
    allocated at its shard's size and read from the checkpoint."""
    import transformers

    from shardformer import lazy as lazy_module

    cls = getattr(transformers, name)
    dtype = getattr(torch, dtype_name)
    before = dict(lazy_module.stats)
    model, _ = ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).from_pretrained(
        cls, directory, dtype=dtype, **_impl(name))
    # (HF's own construction may read a few small tensors: BERT pads its
    # LM-head bias in tie_weights, ViT's trunc_normal_ reads its samples;
    # those count apart, as built_in_construction.)
    built = lazy_module.stats["built_bytes"] - before["built_bytes"]
    assert built == 0, f"{name}: from_pretrained built {built} parameter bytes from their init recipes"
    assert not model.training, f"{name}: from_pretrained should return the model in eval mode"
    ref = cls.from_pretrained(directory, dtype=dtype, **_impl(name))
    # transformers' from_pretrained drops the frozen flag some models set in
    # __init__ (Whisper's sinusoidal embed_positions); ours keeps it: compare
    # gradients of the parameters both train.
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    for n, p in ref.named_parameters():
        if n in frozen:
            p.requires_grad_(False)
    return parity.compare_sharded(model.train(), ref.train(), zoo.make_inputs(name), name, dtype)


def from_pretrained_initializes_missing(ctx, name: str, directory: str, dropped: str,
                                        default_group: bool = False) -> dict:
    """Parameters the checkpoint lacks are initialized as the model's own
    init does (equal to eager construction from the same seed) and named in
    a warning; the others come from the checkpoint.  default_group: with the
    plain ShardConfig() (the pool's whole world is the group)."""
    import warnings

    import transformers

    cls = getattr(transformers, name)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = ShardConfig() if default_group else ShardConfig(tensor_parallel_process_group=ctx.group)
        model, _ = ShardFormer(cfg).from_pretrained(cls, directory, **_impl(name))
    messages = [str(w.message) for w in caught if "newly initialized" in str(w.message)]
    assert messages and dropped in messages[0], f"{name}: no warning naming {dropped}: {messages}"
    from shardformer.checkpoint import gather_full_state_dict

    full = gather_full_state_dict(model)
    ref = zoo.build(name)
    std = model.config.initializer_range
    for key, value in ref.state_dict().items():
        got = full[key]
        if key.startswith(dropped):
            assert got.shape == value.shape, f"{key}: shape {tuple(got.shape)} != {tuple(value.shape)}"
            assert 0.7 * std < got.std().item() < 1.3 * std, \
                f"{key}: std {got.std().item():.4g}, the model's init draws N(0, {std})"
        else:
            assert torch.equal(got, value), f"{name}: {key} differs from the checkpoint"
    return {"warning": messages[0]}


def save_trained(ctx, name: str, directory: str) -> None:
    """The zoo's model sharded at ctx's TP size, one SGD step, saved with
    model.save_pretrained (shardformer's streamed writer): a checkpoint of
    weights no init would give, for loading at other TP sizes."""
    model = zoo.build(name)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    parity.loss_of(model(**zoo.make_inputs(name)), {}).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    model.save_pretrained(directory)


def lazy_custom_model(ctx) -> dict:
    """A user's own nn.Module and Policy (the zoo's ToyModel): built under
    lazy_init(), sharded, it trains like the eagerly built unsharded model
    from the same seed."""
    from zoo import custom

    def build():
        with lazy_init():
            return custom.ToyModel()

    torch.manual_seed(0)
    reference = custom.ToyModel()
    return parity.check_sharded(ctx, build, custom.toy_inputs(), name="ToyModel", policy=custom.ToyPolicy(),
                                reference=reference)
