"""PolicySpec: a policy as one frozen piece of data.

A spec says what a policy does to a model without code: which module of
each class becomes which parallel layer (a style of shardformer.plan's
table), which attributes take this rank's head counts, where split-gather
sequence parallelism splits and gathers the hidden states, which weights are
re-tied, what the policy can do (capabilities) and which configurations it
refuses (refusals, message templates).  Every field is a string, a number, a
tuple or another frozen dataclass of this module (or a typed layout,
shardformer.layer.sequence_layout, or a StageSplit), so a spec is hashable,
compares by value and prints as what it is.

shardformer.plan.interpret(spec, model, shard_config, state) is the one
place a spec becomes replacements ({class name: ModulePolicyDescription});
shardformer.plan.refuse(spec, model, shard_config) raises its refusals.  A
built-in shape is a spec factory (policies/shapes.py DecoderShape.spec()),
and SpecPolicy runs any spec as a Policy: docs/writing-policies.md.

Conditions (`Entry.when`, `Refusal.when`), each a name of CONDITIONS:

    tensor_parallel        ShardConfig.enable_tensor_parallelism
    sequence_parallel      split-gather sequence parallelism is on
    no_sequence_parallel   tensor parallelism without split-gather sequence parallelism
    expert_parallel        ShardConfig.expert_parallel_process_group is set
    no_expert_parallel     it is not
    tensor_or_expert_parallel   either of the two parallelisms that split weights
    overlap / no_overlap   split-gather SP with / without enable_sequence_overlap
    pipeline_parallel      ShardConfig.pipeline_stage_manager has more than one stage
    tensor_parallel_ranks  tensor parallelism over a group of 2 or more ranks
    pipeline_stages        ShardConfig.pipeline_stage_manager is set (any number of stages)
    any_sequence_parallel  ShardConfig.enable_sequence_parallelism, any mode, with or without TP
    split_attention        it is on with mode all_to_all or ring_attn
    config:<attribute>     the model's (text) config has <attribute> set truthy
                           ("config:add_cross_attention")
    model:<attribute>      the model has the attribute <attribute> (Whisper's
                           "model:layer_weights", which only the audio classifier has)
    mode:<mode>            sequence parallelism is on with sequence_parallelism_mode
                           <mode> ("mode:ring_attn"), with or without TP
    composed               the model has one of the spec's composed models
                           (PolicySpec.compose: BLIP-2's language_model)
    not_composed           it has none of them (a BLIP-2 class without a language model)

Sequence-parallel kwargs (`Entry.sp`, `ModuleSpec.sp_linear`), what a layer
takes under split-gather SP (SP_KWARGS; shardformer.plan.sp_kwargs):

    ""       nothing
    "col"    sequence_parallel=True: the input arrives gathered (no copy to the TP region)
    "row"    sequence_parallel=True, reduce_scatter=True: the partial sums
             reduce-scattered along the sequence, the bias added on this rank's rows
    "gather" "col", and with enable_sequence_overlap the layer gathers its input
             rows itself, overlapping the all-gather with its matmul
    "gather_exact"  "gather", the gathered rows cut to the exact sequence
             (padding dropped: an attention's fused projection)
    "gather_rows"   "col", and the layer always gathers its input rows itself
             (gather_input=True), overlapping the all-gather with its matmul
             under enable_sequence_overlap (an MLP that is no module of its
             own: OPT's and Whisper's fc1, ALBERT's ffn)

The rows of the bespoke families (OPT, ALBERT, T5, Whisper; the block at the
end of this module): `Method` (a method of the module's class replaced),
`ModuleSpec.when`, `SplitGatherSpec.ends="module"`, `PolicySpec.stacks` and
`SplitAttention` (Capabilities.split_attention_stacks).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

#: The conditions an Entry or a Refusal may name (see the module docstring).
CONDITIONS = ("tensor_parallel", "sequence_parallel", "expert_parallel", "no_expert_parallel",
              "tensor_or_expert_parallel", "overlap", "no_overlap", "pipeline_parallel",
              "tensor_parallel_ranks", "no_sequence_parallel", "pipeline_stages", "any_sequence_parallel",
              "split_attention", "composed", "not_composed")

#: The sequence-parallel kwargs an Entry may name (see the module docstring).
SP_KWARGS = ("", "col", "row", "gather", "gather_exact", "gather_rows")
#: ModuleSpec.sp_linear: the SP kwargs of its (column, row) styles.
SP_LINEAR = {"": ("", ""), "block": ("col", "col"), "rows": ("col", "row")}

#: The kinds of per-rank head attribute (shardformer.layout.Heads.attributes).
HEAD_KINDS = ("heads", "kv_heads", "groups", "width", "config")


class SpecError(ValueError):
    """A PolicySpec that is not well formed (raised when it is built)."""


def _check_when(owner: str, when: tuple[str, ...]) -> None:
    bad = [c for c in when if c not in CONDITIONS and not c.startswith(("config:", "model:", "mode:"))]
    if bad:
        raise SpecError(f"{owner}: unknown condition(s) {bad} (known: {', '.join(CONDITIONS)})")


@dataclass(frozen=True)
class Entry:
    """The module at `suffix` (dotted, under the module of the class; `*`
    matches every child of a list) becomes `style` (shardformer.plan.STYLES).
    `when`: conditions that must all hold (else the entry is skipped).
    `sp`: its kwargs under split-gather SP (SP_KWARGS); None: by its style's
    kind, as the module's `sp_linear` says.  An unknown style is refused by
    shardformer.plan.interpret, naming the known ones.
    `heads`: this entry's heads (a shardformer.layout.Heads), in place of
    the spec's (a plan translated from a model: each attention its own);
    `kwargs`: (name, value) pairs added to the style's kwargs (applied last).
    `optional`: a module the model may not have (BEiT's bias tables) is skipped.
    """

    suffix: str
    style: str
    when: tuple[str, ...] = ()
    sp: str | None = None
    heads: Any = None
    kwargs: tuple[tuple[str, Any], ...] = ()
    optional: bool = False

    def __post_init__(self):
        _check_when(f"Entry({self.suffix!r})", self.when)
        if self.sp is not None and self.sp not in SP_KWARGS:
            raise SpecError(f"Entry({self.suffix!r}): sp={self.sp!r} is not one of {SP_KWARGS}")


@dataclass(frozen=True)
class Attribute:
    """The attribute `name` (dotted, under the module) set to this rank's
    value of the heads' `kind` (HEAD_KINDS), when the conditions `when` hold.
    `heads`: the Heads it follows, in place of the spec's; a "config" row
    with its own heads copies the config the attribute holds (an attention's
    own), one without the model's text config."""

    name: str
    kind: str
    when: tuple[str, ...] = ()
    heads: Any = None

    def __post_init__(self):
        _check_when(f"Attribute({self.name!r})", self.when)
        if self.kind not in HEAD_KINDS:
            raise SpecError(f"Attribute({self.name!r}): kind {self.kind!r} not in {HEAD_KINDS}")


#: Region.layouts of a module that takes an attention's output (the whole
#: sequence, in sequence order) into a row layer that reduce-scatters it: its
#: input put in all-gather order (shardformer.layer.sequence_segments.GatherOrderInput).
GATHER_ORDER = "gather_order"


@dataclass(frozen=True)
class Region:
    """A module of a layer under split-gather SP: moved by `layouts` (a
    SequenceLayouts: ENTER, BLOCK, ...; or GATHER_ORDER) or, with layouts
    None, run on this rank's rows with its gradients all-reduced (a norm);
    when `when` holds.

    A Region may also stand among a ModuleSpec's entries, its replacement
    where it stands (between the Entry rows), in the SequenceState of the
    split-gather stack whose `layer` is that ModuleSpec's class (skipped
    when that stack's split-gather SP is off).  `segment`: in a segmented
    stack (SplitGatherSpec.segments) the segment whose rows the region
    gathers (None: the whole sequence, in order); `optional`: a module only
    some layers hold (skipped where it is missing)."""

    path: str
    layouts: Any = None
    when: tuple[str, ...] = ()
    segment: str | None = None
    optional: bool = False

    def __post_init__(self):
        _check_when(f"Region({self.path!r})", self.when)

    @property
    def suffix(self) -> str:
        """Its key among a ModuleSpec's entries (one region per path)."""
        return f"{self.path}#region"


@dataclass(frozen=True)
class HeadsFrom:
    """Where the attention's head counts sit in the model's (text) config:
    num_heads, kv_heads (None or absent: num_heads) and head_dim (None or
    absent: hidden // num_heads)."""

    num_heads: str = "num_attention_heads"
    kv_heads: str | None = "num_key_value_heads"
    head_dim: str | None = "head_dim"
    hidden: str = "hidden_size"


@dataclass(frozen=True)
class ModuleSpec:
    """What happens inside every module of class `key` (a class name).

    entries     the replacements, in order (Entry; a Stack row: a stack's
                split-gather SP, its replacements where the row stands; a
                Region row: a split-gather region where it stands, see Region;
                a Hook row: a hook on a module after substitution, see Hook)
    attributes  Attribute rows (or (dotted attribute, kind) pairs) set to this
                rank's value of the heads (shardformer.layout.Heads.attributes);
                Setting rows set to their value; Method rows replace a method
    sp_linear   the SP kwargs of its column and row styles (SP_LINEAR): "block"
                (both sequence_parallel=True: the module's BLOCK region
                reduce-scatters), "rows" (the row layers reduce-scatter
                themselves), "" (none)
    embed_scale an embedding_rowwise entry is scaled like the model's input
                embedding (Gemma: sqrt(hidden), or its scalar_embed_scale)
    when        conditions of the whole module: when one does not hold the
                class gets no description at all (ALBERT's attention forward,
                replaced only under split-gather SP)"""

    key: str
    entries: tuple[Entry, ...] = ()
    attributes: tuple[Attribute, ...] = ()
    sp_linear: str = "block"
    embed_scale: bool = False
    when: tuple[str, ...] = ()

    def __post_init__(self):
        _check_when(f"ModuleSpec({self.key!r})", self.when)
        rows = tuple(a if isinstance(a, (Attribute, Setting, Method)) else Attribute(*a) for a in self.attributes)
        object.__setattr__(self, "attributes", rows)      # pairs read as Attribute rows
        if self.sp_linear not in SP_LINEAR:
            raise SpecError(f"ModuleSpec({self.key!r}): sp_linear={self.sp_linear!r} is not one of {tuple(SP_LINEAR)}")


@dataclass(frozen=True)
class SplitGatherSpec:
    """Split-gather sequence parallelism of one layer stack, as layouts.

    owner      class name of the module holding the layer list
    layers     path of the layer list under the owner
    layer      class name of the layers
    regions    Region rows (or (path under a layer, SequenceLayouts) pairs): the
               modules moved by their layouts (BLOCK: all-gather in,
               reduce-scatter out), then the norms (layouts None)
    overlap    under enable_sequence_overlap the BLOCK regions overlap their
               input gather with their column layers' matmuls
    skip       None: the norms are the Regions without layouts.  Else children
               of a layer that hold no replicated parameters: every other
               child of the first layer that has parameters (its norms) runs
               on this rank's rows, gradients all-reduced
    beside     Entry rows (paths like the regions'), realized after the regions
               and norms: replicated modules inside a region that run on its
               gathered sequence beside the split layers (a MoE router,
               moe_router_sequence_parallel; a shared expert added to the
               experts' partial sums, moe_shared_expert_sequence_parallel)
    params     names of the layers' own parameters (or children) used on this
               rank's rows (BEiT's layer scales lambda_1 / lambda_2): one
               ReplicatedInParallelRegion on the layer list, gradients all-reduced
    dim        the sequence dimension of the hidden states between the layers
               (1: [batch, S, hidden]; ChatGLM2 runs [S, batch, hidden]: 0)
    marks      the layers before the last mark their output rows for
               output_hidden_states (shardformer.plan.split_gather_ends);
               False: no marks (ChatGLM2, whose capabilities refuse those states)
    when       conditions of the whole split-gather SP besides
               "sequence_parallel" (SAM: "tensor_parallel_ranks", none on one rank)
    ends       where the sequence is split and gathered (SPLIT_ENDS): "layers",
               at the first and last layer of the list; "module", at the input
               and output of the one module at `layers` (an encoder whose
               layers are reused, ALBERT's: shardformer.layer.sequence_ends.EncoderEnds);
               "segments", segment by segment (`segments`)
    segments   the names of the contiguous segments of the stack's sequence
               ("query", "text": BLIP-2's Q-Former), with ends="segments": each
               segment split over the ranks on its own, every layer told this
               rank's rows of the first (shardformer.layer.sequence_segments:
               Segments, SegmentSplit); the Region rows name the segment they
               gather (Region.segment)

    `layer` may be the owner's own class: the region paths then run from
    the owner through each layer ("model.layers.0.mlp"), for a stack whose
    layers differ (dense and MoE layers; DerivedPolicy.translate writes it so).
    The first layer splits its input, the last gathers its output, those
    between mark their rows (shardformer.plan.split_gather_ends)."""

    owner: str
    layers: str
    layer: str
    regions: tuple[Region, ...]
    overlap: bool = True
    skip: tuple[str, ...] | None = None
    beside: tuple[Entry, ...] = ()
    params: tuple[str, ...] = ()
    dim: int = 1
    marks: bool = True
    when: tuple[str, ...] = ()
    ends: str = "layers"
    segments: tuple[str, ...] = ()

    def __post_init__(self):
        rows = tuple(r if isinstance(r, Region) else Region(*r) for r in self.regions)
        object.__setattr__(self, "regions", rows)            # pairs read as Region rows
        _check_when(f"SplitGatherSpec({self.owner!r})", self.when)
        if self.ends not in SPLIT_ENDS:
            raise SpecError(f"SplitGatherSpec({self.owner!r}): ends={self.ends!r} is not one of {SPLIT_ENDS}")
        if (self.ends == "segments") != bool(self.segments):
            raise SpecError(f"SplitGatherSpec({self.owner!r}): segments={self.segments!r} go with "
                            f"ends='segments' and only with it (ends={self.ends!r})")
        bad = [e for e in self.beside if not isinstance(e, Entry)]
        if bad:
            raise SpecError(f"SplitGatherSpec({self.owner!r}): beside takes Entry rows, got {bad[0]!r}")


@dataclass(frozen=True)
class Refusal:
    """A configuration the policy refuses, as data: when every condition of
    `when` holds and the config attribute `attribute` (read from the text
    config, `default` when absent) is not one of `allowed`, optimize()
    raises `error` (ValueError or NotImplementedError) with `message`
    formatted with {model} (the model class), {attribute}, {value} and
    {mode} (ShardConfig.sequence_parallelism_mode).  `attribute` "" : no
    config attribute, the conditions alone refuse (BLIP-2's split_gather
    under pipeline stages: when=("mode:split_gather", "pipeline_stages")).
    `also`: more config attributes refused the same way (any of them outside
    `allowed` refuses; Falcon's two dropouts in one message); the message
    may name every attribute's value by its name ({hidden_dropout})."""

    attribute: str
    allowed: tuple = ()
    default: Any = None
    when: tuple[str, ...] = ()
    message: str = "{model}: {attribute}={value} is not supported"
    error: str = "ValueError"
    also: tuple[str, ...] = ()

    def __post_init__(self):
        _check_when(f"Refusal({self.attribute!r})", self.when)
        if self.error not in ("ValueError", "NotImplementedError"):
            raise SpecError(f"Refusal({self.attribute!r}): error must be ValueError or NotImplementedError, "
                            f"got {self.error!r}")


@dataclass(frozen=True)
class Capabilities:
    """What the policy implements (the sharder's questions, answered as data).

    sp_modes               sequence_parallelism_modes in its own layers ("split_gather")
    split_attention_at     (owner class, layer list) where all_to_all / ring_attn
                           split the attention; None: those modes are not available
    sequence_overlap       enable_sequence_overlap; `overlap_refusal` says why not
    sequence_recompute     sequence_parallel_recompute
    pipeline_split         a StageSplit, a tuple of SplitWhen rows (a split per
                           kind of model: the first whose classes it has), or
                           None (`pipeline_refusal` says why)
    parallel_output        ShardConfig(parallel_output=True) is honoured by its LM heads
    records_hidden_states  output_hidden_states=True under split_gather records
                           full-sequence states (else it is refused by name)
    split_attention_options  (name, value) pairs, extra kwargs of
                           SequenceAttentionParallel at split_attention_at
    sp_refusal             why a sequence_parallelism_mode outside sp_modes is
                           refused ("" : not said)
    split_attention_stacks SplitAttention rows, one per layer stack all_to_all /
                           ring_attn split on its own (an encoder-decoder), in
                           place of split_attention_at"""

    sp_modes: tuple[str, ...] = ()
    split_attention_at: tuple[str, str] | None = None
    sequence_overlap: bool = False
    overlap_refusal: str = "its sequence-parallel blocks gather their input before the projections"
    sequence_recompute: bool = False
    pipeline_split: Any = None
    pipeline_refusal: str = ""
    parallel_output: bool = True
    records_hidden_states: bool = True
    split_attention_options: tuple[tuple[str, Any], ...] = ()
    sp_refusal: str = ""
    split_attention_stacks: tuple = ()


@dataclass(frozen=True)
class PolicySpec:
    """A whole policy as data (see the module docstring).

    name          what the spec is of ("llama"): named in its errors
    modules       the ModuleSpecs, one per module class
    heads         where the head counts are read (HeadsFrom), None: no head attributes / styles
    split_gather  the split-gather SP of the layer stack (SplitGatherSpec), or None
    stacks        more SplitGatherSpecs, one per further layer stack, each with
                  its own SequenceState (an encoder-decoder's decoder: Whisper,
                  T5); split_gather is then the first stack
    ties          (source path, target path) pairs whose target `weight` is made the
                  source's after substitution (besides the LM heads HF had tied)
    capabilities  Capabilities
    refusals      Refusal rows, checked before anything changes
    compose       paths of models inside this one (a multimodal model's
                  language model) each sharded by its own registered policy,
                  composed in (shardformer.family.ComposedPolicy: its
                  replacements merged after the spec's, its sanity check,
                  pre- and postprocess run, its sequence-parallel modes and
                  overlap answering for the whole); a path the bound model
                  lacks is skipped (a BLIP-2 class without a language model)"""

    name: str
    modules: tuple[ModuleSpec, ...]
    heads: HeadsFrom | None = None
    split_gather: SplitGatherSpec | None = None
    ties: tuple[tuple[str, str], ...] = ()
    capabilities: Capabilities = Capabilities()
    refusals: tuple[Refusal, ...] = ()
    stacks: tuple[SplitGatherSpec, ...] = ()
    compose: tuple[str, ...] = ()

    def __post_init__(self):
        if self.stacks and self.split_gather is None:
            raise SpecError(f"PolicySpec {self.name!r}: stacks are given but split_gather (the first stack) is not")
        keys = [m.key for m in self.modules]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise SpecError(f"PolicySpec {self.name!r}: module class(es) {twice} given more than once")
        if self.split_gather is not None and "split_gather" not in self.capabilities.sp_modes:
            raise SpecError(f"PolicySpec {self.name!r}: split_gather is set but capabilities.sp_modes "
                            f"{self.capabilities.sp_modes} does not name 'split_gather'")

    def module(self, key: str) -> ModuleSpec:
        """The ModuleSpec of class `key`; KeyError naming the known ones."""
        for m in self.modules:
            if m.key == key:
                return m
        raise KeyError(f"PolicySpec {self.name!r} has no module {key!r} (it has: "
                       f"{', '.join(m.key for m in self.modules)})")


# ---- rows of the fused-QKV and vision shapes (policies/shapes.py) ----


@dataclass(frozen=True)
class Setting:
    """The attribute `name` (dotted, under the module) set to `value` when the
    conditions `when` hold: a constant (BLOOM's residual dropout probability,
    0.0 under split-gather SP, where the row layers draw it) or a value the
    spec's factory computed (a shardformer.layout.PerRank head count)."""

    name: str
    value: Any
    when: tuple[str, ...] = ()

    def __post_init__(self):
        _check_when(f"Setting({self.name!r})", self.when)


@dataclass(frozen=True)
class WindowOverlap:
    """enable_sequence_overlap of windowed blocks (Swin): blocks `first` ..
    depth-1 of a Stack gather their input rows by one overlapped pass that
    also computes the q/k/v projections of the whole (height, width) map in
    sequence order, reordered into windows by the block's own pad / shift /
    partition (shardformer.layer.window_overlap.WindowedGatherOverlap).
    `gather_at`: the child of the block whose output is the gathered map
    (None: the block's input); `attention`: the module whose projections run
    in the pass."""

    attention: str
    gather_at: str | None = None
    first: int = 0


#: SplitGatherSpec.ends: where a layer stack's sequence is split and gathered.
SPLIT_ENDS = ("layers", "module", "segments")

#: Stack.ends: how a stack's blocks meet the sequence (see Stack).
STACK_ENDS = ("split_gather", "rows_between")


@dataclass(frozen=True)
class Stack:
    """Split-gather sequence parallelism of one stack of blocks inside a
    module (a Swin stage: each stage has its own sequence length, so each
    its own SequenceState), a row among its ModuleSpec's entries: its
    replacements come where it stands.  With S the stage's sequence and p the
    group size:

    path     the blocks' ModuleList under the module ("layers.0.blocks")
    depth    the number of blocks
    regions  Region rows under every block (`path`.*.<region path>) moved by
             their layouts
    params   names of the blocks' children whose parameters are used on this
             rank's rows (the norms): one ReplicatedInParallelRegion on the
             stack, its gradients all-reduced, listing their dotted names
    ends     "split_gather": blocks.0 splits its input (S -> S/p rows, padded),
             the last block gathers its output (split_gather_ends);
             "rows_between": every block runs on the full sequence, only what
             lies between blocks is split: blocks.0 cuts its output to this
             rank's rows, the next gather their input and cut their output,
             the last gathers its input (one block: nothing)
    overlap  a WindowOverlap under enable_sequence_overlap, or None
    when     the conditions of the whole row (default: split-gather SP)"""

    path: str
    depth: int
    regions: tuple[Region, ...] = ()
    params: tuple[str, ...] = ()
    ends: str = "split_gather"
    overlap: WindowOverlap | None = None
    when: tuple[str, ...] = ("sequence_parallel",)

    def __post_init__(self):
        _check_when(f"Stack({self.path!r})", self.when)
        rows = tuple(r if isinstance(r, Region) else Region(*r) for r in self.regions)
        object.__setattr__(self, "regions", rows)            # pairs read as Region rows
        if self.ends not in STACK_ENDS:
            raise SpecError(f"Stack({self.path!r}): ends={self.ends!r} is not one of {STACK_ENDS}")

    @property
    def suffix(self) -> str:
        """Its key among the entries (a stack is one row per path)."""
        return f"{self.path}#stack"


# ---- rows of the bespoke families (policies/opt.py, albert.py, t5.py, whisper.py, chatglm2.py, sam.py, bloom.py) ----


@dataclass(frozen=True)
class MethodSite:
    """What a Method's `make` is given: the shard config, the
    tensor-parallel group, its size and this rank, the model, the spec's
    heads (a shardformer.layout.Heads, or None), the SequenceState of the
    spec's split-gather SP (None when it is off) and the conditions held
    (shardformer.plan.conditions)."""

    shard_config: Any
    group: Any
    size: int
    rank: int
    model: Any
    heads: Any
    sequence_state: Any
    held: frozenset


@dataclass(frozen=True)
class SameMethod:
    """A Method's `make` that gives `function` itself whatever the site
    (Method.fixed)."""

    function: Any

    def __call__(self, site: MethodSite) -> Any:
        return self.function


@dataclass(frozen=True)
class Partial:
    """`function` with its leading arguments `args` and keywords `keywords`
    ((name, value) pairs) fixed: functools.partial as a value.  A partial
    compares by identity, so two builds of one spec would differ; a Method
    row reads a functools.partial `make` as this (equal when the function,
    arguments and keywords are), and it pickles like the partial."""

    function: Any
    args: tuple = ()
    keywords: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, made: functools.partial) -> "Partial":
        return cls(made.func, tuple(made.args), tuple(sorted(made.keywords.items())))

    def __call__(self, *args, **kwargs) -> Any:
        return self.function(*self.args, *args, **{**dict(self.keywords), **kwargs})


