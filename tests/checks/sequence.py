"""Rank-side checks of split-gather sequence parallelism (tests/test_sequence_parallel.py)."""
from __future__ import annotations

import re

import torch

import zoo
from checks import parity
from shardformer import ShardConfig, ShardFormer

SP = {"enable_sequence_parallelism": True}


def cut_sequence(inputs: dict, seq: int | None) -> dict:
    """`inputs` with the sequence cut to its first `seq` positions: the last
    dimension of multiple choice's token tensors [batch, choices, S]
    (integer, 3 dimensions: ids, masks, GPT-2 double heads' LM labels),
    dimension 1 of every other tensor [batch, S, ...]; GPT-2 double heads'
    mc_token_ids [batch, choices] (one position per choice, not a sequence)
    kept within the cut.  Asserts the token ids were longer than `seq` and
    now have `seq` positions (the cut happened)."""
    if seq is None:
        return inputs
    ids = inputs.get("input_ids")
    out = {}
    for k, v in inputs.items():
        if not isinstance(v, torch.Tensor) or v.dim() < 2 or k == "mc_token_ids":
            out[k] = v
        elif v.dim() == 3 and not v.is_floating_point():
            out[k] = v[..., :seq].contiguous()
        else:
            out[k] = v[:, :seq].contiguous()
    if "mc_token_ids" in inputs:
        out["mc_token_ids"] = inputs["mc_token_ids"].clamp(max=seq - 1)
    if ids is not None:
        assert ids.shape[-1] > seq and out["input_ids"].shape[-1] == seq, \
            f"input_ids {tuple(ids.shape)}: not cut to {seq} positions ({tuple(out['input_ids'].shape)})"
    return out


def sp_equals_unsharded(ctx, name: str, seq: int | None = None, config=None, overrides=None,
                        dtype_name: str = "float32", device=None) -> dict:
    """check_sharded (forward, loss, every gradient, outputs after a step;
    bf16: forward) with sequence parallelism on; `seq`: the input length
    (cut_sequence; odd lengths are padded inside); `overrides`: model config
    values (zoo.build); device: where it runs (check_sharded's).  The
    report's "seq": the token ids' length run."""
    dtype = getattr(torch, dtype_name)
    inputs = cut_sequence(zoo.make_inputs(name), seq)
    dtype_arg = () if dtype == torch.float32 else (dtype,)      # zoo.vision's build takes no dtype
    report = parity.check_sharded(ctx, lambda: zoo.build(name, *dtype_arg, **(overrides or {})), inputs, name=name,
                                  dtype=dtype, config={**SP, **(config or {})}, device=device)
    if "input_ids" in inputs:
        report["seq"] = inputs["input_ids"].shape[-1]
    return report


def layers_of(model) -> list:
    """The model's decoder / encoder layers: the first ModuleList of
    config.num_hidden_layers modules (Llama's layers, GPT-2's h, BERT's encoder.layer)."""
    n = model.config.num_hidden_layers
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return list(module)
    raise AssertionError(f"{type(model).__name__}: no ModuleList of {n} layers")


