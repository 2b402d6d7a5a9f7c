"""Sequence parallelism for the multimodal models and ChatGLM2: Gemma 3
multimodal and BLIP-2 split their language model's sequence (the vision
tower / Q-Former unsplit), with that language family's modes; ChatGLM2
([S, B, H]: split along dimension 0) takes split_gather, all_to_all and
ring_attn (split at its CoreAttention), SAM's vision encoder (the patch
grid split by rows) split_gather.  Every case is equal to the
unsharded model (forward, loss, every gradient, after an optimizer step) at
SP=2 and 4 (TP=2 and 4 for split_gather), odd lengths (padded inside),
eval with dropout, generate(); the modes that cannot apply refused by name,
the model unchanged."""
import pytest

from checks import sequence_mm as check
from checks.sequence_attention import tp_sp_equals_unsharded, training_dropout_masks

GEMMA3 = ["Gemma3ForConditionalGeneration", "Gemma3Model", "Gemma3ForSequenceClassification"]
BLIP2 = ["Blip2ForConditionalGeneration", "Blip2Model"]
BLIP2_T5 = ["Blip2ForConditionalGeneration/t5"]
CHATGLM2 = ["ChatGLMForConditionalGeneration", "ChatGLMModel"]
SAM = ["SamVisionModel", "SamModel"]
SPLIT_GATHER = GEMMA3 + BLIP2 + BLIP2_T5 + CHATGLM2 + SAM
# BLIP-2 without a language model (split_gather and overlap): the vision encoder's 17 patch tokens and the
# Q-Former's [queries; text] split in one pool call for all classes (the test id names each, for the matrix):
# retrieval with image-text matching (4 queries + 5 text tokens in one sequence) and contrastive ("/itc": the
# queries and the text in two Q-Former calls), Blip2QFormerModel with 3 queries
BLIP2_PARTS = ["Blip2VisionModel", "Blip2VisionModelWithProjection", "Blip2QFormerModel", "Blip2ForImageTextRetrieval",
               "Blip2ForImageTextRetrieval/itc", "Blip2TextModelWithProjection"]
BLIP2_PARTS_ID = "-".join(BLIP2_PARTS)
PARTS = pytest.param(BLIP2_PARTS_ID, id=BLIP2_PARTS_ID)
ALL_TO_ALL = GEMMA3 + BLIP2 + BLIP2_T5 + CHATGLM2
RING = BLIP2 + BLIP2_T5 + CHATGLM2
# odd lengths: Gemma 3's prompt cut to 9 of 10 tokens (images whole); BLIP-2's is 4 queries + 5 text = 9
# ChatGLM2's 8 cut to 7
SEQ = {"Gemma3ForConditionalGeneration": 9, "Gemma3Model": 9, "Gemma3ForSequenceClassification": 9,
       "ChatGLMForConditionalGeneration": 7, "ChatGLMModel": 7}


# ChatGLM2's all_to_all / ring_attn: split at its CoreAttention (policies/chatglm2.py's seam), [S, B, H] layout
CHATGLM2_SPLIT = [("ChatGLMForConditionalGeneration", m) for m in ("all_to_all", "ring_attn")]
# every mode each LM takes (Gemma 3 multimodal's ring_attn: test_mm_refused)
PADDED = [(n, m) for n in ("Gemma3ForConditionalGeneration", "Blip2ForConditionalGeneration")
          for m in ("split_gather", "all_to_all")] + [("Blip2ForConditionalGeneration", "ring_attn")]


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("name,mode", PADDED, ids=[f"{n}-{m}" for n, m in PADDED])
def test_mm_padded_batch(pool, name, mode, sp):
    pool.run(check.mm_equals_unsharded, sp, name, mode, SEQ.get(name), None, 2)


