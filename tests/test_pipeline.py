"""Pipeline parallelism (shardformer.pipeline): GPipe, 1F1B and interleaved
1F1B, at PP=2 and 4 and TP=2 x PP=2 on 4 ranks.  The full-batch loss of one
forward_backward_step and the full state dict after one SGD step equal the
unsharded HF model's (4 layers, same seed); messages between stages are
counted.  Plus the schedules' step order, inference on every rank, eval with
dropout, uneven stage sizes, and the refusals."""
import itertools

import pytest

import zoo
from checks import pipeline as check
from shardformer.pipeline import schedule as S

# Every class of every family whose policy sets a pipeline_split (the zoo builds them all).
PIPELINED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "glm", "phi3", "mixtral", "gpt2",
             "gpt_neo", "gptj", "bloom", "falcon", "opt", "bert", "roberta", "ernie", "albert", "vit", "beit",
             "t5", "whisper", "chatglm2")
# Families whose stack is a vision encoder (SAM: the neck, prompt encoder and mask decoder on the last stage).
PIPELINED_VISION = ("sam", "blip2")
# Gemma 3's multimodal classes: the text model's layers split, the vision tower on every stage (test_gemma3_multimodal_*).
# ChatGLM2: a forward looping over a layer count (test_chatglm2_*).
# BEiT's segmentation head reads several layers' hidden states: they travel in the messages (StageSplit.reads).
FAMILIES = [c for f in PIPELINED + PIPELINED_VISION for c in zoo.family_classes()[f]]


# One test function per schedule: docs/supported-models.md's support matrix has a column per function (scripts/support_matrix.py).
@pytest.mark.compat_covered_by("test_1f1b_equals_unsharded")    # the same stage forwards, scheduled otherwise
@pytest.mark.parametrize("name", FAMILIES)
def test_gpipe_equals_unsharded(pool, name):
    pool.run(check.equals_unsharded, 4, name, 2, "gpipe", 2)                  # two pipelines of 2 stages


@pytest.mark.parametrize("name", FAMILIES)
def test_1f1b_equals_unsharded(pool, name):
    pool.run(check.equals_unsharded, 4, name, 2, "1f1b", 4, 2)               # TP=2 x PP=2, 4 micro-batches


@pytest.mark.compat_covered_by("test_1f1b_equals_unsharded")    # the same HF layers, in two chunks per rank
@pytest.mark.parametrize("name", FAMILIES)
def test_interleaved_equals_unsharded(pool, name):
    pool.run(check.equals_unsharded, 4, name, 2, "interleaved", 2, 1, 2)     # 2 chunks per rank


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_pp4(pool, schedule, m):
    report = pool.run(check.equals_unsharded, 4, "LlamaForCausalLM", 4, schedule, m)
    assert all(r["sent"] > 0 for r in report)


@pytest.mark.parametrize("pp, m", [(4, 4), (2, 4)])
def test_pp_interleaved_sizes(pool, pp, m):
    pool.run(check.equals_unsharded, 4, "LlamaForCausalLM", pp, "interleaved", m, 1, 2, 8)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_tp2_pp2(pool, schedule):
    chunks = 2 if schedule == "interleaved" else 1
    pool.run(check.equals_unsharded, 4, "GPT2LMHeadModel", 2, schedule, 2, 2, chunks)   # tied embeddings too


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM"])
@pytest.mark.parametrize("tp", [1, 2])
def test_with_all_optimizations(pool, name, tp):
    """Fused norms, fused activations and flash attention inside the stages (kernel calls counted)."""
    pool.run(check.equals_unsharded, 4, name, 2, "1f1b", 2, tp, 1, 4, False, 4, {"enable_all_optimization": True})


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_uneven_labels(pool, schedule):
    """Micro-batches with different counts of labelled tokens: num_items_in_batch keeps the full-batch mean."""
    pool.run(check.equals_unsharded, 4, "LlamaForCausalLM", 2, schedule, 4, 1, 1, 4, True)


@pytest.mark.parametrize("counts", [(1, 3), (3, 1), (1, 2, 1, 2)])
def test_num_layers_per_stage(pool, counts):
    pool.run(check.uneven_layers, 4, counts)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, tp", [(2, 1), (4, 1), (2, 2)])
