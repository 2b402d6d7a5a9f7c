"""Rank-side checks: the ranks splitting one model are given one batch
(shardformer.input_check), and DDP spanning them is refused
(shardformer.ddp_guard), at TP=2, DP=2 x TP=2, SP and PP."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

import shardformer
from shardformer import ShardConfig, ShardFormer, data_parallel, mesh

import zoo
from checks import parity

TOL = parity.TOL[torch.float32]


def _ids(seed: int, rows: int = 2, cols: int = 7) -> torch.Tensor:
    return torch.randint(3, 90, (rows, cols), generator=torch.Generator().manual_seed(seed))


def _refused(call, *expect: str, error: type = ValueError) -> str:
    try:
        call()
    except error as e:
        message = str(e)
    else:
        raise AssertionError("not refused")
    missing = [x for x in expect if x not in message]
    assert not missing, f"the refusal does not name {missing}: {message}"
    return message


def _sampled_rows(dataset_rows: torch.Tensor, num_replicas: int, rank: int, batch: int) -> torch.Tensor:
    """The first batch a DistributedSampler(num_replicas, rank) hands this rank."""
    sampler = DistributedSampler(range(len(dataset_rows)), num_replicas=num_replicas, rank=rank, shuffle=False)
    return dataset_rows[list(sampler)[:batch]]


def tp_rows_differ(ctx, every: int = 100) -> dict:
    """TP over ctx.group: the first forward with other rows on each rank is
    refused on every rank naming the ranks and the input (model unchanged,
    a later forward on equal rows equal to the unsharded model's); with
    check_inputs_every=every, a difference is caught on call 1 + every and
    not between; every=0 never checks."""
    torch.manual_seed(0)
    model = zoo.build("LlamaForCausalLM")
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, check_inputs_every=every)).optimize(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = {}
    if every == 0:
        model(input_ids=_ids(ctx.rank))         # not checked: silently mixes the batches
        return {"checked": False}
    ranks = " vs ".join(f"ranks [{r}]" for r in range(ctx.tp_size))
    report["first"] = _refused(lambda: model(input_ids=_ids(ctx.rank)), "tensor-parallel", ranks, "'input_ids'",
                               "DistributedSampler", "Trainer", "accelerate", "shardformer.data_parallel",
                               "forward call 1")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "the refused forward changed weights"
    same = _ids(0)
    parity.check_outputs("equal rows", model(input_ids=same, labels=same), ref(input_ids=same, labels=same), TOL)
    for _ in range(every - 2):                  # calls 3 .. every: not checked
        with torch.no_grad():
            model(input_ids=_ids(ctx.rank))
    report["later"] = _refused(lambda: model(input_ids=_ids(ctx.rank), labels=same), f"forward call {every + 1}",
                               "'input_ids'")
    # labels only: the ids agree, the labels do not (the loss would mix rows)
    for _ in range(every - 1):
        with torch.no_grad():
            model(input_ids=same)
    report["labels"] = _refused(lambda: model(input_ids=same, labels=_ids(ctx.rank)), "'labels'")
    return report


def default_group_sampler(ctx) -> str:
    """ShardConfig() (TP = the whole world) with a DistributedSampler over the
    world: refused naming the ranks; with every rank on the same rows
    (num_replicas=1), the loss equals the unsharded model's."""
    torch.manual_seed(0)
    model = zoo.build("LlamaForCausalLM")
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig()).optimize(model)
    data = _ids(11, rows=8)
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = _sampled_rows(data, world, rank, 2)
    message = _refused(lambda: model(input_ids=mine, labels=mine), "tensor-parallel",
                       " vs ".join(f"ranks [{r}]" for r in range(world)))
    same = _sampled_rows(data, 1, 0, 2)
    parity.assert_close("loss on the same rows", model(input_ids=same, labels=same).loss,
                        ref(input_ids=same, labels=same).loss, TOL)
    return message


def dp_tp_sampler(ctx) -> dict:
    """DP=2 x TP=2 (mesh): a DistributedSampler over the whole world gives
    the TP pairs other rows: refused naming the pairs' ranks; sampling over
    mesh.dp only, DDP over mesh.dp (shardformer.data_parallel) trains: the
    DP-averaged loss equals the unsharded model's on the global batch."""
    m = mesh(dp=2, tp=2)
    torch.manual_seed(0)
    model = zoo.build("LlamaForCausalLM")
    ref = copy.deepcopy(model)
    ShardFormer(m.shard_config()).optimize(model)
    data = _ids(12, rows=8)
    wrong = _sampled_rows(data, 4, dist.get_rank(), 2)
    tp_ranks = m.ranks("tp")
    report = {"world": _refused(lambda: model(input_ids=wrong, labels=wrong), "tensor-parallel",
                                f"ranks [{tp_ranks[0]}] vs ranks [{tp_ranks[1]}]")}
    ddp = data_parallel(model, m)
    mine = _sampled_rows(data, m.sizes["dp"], m.coords["dp"], 2)
    loss = ddp(input_ids=mine, labels=mine).loss
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=m.dp)
    rows = torch.cat([_sampled_rows(data, 2, d, 2) for d in range(2)])
    ref_loss = (ref(input_ids=rows[:2], labels=rows[:2]).loss + ref(input_ids=rows[2:], labels=rows[2:]).loss) / 2
    report["loss"] = parity.assert_close("DP x TP loss", total / 2, ref_loss, TOL)
    return report


