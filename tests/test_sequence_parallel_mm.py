"""Sequence parallelism for the multimodal models and ChatGLM2: Gemma 3
multimodal and BLIP-2 split their language model's sequence (the vision
tower / Q-Former unsplit), with that language family's modes; equal to the
unsharded model (forward, loss, every gradient, after an optimizer step) at
SP=2 and 4 (TP=2 and 4 for split_gather), odd lengths (padded inside),
eval with dropout, generate(); the modes that cannot apply refused by name,
the model unchanged."""
import pytest

from checks import sequence_mm as check

GEMMA3 = ["Gemma3ForConditionalGeneration", "Gemma3Model", "Gemma3ForSequenceClassification"]
BLIP2 = ["Blip2ForConditionalGeneration", "Blip2Model"]
BLIP2_T5 = ["Blip2ForConditionalGeneration/t5"]
SPLIT_GATHER = GEMMA3 + BLIP2 + BLIP2_T5
ALL_TO_ALL = GEMMA3 + BLIP2
RING = BLIP2
# odd lengths: Gemma 3's prompt cut to 9 of 10 tokens (images whole); BLIP-2's is 4 queries + 5 text = 9
SEQ = {"Gemma3ForConditionalGeneration": 9, "Gemma3Model": 9, "Gemma3ForSequenceClassification": 9}


# One test function per mode: README's support matrix has a column per function (scripts/support_matrix.py).
@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("name", SPLIT_GATHER)
def test_sp_mm_equals_unsharded(pool, name, sp):
    pool.run(check.mm_equals_unsharded, sp, name, "split_gather", SEQ.get(name))


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("name", ALL_TO_ALL)
def test_all_to_all_mm_equals_unsharded(pool, name, sp):
    pool.run(check.mm_equals_unsharded, sp, name, "all_to_all", SEQ.get(name))


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("name", RING)
def test_ring_attn_mm_equals_unsharded(pool, name, sp):
    pool.run(check.mm_equals_unsharded, sp, name, "ring_attn", SEQ.get(name))
