"""ALBERT: one AlbertLayer per layer group, reused by every layer of the
group (num_hidden_layers calls, num_hidden_groups modules).  The sharder
plans each module object once, so the shared layer is split once and its
gradients accumulate over all the layers that call it, as in HF.

    albert_layers.*.attention.{query,key,value}   Linear1D_Col (per head)
    albert_layers.*.attention.dense               Linear1D_Row (all-reduce forward)
    albert_layers.*.ffn                           Linear1D_Col
    albert_layers.*.ffn_output                    Linear1D_Row (all-reduce forward)
    albert_layers.*.{attention.output_dropout, dropout}, embeddings.dropout
                                                  DropoutForReplicatedInput
    embeddings.word_embeddings                    VocabParallelEmbedding1D ([vocab, embedding_size])
    encoder.embedding_hidden_mapping_in           replicated (embedding_size -> hidden_size)
    predictions.decoder                           VocabParallelLMHead1D (tied when HF tied it;
                                                  its bias is predictions.bias)
    classifier / qa_outputs / sop_classifier.classifier   Linear1D_Col, gathered

The embeddings are the BERT-shaped encoder's (policies/shapes.py
EncoderShape); the layer is ALBERT's own.  AlbertAttention infers the head
count from the projection width; its num_attention_heads and all_head_size
become this rank's values.

Split-gather sequence parallelism (the layout above sp_linear_kwargs in
policies/shapes.py).  The layer modules are reused, so the hooks live on
the modules once and act on every repetition: the encoder
(AlbertTransformer) splits its input (the embeddings, on the full
sequence) and gathers the last_hidden_state of its output (pooler and heads
see the full sequence); in between every repetition runs on this rank's
rows.  embedding_hidden_mapping_in runs on the rows (gradients
all-reduced).  AlbertAttention takes layouts ENTER (input all-gathered,
saved as this rank's rows) and, since its residual add and post-norm are
inside the module, its forward is replaced (albert_attention_forward): q/k/v
read the gathered input, dense reduce-scatters and adds its bias on this
rank's rows, output_dropout draws a mask per rank, and the residual takes
this rank's rows of the gathered input (a slice; backward the gather's
reduce-scatter sums it in).  ffn gathers its input rows itself
(Linear1D_Col gather_input=True; with enable_sequence_overlap in flight
during its matmul) and ffn_output reduce-scatters; attention.LayerNorm and
full_layer_layer_norm run on the rows (gradients all-reduced).  Refused
with chunk_size_feed_forward (EncoderShape).

all_to_all / ring_attn: see AlbertShape (bidirectional: padded keys are
masked inside, as for BERT).

Pipeline parallelism (StageSplit(calls="num_hidden_layers")): the stages
split the num_hidden_layers calls of the layer groups, not the
num_hidden_groups modules; call i runs group i * G // N, so a stage holds the
groups its calls run, and a group called on several stages (with the default
G = 1, every stage) is replicated there: each replica's gradient sums its
own stage's calls, and after backward the schedule sums the replicas'
gradients along the stages that hold the group (every replica then steps
with the unsharded gradient).  embeddings and embedding_hidden_mapping_in run
on the first stage, pooler and heads on the last.  Refused (ValueError, by
name) when N is not a multiple of G.  Sequence parallelism inside the stages
works: split_gather splits at the encoder's input, so the first stage sends
the unsplit layer-input shape; all_to_all / ring_attn do not split the
received rows again.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from shardformer.family import Family, gathered, lm, replicated_dropout, spec_capabilities
from shardformer.layer.sequence_layout import ENTER
from shardformer.pipeline.stages import StageSplit
from shardformer.policies.shapes import EncoderShape
from shardformer.spec import Attribute, Entry, HeadsFrom, Hook, Method, ModuleSpec, PolicySpec, Region, SplitGatherSpec


def _rows_of(full: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """This rank's rows of a gathered [batch, S, hidden]: padded with zero rows
    to a multiple of `size`, then rank's block of S' / size rows."""
    extra = -full.shape[1] % size
    if extra:
        full = F.pad(full, (0, 0, 0, extra))
    chunk = full.shape[1] // size
    return full.narrow(1, rank * chunk, chunk)


def albert_attention_forward(self, hidden_states: torch.Tensor, attention_mask=None, **kwargs):
    """AlbertAttention.forward under split-gather SP: `hidden_states` is the
    full sequence (the module's ENTER hook gathered it); this rank's heads
    attend over it, dense returns this rank's rows of the sum (plus its
    bias), and the residual adds this rank's rows of the input."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.albert import modeling_albert

    shape = hidden_states.shape[:-1]
    per_head = (*shape, -1, self.attention_head_size)
    q, k, v = (proj(hidden_states).view(per_head).transpose(1, 2) for proj in (self.query, self.key, self.value))
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                      modeling_albert.eager_attention_forward)
    out, weights = attention(self, q, k, v, attention_mask, scaling=self.scaling,
                             dropout=self.attention_dropout.p if self.training else 0.0, **kwargs)
    out = self.output_dropout(self.dense(out.reshape(*shape, -1).contiguous()))
    rows = _rows_of(hidden_states, self.dense.tp_size, self.dense.tp_rank)
    return self.LayerNorm(rows + out), weights