# ChatGLM2's GLMBlock gathers its [S/p, B, H] rows along dimension 0: one overlapped pass per block
# (self_attention: query_key_value; mlp: dense_h_to_4h) and layer, in 2 forwards and 1 backward (2 layers);
# SAM's vision layers project the grid rows by attn.qkv as they arrive, then cut the projected grid into
# windows (layer 0 windowed, layer 1 global): one pass per layer
OVERLAP_PASSES = {**{name: 3 * 2 * 2 for name in CHATGLM2}, **{name: 3 * 2 for name in SAM}}


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("name", GEMMA3 + BLIP2 + BLIP2_T5 + CHATGLM2 + SAM + [PARTS])
def test_sp_overlap_mm_equals_unsharded(pool, name, sp):
    if name == BLIP2_PARTS_ID:      # the gathering layers' overlapped passes counted inside
        pool.run(check.blip2_parts_equal_unsharded, sp, BLIP2_PARTS, True, sp == 4)
        return
    results = pool.run(check.mm_equals_unsharded, sp, name, "split_gather", SEQ.get(name), None, 0,
                       {"enable_sequence_overlap": True})
    assert all(r["overlapped"] > 0 for r in results) or results[0]["backend"] != "shm"
    if name in OVERLAP_PASSES and results[0]["backend"] == "shm":
        assert all(r["overlapped"] == OVERLAP_PASSES[name] for r in results), (name, results)


# fused norms on the local rows, the C attention where the family takes it
ALL_OPT = [(n, "split_gather") for n in ("Gemma3ForConditionalGeneration", "Blip2ForConditionalGeneration",
                                         "ChatGLMForConditionalGeneration", "SamModel")] + [
    (n, "all_to_all") for n in ("Gemma3ForConditionalGeneration", "Blip2ForConditionalGeneration")] + [
    ("Blip2ForConditionalGeneration", "ring_attn")]


@pytest.mark.parametrize("name,mode", ALL_OPT, ids=[f"{n}-{m}" for n, m in ALL_OPT])
def test_mm_with_all_optimizations(pool, name, mode):
    pool.run(check.mm_equals_unsharded, 2, name, mode, SEQ.get(name), None, 0, {"enable_all_optimization": True})


# TP over {0,1},{2,3} and the sequence split over {0,2},{1,3} (checks.sequence_attention.tp_sp_equals_unsharded)
HYBRID = [m for m in PADDED if m[1] != "split_gather"] + CHATGLM2_SPLIT


@pytest.mark.parametrize("name,mode", HYBRID, ids=[f"{n}-{m}" for n, m in HYBRID])
def test_mm_tp2_sp2(pool, name, mode):
    pool.run(tp_sp_equals_unsharded, 4, name, mode, 2)


# output_hidden_states: the language model's recorded states gathered to the full sequence
HIDDEN_EQUAL = PADDED + [("Blip2ForConditionalGeneration/t5", "split_gather")]


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("name,mode", HIDDEN_EQUAL, ids=[f"{n}-{m}" for n, m in HIDDEN_EQUAL])
def test_mm_hidden_states_equal(pool, name, mode, sp):
    pool.run(check.mm_hidden_states_equal, sp, name, mode)


# SAM's vision layers run on grid rows that its recorded states do not gather: refused
HIDDEN = [("SamVisionModel", "split_gather", ("call", "config")), ("SamModel", "split_gather", ("call",))]


@pytest.mark.parametrize("name,mode,hows", HIDDEN, ids=[f"{n}-{m}" for n, m, _ in HIDDEN])
def test_mm_hidden_states_refused(pool, name, mode, hows):
    pool.run(check.mm_hidden_states_refused, 2, name, mode, hows)


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("mode", ["split_gather", "all_to_all"])
def test_gemma3_image_blocks(pool, mode, sp):
    pool.run(check.gemma3_image_blocks_equal, sp, "Gemma3ForConditionalGeneration", mode, 9)


# SAM's patch grid of 3 x 3 (a 24-pixel image in 8-pixel patches): 3 rows over 2 or 4 ranks, padded inside;
# window_size 2 pads the grid to windows inside HF's layer too
# (overlap: the projected grid padded to windows with qkv's bias rows, as the zero rows HF pads with project)
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("sp", [2, 4])
def test_sp_sam_odd_grid(pool, sp, overlap):
    results = pool.run(check.mm_equals_unsharded, sp, "SamVisionModel", "split_gather", None, {"image_size": 24}, 0,
                       {"enable_sequence_overlap": overlap})
    if overlap and results[0]["backend"] == "shm":
        assert all(r["overlapped"] == OVERLAP_PASSES["SamVisionModel"] for r in results), results