def sequence_parallel_rows(ctx, mode: str) -> dict:
    """Sequence parallelism over ctx.group (split_gather with TP, all_to_all
    and ring_attn alone): every rank is given the full sequence and keeps its
    part inside, so the check raises no false alarm (the output equals the
    unsharded model's, checked on every call); other rows per rank are
    refused naming the group."""
    torch.manual_seed(0)
    model = zoo.build("LlamaForCausalLM")
    ref = copy.deepcopy(model)
    cfg = ShardConfig(tensor_parallel_process_group=ctx.group, enable_tensor_parallelism=mode == "split_gather",
                      enable_sequence_parallelism=True, sequence_parallelism_mode=mode, check_inputs_every=1)
    ShardFormer(cfg).optimize(model)
    same = _ids(0, cols=9)
    parity.check_outputs(f"{mode} equal rows", model(input_ids=same, labels=same), ref(input_ids=same, labels=same),
                         TOL)
    group = "tensor-parallel" if mode == "split_gather" else "sequence-parallel"
    message = _refused(lambda: model(input_ids=_ids(ctx.rank, cols=9)), group, "'input_ids'")
    return {"message": message}


def tp_sp_world_sampler(ctx) -> str:
    """TP=2 x SP=2 (all_to_all over mesh.sp): rows from a sampler over the
    world: the check names a group whose ranks got other rows."""
    m = mesh(dp=1, tp=2, sp=2)
    torch.manual_seed(0)
    model = zoo.build("LlamaForCausalLM")
    ShardFormer(m.shard_config()).optimize(model)
    data = _ids(13, rows=8, cols=9)
    wrong = _sampled_rows(data, 4, dist.get_rank(), 2)
    return _refused(lambda: model(input_ids=wrong), "tensor-parallel")


def pipeline_rows(ctx) -> dict:
    """PP=2 x TP=2 (mesh): the schedule's step given other rows on each
    stage (the last stage's labels would not be the first stage's ids, the
    TP pairs agreeing) is refused naming the pipeline group; the same rows
    give the unsharded loss."""
    from shardformer.pipeline import OneForwardOneBackwardSchedule

    m = mesh(dp=1, pp=2, tp=2)
    torch.manual_seed(0)
    model = zoo.build("LlamaForCausalLM")
    ref = copy.deepcopy(model)
    cfg = m.shard_config()
    ShardFormer(cfg).optimize(model)
    schedule = OneForwardOneBackwardSchedule(cfg.pipeline_stage_manager, num_microbatches=2)
    mine = _ids(m.coords["pp"], rows=4)
    pp = m.ranks("pp")
    message = _refused(lambda: schedule.forward_backward_step(model, {"input_ids": mine, "labels": mine}),
                       "pipeline", f"ranks [{pp[0]}] vs ranks [{pp[1]}]")
    same = _ids(0, rows=4)
    loss = schedule.forward_backward_step(model, {"input_ids": same, "labels": same})["loss"]
    parity.assert_close("pipeline loss", loss, ref(input_ids=same, labels=same).loss, TOL)
    return {"message": message}


def vision_pixels_differ(ctx) -> str:
    """Float inputs: ViT given other pixel_values per rank is refused."""
    name = "ViTForImageClassification"
    torch.manual_seed(0)
    model = zoo.build(name)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    pixels = zoo.make_inputs(name)["pixel_values"]
    pixels = pixels + ctx.rank * 1e-3
    return _refused(lambda: model(pixel_values=pixels), "'pixel_values'", "same shapes, different values")


# ---- DDP spanning the TP ranks ----------------------------------------------------------------

