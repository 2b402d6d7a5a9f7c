"""Rank-side checks: ranks that must agree (decoding, gradients, set-up
steps, concurrent optimize) agree or raise by name, never hang or diverge."""
from __future__ import annotations

import contextlib
import copy
import os
import threading
import time

import torch
import torch.distributed as dist

import zoo
from checks.parity import TOL, assert_close, prompt_ids
from shardformer import ShardConfig, ShardFormer

# generate() settings: greedy, sampling, top-k / top-p, beam search, sampled beams
DECODING = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=0, top_p=1.0),
    "top_k_top_p": dict(do_sample=True, top_k=20, top_p=0.9, temperature=0.7),
    "beams": dict(do_sample=False, num_beams=3),
    "beam_sample": dict(do_sample=True, num_beams=2, top_k=0),
}


def _config(ctx, default_group: bool) -> ShardConfig:
    return ShardConfig() if default_group else ShardConfig(tensor_parallel_process_group=ctx.group)


def generate_in_lockstep(ctx, name: str, default_group: bool = False) -> dict:
    """Each rank seeds its own generator (torch.manual_seed(100 + rank)); every
    decoding mode of the sharded model returns, on every rank, the tokens of
    the unsharded model's generate() seeded as rank 0 (100).  Afterwards rank
    0's generator is where the unsharded one's is; the others' are as they
    were before generate()."""
    torch.manual_seed(0)
    model = zoo.build(name).eval()
    ref = copy.deepcopy(model)
    ShardFormer(_config(ctx, default_group)).optimize(model)
    out = {}
    for mode, kwargs in DECODING.items():
        kwargs = dict(kwargs, max_new_tokens=6, pad_token_id=0)
        torch.manual_seed(100 + ctx.rank)
        before = torch.get_rng_state()
        with torch.no_grad():
            got = model.generate(prompt_ids(), **kwargs)
        after = torch.get_rng_state()
        torch.manual_seed(100)
        with torch.no_grad():
            exp = ref.generate(prompt_ids(), **kwargs)
        assert torch.equal(got, exp), f"{name} {mode}: rank {ctx.rank} decoded\n{got}\nthe unsharded model\n{exp}"
        if ctx.rank == 0:
            assert torch.equal(after, torch.get_rng_state()), f"{mode}: rank 0's generator is not where HF leaves it"
        else:
            assert torch.equal(after, before), f"{mode}: rank {ctx.rank}'s own generator state was not put back"
        out[mode] = got.tolist()
    return out


class _BanOnRank1:
    """A logits processor (HF's call signature) that bans the best token on
    global rank 1 only: the same class on every rank, different logits."""

    def __call__(self, input_ids, scores):
        if dist.get_rank() == 1:
            scores = scores.clone()
            scores[torch.arange(scores.shape[0]), scores.argmax(-1)] = -float("inf")
        return scores


def generate_diverging_refused(ctx, name: str, how: str) -> str:
    """Ranks that would decode differently raise on every rank, naming the
    ranks, instead of carrying on (or waiting on a step the others skip):
    other settings (max_new_tokens) or other prompts, refused before the
    first step; logits processed differently, stopped at the first step."""
    from transformers import LogitsProcessorList

    torch.manual_seed(0)
    model = zoo.build(name).eval()
    ShardFormer(_config(ctx, False)).optimize(model)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    prompt = prompt_ids()
    if how == "settings":
        kwargs["max_new_tokens"] = 3 if ctx.rank == 0 else 6
        expect = "different settings"
    elif how == "inputs":
        prompt = prompt_ids(seed=3 + ctx.rank)
        expect = "different inputs"
    else:
        kwargs["logits_processor"] = LogitsProcessorList([_BanOnRank1()])
        expect = "decoded different tokens"
    with torch.no_grad():
        return _raises_within(lambda: model.generate(prompt, **kwargs), 30, expect, "rank 1", "rank 0")


def grad_missing_refused(ctx, which: str) -> str:
    """A gradient None on every rank is torch's 'absent': the norm is the
    unsharded model's without it.  Present on rank 0 and None on the others
    (a replicated parameter, or a sharded one): clip_grad_norm_ raises on
    every rank naming the parameter and the ranks, and changes no gradient."""
    from shardformer.grad_norm import clip_grad_norm_, grad_norm

    names = {"replicated": "model.norm.weight", "sharded": "model.layers.0.self_attn.q_proj.weight"}
    torch.manual_seed(0)
    ref = zoo.build("LlamaForCausalLM")
    model = copy.deepcopy(ref)
    ShardFormer(_config(ctx, False)).optimize(model)
    inputs = zoo.make_inputs("LlamaForCausalLM")
    for m in (model, ref):
        m(**inputs).loss.backward()
    saved = model.get_parameter(names[which]).grad
    for m in (model, ref):
        m.get_parameter(names[which]).grad = None
    expected = torch.nn.utils.clip_grad_norm_([t for t in ref.parameters() if t.grad is not None], float("inf"))
    assert_close("norm without the gradient", grad_norm(model).float(), expected, TOL[torch.float32])
    if ctx.rank == 0:
        model.get_parameter(names[which]).grad = saved
    grads = {n: t.grad.clone() for n, t in model.named_parameters() if t.grad is not None}
    msg = _raises_within(lambda: clip_grad_norm_(model, 1e-3), 30, names[which], "ranks [0]", "none on [1")
    for n, t in model.named_parameters():
        if n in grads:
            assert torch.equal(t.grad, grads[n]), f"{n}: changed by a refused clip"
    return msg


