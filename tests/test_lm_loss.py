"""ShardConfig(parallel_output=True): every class with an LM head returns its
rank's vocabulary shard of the logits and computes its own loss on the
shards (shardformer.lm_loss), equal to the unsharded HF model's loss and
gradients at TP=2 and 4 (vocabularies that do not divide evenly); the C
cross-entropy is counted.  Plus HF's num_items_in_batch, tuple outputs,
eval with dropout, generate(), pipeline stages, the refusals, and the torch
halves of cross_entropy_1d used off the CPU."""
import pytest
import torch

import zoo
from checks import lm_loss as check
from checks import pipeline as pipeline_check
from shardformer import ShardConfig
from shardformer.layer import loss as L
from shardformer.lm_loss import LMLoss, declared


def _lm_classes() -> list[str]:
    """The zoo names of every registered class whose policy has an LM head (and labels to train on)."""
    import importlib

    from shardformer.autopolicy import registry

    names = set(zoo.names())
    out = []
    for key, (family, policy) in sorted(registry().items()):
        cls = getattr(importlib.import_module(f"shardformer.policies.{family}"), policy)
        name = key.rsplit(".", 1)[-1]
        if any(h.kind == "lm" for h in cls.heads) and name in names and "labels" in zoo.make_inputs(name):
            out.append(name)
    # variants: BLIP-2 around OPT (the outer model computes the loss) and around T5 (T5 does)
    return out + ["Blip2ForConditionalGeneration", "Blip2ForConditionalGeneration/t5",
                  "T5ForConditionalGeneration/v1.1", "ChatGLMForConditionalGeneration/mha"]


def _computes_own_loss(name: str) -> bool:
    """A class declared "hook" whose forward, in the installed transformers, does
    not call self.loss_function: parallel_output refuses it (tested below)."""
    import transformers

    from shardformer.lm_loss import calls_loss_function

    cls = getattr(transformers, name.split("/")[0], None)
    return cls is not None and name.split("/")[0] in HOOKED and not calls_loss_function(cls)


HOOKED = {"Blip2ForConditionalGeneration", "Gemma3ForConditionalGeneration"}
LM_CLASSES = _lm_classes()
OWN_LOSS = [n for n in LM_CLASSES if _computes_own_loss(n)]


def test_every_lm_family_is_covered():
    families = {zoo.module_of(n).__name__ for n in LM_CLASSES}
    assert len(LM_CLASSES) >= 30, LM_CLASSES
    assert {"zoo.llama_gpt2_bert", "zoo.decoders", "zoo.encoders", "zoo.vision", "zoo.gemma3mm"} <= families


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", LM_CLASSES)
def test_loss_on_vocabulary_shards(pool, name, tp):
    if name in OWN_LOSS:
        pytest.skip("this transformers computes the class's loss without self.loss_function: refused "
                    "(test_own_loss_refused)")
    pool.run(check.equals_unsharded, tp, name)


@pytest.mark.parametrize("name", OWN_LOSS or [pytest.param("none", marks=pytest.mark.skip(
    reason="every hooked class calls self.loss_function in this transformers"))])
def test_own_loss_refused(pool, name):
    """Where a class computes nn.CrossEntropyLoss itself (transformers 5.15's BLIP-2 and Gemma 3
    multimodal heads), parallel_output is refused before anything changes, naming the class."""
    msg = pool.run(check.refuses_own_loss, 2, name)[0]
    assert "parallel_output" in msg and "loss_function" in msg, msg


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "MixtralForCausalLM", "BertLMHeadModel"])
def test_num_items_in_batch(pool, name):
    """HF's gradient-accumulation divisor (a loss kwarg) is honoured: sum / num_items_in_batch."""
    pool.run(check.equals_unsharded, 2, name, 0.0, True)


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "BertForPreTraining", "T5ForConditionalGeneration",
                                  "GPT2DoubleHeadsModel"])
def test_tuple_outputs(pool, name):
    pool.run(check.equals_unsharded, 2, name, 0.0, False, False)


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "BertForMaskedLM", "T5ForConditionalGeneration",
                                  "WhisperForConditionalGeneration"])
def test_eval_with_dropout(pool, name):
    pool.run(check.equals_unsharded, 2, name, 0.1)


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_generate_gathers(pool, name):
    pool.run(check.generate_equals_unsharded, 2, name)