def sp_activations_are_split(ctx, name: str) -> dict:
    """Between the blocks each rank holds only its rows: the input of every
    layer after the first has ceil(S / tp) rows, and so has the output of
    every row layer that reduce-scatters itself (GPT-2, BERT, ...)."""
    from shardformer.layer import Linear1D_Row

    model = zoo.build(name)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **SP)).optimize(model)
    seen, rows_out = [], []
    for layer in layers_of(model)[1:]:
        layer.register_forward_pre_hook(lambda m, a, k: seen.append(k.get("hidden_states", a[0] if a else None).shape[1]),
                                        with_kwargs=True)
    inputs = zoo.make_inputs(name)
    seq = inputs["input_ids"].shape[-1]
    batch = inputs["input_ids"].numel() // seq
    for module in model.modules():     # [batch, rows, hidden], or rows flattened [batch * rows, hidden] (OPT's MLP)
        if isinstance(module, Linear1D_Row) and getattr(module, "reduce_scatter", False):
            module.register_forward_hook(
                lambda m, a, out: rows_out.append(out.shape[1] if out.dim() > 2 else out.shape[0] // batch))
    with torch.no_grad():
        model(**inputs)
    expected = -(-seq // ctx.tp_size)
    assert seen and all(s == expected for s in seen), f"{name}: layer inputs of {seen} rows, expected {expected}"
    assert all(s == expected for s in rows_out), f"{name}: row layer outputs of {rows_out} rows, expected {expected}"
    return {"rows": seen[0], "seq": seq, "row_layers_scattering": len(rows_out)}


def _with_dropout(name: str, p: float):
    """zoo.build_with_dropout(name, p), but no layerdrop (OPT: refused with SP)."""
    model = zoo.build_with_dropout(name, p)
    for m in [model.config] + list(model.modules()):
        if isinstance(getattr(m, "layerdrop", None), float):
            m.layerdrop = 0.0
    return model


def sp_eval_with_dropout(ctx, name: str, p: float = 0.3) -> dict:
    """eval() with every dropout probability p > 0: sequence parallelism
    equals the unsharded model (forward, loss, every gradient, after a step)."""
    import copy

    model = _with_dropout(name, p).eval()
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **SP)).optimize(model)
    assert not model.training
    return parity.compare_sharded(model, ref, zoo.make_inputs(name), f"{name} (eval, dropout {p})")


def _recorder(masks: dict, mname: str):
    """A forward hook keeping the dropped positions of a module's first call
    in masks[mname]; it returns None: the module's output stays as it is."""
    def hook(_module, _args, out):
        masks.setdefault(mname, out == 0)

    return hook


def sp_dropout_masks_differ(ctx, name: str, p: float = 0.5) -> dict:
    """Training with dropout under sequence parallelism: the residual dropouts
    run on this rank's rows and draw a different mask on every rank (never
    one mask for all rows); the gathered outputs are the same on every rank,
    the loss is finite and backward runs."""
    from shardformer.layer import DropoutForParallelInput

    model = _with_dropout(name, p).train()
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **SP)).optimize(model)
    masks = {}
    for mname, module in model.named_modules():
        if isinstance(module, DropoutForParallelInput) and not mname.endswith(
                ("attn_dropout", "self.dropout", "attention_dropout")):
            module.register_forward_hook(_recorder(masks, mname))
    inputs = zoo.make_inputs(name)
    return check_split_dropout_step(ctx, name, masks, model(**inputs))


def sp_generate_matches(ctx, name: str, overlap: bool = False) -> list:
    """Greedy generate() with sequence parallelism (and enable_sequence_overlap)
    equals the unsharded model's (decode steps of one token: one rank holds
    it, the others padding)."""
    model = zoo.build(name).eval()
    import copy

    ref = copy.deepcopy(model)
    cfg = overlap_config(ctx) if overlap else ShardConfig(tensor_parallel_process_group=ctx.group, **SP)
    ShardFormer(cfg).optimize(model)
    return parity.greedy_matches(model, ref, {"input_ids": parity.prompt_ids()}, name, 5).tolist()


def sp_regathers_in_backward(ctx, name: str, overlap: bool = False) -> dict:
    """Each block keeps only its rows of the gathered input for backward and
    all-gathers them once when backward needs them: 2 re-gathers (attention,
    MLP) per decoder layer per backward, none in no_grad forwards; the same
    with enable_sequence_overlap (a Llama block's q/k/v, gate/up share one
    gather and one re-gather)."""
    model = zoo.build(name)
    cfg = overlap_config(ctx) if overlap else ShardConfig(tensor_parallel_process_group=ctx.group, **SP)
    ShardFormer(cfg).optimize(model)
    got = backward_regathers(model, zoo.make_inputs(name))
    layers = model.config.num_hidden_layers
    blocks = 3 if getattr(model.config, "add_cross_attention", False) else 2
    assert got == blocks * layers, f"{name}: {got} re-gathers in backward, expected {blocks * layers}"
    return {"regathers": got}


