"""Rank-side checks of sequence parallelism on policies derived from a
model's tensor-parallel plan (tests/test_derived_sequence.py): the tiny
models of checks.derived_policy, split over the sequence in each mode,
against the unsharded model from the same seed (checks.parity), with the
split path's calls counted."""
from __future__ import annotations

import copy
import dataclasses

import torch

import zoo
from checks import derived_policy as DP
from checks import parity
from checks.sequence_attention import mesh_groups, sp_config
from shardformer import ShardConfig, ShardFormer
from shardformer.layer import sequence_attention as sa
from shardformer.layer.sequence import STATE_MARK, _Regathered


# Architectures checked here only (refusals): {name: (ForCausalLM class, config overrides)}
SP_ONLY = {"GptOss": ("GptOssForCausalLM", dict(num_local_experts=3, num_experts_per_tok=2, sliding_window=4,
                                                intermediate_size=32, rope_parameters={"rope_type": "default",
                                                                                       "rope_theta": 10000.0}))}


def build(name: str, **overrides):
    """checks.derived_policy.build, or an architecture of SP_ONLY."""
    if name not in SP_ONLY:
        return DP.build(name, **overrides)
    import transformers

    cls_name, extra = SP_ONLY[name]
    cls = getattr(transformers, cls_name)
    config = cls.config_class(**dict(DP.BASE, **extra, **overrides))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(config)


def inputs_of(name: str, seq: int, seed: int = 1) -> dict:
    """A [2, seq] batch of token ids with labels (any length, odd included)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, DP.BASE["vocab_size"], (DP.BATCH, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def mode_config(mode: str) -> dict:
    """split_gather over the TP group; all_to_all / ring_attn over the group with TP off."""
    if mode == "split_gather":
        return {"enable_sequence_parallelism": True}
    return sp_config(mode)


def _regions(model) -> int:
    """The split_gather regions of a sharded model (its blocks: every
    module carrying the sequence state that is not a layer itself)."""
    marked = [m for m in model.modules() if STATE_MARK in m.__dict__]
    layers = {id(m) for m in _layers_of(model)}
    return sum(1 for m in marked if id(m) not in layers)


def _layers_of(model) -> list:
    from shardformer.autopolicy import get_autopolicy

    policy = get_autopolicy(model)
    policy.set_model(model)
    base, _, name = policy.layer_stack()
    return list(getattr(base, name))


def _split_calls(mode: str) -> int:
    return _Regathered.gathers if mode == "split_gather" else sa.CALLS[mode]


def _expected_calls(model, mode: str) -> int:
    """split_gather: one re-gather of the saved rows per region in the one
    backward; the split attention: one call per layer in each of the two
    forwards of compare_sharded."""
    if mode == "split_gather":
        return _regions(model)
    return 2 * len(_layers_of(model))


def equals_unsharded(ctx, name: str, mode: str, seq: int = 7, overrides: dict | None = None) -> dict:
    """check_sharded (forward, loss, every gradient, outputs after an SGD
    step) with the sequence split over ctx.group in `mode`; the split path
    ran exactly as often as the model's layers / regions say."""
    before = _split_calls(mode)
    holder = {}

    def build():
        holder["model"] = DP.build(name, **(overrides or {}))
        return holder["model"]

    report = parity.check_sharded(ctx, build, inputs_of(name, seq), name=f"{name} {mode}",
                                  config=mode_config(mode), fp64_floor=name in DP.FP64_FLOOR)
    calls, expected = _split_calls(mode) - before, _expected_calls(holder["model"], mode)
    assert expected > 0 and calls == expected, f"{name}: the {mode} path ran {calls} times, expected {expected}"
    report["split_calls"] = calls
    return report


