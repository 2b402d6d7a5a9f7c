"""Sequence parallelism whose attention crosses the split: all_to_all
(Ulysses) and ring_attn (zigzag ring over the C flash kernel's LSE), for the
Llama-shaped decoder families, GPT-2, the BERT-style encoders, OPT and ViT: equal to the unsharded model (forward, loss,
every gradient, after an optimizer step) at SP=2 and 4 with TP off, and at
TP=2 x SP=2 on 4 ranks; odd lengths (padded inside), padded batches,
eval with dropout, generate(); refusals by name."""
import pytest

from checks import sequence_attention as check

MODES = ["all_to_all", "ring_attn"]
FAMILIES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
            "GlmForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM",
            "LlamaForSequenceClassification", "Qwen2ForTokenClassification", "LlamaModel", "Gemma3ForCausalLM",
            "Gemma2ForCausalLM"]
# Logit soft-capping (Gemma 2): the model's own attention after the all-to-all, the C kernel's softcap in each
# ring block.  Sliding-window layers (Gemma 3) run in both modes.
# Beyond the Llama-shaped decoders: GPT-2, the BERT-style encoders (bidirectional: padded keys masked inside), OPT, ViT.
OTHER_FAMILIES = ["GPT2LMHeadModel", "GPT2ForSequenceClassification", "BertForMaskedLM", "BertForTokenClassification",
                  "RobertaForMaskedLM", "ErnieForMaskedLM", "OPTForCausalLM", "ViTForImageClassification"]


# One test function per mode: README's support matrix has a column per function (scripts/support_matrix.py).
@pytest.mark.parametrize("name", FAMILIES + OTHER_FAMILIES)
def test_all_to_all_equals_unsharded(pool, name):
    pool.run(check.equals_unsharded, 2, name, "all_to_all", 7)       # 7 tokens: padded inside


@pytest.mark.parametrize("name", FAMILIES + OTHER_FAMILIES)
def test_ring_attn_equals_unsharded(pool, name):
    pool.run(check.equals_unsharded, 2, name, "ring_attn", 7)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sp, seq, window, padded", [(2, 7, 3, False), (4, 8, 3, False), (2, 8, 5, True),
                                                     (4, 7, 2, True)])
def test_sliding_window(pool, mode, sp, seq, window, padded):
    """Mistral with sliding_window shorter than the sequence equals the unsharded model."""
    pool.run(check.sliding_window_equals_unsharded, sp, "MistralForCausalLM", mode, window, seq, padded)


@pytest.mark.parametrize("seq, window", [(8, 2), (7, 1), (5, 2)])
def test_sliding_window_ring_skips_hops(pool, seq, window):
    """SP=4, a window within one chunk's reach (chunks of 1 row): K/V of the ranks out of every local
    query's window never travel (fewer messages than the plain ring's p-1 per forward and 2p-1 per
    backward), and the model still equals the unsharded one."""
    p = 4
    for r in pool.run(check.sliding_window_equals_unsharded, p, "MistralForCausalLM", "ring_attn", window, seq):
        passes = r["ring_passes"]
        plain = passes["forward"] * (p - 1) + passes["backward"] * (2 * p - 1)
        assert r["ring_unvisited"] > 0 and r["ring_messages"] < plain, r


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seq", [3, 6, 7])                   # 3 < 4 ranks; 6, 7 not multiples of 4 or 8
def test_sp4_odd_lengths(pool, mode, seq):
    pool.run(check.equals_unsharded, 4, "LlamaForCausalLM", mode, seq)


def test_padded_batch_every_row(pool):
    # all_to_all runs the model's own attention: even the padding rows are equal
    pool.run(check.equals_unsharded, 4, "LlamaForCausalLM", "all_to_all", 7, None, True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sp", [2, 4])
def test_padded_batch(pool, mode, sp):
    pool.run(check.padded_batch_real_rows, sp, "LlamaForCausalLM", mode)


@pytest.mark.parametrize("mode", MODES)
def test_with_all_optimizations(pool, mode):
    pool.run(check.equals_unsharded, 2, "LlamaForCausalLM", mode, 7, {"enable_all_optimization": True})


@pytest.mark.parametrize("mode", MODES)
def test_tp2_sp2(pool, mode):
    pool.run(check.tp_sp_equals_unsharded, 4, "LlamaForCausalLM", mode, 2, 7)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sp", [2, 4])
def test_rows_are_split(pool, mode, sp):
    pool.run(check.rows_are_split, sp, "LlamaForCausalLM", mode)


@pytest.mark.parametrize("mode", MODES)
def test_eval_with_dropout(pool, mode):
    pool.run(check.eval_with_dropout, 2, "LlamaForCausalLM", mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "Gemma2ForCausalLM"])
