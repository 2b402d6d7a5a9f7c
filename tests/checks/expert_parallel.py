"""Rank-side checks of expert parallelism (shardformer.layer.expert_parallel):
every function runs on the 4 ranks of the pool (mesh() is collective).

A MoE model is sharded over mesh(dp=, tp=, ep=) and trained one step with
shardformer.data_parallel on this rank's rows of a global batch (different
data per DP rank, odd sequence length); the unsharded model from the same
seed runs the whole batch.  Loss, every gradient (this rank's experts and
TP shard of the reference's), clip_grad_norm_ and the weights after the
optimizer step must match, the dispatch exchange must have run, and each
rank must hold only its block of experts."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import transformers

import zoo
from checks import derived_policy as derived
from checks import parity
from checks.optimizations import counting_calls
from shardformer import ShardConfig, ShardFormer, average_gradients, clip_grad_norm_, data_parallel, lazy_init, mesh
from shardformer.checkpoint import _shard_info, gather_full_state_dict, load_full_state_dict
from shardformer.checkpoint.pretrained import load_pretrained
from shardformer.layer import expert_parallel
from shardformer.layer.expert_parallel import ExpertParallelExperts, expert_block, is_expert_param
from shardformer.layer.parallel_module import shard_of
from shardformer.lazy import is_lazy

TOL = (1e-5, 1e-6)
ROWS, SEQ = 2, 7          # per DP rank
LR = 1e-2


def build(arch: str, experts: int | None = None, **overrides):
    """The unsharded model of `arch` ("mixtral": the built-in family;
    "olmoe": a derived plan with transformers' expert-parallel entries,
    ep_router included), from seed 0."""
    if arch == "mixtral":
        if experts is not None:
            overrides["num_local_experts"] = experts
        return zoo.build("MixtralForCausalLM", **overrides)
    if experts is not None:
        overrides["num_experts"] = experts
    model = derived.build("Olmoe", **overrides)
    ep_plan = {f"model.{k}": v for k, v in type(model.config).base_model_ep_plan.items()}
    model._tp_plan = dict(model._tp_plan, **ep_plan)
    return model


def batch(vocab: int, rows: int) -> dict:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, vocab, (rows, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _expected(model, name: str, p: torch.Tensor, full: torch.Tensor, info: dict) -> torch.Tensor:
    """This rank's part of the unsharded tensor `full` of parameter `name`:
    its block of experts (expert-parallel layers), then its TP shard."""
    owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    if isinstance(owner, ExpertParallelExperts):
        full = full[owner.first_expert:owner.first_expert + owner.num_experts]
    if id(p) in info:
        dim, shard, _ = info[id(p)]
        full = shard_of(full, dim, shard)
    return full


def compare(model, ref, what: str, grads: bool, tol=TOL) -> float:
    info = _shard_info(model)
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        rp = ref_params[name]
        got, full = (p.grad, rp.grad) if grads else (p.detach(), rp.detach())
        assert got is not None and full is not None, f"{what}: {name} has no gradient"
        worst = max(worst, parity.assert_close(f"{what} {name}", got, _expected(model, name, p, full, info), tol))
    return worst


def _expert_numel(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)


def training(ctx, arch: str, dp: int, tp: int, ep: int, experts: int | None = None, mode: str = "train",
             optimizer: str = "sgd", via: str = "ddp", rank0_only: bool = False, save_to: str | None = None) -> dict:
    """One optimizer step of the model sharded over mesh(dp, tp, ep) with
    data_parallel(model, mesh) (via="ddp_group": data_parallel(model,
    mesh.dp); via="average": shardformer.average_gradients(model, mesh)
    instead of DDP) against the unsharded model on the concatenated
    batch, then gather_full_state_dict (rank0_only: to global rank 0 only)
    against the unsharded state dict.  mode="eval": eval mode with attention
    dropout 0.3 configured."""
    m = mesh(dp=dp, tp=tp, ep=ep)
    overrides = {"attention_dropout": 0.3} if mode == "eval" else {}
    torch.manual_seed(0)
    model = build(arch, experts, **overrides)
    model.train(mode == "train")
    ref = copy.deepcopy(model)
    name = type(model).__name__
    model, _ = ShardFormer(m.shard_config()).optimize(model)
    layers = [mod for mod in model.modules() if isinstance(mod, ExpertParallelExperts)]
    assert layers, f"{name}: no expert-parallel layer"
    e_total = layers[0].total_experts
    first, count = expert_block(e_total, ep, m.coords["dp"] % ep)
    assert all((mod.first_expert, mod.num_experts) == (first, count) for mod in layers)

    # each rank holds its block of experts, 1/tp of each: summed over the world that is the
    # unsharded experts once per expert_dp replica
    held = torch.tensor([_expert_numel(model)], dtype=torch.int64)
    dist.all_reduce(held)
    assert int(held) == _expert_numel(ref) * (dp // ep), (int(held), _expert_numel(ref), dp, ep)

    # via="ddp_group": the DP group alone (enough when EP spans it)
    wrapped = {"ddp": lambda: data_parallel(model, m), "ddp_group": lambda: data_parallel(model, m.dp),
               "average": lambda: model}[via]()
    kind = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer]
    opt, ref_opt = kind(model.parameters(), lr=LR), kind(ref.parameters(), lr=LR)
    whole = batch(ref.config.vocab_size, ROWS * dp)
    d = m.coords["dp"]
    mine = {k: v[d * ROWS:(d + 1) * ROWS] for k, v in whole.items()}
    with counting_calls({"a2a": (expert_parallel, "all_to_all_along")}) as calls:
        loss = wrapped(**mine).loss
    assert calls["a2a"] == 2 * len(layers), f"{name}: {calls['a2a']} exchanges for {len(layers)} MoE layers"
    loss.backward()
    if via == "average":
        average_gradients(model, m)
    ref_loss = ref(**whole).loss
    ref_loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=m.dp)
    report = {"loss": parity.assert_close(f"{name} loss", total / dp, ref_loss.detach(), TOL)}
    report["grad"] = compare(model, ref, f"{name} grad", grads=True)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
    norm = clip_grad_norm_(model, float(ref_norm) / 2)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), float(ref_norm) / 2)
    report["norm"] = parity.assert_close(f"{name} grad norm", norm, ref_norm, TOL)
    opt.step()
    ref_opt.step()
    # AdamW's first step is lr * g / |g| per element: a gradient near 0 that differs by rounding
    # (another summation order) moves its weight by up to lr, so that weight is compared to 5% of
    # lr (as checks.hybrid does); a wrong gradient moves weights by ~lr everywhere
    step_tol = TOL if optimizer == "sgd" else (0.0, 0.05 * LR)
    report["step"] = compare(model, ref, f"{name} after one {optimizer} step", grads=False, tol=step_tol)
    # the experts gathered over TP and EP: the unsharded model's state dict, names and shapes
    full = gather_full_state_dict(model, rank0_only=rank0_only)
    expected = ref.state_dict()
    if rank0_only and ctx.rank != 0:
        assert full == {}, f"rank {ctx.rank} kept {len(full)} tensors with rank0_only"
    else:
        assert set(full) == set(expected), set(full) ^ set(expected)
        for key, t in expected.items():
            parity.assert_close(f"{name} gathered {key}", full[key], t, step_tol)
    # and back: load_full_state_dict cuts each rank's experts and TP shard of the full tensors
    torch.manual_seed(1)
    fresh, _ = ShardFormer(m.shard_config(extra_kwargs={"check_replicas": False})).optimize(
        build(arch, experts, **overrides))
    load_full_state_dict(fresh, expected)
    report["loaded"] = compare(fresh, ref, f"{name} loaded from the full state dict", grads=False, tol=(0.0, 0.0))
    if save_to is not None:         # save_pretrained gathers over EP; plain transformers loads it back
        model.save_pretrained(save_to)
        dist.barrier()
        loaded = type(ref).from_pretrained(save_to).state_dict()
        assert set(loaded) == set(expected), set(loaded) ^ set(expected)
        for key, t in expected.items():
            parity.assert_close(f"{name} saved and reloaded {key}", loaded[key], t, step_tol)
        # reading a checkpoint's slices into an EP model: refused by name (load_full_state_dict works)
        msg = parity.refused_unchanged(model, lambda: load_pretrained(model, save_to), "load_pretrained",
                                       NotImplementedError)
        assert "load_pretrained" in msg and name in msg, msg
        try:
            ShardFormer(m.shard_config()).from_pretrained(type(ref), save_to)
        except NotImplementedError as e:
            assert "from_pretrained" in str(e) and "expert" in str(e), e
        else:
            raise AssertionError("from_pretrained with an EP group was not refused")
    if optimizer == "sgd":
        with torch.no_grad():
            after, ref_after = model(**mine).logits, ref(**mine).logits
        report["after"] = parity.assert_close(f"{name} logits after the step", after, ref_after, TOL)
    report["exchanges"] = sum(mod.exchanges for mod in layers)
    report["experts_here"] = count
    return report


def lazy_equals_eager(ctx, dp: int, tp: int, ep: int, experts: int) -> dict:
    """A model built under lazy_init() and sharded with EP holds exactly the
    eager model's experts block and TP shard (every parameter)."""
    m = mesh(dp=dp, tp=tp, ep=ep)
    torch.manual_seed(0)
    with lazy_init():
        model = build("mixtral", experts)
    assert is_lazy(model.model.layers[0].mlp.experts.gate_up_proj), "lazy_init() built real experts"
    torch.manual_seed(0)
    eager = build("mixtral", experts)
    model, _ = ShardFormer(m.shard_config()).optimize(model)
    assert any(isinstance(mod, ExpertParallelExperts) for mod in model.modules())
    return {"params": compare(model, eager, "lazy_init vs eager", grads=False, tol=(0.0, 0.0))}