def test_inference_on_every_rank(pool, schedule, pp, tp):
    pool.run(check.inference_on_every_rank, 4, "LlamaForCausalLM", pp, tp, schedule)


def test_eval_with_dropout(pool):
    pool.run(check.inference_on_every_rank, 4, "GPT2LMHeadModel", 2, 1, "1f1b", 0.3)
    assert all(pool.run(check.training_dropout_differs, 4, "LlamaForCausalLM"))


@pytest.mark.parametrize("pp, tp", [(2, 1), (2, 2)])
def test_load_full_state_dict(pool, pp, tp):
    pool.run(check.load_full_round_trip, 4, "GPT2LMHeadModel", pp, tp)


# Encoder-decoder families: the stages split [encoder layers | decoder layers] (single-stack classes: one).
ENC_DEC = [c for f in ("t5", "whisper") for c in zoo.family_classes()[f]]
ONE_STACK = ("T5EncoderModel", "T5ForTokenClassification", "WhisperForCausalLM", "WhisperForAudioClassification")
TWO_STACKS = [c for c in ENC_DEC if c not in ONE_STACK]
PLAIN_MESSAGES = ("WhisperForCausalLM", "WhisperForAudioClassification")    # one stack, nothing carried


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("name", ENC_DEC)
def test_encdec_pp4_boundary_on_stage_edge(pool, name, schedule):
    """PP=4, one layer per stage: the encoder ends on stage 1's edge (stage 2 gets (encoder output,) and
    runs the decoder from its embeddings); T5's position biases travel in tuple messages (counted)."""
    report = pool.run(check.equals_unsharded, 4, name, 4, schedule, 2)
    assert all((r["tuples"] > 0) == (name not in PLAIN_MESSAGES) for r in report), report


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
@pytest.mark.parametrize("name", TWO_STACKS)
def test_encdec_boundary_inside_a_stage(pool, name, schedule):
    """3 encoder + 3 decoder layers; the boundary inside a stage: PP=4 (2, 2, 1, 1): stage 1 holds encoder
    layer 2 and decoder layer 0 (enters mid-encoder, leaves mid-decoder); interleaved PP=2 x 2 chunks
    (2, 2, 1, 1): chunk 0 of stage 1 holds encoder layer 2 and decoder layer 0, and the tied embedding is
    held by stage 1 (decoder embeddings, LM head) and, for T5, stage 0 (the encoder's)."""
    pp, chunks = (4, 1) if schedule == "1f1b" else (2, 2)
    report = pool.run(check.equals_unsharded, 4, name, pp, schedule, 4 if pp == 2 else 2, 1, chunks, 6,
                      num_layers_per_stage=(2, 2, 1, 1), encoder_layers=3)
    assert all(r["tuples"] > 0 for r in report), report


@pytest.mark.parametrize("name", ["T5ForConditionalGeneration", "WhisperForConditionalGeneration"])
@pytest.mark.parametrize("pp, tp", [(2, 1), (4, 1), (2, 2)])
def test_encdec_inference_on_every_rank(pool, name, pp, tp):
    """schedule.forward() in eval mode with dropout 0.3 configured: the logits on every rank."""
    pool.run(check.inference_on_every_rank, 4, name, pp, tp, "1f1b", 0.3)


@pytest.mark.parametrize("name", ["T5ForConditionalGeneration", "WhisperForConditionalGeneration"])
@pytest.mark.parametrize("pp, tp", [(2, 1), (4, 1), (2, 2)])
def test_encdec_from_pretrained(pool, tmp_path, name, pp, tp):
    """Each stage loads its part of a checkpoint; T5's shared embedding is stored once and read by the
    encoder's, the decoder's and the LM head's stages."""
    pool.run(check.from_pretrained_encdec, 4, name, pp, tp, str(tmp_path / name))


def test_encoder_decoder_refusals(pool):
    pool.run(check.encoder_decoder_refusals, 4)


def test_refusals(pool):
    pool.run(check.refusals, 4)


def test_replicas_must_agree(pool):
    pool.run(check.replicas_must_agree, 4)


# ---- the schedules' step order (no processes) ------------------------------------------

def _in_flight(steps) -> int:
    live = peak = 0
    for kind, _, _ in steps:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.transformers_independent      # the schedules' step lists alone