@contextlib.contextmanager
def agree_timeout(seconds: float):
    old = os.environ.get("SHARDFORMER_AGREE_TIMEOUT_S")
    os.environ["SHARDFORMER_AGREE_TIMEOUT_S"] = str(seconds)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SHARDFORMER_AGREE_TIMEOUT_S")
        else:
            os.environ["SHARDFORMER_AGREE_TIMEOUT_S"] = old


def _raises_within(call, seconds: float, *fragments: str) -> str:
    start = time.monotonic()
    try:
        call()
    except (RuntimeError, ValueError) as e:
        took = time.monotonic() - start
        assert took < seconds, f"raised after {took:.1f} s"
        for fragment in fragments:
            assert fragment in str(e), f"{fragment!r} not in: {e}"
        return str(e)
    raise AssertionError("accepted")


def mesh_sizes_disagree(ctx) -> str:
    """Rank 0 asks for tp=2, the others for tp=4: every rank raises within
    seconds naming the ranks and the sizes; then the same call everywhere works."""
    import shardformer

    tp = 2 if ctx.rank == 0 else 4
    msg = _raises_within(lambda: shardformer.mesh(tp=tp), 20, "shardformer.mesh", "rank 0: tp=2",
                         "ranks 1, 2, 3: tp=4")
    m = shardformer.mesh(tp=2)
    assert m.sizes["tp"] == 2 and m.sizes["dp"] == 2
    return msg


def tp_and_pp_same_ranks_refused(ctx, default_group: bool) -> str:
    """A PipelineStageManager over the tensor-parallel group (or both on the
    default group) is refused by ShardConfig, naming both groups."""
    from shardformer.pipeline import PipelineStageManager

    group = None if default_group else ctx.group
    sm = PipelineStageManager(group)
    kwargs = {} if default_group else {"tensor_parallel_process_group": group}
    return _raises_within(lambda: ShardConfig(pipeline_stage_manager=sm, **kwargs), 5, "pipeline_stage_manager",
                          "tensor_parallel_process_group", f"share ranks {list(range(ctx.tp_size))}")


def stage_managers_disagree(ctx) -> str:
    """num_model_chunks 2 on rank 0, 1 on rank 1: both raise, naming the ranks."""
    from shardformer.pipeline import PipelineStageManager

    chunks = 2 if ctx.rank == 0 else 1
    return _raises_within(lambda: PipelineStageManager(ctx.group, num_model_chunks=chunks), 20,
                          "PipelineStageManager", "rank 0: num_model_chunks=2", "rank 1: num_model_chunks=1")


def optimize_disagrees(ctx) -> str:
    """parallel_output on rank 0 only: optimize() raises on both ranks before
    anything changes, naming the ranks and the switch."""
    torch.manual_seed(0)
    model = zoo.build("LlamaForCausalLM")
    names = [n for n, _ in model.named_parameters()]
    cfg = ShardConfig(tensor_parallel_process_group=ctx.group, parallel_output=ctx.rank == 0)
    msg = _raises_within(lambda: ShardFormer(cfg).optimize(model), 20, "ShardFormer.optimize",
                         "rank 0: parallel_output=True", "rank 1: parallel_output=False")
    assert [n for n, _ in model.named_parameters()] == names
    return msg


def optimize_groups_disagree(ctx) -> str:
    """Rank 0 shards over ranks [0, 1], the others over the default group
    (ranks 0-3): no rank waits past SHARDFORMER_AGREE_TIMEOUT_S; each names
    the ranks that did not come and what they called instead."""
    torch.manual_seed(0)
    model = zoo.build("LlamaForCausalLM")
    group = dist.new_group([0, 1])
    cfg = ShardConfig(tensor_parallel_process_group=group) if ctx.rank == 0 else ShardConfig()
    with agree_timeout(4):
        return _raises_within(lambda: ShardFormer(cfg).optimize(model), 20, "did not make this call within 4 s",
                              "last called ShardFormer.optimize over the group of global ranks")


def concurrent_optimize(ctx, default_group: bool = False) -> list:
    """Two threads per rank shard two copies of one model at once: both
    finish (serialized), and both equal the unsharded model."""
    torch.manual_seed(0)
    ref = zoo.build("LlamaForCausalLM").eval()
    models = [copy.deepcopy(ref) for _ in range(2)]
    errors: list = []

    def run(model):
        try:
            ShardFormer(_config(ctx, default_group)).optimize(model)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(m,), daemon=True) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "an optimize() thread is stuck"
    assert not errors, errors
    inputs = zoo.make_inputs("LlamaForCausalLM")
    inputs.pop("labels", None)
    with torch.no_grad():
        exp = ref(**inputs).logits
        return [assert_close(f"model {i}", m(**inputs).logits, exp, TOL[torch.float32]) for i, m in enumerate(models)]