def refusals(ctx) -> list[str]:
    """What expert parallelism refuses, each before the model changes."""
    from shardformer.pipeline import PipelineStageManager

    m = mesh(dp=4, tp=1, ep=4)
    messages = []

    def refused(model, config, what, error=ValueError):
        message = parity.refused_unchanged(model, lambda: ShardFormer(config).optimize(model), what, error,
                                           structure=True)
        messages.append(message)
        return message

    torch.manual_seed(0)
    msg = refused(build("mixtral", 3), m.shard_config(), "3 experts over 4 EP ranks")
    assert "3 experts" in msg and "4 ranks" in msg and "MixtralForCausalLM" in msg, msg
    assert "model.layers.0.mlp.experts" in msg, msg
    msg = refused(zoo.build("LlamaForCausalLM"), m.shard_config(), "EP on a model without experts")
    assert "LlamaForCausalLM" in msg and "expert_parallel_process_group" in msg, msg
    msg = refused(build("mixtral", 4, router_jitter_noise=0.1), m.shard_config(), "router jitter")
    assert "router_jitter_noise" in msg and "MixtralForCausalLM" in msg, msg
    no_ep = ShardConfig(tensor_parallel_process_group=m.tp)
    if getattr(transformers.OlmoeConfig, "base_model_ep_plan", None):     # (transformers versions that have it)
        msg = refused(build("olmoe", 4), no_ep, "ep_router without an EP group")
        assert "'ep_router'" in msg and "model.layers.0.mlp.gate" in msg and "OlmoeForCausalLM" in msg, msg
    # pipeline stages over the EP group's own ranks: a stage's exchange would wait on the other stages
    # (EP with PP over other ranks: tests/test_combos.py)
    for kwargs, error in (({"pipeline_stage_manager": PipelineStageManager(m.dp)}, ValueError),
                          ({"enable_sequence_parallelism": True, "sequence_parallelism_mode": "all_to_all",
                            "sequence_parallel_process_group": m.dp}, NotImplementedError)):
        try:
            ShardConfig(tensor_parallel_process_group=m.tp, expert_parallel_process_group=m.ep, **kwargs)
        except error as e:
            messages.append(str(e))
        else:
            raise AssertionError(f"expert parallelism with {sorted(kwargs)} was not refused")
    try:
        ShardConfig(tensor_parallel_process_group=m.ep, expert_parallel_process_group=m.ep)
    except ValueError as e:
        messages.append(str(e))
    else:
        raise AssertionError("the TP group as EP group was not refused")
    return messages