def eval_with_dropout(ctx, name: str, mode: str, p: float = 0.3, seq: int = 7) -> dict:
    """Every dropout probability of the config p > 0, the model in eval():
    forward, loss, every gradient and after a step equal to the unsharded
    eval model, through the split path (counted)."""
    base = DP.build(name)
    cfg = copy.deepcopy(base.config)
    changed = zoo._with_dropout(cfg, p)
    assert changed, f"{name}: its config has no dropout probability"
    torch.manual_seed(0)
    model = type(base)(cfg)
    model.load_state_dict(base.state_dict())
    model.eval()
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **mode_config(mode))).optimize(model)
    assert not model.training
    before = _split_calls(mode)
    report = parity.compare_sharded(model, ref, inputs_of(name, seq), f"{name} {mode} (eval, dropout {p})")
    assert _split_calls(mode) - before == _expected_calls(model, mode), f"{name}: the {mode} path did not run"
    report["dropout"] = changed
    return report


def tp_sp_equals_unsharded(ctx, name: str, mode: str, tp: int = 2, seq: int = 7) -> dict:
    """TP over {0,1},{2,3} and the sequence split over {0,2},{1,3}:
    check_sharded over the TP group, the split attention counted."""
    tp_group, sp_group = mesh_groups(ctx, tp)
    sub = dataclasses.replace(ctx, tp_size=tp, group=tp_group)
    before = sa.CALLS[mode]
    holder = {}

    def build():
        holder["model"] = DP.build(name)
        return holder["model"]

    report = parity.check_sharded(sub, build, inputs_of(name, seq), name=f"{name} TP{tp} x {mode}",
                                  config={"enable_sequence_parallelism": True, "sequence_parallelism_mode": mode,
                                          "sequence_parallel_process_group": sp_group})
    calls = sa.CALLS[mode] - before
    assert calls == _expected_calls(holder["model"], mode), f"{name}: the {mode} attention ran {calls} times"
    return report


def refused(ctx, name: str, mode: str, expect: tuple[str, ...], overrides: dict | None = None,
            config: dict | None = None) -> str:
    """optimize() in `mode` (plus ShardConfig `config`) raises
    NotImplementedError naming each of `expect`, leaving every weight and
    module as it was."""
    model = build(name, **(overrides or {}))
    config = ShardConfig(tensor_parallel_process_group=ctx.group, **mode_config(mode), **(config or {}))
    message = parity.refused_unchanged(model, lambda: ShardFormer(config).optimize(model), f"{name} {mode}",
                                       error=NotImplementedError, structure=True, names=tuple(expect))
    return message


def own_attention_refused(ctx, mode: str) -> str:
    """Olmo2 whose layer 0 runs an attention class of the user's own (its
    forward wraps HF's, not through transformers' AttentionInterface): the
    split-attention modes refuse it by name, the model unchanged."""
    model = DP.build("Olmo2")
    attn = model.model.layers[0].self_attn
    hf = type(attn)

    def forward(self, *args, **kwargs):
        return hf.forward(self, *args, **kwargs)

    attn.__class__ = type("OwnAttention", (hf,), {"forward": forward})
    config = ShardConfig(tensor_parallel_process_group=ctx.group, **mode_config(mode))
    message = parity.refused_unchanged(model, lambda: ShardFormer(config).optimize(model), f"OwnAttention {mode}",
                                       error=NotImplementedError, structure=True)
    for part in ("Olmo2ForCausalLM", "model.layers.0", "OwnAttention", "AttentionInterface", repr(mode)):
        assert part in message, f"the refusal does not name {part}: {message}"
    return message