@dataclass(frozen=True)
class Method:
    """The method `name` ("forward") of every module of the ModuleSpec's
    class replaced by `make(site)` (a MethodSite), when the conditions `when`
    hold; a row of ModuleSpec.attributes.  `make` is a module-level function
    returning a module-level function or a functools.partial of one, so the
    sharded model pickles (SAM's layer forward on this rank's grid rows;
    BLOOM's ALiBi builder keeping this rank's heads).  Method.fixed(name,
    function) replaces it by one function on every rank (ALBERT's attention,
    whose residual add and post-norm sit inside the module, under
    split-gather SP)."""

    name: str
    make: Any
    when: tuple[str, ...] = ()

    def __post_init__(self):
        _check_when(f"Method({self.name!r})", self.when)
        if not callable(self.make):
            raise SpecError(f"Method({self.name!r}): make must be callable, got {type(self.make).__name__}")
        if isinstance(self.make, functools.partial):   # compared by value (Partial), not by identity
            object.__setattr__(self, "make", Partial.of(self.make))

    @classmethod
    def fixed(cls, name: str, function: Any, when: tuple[str, ...] = ()) -> "Method":
        """The method `name` replaced by `function` itself on every rank."""
        if not callable(function):
            raise SpecError(f"Method({name!r}): function must be callable, got {function!r}")
        return cls(name, SameMethod(function), when)