@pytest.mark.parametrize("steps_of, v", [(S._gpipe_steps, 1), (S._one_f_one_b_steps, 1), (S._interleaved_steps, 2),
                                         (S._interleaved_steps, 3)])
@pytest.mark.parametrize("p, m", [(1, 1), (2, 1), (2, 4), (3, 6), (4, 4), (4, 8), (4, 3)])
def test_plan_runs_every_step_once(steps_of, v, p, m):
    if steps_of is S._interleaved_steps and m % p:
        pytest.skip("interleaved needs m to be a multiple of p")
    plan = S._plan(steps_of, p, v, m, True)
    for s in range(p):
        compute = [st for st in plan[s] if st[0] in "FB"]
        expected = {(k, c, i) for k in "FB" for c in range(v) for i in range(m)}
        assert sorted(compute) == sorted(expected)
        assert len(compute) == len(expected)
    # every message is sent once and received once, in the same global order on both ends
    sends = [(s, st[1], st[2]) for s in range(p) for st in plan[s] if st[0] == "send"]
    recvs = [(st[1], s, st[2]) for s in range(p) for st in plan[s] if st[0] == "recv"]
    assert sorted(sends) == sorted(recvs)
    for a, b in itertools.combinations(range(p), 2):
        ab = [st[2] for st in plan[a] if st[0] in ("send", "recv") and st[1] == b]
        ba = [st[2] for st in plan[b] if st[0] in ("send", "recv") and st[1] == a]
        assert ab == ba, (a, b)


@pytest.mark.transformers_independent      # the schedules' step lists alone
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 4)])
def test_1f1b_holds_fewer_activations_than_gpipe(p, m):
    for s in range(p):
        assert _in_flight(S._gpipe_steps(s, p, 1, m)) == m
        assert _in_flight(S._one_f_one_b_steps(s, p, 1, m)) == min(p - s, m)


@pytest.mark.transformers_independent      # the schedules' step lists alone
def test_stage_manager_layer_split():
    from shardformer.pipeline import PipelineStageManager

    sm = PipelineStageManager()                      # no torch.distributed: one stage
    assert sm.num_stages == 1 and sm.distribute_layers(5) == [5]
    sm.num_stages = 4                                # the arithmetic alone
    assert sm.distribute_layers(10) == [2, 3, 3, 2]  # remainder to the middle stages
    assert sm.distribute_layers(9) == [2, 3, 2, 2]
    with pytest.raises(ValueError, match="3 layers cannot be split over 4 pipeline stages"):
        sm.distribute_layers(3)
    with pytest.raises(ValueError, match="num_model_chunks"):
        PipelineStageManager(num_model_chunks=0)
    with pytest.raises(ValueError, match="num_layers_per_stage"):
        PipelineStageManager(num_layers_per_stage=[1, 2])


@pytest.mark.parametrize("pp, tp, tied", [(2, 1, False), (2, 2, False), (4, 1, False), (2, 1, True), (2, 2, True)])
def test_from_pretrained_loads_each_stage(pool, tmp_path, pp, tp, tied):
    """tied: the checkpoint stores the LM head only as the input embedding; the last stage reads it from there."""
    report = pool.run(check.from_pretrained_stages, 4, pp, tp, str(tmp_path / "llama"), tied)
    assert all(r["fraction"] < 0.75 for r in report), report


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "T5ForConditionalGeneration",
                                  "WhisperForConditionalGeneration"])
def test_gradient_checkpointing(pool, name, reentrant):
    pool.run(check.checkpointed_equals_unsharded, 4, name, 2, 1, reentrant)


@pytest.mark.transformers_independent      # the schedules' step lists alone
@pytest.mark.parametrize("steps_of, v", [(S._gpipe_steps, 1), (S._one_f_one_b_steps, 1), (S._interleaved_steps, 2)])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8)])
def test_plan_sends_each_output_as_it_is_made(steps_of, v, p, m):
    """Every activation / gradient is sent right after the step that made it
    (the tick's other sends may come between), so the next stage can start
    while this one goes on: the stages overlap."""
    plan = S._plan(steps_of, p, v, m, True)
    for s in range(p):
        steps = plan[s]
        for k, step in enumerate(steps):
            if step[0] not in "FB":
                continue
            kind, c, i = step
            vs = c * p + s
            if (kind == "F" and vs < p * v - 1) or (kind == "B" and vs > 0):
                msg = ("act", vs, i) if kind == "F" else ("grad", vs, i)
                rest = steps[k + 1:]
                nxt = next(j for j, st in enumerate(rest) if st[0] in "FB") if any(st[0] in "FB" for st in rest) \
                    else len(rest)
                assert any(st[0] in ("send", "local") and st[2] == msg for st in rest[:nxt]), (s, step)