# One test function per mode: docs/supported-models.md's support matrix has a column per function (scripts/support_matrix.py).
@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("name", SPLIT_GATHER + [PARTS])
def test_sp_mm_equals_unsharded(pool, name, sp):
    if name == BLIP2_PARTS_ID:      # every class in one call: TP=4 with the plain ShardConfig, TP=2 with a group;
        # at TP=4 the same call checks that split_gather with pipeline stages is refused (checks.sequence_mm)
        pool.run(check.blip2_parts_equal_unsharded, sp, BLIP2_PARTS, False, sp == 4)
        return
    pool.run(check.mm_equals_unsharded, sp, name, "split_gather", SEQ.get(name))


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("name", ALL_TO_ALL)
def test_all_to_all_mm_equals_unsharded(pool, name, sp):
    pool.run(check.mm_equals_unsharded, sp, name, "all_to_all", SEQ.get(name))


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("name", RING)
def test_ring_attn_mm_equals_unsharded(pool, name, sp):
    pool.run(check.mm_equals_unsharded, sp, name, "ring_attn", SEQ.get(name))


EVAL = [(n, m) for n in ("Gemma3ForConditionalGeneration", "Blip2ForConditionalGeneration")
        for m in ("split_gather", "all_to_all")] + [("ChatGLMForConditionalGeneration", "split_gather"),
                                                   ("SamModel", "split_gather")] + CHATGLM2_SPLIT


@pytest.mark.parametrize("name,mode", EVAL, ids=[f"{n}-{m}" for n, m in EVAL])
def test_mm_eval_with_dropout(pool, name, mode):
    pool.run(check.mm_eval_with_dropout, 2, name, mode)


# every mode each model takes (the others: test_mm_refused)
GENERATE = [(n, m) for n in ("Gemma3ForConditionalGeneration", "Blip2ForConditionalGeneration")
            for m in ("split_gather", "all_to_all")] + [
    ("Blip2ForConditionalGeneration", "ring_attn"), ("Blip2ForConditionalGeneration/t5", "split_gather"),
    ("ChatGLMForConditionalGeneration", "split_gather")] + CHATGLM2_SPLIT


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("name,mode", GENERATE, ids=[f"{n}-{m}" for n, m in GENERATE])
def test_mm_generate(pool, name, mode, sp):
    tokens = pool.run(check.mm_generate_matches, sp, name, mode)
    assert all(t == tokens[0] for t in tokens)
    assert len({t for row in tokens[0] for t in row[-5:]}) > 1, tokens[0]     # not one id repeated


@pytest.mark.parametrize("name,mode,what", [
    ("Gemma3ForConditionalGeneration", "ring_attn", "model.language_model"),
    ("Gemma3Model", "ring_attn", "token_type_ids"),
    ("Blip2VisionModel", "all_to_all", "vision_model / qformer"),
    ("Blip2ForImageTextRetrieval", "all_to_all", "has none"),
    ("Blip2QFormerModel", "ring_attn", "vision_model / qformer"),
])
def test_mm_refused(pool, name, mode, what):
    pool.run(check.mm_refused, 2, name, mode, what)


@pytest.mark.parametrize("name,mode", CHATGLM2_SPLIT, ids=[f"{n}-{m}" for n, m in CHATGLM2_SPLIT])
def test_chatglm2_training_dropout_masks(pool, name, mode):
    # hidden_dropout on this rank's rows: a different mask per rank (the per-rank stream of the split layers)
    pool.run(training_dropout_masks, 2, name, mode)


@pytest.mark.parametrize("name,mode,what,overrides", [
    ("ChatGLMForConditionalGeneration", "split_gather", "add_bias_linear=True", {"add_bias_linear": True}),
    ("SamModel", "all_to_all", "vision_encoder.layers.*.attn", None),
    ("SamVisionModel", "ring_attn", "decomposed relative positions", None),
])
def test_chatglm2_sam_refused(pool, name, mode, what, overrides):
    pool.run(check.mm_refused, 2, name, mode, what, overrides)