class AlbertShape(EncoderShape):
    """Split-gather SP: the split and the gather on the encoder (EncoderEnds);
    every call of a shared AlbertLayer marks its input and output rows for
    output_hidden_states (mark_layer_rows).  all_to_all / ring_attn
    (shardformer.layer.sequence_attention, repeated=True): the layer groups
    run num_hidden_layers times in one forward, so the input is split at the
    first entry of albert_layer_groups[0] and AlbertTransformer's
    last_hidden_state gathered; a shared parameter's gradient hook runs once
    on the sum of its uses, then all-reduces over the group."""

    split_attention_at = ("AlbertTransformer", "albert_layer_groups")
    split_attention_options = {"repeated": True}
    # Pipeline stages split the num_hidden_layers calls of the layer groups (call i runs group
    # i * num_hidden_groups // num_hidden_layers); a group called on several stages is replicated
    # there, its gradients summed over them after backward (shardformer.pipeline.stages, StageCalls).
    # embeddings and embedding_hidden_mapping_in run on the first stage, the pooler and heads on the last.
    pipeline_split = StageSplit("{prefix}Model", "encoder.albert_layer_groups", last=("pooler",),
                                calls="num_hidden_layers")

    sp_modes = ("split_gather",)

    def layer_entries(self) -> tuple[Entry, ...]:
        """The entries under one AlbertLayer: query / key / value by heads,
        dense by the same heads, the residual dropout, ffn (gathering its own
        input rows under SP: the MLP is no module) and ffn_output."""
        return (Entry("attention.query", "colwise_heads"), Entry("attention.key", "colwise_heads"),
                Entry("attention.value", "colwise_heads"), Entry("attention.dense", "rowwise_heads"),
                Entry("attention.output_dropout", "dropout_residual"), Entry("ffn", "colwise", sp="gather_rows"),
                Entry("ffn_output", "rowwise"),
                Entry("dropout", "dropout_replicated"))        # (dropout: unused by AlbertLayer.forward)

    def build_spec(self) -> PolicySpec:
        """The layer (layer_entries(), this rank's head attributes), the
        embeddings (EncoderShape's), and under split-gather SP the attention's
        forward (albert_attention_forward), the mapping-in's gradient
        all-reduce, the split / gather around the encoder (ends="module") and
        every call of the shared layer marking its rows (a Hook row)."""
        sp = ("sequence_parallel",)
        attributes = (Attribute("attention.num_attention_heads", "heads"),
                      Attribute("attention.all_head_size", "width"))
        regions = (Region("attention", ENTER), Region("attention.LayerNorm"), Region("full_layer_layer_norm"))
        return PolicySpec(
            name=self.family.name if self.family is not None else "albert",
            modules=(ModuleSpec("AlbertLayer", self.layer_entries() + (Hook("", "mark_layer_rows"),), attributes,
                                sp_linear="rows"),
                     ModuleSpec("AlbertEmbeddings", tuple(Entry(k, v) for k, v in self.EMBEDDINGS_PLAN.items())),
                     ModuleSpec("AlbertAttention", attributes=(Method.fixed("forward", albert_attention_forward),), when=sp),
                     ModuleSpec("AlbertTransformer", (Entry("embedding_hidden_mapping_in",
                                                            "replicated_with_grad_allreduce"),), when=sp)),
            heads=HeadsFrom(kv_heads=None, head_dim=None),
            split_gather=SplitGatherSpec("AlbertModel", "encoder", "AlbertLayer", regions, overlap=False,
                                         ends="module"),
            capabilities=replace(spec_capabilities(self),
                                 split_attention_options=tuple(self.split_attention_options.items())),
            refusals=self.refusals(),
        )


# Both call nn.CrossEntropyLoss themselves; pre-training adds the sentence-order loss.
MLM = lm("predictions.decoder", bias_of="predictions", loss="masked")
PRETRAIN = lm("predictions.decoder", bias_of="predictions", loss="masked", also=("sentence_order_label", "sop_logits"))
CLASSIFIER = (gathered("classifier"), replicated_dropout("dropout"))

FAMILY = Family("albert", "albert.modeling_albert", AlbertShape, options={"prefix": "Albert"}, heads={
    "AlbertModel": (),
    "AlbertForPreTraining": (PRETRAIN, replicated_dropout("sop_classifier.dropout"),
                             gathered("sop_classifier.classifier")),
    "AlbertForMaskedLM": MLM,
    "AlbertForSequenceClassification": CLASSIFIER,
    "AlbertForTokenClassification": CLASSIFIER,
    "AlbertForQuestionAnswering": gathered("qa_outputs"),
    "AlbertForMultipleChoice": CLASSIFIER,
})
globals().update(FAMILY.policy_classes())