@pytest.mark.parametrize("pp, tp, schedule", [(2, 1, "gpipe"), (2, 2, "1f1b"), (4, 1, "1f1b")])
def test_custom_policy(pool, pp, tp, schedule):
    """docs/pipeline.md's one line of data for a user's own Policy."""
    pool.run(check.custom_policy_equals_unsharded, 4, pp, tp, schedule)


# Sequence parallelism inside the stages, on 4 ranks: two stages of 2 ranks; split_gather with TP=2 over
# each stage's pair, all_to_all / ring_attn over the pair with TP off.  7 tokens (padded inside); a later
# stage receives only this rank's rows of the previous stage's output (checked), and learns the sequence
# length from the first stage's layer-input shape that travels in the message header.
LM_CLASSES = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration")   # the first one per family
SP_PIPELINED = [next(c for c in zoo.family_classes()[f] if c.endswith(LM_CLASSES))
                for f in PIPELINED if f not in ("vit", "beit", "t5", "whisper")]   # T5 and Whisper: below
                                                                            # (test_encdec_sequence_parallel_*)
SPLIT_ATTENTION = ["LlamaForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
                   "MixtralForCausalLM", "GPT2LMHeadModel", "OPTForCausalLM", "BertForMaskedLM", "AlbertForMaskedLM",
                   "ChatGLMForConditionalGeneration"]


@pytest.mark.parametrize("name", SP_PIPELINED)
def test_split_gather_in_stages(pool, name):
    pool.run(check.equals_unsharded, 4, name, 2, "1f1b", 2, 2, 1, 4, False, 4, None, "split_gather", 7)


@pytest.mark.parametrize("mode", ["all_to_all", "ring_attn"])
@pytest.mark.parametrize("name", SPLIT_ATTENTION)
def test_split_attention_in_stages(pool, name, mode):
    pool.run(check.equals_unsharded, 4, name, 2, "1f1b", 2, 2, 1, 4, False, 4, None, mode, 7)


@pytest.mark.parametrize("mode", ["split_gather", "all_to_all", "ring_attn"])
@pytest.mark.parametrize("schedule, seq", [("gpipe", 5), ("interleaved", 7), ("interleaved", 8)])
def test_sequence_parallel_schedules(pool, mode, schedule, seq):
    chunks = 2 if schedule == "interleaved" else 1
    pool.run(check.equals_unsharded, 4, "LlamaForCausalLM", 2, schedule, 2, 2, chunks, 4, False, 4, None, mode, seq)


@pytest.mark.parametrize("mode", ["split_gather", "all_to_all", "ring_attn"])
def test_sequence_parallel_inference(pool, mode):
    """schedule.forward() in eval mode with dropout configured: the logits on every rank."""
    pool.run(check.inference_on_every_rank, 4, "LlamaForCausalLM", 2, 2, "1f1b", 0.3, mode, 7)


# ALBERT calls its layer groups num_hidden_layers times (StageSplit.calls): the stages split the calls, a
# group called on several stages is replicated there and its gradients summed over them (counted).
@pytest.mark.parametrize("pp, schedule, groups, inner, chunks", [
    (4, "gpipe", 1, 1, 1),          # one call per stage, the one group on all 4 stages
    (4, "1f1b", 2, 1, 1),           # group 0 on stages 0-1, group 1 on stages 2-3
    (2, "1f1b", 2, 2, 1),           # one group per stage (nothing replicated), 2 layers per group
    (2, "interleaved", 2, 1, 2),    # 4 virtual stages: both groups on both ranks
    (2, "gpipe", 4, 1, 1),          # one group per call
])
def test_albert_repeated_calls(pool, pp, schedule, groups, inner, chunks):
    pool.run(check.equals_unsharded, 4, "AlbertForMaskedLM", pp, schedule, 2, 1, chunks,
             num_hidden_groups=groups, inner_group_num=inner)