@dataclass(frozen=True)
class SplitWhen:
    """A row of Capabilities.pipeline_split for a family whose classes split
    differently (an encoder-decoder and its encoder alone): `split` (a
    StageSplit) for a model holding a module of every class in `has` and
    of none in `lacks`.  Of several rows the first that holds is the split
    (shardformer.plan.stage_split); none: no split (refused by name)."""

    has: tuple[str, ...]
    split: Any
    lacks: tuple[str, ...] = ()


@dataclass(frozen=True)
class Hook:
    """A row among a ModuleSpec's entries: after substitution, the module at
    `path` under every module of the class ("" : the module itself), as it
    is then (the replacement another row made of it, or the module), gets
    the hook `hook` (a name of shardformer.plan.HOOKS) in the SequenceState
    of the split-gather stack whose `layer` is that class, when the
    conditions `when` hold (default: split-gather SP over 2 or more ranks).
    It composes with a replacement: the replacement's forward is what the
    hook wraps.  `kwargs`: (name, value) pairs the hook takes; `optional`: a
    module only some models hold (BEiT's per-layer bias table, None with
    the shared one) is skipped where it is missing.

        mark_layer_rows    its input and output are this rank's rows, marked
                           for output_hidden_states (ALBERT's shared layer,
                           between a split and a gather on the encoder)
        full_length_kwarg  its calls' keyword `name` set to the full sequence
                           length (BEiT's bias table: dim_size; it sits in
                           the gathered attention, which needs [heads, S, S])"""

    path: str
    hook: str
    kwargs: tuple[tuple[str, Any], ...] = ()
    when: tuple[str, ...] = ("sequence_parallel", "tensor_parallel_ranks")
    optional: bool = False

    def __post_init__(self):
        _check_when(f"Hook({self.path!r})", self.when)
        if self.hook not in HOOK_NAMES:
            raise SpecError(f"Hook({self.path!r}): hook {self.hook!r} is not one of {HOOK_NAMES}")

    @property
    def suffix(self) -> str:
        """Its key among a ModuleSpec's entries (one hook of a kind per path)."""
        return f"{self.path}#hook:{self.hook}"


#: The hooks a Hook row may name (shardformer.plan.HOOKS installs them).
HOOK_NAMES = ("mark_layer_rows", "full_length_kwarg")


@dataclass(frozen=True)
class SplitAttention:
    """One layer stack that all_to_all / ring_attn split on its own
    (Capabilities.split_attention_stacks): the first module of class `owner`
    calls the ModuleList at `layers` (a path under it); `base` is the path
    under the owner of the module whose forward runs the stack ("" : the
    owner); `options`, (name, value) pairs, are extra kwargs of
    SequenceAttentionParallel (`cross`: the attentions reading the whole
    encoder output, `full_bias`: the method building the position bias for
    the whole sequence, shardformer.layer.sequence_attention)."""

    owner: str
    layers: str
    base: str = ""
    options: tuple[tuple[str, Any], ...] = ()