def overlap_config(ctx) -> ShardConfig:
    """ShardConfig with split-gather SP and enable_sequence_overlap=True."""
    return ShardConfig(tensor_parallel_process_group=ctx.group, enable_sequence_overlap=True, **SP)


def sp_overlap_equals_unsharded(ctx, name: str, seq: int | None = None, blocks: int = 0, device=None) -> dict:
    """enable_sequence_overlap: the same guarantees as sp_equals_unsharded
    (forward, loss, every gradient, after a step), and on the shared-memory
    backend every gathering column layer ran its collectives in flight in
    both forwards and the backward (GatherRowsLinear.overlapped).  `blocks`:
    the overlapped blocks per layer (Llama-shaped: 2, attention and MLP,
    whose column layers share one gather: one pass each, not one per layer).
    device: where the model, the reference and the inputs run (None: CPU);
    on CUDA the collectives are asynchronous on every backend, so every
    pass must have overlapped there too."""
    import copy

    from shardformer.distributed import backend_for
    from shardformer.layer import Linear1D_Col
    from shardformer.layer.linear import GatherRowsLinear

    inputs = cut_sequence(zoo.make_inputs(name), seq)
    cfg = overlap_config(ctx)
    torch.manual_seed(0)
    model = zoo.build(name).train()
    if device is not None:
        model.to(device)
        inputs = parity.to_device(inputs, device)
    ref = copy.deepcopy(model)
    ShardFormer(cfg).optimize(model)
    gathering = {n: m for n, m in model.named_modules() if isinstance(m, Linear1D_Col) and getattr(m, "overlap", False)}
    units = len(gathering) + blocks * model.config.num_hidden_layers
    assert units, f"{name}: no column layer gathers its input with overlap"
    before, unused = GatherRowsLinear.overlapped, GatherRowsLinear.unused
    report = parity.compare_sharded(model, ref, inputs, f"{name} (overlap)")
    ran = GatherRowsLinear.overlapped - before
    # every output a block's overlapped gather computed was the one its layer returned
    assert GatherRowsLinear.unused == unused, f"{name}: {GatherRowsLinear.unused - unused} precomputed outputs unused"
    # the backward passes: those of the gathering layers whose weight the unsharded model's loss reaches
    # (all of them, except where a head reads no later layer: BeitForSemanticSegmentation's reads
    # hidden_states[i - 1] for i in out_indices, so the layers past max(out_indices) - 1 get no gradient)
    backward = len(gathering) - sum(ref.get_submodule(n).weight.grad is None for n in gathering) + blocks * model.config.num_hidden_layers
    starved = {n for n in gathering if ref.get_submodule(n).weight.grad is None}
    if starved:   # only the layers a multi-level head never reads (it reads hidden_states[i - 1], i in out_indices)
        out_indices = getattr(model.config, "out_indices", None) or [len(gathering) + 1]
        unread = {n for n in gathering if int(re.search(r"\.layers?\.(\d+)\.", n).group(1)) >= max(out_indices) - 1}
        assert starved == unread, f"{name}: no gradient reached {sorted(starved)}, out_indices {out_indices} leave {sorted(unread)}"
    backend = backend_for(torch.empty(1, device=device), ctx.group)
    if backend == "shm" or device is not None:   # 2 forwards (before and after the step), 1 backward per layer reached
        expected = 2 * units + backward
        assert ran == expected, f"{name}: {ran} overlapped passes, expected {expected} ({units} layers, {backward} backwards)"
    return {**report, "overlapped": ran, "backend": backend}


def sp_checkpointing_matches(ctx, name: str, use_reentrant: bool, p: float = 0.2, overlap: bool = False) -> dict:
    """Gradient checkpointing with sequence parallelism and live dropout gives
    the gradients of the same model without checkpointing: the recomputed
    layers split, gather and reduce-scatter again in backward (every rank in
    the same order) and draw the same per-rank masks."""
    from checks.runtime_state import checkpointed_grads_match

    model = _with_dropout(name, p)
    inputs = zoo.make_inputs(name)
    cfg = overlap_config(ctx) if overlap else ShardConfig(tensor_parallel_process_group=ctx.group, **SP)
    ShardFormer(cfg).optimize(model)
    return {"worst": checkpointed_grads_match(model, inputs, name, use_reentrant)}