@pytest.mark.parametrize("pp, groups, chunks", [(2, 1, 1), (4, 2, 1), (2, 2, 2)])
def test_albert_grad_norm(pool, pp, groups, chunks):
    pool.run(check.repeated_calls_grad_norm, 4, pp, groups, chunks)


@pytest.mark.parametrize("pp, tp", [(2, 1), (2, 2)])
def test_albert_load_full_state_dict(pool, pp, tp):
    pool.run(check.load_full_round_trip, 4, "AlbertForMaskedLM", pp, tp)


@pytest.mark.parametrize("pp, tp", [(2, 1), (4, 1), (2, 2)])
def test_albert_from_pretrained(pool, tmp_path, pp, tp):
    pool.run(check.from_pretrained_stages, 4, pp, tp, str(tmp_path / "albert"), False, "AlbertForMaskedLM")


@pytest.mark.parametrize("pp, tp, schedule", [(2, 1, "gpipe"), (4, 1, "1f1b"), (2, 2, "1f1b")])
def test_albert_inference_eval_dropout(pool, pp, tp, schedule):
    """schedule.forward() in eval mode with dropout 0.3 configured: the logits on every rank."""
    pool.run(check.inference_on_every_rank, 4, "AlbertForMaskedLM", pp, tp, schedule, 0.3)


def test_albert_refusals(pool):
    pool.run(check.repeated_calls_refusals, 4)


# BEiT with one relative position bias shared by every layer: the table runs on every stage (StageSplit.everywhere),
# its gradient summed over them (counted).
@pytest.mark.parametrize("pp, schedule, chunks", [(2, "gpipe", 1), (4, "1f1b", 1), (2, "interleaved", 2)])
def test_beit_shared_bias(pool, pp, schedule, chunks):
    pool.run(check.equals_unsharded, 4, "BeitModel/shared_bias", pp, schedule, 2, 1, chunks)


@pytest.mark.parametrize("schedule, default", [("gpipe", True), ("1f1b", False)])
def test_beit_segmentation_pp4(pool, schedule, default):
    """PP=4, one layer per stage: the decode head reads hidden states 0..3 (out_indices 1..4), each sent on
    from the stage computing it to the last in ever longer messages, their gradients back.  GPipe over the
    default group (PipelineStageManager(), a plain ShardConfig), 1F1B over explicit groups."""
    report = pool.run(check.equals_unsharded, 4, "BeitForSemanticSegmentation", 4, schedule, 2, default=default)
    assert all(r["tuples"] > 0 for r in report), report


def test_beit_segmentation_bad_reads(pool):
    pool.run(check.beit_segmentation_bad_reads, 4)


# Swin and Swinv2: the layer list is encoder.layers (one Swin stage: blocks, then the patch merging); the stages
# before a chunk run in shapes only (StageSplit.shaped_layers), so the encoder halves input_dimensions as unsharded,
# and each pipeline edge carries [batch, H*W, C] at its own resolution.  The three classes of a family share one
# pool call; the matrix columns count them (scripts/support_matrix.py FEATURES).
SWIN = {f: zoo.family_classes()[f] for f in ("swin", "swinv2")}


def _swin_params():
    return [pytest.param(c, id="-".join(c)) for c in SWIN.values()]


def test_shaped_layers_plan():
    """Process-free (one stage): the stand-in of a layer before the chunk (StageSplit.shaped_layers) gives zeros
    shaped like the layer's output, its non-tensor outputs as computed, no gradient, and runs none of the layer's
    hooks; shaped_layers with repeated calls or a layer count is refused, naming the model."""
    import dataclasses

    import torch
    from shardformer.autopolicy import get_autopolicy
    from shardformer.pipeline import PipelineStageManager
    from shardformer.pipeline.stages import _ShapedLayer, plan_stages

    model = zoo.build("Swinv2Model")
    split, sm = get_autopolicy(model).pipeline_split, PipelineStageManager()
    fired = []
    model.encoder.layers[0].register_forward_hook(lambda *a: fired.append("before"))
    plan = plan_stages(model, split, sm, "Swinv2Model", prefix="Swinv2")
    model.encoder.layers[0].register_forward_hook(lambda *a: fired.append("after"))
    hidden = torch.randn(3, 64, 40, requires_grad=True)
    out = _ShapedLayer(plan.layer_shadows[0], 0)(hidden, (8, 8))
    assert fired == [], fired                        # neither the hook there at planning nor one added later
    real = model.encoder.layers[0](hidden, (8, 8))
    assert fired == ["before", "after"], fired
    assert out[0].shape == real[0].shape == (3, 16, 80) and not out[0].any() and not out[0].requires_grad
    assert out[2] == real[2] == (8, 8, 4, 4)         # Swinv2's output dimensions, as computed
    assert next(plan.layer_shadows[0].parameters()).is_meta
    for bad in (dict(count="num_layers"), dict(calls="num_layers")):
        with pytest.raises(ValueError, match="Swinv2Model: .*shaped_layers=True"):
            plan_stages(model, dataclasses.replace(split, **bad), sm, "Swinv2Model", prefix="Swinv2")