def ddp_dp_tp(ctx) -> dict:
    """DP=2 x TP=2: DistributedDataParallel(model) over the world is refused
    at construction on every rank, naming the shared TP ranks and the fix,
    with every shard intact (no broadcast ran); over mesh.dp and through
    shardformer.data_parallel it is accepted."""
    from torch.nn.parallel import DistributedDataParallel

    m = mesh(dp=2, tp=2)
    torch.manual_seed(0)
    model = zoo.build("LlamaForCausalLM")
    ShardFormer(m.shard_config()).optimize(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tp = m.ranks("tp")
    report = {"world": _refused(lambda: DistributedDataParallel(model), "DistributedDataParallel over ranks [0, 1, 2, 3]",
                                f"ranks {tp} of this model's tensor-parallel group", "shardformer.data_parallel",
                                "Trainer")}
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert not changed, f"the refused DDP changed {changed}"
    world = dist.new_group(list(range(dist.get_world_size())))          # the world, as an explicit group
    report["explicit"] = _refused(lambda: DistributedDataParallel(model, process_group=world), "tensor-parallel")
    DistributedDataParallel(model, process_group=m.dp)
    data_parallel(model, m)
    return report


def ddp_pipeline(ctx) -> str:
    """PP=2 x TP=2: DDP over the pipeline group (stages hold other layers) is refused."""
    from torch.nn.parallel import DistributedDataParallel

    m = mesh(dp=1, pp=2, tp=2)
    torch.manual_seed(0)
    model = zoo.build("LlamaForCausalLM")
    ShardFormer(m.shard_config()).optimize(model)
    return _refused(lambda: DistributedDataParallel(model, process_group=m.pp), "pipeline group")


# ---- the user's own loop: torchrun-like ranks of shardformer.launch.spawn (world = 2) -----------

def _rows_dataset(rows: torch.Tensor) -> list[dict]:
    return [{"input_ids": r, "labels": r} for r in rows]


def trainers_refused(rank: int, tmp: str) -> dict:
    """TP=2 over the whole world (ShardConfig()): DistributedDataParallel
    (model), transformers.Trainer.train() and accelerate's prepare(), each
    with the real library, raise the DDP refusal before any weight changed."""
    import transformers
    from accelerate import Accelerator
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = zoo.build("LlamaForCausalLM")
    ShardFormer(ShardConfig()).optimize(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = {"ddp": _refused(lambda: DistributedDataParallel(model), "tensor-parallel group",
                           "shardformer.data_parallel")}
    args = transformers.TrainingArguments(output_dir=tmp, per_device_train_batch_size=2, max_steps=2, use_cpu=True,
                                          report_to=[], save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_rows_dataset(_ids(21, rows=8)))
    out["trainer"] = _refused(trainer.train, "DistributedDataParallel over ranks [0, 1]", "tensor-parallel group")
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out["accelerate"] = _refused(lambda: accelerator.prepare(model, optimizer), "tensor-parallel group")
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert not changed, f"the refused wrappers changed {changed}"
    return out


def torch_clip_drift(ctx, plain: bool) -> dict:
    """torch.nn.utils.clip_grad_norm_ on a sharded Llama: each rank clips by
    the norm of its own shards, so the whole copies (norm weights) drift
    apart; the next forward (call 2) raises on every rank naming them, the
    ranks and shardformer.clip_grad_norm_.  The same loop with
    shardformer.clip_grad_norm_ raises nothing over 4 steps (forward calls
    2, 3 and 5 compare) and gives the unsharded model's losses, with torch's
    clip on the unsharded model.  plain: ShardConfig() (TP = the world)."""
    torch.manual_seed(0)
    model = zoo.build("LlamaForCausalLM")
    ref = copy.deepcopy(model)
    fresh = copy.deepcopy(model)
    cfg = (lambda: ShardConfig()) if plain else (lambda: ShardConfig(tensor_parallel_process_group=ctx.group))
    ShardFormer(cfg()).optimize(model)
    ids = _ids(0, rows=2, cols=9)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(input_ids=ids, labels=ids).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)       # the norm of this rank's shards
    opt.step()
    report = {"drift": _refused(lambda: model(input_ids=ids, labels=ids), "forward call 2",
                                        "'model.layers.0.input_layernorm.weight'", "torch.nn.utils.clip_grad_norm_",
                                        "shardformer.clip_grad_norm_", "docs/training.md",
                                        " vs ".join(f"ranks [{r}]" for r in range(ctx.tp_size)), error=RuntimeError)}
    ShardFormer(cfg()).optimize(fresh)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (fresh, ref)]
    for step in range(4):
        losses = []
        for m, o in zip((fresh, ref), opts):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            (shardformer.clip_grad_norm_(m, 0.05) if m is fresh else torch.nn.utils.clip_grad_norm_(m.parameters(),
                                                                                                   0.05))
            o.step()
            o.zero_grad()
            losses.append(loss.detach())
        parity.assert_close(f"loss at step {step}", losses[0], losses[1], TOL)
    return report