def sp_hidden_states_refused(ctx, name: str) -> str:
    """A policy that does not mark its layers' rows (records_hidden_states
    False: every built-in family marks them) refuses output_hidden_states=True
    (in the call, or in the config) under split-gather SP with
    NotImplementedError, rather than return one rank's rows of every layer's
    hidden states; other calls still work."""
    from shardformer.autopolicy import get_autopolicy

    model = zoo.build(name).eval()
    unmarked = type("Unmarked", (type(get_autopolicy(model)),), {"records_hidden_states": False})
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, **SP)).optimize(model, policy=unmarked())
    inputs = zoo.make_inputs(name)
    message = ""
    for how in ("call", "config"):
        try:
            with torch.no_grad():
                if how == "call":
                    model(**inputs, output_hidden_states=True)
                else:
                    model.config.output_hidden_states = True
                    model(**inputs)
        except NotImplementedError as e:
            assert "output_hidden_states" in str(e) and name in str(e), str(e)
            message = str(e)
        else:
            raise AssertionError(f"{name}: output_hidden_states=True ({how}) was not refused")
        finally:
            model.config.output_hidden_states = False
    with torch.no_grad():
        model(**inputs)
    return message


def sp_linear_layers(ctx, seq: int, overlap: bool, conv1d: bool = False) -> dict:
    """The sequence-parallel layer options alone, against nn.Linear (or HF
    Conv1D) on the full sequence: Linear1D_Col(gather_input=True) on this
    rank's rows (3-D with sequence_state: the exact sequence; 2-D flattened
    rows: padding kept) and Linear1D_Row(reduce_scatter=True) with a bias,
    forward and every gradient (input rows, weight shard, bias)."""
    import torch.nn.functional as F
    from transformers.pytorch_utils import Conv1D

    from shardformer.layer import Linear1D_Col, Linear1D_Row
    from shardformer.layer import GPT2FusedLinearConv1D_Col, GPT2FusedLinearConv1D_Row
    from shardformer.layer.parallel_module import shard_of
    from shardformer.layer.sequence import SequenceState
    from shardformer.layout import Split

    p, r = ctx.tp_size, ctx.rank
    tol = parity.TOL[torch.float32]
    B, H, O = 2, 12, 10
    s = -(-seq // p)
    torch.manual_seed(5)
    if conv1d:
        col_native, row_native = Conv1D(O, H), Conv1D(H, O)
        col_cls, row_cls, w_dim = GPT2FusedLinearConv1D_Col, GPT2FusedLinearConv1D_Row, 1
    else:
        col_native, row_native = torch.nn.Linear(H, O), torch.nn.Linear(O, H)
        col_cls, row_cls, w_dim = Linear1D_Col, Linear1D_Row, 0
    # w_dim: the weight's output-feature dimension (split by the column layer; the row layer splits the other)
    x = torch.randn(B, seq, H)
    rows = F.pad(x, (0, 0, 0, p * s - seq))[:, r * s:(r + 1) * s]
    report = {}
    for flat in (False, True):
        state = SequenceState()
        state.length = seq
        kwargs = dict(sequence_parallel=True, gather_input=True, overlap=overlap, split=Split())
        if not flat:
            kwargs["sequence_state"] = state
        col = col_cls.from_native_module(col_native, ctx.group, **kwargs)
        ref_in = x if not flat else torch.cat([F.pad(x, (0, 0, 0, p * s - seq))[:, i * s:(i + 1) * s].reshape(-1, H)
                                               for i in range(p)])
        ref_in = ref_in.clone().requires_grad_(True)
        mine = (rows if not flat else rows.reshape(-1, H)).clone().requires_grad_(True)
        y, exp = col(mine), col_native(ref_in)
        exp_local = shard_of(exp.detach(), -1, col.shard)
        parity.assert_close(f"col{' flat' if flat else ''} forward", y, exp_local, tol)
        probe = torch.randn(exp.shape, generator=torch.Generator().manual_seed(7))
        (y * shard_of(probe, -1, col.shard)).sum().backward()
        (exp * probe).sum().backward()
        exp_rows = ref_in.grad if flat else F.pad(ref_in.grad, (0, 0, 0, p * s - seq))[:, r * s:(r + 1) * s]
        if flat:
            exp_rows = exp_rows[r * B * s:(r + 1) * B * s]
        parity.assert_close("col dX rows", mine.grad, exp_rows, tol)
        parity.assert_close("col dW", col.weight.grad, shard_of(col_native.weight.grad, w_dim, col.shard), tol)
        parity.assert_close("col db", col.bias.grad, shard_of(col_native.bias.grad, 0, col.shard), tol)
        col_native.zero_grad()
    row = row_cls.from_native_module(row_native, ctx.group, sequence_parallel=True, reduce_scatter=True)
    z = torch.randn(B, seq, O, requires_grad=True)
    z_local = shard_of(z.detach(), -1, row.shard).requires_grad_(True)
    out, exp = row(z_local), row_native(z)
    exp_rows = F.pad(exp.detach(), (0, 0, 0, p * s - seq))[:, r * s:(r + 1) * s]
    valid = max(0, min(s, seq - r * s))          # padding rows hold the bias alone: not compared
    parity.assert_close("row forward", out[:, :valid], exp_rows[:, :valid], tol)
    probe = torch.randn(exp.shape, generator=torch.Generator().manual_seed(8))
    probe_rows = F.pad(probe, (0, 0, 0, p * s - seq))[:, r * s:(r + 1) * s]
    (out * probe_rows).sum().backward()
    (exp * probe).sum().backward()
    parity.assert_close("row dX", z_local.grad, shard_of(z.grad, -1, row.shard), tol)
    parity.assert_close("row dW", row.weight.grad, shard_of(row_native.weight.grad, 1 - w_dim, row.shard), tol)
    parity.assert_close("row db (all-reduced over the ranks' rows)", row.bias.grad, row_native.bias.grad, tol)
    from shardformer.layer.linear import GatherRowsLinear

    report["overlapped_total"] = GatherRowsLinear.overlapped
    return report


def check_split_dropout_step(ctx, name: str, masks: dict, out) -> dict:
    """A training forward with live dropout: every dropout on split rows
    ({module name: its dropped positions}) drew a different mask on each
    rank of ctx.group, the ranks agree on the gathered output, and the loss
    is finite and differentiable."""
    import torch.distributed as dist

    assert masks, f"{name}: no residual dropout ran on split rows"
    same = []
    for mname, mask in masks.items():
        gathered = [torch.empty_like(mask, dtype=torch.uint8) for _ in range(ctx.tp_size)]
        dist.all_gather(gathered, mask.to(torch.uint8).contiguous(), group=ctx.group)
        if all(torch.equal(g, gathered[0]) for g in gathered[1:]):
            same.append(mname)
    assert not same, f"{name}: ranks drew the same dropout mask for their different rows in {same}"
    first = next(iter(parity.output_tensors(out).values()))
    copies = [torch.empty_like(first) for _ in range(ctx.tp_size)]
    dist.all_gather(copies, first.detach().contiguous(), group=ctx.group)
    assert all(torch.equal(c, copies[0]) for c in copies[1:]), f"{name}: ranks disagree on the gathered output"
    loss = parity.loss_of(out, {})
    assert torch.isfinite(loss), f"{name}: loss {loss}"
    loss.backward()
    return {"residual_dropouts": len(masks)}


def backward_regathers(model, inputs: dict) -> int:
    """The re-gathers of saved block inputs in one backward of `model`
    (none in a no_grad forward, asserted)."""
    from shardformer.layer.linear import GatherRowsLinear
    from shardformer.layer.sequence import _Regathered

    def regathers():
        return _Regathered.gathers + GatherRowsLinear.regathers

    before = regathers()
    with torch.no_grad():
        model(**inputs)
    assert regathers() == before, "a no_grad forward re-gathered"
    parity.loss_of(model(**inputs), {}).backward()
    return regathers() - before