def plain_group_needs_mesh(ctx) -> str:
    """average_gradients with the DP group alone, when EP is smaller than DP,
    asks for the mesh (expert gradients need .expert_dp)."""
    m = mesh(dp=4, tp=1, ep=2)
    torch.manual_seed(0)
    model, _ = ShardFormer(m.shard_config()).optimize(build("mixtral", 3))
    model(**batch(model.config.vocab_size, 1)).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if is_expert_param(p)}
    message = parity.refused_unchanged(model, lambda: average_gradients(model, m.dp), "average_gradients")
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters() if n in grads)
    assert "mesh" in message and "MixtralForCausalLM" in message, message
    return message


def mesh_groups(ctx, dp: int, tp: int, ep: int) -> dict:
    """mesh(ep=) cuts each DP group into blocks of ep consecutive DP ranks;
    expert_dp joins the same position of every block."""
    m = mesh(dp=dp, tp=tp, ep=ep)
    dp_ranks = m.ranks("dp")
    pos = dp_ranks.index(ctx.rank)
    block = pos // ep
    assert dist.get_process_group_ranks(m.ep) == dp_ranks[block * ep:(block + 1) * ep]
    assert dist.get_process_group_ranks(m.expert_dp) == dp_ranks[pos % ep::ep]
    config = m.shard_config()
    assert config.expert_parallel_process_group is (m.ep if ep > 1 else None)
    return {"ep": dist.get_process_group_ranks(m.ep), "expert_dp": dist.get_process_group_ranks(m.expert_dp)}
