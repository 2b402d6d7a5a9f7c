"""Rank-side checks of generate() under pipeline parallelism (tests/test_pipeline_generate.py).

Reference: the unsharded HF model built from the same seed, generating on
the same left-padded prompts with the same arguments (sampling: seeded as
global rank 0 is, while each rank of the pipelined model seeds its own
generator differently)."""
from __future__ import annotations

import copy

import torch

import shardformer
from checks.pipeline import build, groups
from shardformer import ShardConfig, ShardFormer
from shardformer.pipeline import PipelineStageManager, p2p

SAMPLING = dict(do_sample=True, top_k=20, top_p=0.9, temperature=0.7)


def prompts() -> dict:
    """Three prompts of 6, 4 and 2 tokens, left-padded to 6 (pad id 0)."""
    ids = torch.randint(3, 90, (3, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    for row, pad in ((1, 2), (2, 4)):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


def _pipelined(ctx, name: str, pp: int, tp: int, layout: str, layers: int):
    """(reference, pipelined model, stage manager) in eval mode.  layout:
    "groups" (explicit TP / PP groups, checks.pipeline.groups), "default"
    (PipelineStageManager() over the world, ShardConfig's default group),
    "mesh" (shardformer.mesh(pp=, tp=).shard_config())."""
    torch.manual_seed(0)
    model = build(name, layers).eval()
    ref = copy.deepcopy(model)
    if layout == "default":
        assert tp == 1 and pp == ctx.world_size
        sm = PipelineStageManager()
        cfg = ShardConfig(pipeline_stage_manager=sm, enable_tensor_parallelism=False)
    elif layout == "mesh":
        cfg = shardformer.mesh(pp=pp, tp=tp).shard_config()
        sm = cfg.pipeline_stage_manager
    else:
        tp_group, pp_group = groups(ctx, pp, tp)
        sm = PipelineStageManager(pp_group)
        cfg = ShardConfig(tensor_parallel_process_group=tp_group, pipeline_stage_manager=sm,
                          enable_tensor_parallelism=tp > 1)
    model, _ = ShardFormer(shard_config=cfg).optimize(model)
    return ref, model, sm


def _same(got, exp, what: str, ctx):
    assert torch.equal(got, exp), f"{what}: rank {ctx.rank} decoded\n{got}\nthe unsharded model\n{exp}"


def generate_equals_unsharded(ctx, name: str, pp: int, tp: int = 1, layout: str = "groups",
                              layers: int = 4) -> dict:
    """Greedy (KV cache on and off), sampling (each rank seeded 100 + rank:
    every rank decodes what the unsharded model does seeded as the first
    rank of its pipeline: rank 0, or 2 for the second pipeline at PP=2) and eos
    stopping (every rank stops at the unsharded model's step) equal the
    unsharded model's generate() on left-padded prompts; the steps ran
    through the stages (messages sent or received on every rank)."""
    ref, model, sm = _pipelined(ctx, name, pp, tp, layout, layers)
    batch, out = prompts(), {}
    base = dict(max_new_tokens=5, pad_token_id=0)
    moved = p2p.COUNTS["sent"] + p2p.COUNTS["received"]
    for mode, kwargs in (("greedy", dict(do_sample=False)), ("greedy, no cache", dict(do_sample=False,
                                                                                     use_cache=False))):
        with torch.no_grad():
            got = model.generate(**batch, **base, **kwargs)
            exp = ref.generate(**batch, **base, **kwargs)
        _same(got, exp, f"{name} {mode}", ctx)
        out[mode] = got.tolist()
    assert p2p.COUNTS["sent"] + p2p.COUNTS["received"] > moved, "no message crossed the stages"
    out["cache"] = kv_cache_per_stage(model, sm, batch, base, out["greedy"])
    torch.manual_seed(100 + ctx.rank)
    before = torch.get_rng_state()
    with torch.no_grad():
        got = model.generate(**batch, **base, **SAMPLING)
    after = torch.get_rng_state()
    torch.manual_seed(100 + ctx.rank - ctx.rank % (pp * tp))    # the first rank of this rank's pipeline
    with torch.no_grad():
        exp = ref.generate(**batch, **base, **SAMPLING)
    _same(got, exp, f"{name} sampling", ctx)
    if ctx.rank % (pp * tp) == 0:
        assert torch.equal(after, torch.get_rng_state()), "rank 0's generator is not where HF leaves it"
    else:
        assert torch.equal(after, before), f"rank {ctx.rank}'s own generator state was not put back"
    out["sampling"] = got.tolist()
    # eos: every row's third new token ends it, so the unsharded model stops after 3 of 8 tokens
    width = batch["input_ids"].shape[1]
    eos = sorted({row[width + 2] for row in out["greedy"]})
    with torch.no_grad():
        got = model.generate(**batch, **dict(base, max_new_tokens=8), do_sample=False, eos_token_id=eos)
        exp = ref.generate(**batch, **dict(base, max_new_tokens=8), do_sample=False, eos_token_id=eos)
    _same(got, exp, f"{name} eos {eos}", ctx)
    assert got.shape[1] < width + 8, got.shape
    out["eos"] = list(got.shape)
    return out


def refusals(ctx) -> list[str]:
    """What pipelined generate() cannot do is refused by name on every rank,
    before any step runs (no message between the stages, no decoding step)."""
    from shardformer.pipeline import generate as pipeline_generate

    _, model, _ = _pipelined(ctx, "LlamaForCausalLM", 2, 1, "groups", 4)
    _, t5, _ = _pipelined(ctx, "T5ForConditionalGeneration", 2, 1, "groups", 4)
    batch = prompts()
    msgs = []
    cases = (("T5ForConditionalGeneration is an encoder-decoder model", dict(model=t5)),
             ("beam search (num_beams=2)", dict(num_beams=2)),
             ("beam sample (num_beams=2)", dict(num_beams=2, do_sample=True)),
             ("assisted generation", dict(prompt_lookup_num_tokens=2)),
             ("output_hidden_states=True", dict(output_hidden_states=True, return_dict_in_generate=True)),
             ("cache_implementation='static'", dict(cache_implementation="static")))
    for what, kwargs in cases:
        moved, steps = p2p.COUNTS["sent"] + p2p.COUNTS["received"], pipeline_generate.COUNTS["steps"]
        which = kwargs.pop("model", model)
        try:
            which.generate(**batch, max_new_tokens=2, pad_token_id=0, **kwargs)
        except NotImplementedError as e:
            text = str(e)
            assert what in text and f"{type(which).__name__}.generate" in text and "docs/pipeline.md" in text, text
            msgs.append(text)
        else:
            raise AssertionError(f"{what} was not refused")
        assert p2p.COUNTS["sent"] + p2p.COUNTS["received"] == moved and \
            pipeline_generate.COUNTS["steps"] == steps, f"{what}: something ran before the refusal"
    return msgs


def kv_cache_per_stage(model, sm, batch: dict, base: dict, greedy: list) -> dict:
    """With the KV cache, each stage's cache holds its own layers' keys and
    values only (the others' entries store nothing), and after the prompt
    only the new token's hidden states [B, 1, H] go to the next stage."""
    from shardformer.pipeline.stages import runtime_of

    sent, original = [], p2p.StageLink.send_message

    def recording(link, message, to_stage, key, input_shape=None):
        sent.append(tuple(message.shape))
        return original(link, message, to_stage, key, input_shape)

    p2p.StageLink.send_message = recording
    try:
        with torch.no_grad():
            res = model.generate(**batch, **base, do_sample=False, return_dict_in_generate=True)
    finally:
        p2p.StageLink.send_message = original
    assert res.sequences.tolist() == greedy, (res.sequences, greedy)
    rows, width = batch["input_ids"].shape
    held = runtime_of(model).plan.chunks[0]
    lengths = {}
    for i, layer in enumerate(res.past_key_values.layers):
        lengths[i] = None if layer.keys is None else layer.keys.shape[-2]
    want = {i: width + base["max_new_tokens"] - 1 if i in held else None for i in lengths}
    assert lengths == want, f"stage {sm.stage} (layers {held.start}-{held.stop - 1}): cache lengths {lengths}"
    if sm.stage < sm.num_stages - 1:
        hidden = model.config.hidden_size if hasattr(model.config, "hidden_size") else model.config.n_embd
        assert sent == [(rows, width, hidden)] + [(rows, 1, hidden)] * (base["max_new_tokens"] - 1), sent
    else:
        assert sent == [], sent
    return {"sent": sent, "cache_lengths": lengths}