@pytest.mark.compat_covered_by("test_swin_1f1b_equals_unsharded")     # the same stage forwards, scheduled otherwise
@pytest.mark.parametrize("classes", _swin_params())
def test_swin_gpipe_equals_unsharded(pool, classes):
    """PP=4 over the default group (PipelineStageManager(), a plain ShardConfig): one Swin stage per rank."""
    pool.run(check.swin_classes_equal_unsharded, 4, classes, "gpipe", default=True)


@pytest.mark.parametrize("classes", _swin_params())
def test_swin_1f1b_equals_unsharded(pool, classes):
    """TP=2 x PP=2, 4 micro-batches; and output_hidden_states / output_attentions refused on every rank."""
    pool.run(check.swin_classes_equal_unsharded, 4, classes, "1f1b", 2, m=4, refusals=True)


@pytest.mark.compat_covered_by("test_swin_1f1b_equals_unsharded")     # the same Swin stages, two chunks per rank
@pytest.mark.parametrize("classes", _swin_params())
def test_swin_interleaved_equals_unsharded(pool, classes):
    pool.run(check.swin_classes_equal_unsharded, 4, classes, "interleaved", 1, 2)   # 4 Swin stages, 2 chunks


# ChatGLM2 (zoo.chatglm2, remote-code style): GLMTransformer runs `for i in range(self.num_layers)` over
# self.layers[i]; each stage sets num_layers to its chunk's count (StageSplit.count: every layer run is got by
# its chunk position, counted) and the stages pass [seq, batch, hidden]; ChatGLMModel's last_hidden_state is
# concatenated over the micro-batches along dimension 1 (StageSplit.batch_dims).
CHATGLM2 = zoo.family_classes()["chatglm2"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("name", CHATGLM2)
def test_chatglm2_pp4(pool, name, schedule):
    report = pool.run(check.equals_unsharded, 4, name, 4, schedule, 2)
    assert all(r["positions"] == 2 for r in report), report          # one layer per stage, 2 micro-batches


@pytest.mark.parametrize("name", CHATGLM2)
@pytest.mark.parametrize("layers, counts, m, seq", [(3, None, 2, 7), (4, (3, 1), 4, 5), (5, (1, 4), 1, 9)])
def test_chatglm2_uneven(pool, name, layers, counts, m, seq):
    """Uneven stages (3 layers over 2; 3 + 1; 1 + 4) and odd sequence lengths, TP=2 x PP=2."""
    report = pool.run(check.equals_unsharded, 4, name, 2, "1f1b", m, 2, 1, layers, seq=seq,
                      num_layers_per_stage=counts)
    assert all(r["positions"] > 0 for r in report), report


@pytest.mark.parametrize("name", CHATGLM2)
@pytest.mark.parametrize("pp, tp", [(2, 1), (4, 1), (2, 2)])
def test_chatglm2_inference_on_every_rank(pool, name, pp, tp):
    """schedule.forward() in eval mode with hidden_dropout 0.3 configured: the logits (ChatGLMModel: the
    sequence-first hidden states) on every rank."""
    pool.run(check.inference_on_every_rank, 4, name, pp, tp, "1f1b", 0.3)


@pytest.mark.parametrize("mode", ["split_gather", "all_to_all", "ring_attn"])
@pytest.mark.parametrize("name", CHATGLM2)
def test_chatglm2_sequence_parallel_in_stages(pool, name, mode):
    """The sequence split along dimension 0 inside the stages: interleaved, 2 chunks per rank, 7 tokens (a later
    stage receives S'/p rows of [S', b, hidden]); then schedule.forward() in eval mode with dropout.
    ChatGLMModel's step is checked in float64 (a projection of its hidden states), which the ring kernel does
    not take: ring_attn is checked for it by the float32 inference only."""
    if not (name == "ChatGLMModel" and mode == "ring_attn"):
        pool.run(check.equals_unsharded, 4, name, 2, "interleaved", 2, 2, 2, 4, False, 4, None, mode, 7)
    pool.run(check.inference_on_every_rank, 4, name, 2, 2, "1f1b", 0.3, mode, 7)


@pytest.mark.parametrize("name", CHATGLM2 + ["Gemma3ForConditionalGeneration"])
@pytest.mark.parametrize("pp, tp", [(2, 1), (2, 2)])
def test_chatglm2_gemma3mm_load_full_state_dict(pool, name, pp, tp):
    pool.run(check.load_full_round_trip, 4, name, pp, tp)


def test_chatglm2_refusals(pool):
    pool.run(check.chatglm2_refusals, 4)


# Gemma 3 multimodal: the text model's layers split; the vision tower and projector replicated on every stage
# (StageSplit.everywhere), their gradients summed over the stages (counted).
GEMMA3_MM = ("Gemma3Model", "Gemma3ForConditionalGeneration", "Gemma3ForSequenceClassification")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("name", GEMMA3_MM)
def test_gemma3_multimodal_pp4(pool, name, schedule):
    report = pool.run(check.equals_unsharded, 4, name, 4, schedule, 2)
    assert all(r["replicated"] > 0 for r in report), report


@pytest.mark.parametrize("name", GEMMA3_MM)
@pytest.mark.parametrize("pp, tp", [(2, 1), (4, 1), (2, 2)])
def test_gemma3_multimodal_inference_on_every_rank(pool, name, pp, tp):
    """schedule.forward() in eval mode with the text model's attention dropout 0.3 configured."""
    pool.run(check.inference_on_every_rank, 4, name, pp, tp, "1f1b", 0.3)


@pytest.mark.parametrize("mode", ["split_gather", "all_to_all"])
@pytest.mark.parametrize("name", ["Gemma3ForConditionalGeneration", "Gemma3Model"])
def test_gemma3_multimodal_sequence_parallel_in_stages(pool, name, mode):
    """The merged image-and-text sequence split inside the stages (7 tokens, TP=2 for split_gather)."""
    pool.run(check.equals_unsharded, 4, name, 2, "1f1b", 2, 2, 1, 4, False, 4, None, mode, 7)


@pytest.mark.parametrize("pp, tp", [(2, 1), (2, 2)])
def test_gemma3_multimodal_from_pretrained(pool, tmp_path, pp, tp):
    """Each stage reads its text layers and the vision tower it replicates; a trained pipeline saves a checkpoint
    plain transformers loads back."""
    report = pool.run(check.from_pretrained_stages, 4, pp, tp, str(tmp_path / "gemma3mm"), False,
                      "Gemma3ForConditionalGeneration")
    assert all(r["fraction"] < 1 for r in report), report


# T5 and Whisper with sequence parallelism inside the stages, SP=2 x PP=2 (split_gather with TP=2 over each
# stage's pair): 7 encoder tokens (Whisper: 7 positions after its convolutions), 5 decoder tokens.  The hidden
# states travel as this rank's rows; the encoder output the decoder attends to and T5's position biases travel
# whole (checked on every received message).  Where the stages split: "stacks", 2 + 2 layers, the boundary on
# the stages' edge (stage 1 gets the encoder output and splits the decoder itself); "mid_encoder", 3 + 3 layers
# as (2, 4): stage 1 enters the encoder at layer 2 from received rows (and T5's bias), then starts the decoder;
# "mid_decoder", (4, 2): stage 1 enters the decoder at layer 1 (rows, both biases, the encoder output).
ENC_DEC_SP_SPLITS = {"stacks": {},
                     "mid_encoder": {"layers": 6, "num_layers_per_stage": (2, 4), "encoder_layers": 3},
                     "mid_decoder": {"layers": 6, "num_layers_per_stage": (4, 2), "encoder_layers": 3}}


@pytest.mark.parametrize("split", list(ENC_DEC_SP_SPLITS))
@pytest.mark.parametrize("mode", ["split_gather", "all_to_all", "ring_attn"])
@pytest.mark.parametrize("name", ["T5ForConditionalGeneration", "WhisperForConditionalGeneration"])
def test_encdec_sequence_parallel_in_stages(pool, name, mode, split):
    pool.run(check.equals_unsharded, 4, name, 2, "1f1b", 2, tp=2, sp_mode=mode, seq=7, **ENC_DEC_SP_SPLITS[split])


# ring_attn runs the C flash kernel (float32 / 16 / bf16): the classes checked through a float64 projection of
# their outputs (no labels: T5Model, T5EncoderModel, T5ForQuestionAnswering, WhisperModel) are left out there.
ENC_DEC_SP = [(n, m) for n in ENC_DEC for m in ("split_gather", "all_to_all", "ring_attn")
              if m != "ring_attn" or "labels" in zoo.make_inputs(n)]


@pytest.mark.parametrize("name, mode", ENC_DEC_SP)
def test_encdec_sequence_parallel_every_class(pool, name, mode):
    """Every T5 / Whisper class (single-stack ones: T5's bias carried, Whisper's plain messages), 2 + 2 layers."""
    pool.run(check.equals_unsharded, 4, name, 2, "1f1b", 2, tp=2, sp_mode=mode, seq=7)


@pytest.mark.parametrize("mode", ["split_gather", "all_to_all", "ring_attn"])
@pytest.mark.parametrize("schedule, split", [("gpipe", "mid_decoder"), ("gpipe", "mid_encoder"),
                                             ("interleaved", "stacks")])
@pytest.mark.parametrize("name", ["T5ForConditionalGeneration", "WhisperForConditionalGeneration"])
def test_encdec_sequence_parallel_schedules(pool, name, mode, schedule, split):
    """GPipe, and interleaved 1F1B (PP=2 x 2 chunks, one layer per virtual stage: chunk 0 of stage 1 ends the
    encoder, chunk 1 of stage 0 starts the decoder), 4 micro-batches."""
    chunks = 2 if schedule == "interleaved" else 1
    pool.run(check.equals_unsharded, 4, name, 2, schedule, 4, tp=2, chunks=chunks, sp_mode=mode, seq=7,
             **ENC_DEC_SP_SPLITS[split])


@pytest.mark.parametrize("mode", ["split_gather", "all_to_all", "ring_attn"])
@pytest.mark.parametrize("name", ["T5ForConditionalGeneration", "WhisperForConditionalGeneration"])
def test_encdec_sequence_parallel_inference(pool, name, mode):
    """schedule.forward() in eval mode with dropout 0.3 configured, SP=2 x PP=2: the logits on every rank."""
    pool.run(check.inference_on_every_rank, 4, name, 2, 2, "1f1b", 0.3, mode, 7)


@pytest.mark.parametrize("name", ["T5ForConditionalGeneration", "WhisperForConditionalGeneration"])
def test_encdec_sequence_overlap_in_stages(pool, name):
    """split_gather with enable_sequence_overlap (the blocks' all-gather overlapped with their column layers),
    the stage edge inside the decoder."""
    pool.run(check.equals_unsharded, 4, name, 2, "1f1b", 2, tp=2, sp_mode="split_gather", seq=7,
             config={"enable_sequence_overlap": True}, **ENC_DEC_SP_SPLITS["mid_decoder"])


def test_per_layer_outputs_refused(pool):
    """output_hidden_states / output_attentions under PP: refused by name for a decoder LM (plain
    ShardConfig(), PP=4), GPT-2 at TP=2 x PP=2, BERT interleaved, T5, ViT zero-bubble (one pool call)."""
    msgs = pool.run(check.per_layer_outputs_refused, 4)
    assert len(msgs[0]) >= 17 and all(len(m) == len(msgs[0]) for m in msgs), msgs


@pytest.mark.parametrize("overlap", [False, True])
def test_swin_split_gather_in_stages(pool, overlap):
    """Swin / Swinv2, split_gather (and its overlap) inside the pipeline stages, TP=2 x PP=2."""
    pool.run(check.swin_sequence_parallel_in_stages, 4, overlap)