def generate_matches(ctx, name: str, mode: str, new_tokens: int = 5) -> list:
    """Greedy generate() of the model sharded in `mode` equals the unsharded
    model's (KV-cache steps: unsplit under all_to_all / ring_attn, one token
    on one rank's rows under split_gather); a use_cache=False forward after
    it still takes the split path (counted) and equals the unsharded logits."""
    model = build(name).eval()
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **mode_config(mode))).optimize(model)
    tokens = parity.greedy_matches(model, ref, {"input_ids": parity.prompt_ids()}, f"{name} {mode}", new_tokens)
    before = sa.CALLS[mode] if mode in sa.MODES else None
    ids = inputs_of(name, 7)["input_ids"]
    with torch.no_grad():
        got, exp = model(input_ids=ids, use_cache=False).logits, ref(input_ids=ids, use_cache=False).logits
    if before is not None:
        assert sa.CALLS[mode] > before, f"{name}: the {mode} attention did not run after generate()"
    parity.assert_close(f"{name} {mode} logits after generate()", got, exp, parity.TOL[torch.float32])
    return tokens.tolist()


def padded_batch(ctx, name: str, mode: str, sp_seq: int = 7, pad: int = 2) -> dict:
    """Batch row 0 left-padded by `pad` tokens (attention_mask), labels -100
    where a padding query predicts: the logits at the real positions, the
    loss and every gradient (this rank's shard under split_gather) equal the
    unsharded model's, through the split path (counted).  What a query that
    sees only padding attends to is each kernel's own convention and reaches
    nothing real."""
    torch.manual_seed(0)
    model = build(name).train()
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **mode_config(mode))).optimize(model)
    inputs = inputs_of(name, sp_seq)
    mask = torch.ones_like(inputs["input_ids"])
    mask[0, :pad] = 0
    inputs["labels"][0, : pad + 1] = -100                 # label t is predicted at t - 1
    inputs["attention_mask"] = mask
    before = _split_calls(mode)
    got, exp = model(**inputs), ref(**inputs)
    tol = parity.TOL[torch.float32]
    real = mask.bool()
    parity.assert_close(f"{name} {mode} logits at real positions", got.logits[real], exp.logits[real], tol)
    parity.assert_close(f"{name} {mode} loss", got.loss, exp.loss, tol)
    got.loss.backward()
    exp.loss.backward()
    worst = parity.compare_grads(model, ref, f"{name} {mode} padded", tol)
    assert _split_calls(mode) > before, f"{name}: the {mode} path did not run"
    return {"grad": worst}


def equals_or_refused(ctx, name: str, mode: str, seq: int = 7) -> str:
    """equals_unsharded, or optimize() refuses the mode (NotImplementedError
    naming the model class and the mode): "equal" or "refused"."""
    cls = (DP.MODELS.get(name) or SP_ONLY[name])[0]
    try:
        equals_unsharded(ctx, name, mode, seq)
    except NotImplementedError as e:
        message = str(e)
        assert cls in message and repr(mode) in message, f"the refusal does not name {cls} and {mode!r}: {message}"
        return "refused"
    return "equal"


def sequence_conv_refused(ctx, mode: str) -> str:
    """Olmo2 with a short convolution over the sequence added to layer 1
    (a conv mixer, as hybrid architectures have): every mode refuses it by
    name, the model unchanged."""
    model = DP.build("Olmo2")
    model.model.layers[1].short_conv = torch.nn.Conv1d(4, 4, 3, groups=4)
    config = ShardConfig(tensor_parallel_process_group=ctx.group, **mode_config(mode))
    message = parity.refused_unchanged(model, lambda: ShardFormer(config).optimize(model), f"conv {mode}",
                                       error=NotImplementedError, structure=True)
    for part in ("Olmo2ForCausalLM", "model.layers.1.short_conv", "convolution", repr(mode)):
        assert part in message, f"the refusal does not name {part}: {message}"
    return message


def shared_experts_split_gather(ctx, name: str, seq: int) -> dict:
    """split_gather on a MoE block whose shared expert the plan leaves
    replicated (SolarOpen): equals_unsharded, and the shared expert's
    output scaling (SharedExpertInSequenceParallel) counted."""
    from checks.optimizations import counting_calls
    from shardformer.layer import moe

    with counting_calls({"shared": (moe, "_scale_output")}) as calls:
        report = equals_unsharded(ctx, name, "split_gather", seq)
    report["shared_calls"] = calls["shared"]
    return report