def test_unknown_loss_function_refused(pool):
    msg = pool.run(check.refuses_unknown_loss, 2, "LlamaForCausalLM")[0]
    assert "LlamaForCausalLM" in msg and "loss_function" in msg and "parallel_output" in msg, msg


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "BertForMaskedLM", "ChatGLMForConditionalGeneration",
                                  "Gemma3ForConditionalGeneration"])
def test_pipeline_stages(pool, name):
    """TP=2 x PP=2: the last stage's loss runs on its vocabulary shards."""
    if _computes_own_loss(name):
        pytest.skip("this transformers computes the class's loss without self.loss_function: refused "
                    "(test_own_loss_refused)")
    pool.run(pipeline_check.equals_unsharded, 4, name, 2, "1f1b", 2, 2, 1, 4, False, 4, {"parallel_output": True})


def test_gather_output_option_replaced():
    with pytest.raises(ValueError, match="parallel_output"):
        ShardConfig(extra_kwargs={"gather_output": False})
    with pytest.raises(TypeError, match="parallel_output"):
        ShardConfig(parallel_output=1)


def test_policy_data():
    from shardformer.policies import bert, t5, whisper

    assert declared(bert.BertForPreTrainingPolicy) == LMLoss("masked", ("next_sentence_label", "seq_relationship_logits"))
    assert declared(bert.BertLMHeadModelPolicy).kind == "hook"
    assert declared(t5.T5ForConditionalGenerationPolicy).kind == "seq2seq"
    assert declared(whisper.WhisperForCausalLMPolicy).kind == "masked"
    with pytest.raises(ValueError, match="kind"):
        LMLoss("shifted")
    with pytest.raises(ValueError, match="also"):
        LMLoss("hook", ("a", "b"))


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("vocab_start, vocab_real", [(0, 7), (7, 5), (14, 0)])
def test_torch_halves_equal_the_c_kernels(vocab_start, vocab_real, eps):
    """The torch halves (used for CUDA logits) give the C kernels' numbers."""
    from shardformer import ops

    g = torch.Generator().manual_seed(0)
    z = torch.randn(9, 7, generator=g) * 3
    y = torch.randint(0, 12, (9,), generator=g)
    y[2] = -100
    c = ops.xent_stats(z, y, vocab_start, vocab_real, -100, eps > 0, vocab_size=12)
    t = L.torch_xent_stats(z, y, vocab_start, vocab_real, -100, eps > 0, vocab_size=12)
    for a, b in zip(c, t):
        if a is None:
            assert b is None
        else:
            torch.testing.assert_close(b, a)
    lse = torch.randn(9, generator=g).abs() + 3
    scale = torch.rand(9, generator=g)
    scale[2] = 0
    torch.testing.assert_close(L.torch_xent_grad(z, y, vocab_start, vocab_real, -100, lse, scale, eps, 12),
                               ops.xent_grad(z, y, vocab_start, vocab_real, -100, lse, scale, eps, 12))
    with pytest.raises(IndexError):
        L.torch_xent_stats(z, torch.full((9,), 12), vocab_start, vocab_real, -100, False, vocab_size=12)


# (zoo name, num_items_in_batch, return_dict): a causal hook, a masked hook, a masked head with a
# sentence-level loss beside it (kind "masked", also=...), a seq2seq model, a tuple output
GATHERED_CASES = [("LlamaForCausalLM", True, None), ("BertForMaskedLM", False, None),
                  ("BertForPreTraining", False, None), ("T5ForConditionalGeneration", False, None),
                  ("GPT2LMHeadModel", False, False)]


@pytest.mark.parametrize("tp", [2, 4])
def test_gathered_logits_loss_on_shards(pool, tp):
    """parallel_output=False (gathered logits) called with labels: the loss on the vocabulary shards (the
    C vocabulary-parallel cross-entropy; the ledger counts its ONE collective, an all-gather of 3
    floats per row, and a single logits all-gather), the returned logits gathered off the loss path,
    loss, logits and every gradient equal to unsharded; TP=4 with the plain ShardConfig() (its group is the 4-rank world), TP=2 explicit."""
    cases = GATHERED_CASES if tp == 2 else GATHERED_CASES[:2] + GATHERED_CASES[3:4]   # CI time: 3 kinds at TP=4
    pool.run(check.gathered_loss_on_shards, tp, cases, tp == 4)


@pytest.mark.parametrize("tp", [2, 4])
def test_nan_logit_stays_nan(world_pool, tp):
    """A NaN logit column gives a NaN loss, as unsharded (checks.lm_loss.nan_logit_stays_nan)."""
    out = world_pool(tp).run(check.nan_logit_stays_nan, tp)
    assert all(o == out[0] for o in out), out
