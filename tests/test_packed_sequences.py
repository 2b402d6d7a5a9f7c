"""Packed sequences (position_ids restarting or jumping, no attention_mask)
in every staged or split forward: logits, loss and every gradient equal the
unsharded HF model called the same way.  transformers masks the documents
block-diagonally only without a KV cache; the unsharded model makes one by
default (config.use_cache), so by default it masks causally across them, and
with use_cache=False (or gradient checkpointing in training) per document.
Pipeline stages and split forwards run without a cache: the decision is
taken on the user's call (shardformer.packing); ring_attn applies the
block-diagonal mask block by block.  SP ranks given different sequence
lengths raise, naming them."""
import pytest

from checks import packed as check

KINDS = ["packed", "gaps"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sp", [2, 4])
def test_sp_modes_equal_unsharded(pool, sp, kind):
    """split_gather, all_to_all, ring_attn at SP=sp: default use_cache, then use_cache=False."""
    pool.run(check.sp_modes_equal_unsharded, sp, "LlamaForCausalLM", kind)


def test_sp_modes_other_family(pool):
    pool.run(check.sp_modes_equal_unsharded, 2, "Qwen2ForCausalLM", "packed")


@pytest.mark.parametrize("arch", ["Olmo2", "Ministral"])
def test_sp_modes_derived_plan(pool, arch):
    """Architectures sharded by a policy derived from their TP plan (Ministral: sliding and full layers)."""
    pool.run(check.sp_modes_equal_unsharded, 2, f"derived:{arch}", "packed")


def test_sp_modes_checkpointing(pool):
    """Gradient checkpointing in training: the unsharded model drops its cache and masks per document."""
    pool.run(check.sp_modes_equal_unsharded, 2, "LlamaForCausalLM", "gaps", explicit=False, checkpointing=True)


def test_sp_modes_eval_default_group(pool):
    """eval under no_grad, ShardConfig() over the world (4 ranks); use_cache default, False and True."""
    pool.run(check.sp_modes_equal_unsharded, 4, "LlamaForCausalLM", "packed", training=False, default_group=True)


def test_tp_sp(pool):
    """TP=2 x SP=2 on 4 ranks (split_gather: TP and SP over the 4 ranks)."""
    pool.run(check.sp_modes_equal_unsharded, 4, "LlamaForCausalLM", "gaps", tp=2, explicit=False)


@pytest.mark.parametrize("schedule, chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_pipeline_schedules(pool, schedule, chunks):
    """PP=2 (two pipelines of 2 stages on 4 ranks): default use_cache, then use_cache=True / False in the batch."""
    pool.run(check.pipeline_variants_equal_unsharded, 4, "LlamaForCausalLM", schedule, "packed",
             [(None, False), (True, False), (False, False)], chunks=chunks)


def test_pipeline_gaps_other_family(pool):
    """Qwen2 with gaps; then gradient checkpointing in training (the unsharded model drops its cache)."""
    pool.run(check.pipeline_variants_equal_unsharded, 4, "Qwen2ForCausalLM", "1f1b", "gaps",
             [(None, False), (None, True)])


@pytest.mark.parametrize("sp_mode", ["all_to_all", "split_gather", "ring_attn"])
def test_pipeline_times_sp(pool, sp_mode):
    """PP=2 x SP=2 on 4 ranks: default use_cache, then use_cache=False in the batch."""
    pool.run(check.pipeline_variants_equal_unsharded, 4, "LlamaForCausalLM", "1f1b", "packed",
             [(None, False), (False, False)], sp_mode=sp_mode, tp=2)


@pytest.mark.parametrize("mode", ["ring_attn", "all_to_all"])
def test_sp_lengths_disagree(pool, mode):
    """7 tokens on one SP rank, 8 on the other."""
    pool.run(check.sp_lengths_disagree, 2, "LlamaForCausalLM", mode)