def test_generate(pool, mode, name):
    pool.run(check.generate_matches, 2, name, mode)


def test_gemma2_ring_eval_with_dropout(pool):
    pool.run(check.eval_with_dropout, 2, "Gemma2ForCausalLM", "ring_attn")


def test_cached_training_forward_refused(pool):
    pool.run(check.cached_training_forward_refused, 2, "LlamaForCausalLM", "all_to_all")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sp, seq", [(2, 7), (4, 7), (4, 8)])
def test_softcap_in_force(pool, mode, sp, seq):
    """Gemma 2 with a cap that binds (0.05: the zoo's 50 never does on a tiny model) equals the unsharded model."""
    pool.run(check.softcap_equals_unsharded, sp, "Gemma2ForCausalLM", mode, 0.05, seq)


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "Gemma2ForCausalLM"])
def test_ring_attention_dropout_training(pool, name, sp):
    """attention_dropout > 0 in training: the ring draws the kernel's mask of the whole sequence."""
    pool.run(check.ring_dropout_matches_kernel, sp, name)


def test_ring_refusals(pool):
    # a packed-sequence (4-D) mask: the ring covers causal attention with key padding and windows
    pool.run(check.ring_packed_mask_refused, 2, "LlamaForCausalLM")


def test_split_attention_refused_by_name():
    # attention outside transformers' registry (GPT-Neo, BLOOM), relative position biases (T5), shared layers (ALBERT)
    import zoo
    from shardformer import ShardConfig, ShardFormer

    for name in ("GPTNeoForCausalLM", "BloomForCausalLM", "T5ForConditionalGeneration", "AlbertForMaskedLM"):
        for mode in MODES:
            model = zoo.build(name)
            with pytest.raises(NotImplementedError, match=f"{mode}.*not available for"):
                ShardFormer(ShardConfig(**check.sp_config(mode))).optimize(model)


@pytest.mark.parametrize("mode", MODES)
def test_recorded_outputs_refused_when_split(pool, mode):
    pool.run(check.recorded_outputs_refused, 2, "LlamaForCausalLM", mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("default_group", [False, True], ids=["group", "default_group"])
def test_accumulated_forwards(pool, mode, default_group):
    # default_group: ShardConfig names no group (the world); the gradient sync must still run
    pool.run(check.accumulated_forwards, 4, "LlamaForCausalLM", mode, default_group)


@pytest.mark.parametrize("mode", MODES)
def test_sp_group_replicas_checked(pool, mode):
    pool.run(check.sp_group_replicas_checked, 4, "LlamaForCausalLM", mode)


@pytest.mark.parametrize("mode", MODES)
def test_split_attention_refuses_cross_attention_and_layerdrop(mode):
    import transformers

    from shardformer import ShardConfig, ShardFormer

    small = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=40, vocab_size=50)
    decoder = transformers.RobertaForCausalLM(transformers.RobertaConfig(**small, is_decoder=True,
                                                                         add_cross_attention=True))
    with pytest.raises(NotImplementedError, match=f"RobertaForCausalLM.*{mode}.*cross-attention"):
        ShardFormer(ShardConfig(**check.sp_config(mode))).optimize(decoder)
    opt = transformers.OPTForCausalLM(transformers.OPTConfig(hidden_size=32, num_attention_heads=2, ffn_dim=40,
                                                             num_hidden_layers=2, vocab_size=50, layerdrop=0.1,
                                                             word_embed_proj_dim=32))
    with pytest.raises(NotImplementedError, match=f"OPTForCausalLM.*{mode}.*layerdrop"):
        ShardFormer(ShardConfig(**check.sp_config(mode))).optimize(opt)
