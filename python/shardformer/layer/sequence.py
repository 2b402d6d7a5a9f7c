"""Sequence parallelism, split-gather mode (Megatron-style SP inside the TP group).

Notation: hidden states X are [batch, S, hidden]; p ranks, rank i.  S is
padded with zeros to S' = p * ceil(S / p); rank i holds the rows
X[:, i*S'/p : (i+1)*S'/p] (the last ranks may hold padding rows).

Between the blocks of a decoder the hidden states stay split along the
sequence: norms, dropouts and residual additions run on this rank's rows
only.  A block (attention, MLP) is a tensor-parallel region:

    region input    all-gather along S, padding dropped      (backward: pad, reduce-scatter)
    column layers   no copy_to_tp_region: the gather's backward sums dX
    row layers      no all-reduce: partial sums leave the block
    region output   pad, reduce-scatter along S              (backward: all-gather, drop padding)

so each block moves the same bytes as plain TP's all-reduce, split into an
all-gather and a reduce-scatter, and everything between blocks holds 1/p of
the activations.  Inside a block, the gathered input X that the column layers
save for their weight gradients is kept as this rank's rows only and
all-gathered again when backward first needs it (saved-tensor hooks, one
re-gather per block shared by q/k/v or gate/up): the full-sequence X never
outlives the block's forward.  The first decoder layer's input is split (backward:
all-gather) and the last decoder layer's output gathered (backward: this
rank's rows of the gradient, which is the same on every rank), so the model
keeps its inputs and outputs (full sequence).  Replicated parameters used on
this rank's rows only (the decoder layers' norms) get their gradients
all-reduced (shardformer.layer.replicated).

SequenceParallelRegion keeps the module it is applied to and adds the
forward hooks that move its input and output between typed layouts
(SequenceLayouts, layer/sequence_layout.py; the role strings "split",
"gather", "block", "enter", "rows", and for Swin's windowed blocks
"enter_output", "sum_grad", "leave", name them); SequenceState carries the unpadded length S
from the split to the blocks of one forward.  output_hidden_states: the
recorded states, this rank's rows, are marked and gathered in the model's
output (mark_rows, record_full_hidden_states).

Blocks whose row layer has a bias, or whose output passes a dropout or a
residual add inside the module (GPT-2, BERT, BLOOM, OPT: policies/shapes.py),
cannot leave the region at the module's output: the sum over ranks has to
come before the bias and the dropout.  There the module takes role "enter"
(the region input above, with the same saved-rows re-gather, and nothing at
its output) and the row layer leaves the region itself:
Linear1D_Row(sequence_parallel=True, reduce_scatter=True) pads and
reduce-scatters its partial sums along the tokens (reduce_scatter_rows;
backward: all-gather), then adds the bias on this rank's rows (bias gradient
all-reduced).  What follows inside the module (residual dropout, residual
add, post-norm) then runs on this rank's rows: such dropouts draw a
different mask on every rank (DropoutForParallelInput), and such norms get
their gradients all-reduced, like the norms between blocks.

With ShardConfig.enable_sequence_overlap a "block" (overlap=True: the
Llama-shaped decoders) gathers its input through
sequence.gather_block_input: one all-gather, asynchronous where the
communicator overlaps (shm, torch.distributed), runs while the block's column layers (q/k/v or qkv; gate/up or
gate_up) multiply this rank's rows; then the other ranks' rows; the module
gets the gathered sequence and its column layers return the outputs already
computed.  Backward: one re-gather during the summed dX matmul, the
reduce-scatter of dX during the dW matmuls.  The output leaves as above.
"""
from __future__ import annotations

import contextlib
import functools
import warnings

import torch
from torch import nn

from .. import compile_refusal
from .. import distributed as D
from ..distributed.mappings import (  # noqa: F401 - start_*, reduce_scatter_rows, token_dim: re-exported
    GatherRowsLinear,
    SequenceRows,
    all_gather_even,
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_sequence_rows,
    keep_sequence_rows,
    pad_to,
    padded_length,
    reduce_scatter_rows,
    reduce_scatter_to_sequence_region,
    split_sequence_rows,
    start_all_gather,
    start_reduce_scatter,
    token_dim,
)
from . import recompute
from .linear import Linear1D_Col
from .parallel_module import ShardPlan, plan_directly
from .sequence_layout import (  # noqa: F401 - the typed vocabulary, re-exported
    FULL,
    FULL_PARTIAL_GRAD,
    PARTIAL_SUM,
    ROLE_LAYOUTS,
    ROLES,
    ROWS,
    Layout,
    Move,
    Placement,
    SequenceLayouts,
    as_layouts,
    role_spelled_as_layouts,
)

SEQ_DIM = 1
STATE_MARK = "_shardformer_sequence_state"     # a hooked module's SequenceState


class SequenceState:
    """The unpadded sequence length of the forward in progress (set by the
    split at the first decoder layer, read by the blocks and the gather),
    and `dim`, the sequence dimension of the hidden states the split, the
    blocks and the gather see: SEQ_DIM for [batch, S, hidden], 0 for models
    that run [S, batch, hidden] (ChatGLM2)."""

    def __init__(self, dim: int = SEQ_DIM, recompute: str | None = None):
        self.length: int | None = None
        self.dim = dim
        # ShardConfig.sequence_parallel_recompute: "selective" opens a saved-tensor scope per layer
        # (shardformer.layer.recompute) in the layers that carry the split / rows / gather roles
        self.recompute = recompute
        # whether the split ran in the forward in progress (begin() clears it): a pipeline
        # stage whose split comes before its layers (ALBERT: at the encoder's input) then
        # sends the unsplit layer-input shape, S = length, to the later stages
        self.split_in_forward = False
        # the row layout of the forward in progress, where it is not contiguous blocks of the
        # sequence (None): a SequenceRows with `order`, e.g. segment_rows (BLIP-2's Q-Former)
        self.layout: SequenceRows | None = None

    def begin(self) -> None:
        """A forward starts (a pipeline stage's run): no split has run in it yet."""
        self.split_in_forward = False

    def __repr__(self) -> str:
        return f"SequenceState(length={self.length}, dim={self.dim})"

    def resume(self, full: torch.Tensor) -> None:
        """A forward that starts past the split (a later pipeline stage: its
        first layer receives this rank's rows from the previous stage);
        `full` is shaped like the unsplit layer input (the sequence along `dim`)."""
        self.length = full.shape[self.dim]

    def __deepcopy__(self, memo):
        # A deep copy of a model keeps its hooks' closures, which hold this
        # state: layers that read it (Linear1D_Col sequence_state) must too.
        return self


def _rows(state: SequenceState, group) -> SequenceRows:
    """The layout of the forward in progress: state.layout where one is set, else
    contiguous blocks of the sequence padded to a multiple of p."""
    if state.layout is not None:
        return state.layout
    return SequenceRows.even(group, state.length, state.dim)


def split_sequence(x: torch.Tensor, state: SequenceState, group) -> torch.Tensor:
    """Full sequence -> this rank's rows, setting the forward's length (backward: all-gather)."""
    state.length = x.shape[state.dim]
    state.split_in_forward = True
    return split_sequence_rows(x, _rows(state, group))


def gather_sequence(x: torch.Tensor, state: SequenceState, group) -> torch.Tensor:
    """This rank's rows -> full sequence (backward: this rank's rows of the replicated gradient)."""
    return gather_sequence_rows(x, _rows(state, group))


def block_input(x: torch.Tensor, state: SequenceState, group) -> torch.Tensor:
    """Sequence-split -> full sequence: all-gather (backward: reduce-scatter), padding dropped."""
    # contiguous: the all-gather's [S, batch, hidden] layout seen as [batch, S, hidden] is not
    # (the layers would copy it anyway), and the saved-tensor hooks recognise it by its storage
    gathered = gather_from_sequence_region(x, state.dim, group)
    if state.layout is not None:            # rows in another order (segment_rows): put in sequence order
        return state.layout.in_sequence(gathered).contiguous()
    return gathered.narrow(state.dim, 0, state.length).contiguous()


def block_output(y: torch.Tensor, state: SequenceState, group) -> torch.Tensor:
    """Partial sums over the full sequence -> this rank's rows of the sum:
    padded, reduce-scatter (backward: all-gather)."""
    padded = padded_length(y.shape[state.dim], D.world_size(group))
    return reduce_scatter_to_sequence_region(pad_to(y, padded, state.dim), state.dim, group)


def split_rows(x: torch.Tensor, state: SequenceState, group) -> torch.Tensor:
    """A full-sequence tensor that is the same on every rank (the output of
    an all-reduced row layer) -> this rank's rows along state.dim, padded as
    the split pads (backward: all-gather of the rows' gradients, padding
    dropped: the full gradient, as the all-reduce's identity backward needs)."""
    return split_sequence_rows(x, _rows(state, group))


def keep_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Full sequence -> this rank's rows (backward: zeros outside them)."""
    return keep_sequence_rows(x, group)


def sum_grad_over_ranks(y: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; backward, the gradient all-reduced over the group
    (each rank's gradient covers only the rows that rank kept: keep_rows)."""
    return copy_to_tp_region(y, group)


def gather_block_input(module: nn.Module, x: torch.Tensor, state, group) -> torch.Tensor:
    """The overlapped input gather of a sequence-parallel block (role
    "block" with ShardConfig.enable_sequence_overlap, layer/sequence.py):
    `x` is this rank's rows [batch, S/p, in] of the input of `module`
    (a Llama attention or MLP), or [S/p, batch, in] where the sequence is
    dimension 0 (state.dim = 0: ChatGLM2's GLMBlock); the rows are gathered
    along state.dim.  One GatherRowsLinear pass gathers the rows
    (overlap: in flight while this rank's rows are multiplied) and computes
    the output of every sequence-parallel column layer among the module's
    children (q/k/v or qkv; gate/up or gate_up: they all read the block's
    input) on the exact sequence; each layer keeps its output and returns it
    when the module calls it with the returned tensor, X[:, :S] (full
    sequence, gathered by the time this returns: the module reads its shape;
    a layer called with anything else computes as usual, and a gradient
    reaching X joins dX).  Backward: one re-gather, one reduce-scatter of
    the summed dX (see GatherRowsLinear).  Without such children: the plain
    block gather (sequence.block_input).

    Why at the block and not in the projections (as GPT-2's c_attn,
    Linear1D_Col(gather_input=True)): HF's Llama-style attention reads
    `input_shape = hidden_states.shape[:-1]` before its projections and
    views their outputs as (*input_shape, -1, head_dim), and rotary
    embeddings and the mask are built for the full sequence; a q/k/v that
    gathered inside would hand it S rows for an input of S/p (a view with
    -1 heads would even succeed, wrongly).  Handing the module an ungathered
    or still-arriving tensor of the full shape is no option either (its
    contents would be read before the collective completes).  So the module
    gets the real gathered X, complete when the hook returns, and what
    overlaps the all-gather is the projections' matmuls of this rank's own
    rows, done before the module runs; the module's own projection calls
    then return the precomputed outputs.  The MLP takes the same path
    (gate/up or gate_up share the one gather), and both blocks keep the
    module-level reduce-scatter of the row layer's partial sums (role
    "block": o_proj / down_proj have no bias in these families)."""
    layers = [m for m in module.children()
              if isinstance(m, Linear1D_Col) and m.sequence_parallel and not m.gather_input and not m.gather_output]
    if not layers or D.world_size(group) == 1:
        return block_input(x, state, group)
    conv1d = {m.conv1d_layout for m in layers}
    if len(conv1d) != 1:
        raise ValueError(f"{type(module).__name__}: column layers of both weight layouts cannot share a gather")
    params = []
    for m in layers:
        params += list(m._local_params())
    dim = state.dim                  # the sequence's dimension: 1 of [batch, S, in], 0 of ChatGLM2's [S, batch, in]
    outs = GatherRowsLinear.apply(x.movedim(dim, 0), conv1d.pop(), group, state.length, True, True, *params)
    full = outs[0].movedim(0, dim)
    for m, y in zip(layers, outs[1:]):
        m._precomputed = (full, y.movedim(0, dim))
    return full


def release_block_input(module: nn.Module) -> None:
    """Drop the outputs gather_block_input computed for `module`'s layers
    and the module did not ask for (the block's forward is over)."""
    for m in module.children():
        if getattr(m, "_precomputed", None) is not None:
            m._precomputed = None
            GatherRowsLinear.unused += 1


class _Regathered:
    """This rank's rows of a block's gathered input, saved for backward in
    place of the full tensor; the first unpack all-gathers them again (every
    rank runs the same backward graph in the same order, so the collectives
    match) and the later ones reuse it.  `gathers` counts the re-gathers
    of this process (tests read it)."""

    gathers = 0

    def __init__(self, local, length: int, group, dim: int = SEQ_DIM, layout: SequenceRows | None = None):
        # local: the rows, or their Recipe under selective recompute (recompute.stored_value);
        # layout: the rows' order where it is not contiguous blocks (SequenceState.layout)
        self.local, self.length, self.group, self.dim, self.layout = local, length, group, dim, layout
        self.full: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self.full is None:
            local = recompute.stored_value(self.local)
            gathered = all_gather_even(local, self.dim, self.group)
            if self.layout is not None:
                self.full = self.layout.in_sequence(gathered).contiguous()
            else:
                self.full = gathered.narrow(self.dim, 0, self.length).contiguous()
            _Regathered.gathers += 1
        return self.full


def _save_rows_only(full: torch.Tensor, local: torch.Tensor, state: SequenceState, group):
    """saved_tensors_hooks for a block's forward: the gathered input `full`
    (or a contiguous reshape of it: F.linear saves [B*S, H]) is saved as a
    _Regathered of this rank's rows; everything else as it is.  Plain
    closures, no reference cycle: the re-gathered tensor is freed as soon as
    the last node that saved it has run its backward.  Inside a selective-
    recompute scope (the layer's, shardformer.layer.recompute) the scope's
    hooks take the re-gather as an alias instead (hooks do not nest) and the
    rows are kept as the scope stores them (a Recipe where they are one)."""
    key = (full.data_ptr(), full.numel(), full.dtype)      # full is contiguous (block_input)
    scope = recompute.active_scope()
    if scope is not None:
        holder = _Regathered(scope.stored(local), state.length, group, state.dim, state.layout)
        scope.aliases[key] = holder.get
        return contextlib.nullcontext()
    holder = _Regathered(local.detach(), state.length, group, state.dim, state.layout)

    def pack(t):
        if isinstance(t, torch.Tensor) and t.is_contiguous() and (t.data_ptr(), t.numel(), t.dtype) == key:
            return (holder, tuple(t.shape))
        return t

    def unpack(p):
        if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], _Regathered):
            return p[0].get().view(p[1])
        return p

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def first_input(args, kwargs):
    """(a hook's first input: args[0] or kwargs["hidden_states"], a function
    rebuilding (args, kwargs) with a new value in its place)."""
    if args:
        return args[0], lambda v: ((v,) + tuple(args[1:]), kwargs)
    return kwargs["hidden_states"], lambda v: (args, {**kwargs, "hidden_states": v})


def on_output(output, fn):
    """`output` (a tensor, or a tuple starting with one) with fn applied to that tensor."""
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (fn(output[0]),) + tuple(output[1:])
    raise TypeError(f"sequence parallelism: a module returned {type(output).__name__}; expected the hidden "
                    f"states (a tensor, or a tuple starting with one)")


class SequenceParallelRegion:
    """Hooks that move a module's input and output between sequence layouts;
    the module stays as it is.  `layouts=SequenceLayouts(input=Move(src, dst),
    output=Move(src, dst), layer=...)` (layer/sequence_layout.py: the layouts,
    the supported moves and the operator each one runs), or `role=`, a name
    for one (ROLE_LAYOUTS) or a tuple of names whose moves combine:
    `"split"` (the first decoder layer: its input is split), `"gather"` (the
    last decoder layer: its output is gathered), `"block"` (attention or
    MLP: input gathered, output reduce-scattered), `"enter"` (attention or
    MLP whose row layer reduce-scatters itself, Linear1D_Row(reduce_scatter=True):
    input gathered, output left as it is), `"rows"` (a layer between the
    split and the gather: its output, this rank's rows, marked for
    output_hidden_states), for blocks that reshape the whole sequence between
    their modules (Swin's windows) `"enter_output"`, `"sum_grad"`, `"leave"`,
    and for a layer that reads its whole input before any of its modules
    runs (Swinv2's post-norm layer) `"gather_input"` and `"split_output"`.
    A block's gathered input is saved for backward as this rank's rows only.
    Kwarg `state`: the model's SequenceState; `overlap=True` (a block only):
    the input gather overlaps the module's column layers' matmuls
    (sequence.gather_block_input)."""

    ROLES = ROLES

    @staticmethod
    def _layouts(role, layouts, overlap: bool) -> SequenceLayouts:
        if (role is None) == (layouts is None):
            raise ValueError(f"SequenceParallelRegion: give exactly one of role= and layouts=, got role={role!r}, "
                             f"layouts={layouts!r} (docs/sequence-layouts.md)")
        if layouts is not None and not isinstance(layouts, SequenceLayouts):
            raise TypeError(f"SequenceParallelRegion: layouts must be a SequenceLayouts, got "
                            f"{type(layouts).__name__} (docs/sequence-layouts.md)")
        out = as_layouts(role if layouts is None else layouts)
        if layouts is None and not isinstance(role, SequenceLayouts):
            warnings.warn(f"SequenceParallelRegion(role={role!r}) is deprecated: write layouts="
                          f"{role_spelled_as_layouts(role)} (shardformer.layer.sequence_layout; "
                          f"docs/sequence-layouts.md)", DeprecationWarning, stacklevel=4)
        if overlap and not out.is_block:
            raise ValueError(f"SequenceParallelRegion: overlap=True needs a block (role 'block': input "
                             f"{ROWS} -> {FULL_PARTIAL_GRAD}, output {PARTIAL_SUM} -> {ROWS}), got "
                             f"{role if layouts is None else layouts!r}")
        return out

    @classmethod
    def plan_shard(cls, module: nn.Module, tp_size: int, rank: int, role=None, state=None, overlap: bool = False,
                   layouts=None, **kwargs) -> ShardPlan:
        cls._layouts(role, layouts, overlap)
        if not isinstance(state, SequenceState):
            raise TypeError(f"SequenceParallelRegion: state must be a SequenceState, got {type(state).__name__}")
        return ShardPlan(tp_size, rank)

    @classmethod
    def prepare_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                              role=None, state=None, overlap: bool = False, layouts=None, **kwargs) -> "_Hooks":
        if plan is None:
            plan = plan_directly(cls, module, process_group, role=role, state=state, overlap=overlap,
                                 layouts=layouts)
        spec = cls._layouts(role, layouts, overlap)
        return _Hooks(module, spec if plan.tp_size > 1 else None, state, process_group, overlap)

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                           role=None, state=None, overlap: bool = False, layouts=None, **kwargs) -> nn.Module:
        return cls.prepare_native_module(module, process_group, plan=plan, role=role, state=state,
                                         overlap=overlap, layouts=layouts).commit()


class FullLengthKwarg:
    """A forward pre-hook that sets keyword argument `name` of the module's
    calls to the full sequence length S of the forward in progress
    (`state`, a SequenceState), where the HF caller computes it from its own
    input, which under split-gather SP is this rank's S'/p rows.  BEiT's
    relative position bias: BeitLayer passes dim_size=hidden_states.shape[1]
    (read with interpolate_pos_encoding=True), while the bias is added to the
    scores of the gathered, full-length attention: [heads, S, S].  No
    collective; calls before the first split (state.length unset) are left
    as they are."""

    @classmethod
    def plan_shard(cls, module: nn.Module, tp_size: int, rank: int, name=None, state=None, **kwargs) -> ShardPlan:
        if not isinstance(name, str):
            raise TypeError(f"FullLengthKwarg: name must be a keyword argument's name, got {name!r}")
        if not isinstance(state, SequenceState):
            raise TypeError(f"FullLengthKwarg: state must be a SequenceState, got {type(state).__name__}")
        return ShardPlan(tp_size, rank)

    @classmethod
    def prepare_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                              name=None, state=None, **kwargs) -> "PreHook":
        if plan is None:
            plan = plan_directly(cls, module, process_group, name=name, state=state)

        pre = functools.partial(_full_length_pre, name, state)
        return PreHook(module, pre if plan.tp_size > 1 else None)

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                           name=None, state=None, **kwargs) -> nn.Module:
        return cls.prepare_native_module(module, process_group, plan=plan, name=name, state=state).commit()


def _full_length_pre(name: str, state: SequenceState, _module, args, call_kwargs):
    """FullLengthKwarg's pre-hook: keyword `name` set to the unsplit length."""
    if name not in call_kwargs or state.length is None:
        return None
    return args, {**call_kwargs, name: state.length}


class PreHook:
    """One forward pre-hook (with kwargs) on `module`: registered by commit(),
    removed by rollback(); none when `pre` is None (a group of one)."""

    def __init__(self, module: nn.Module, pre):
        self.module, self.pre, self.handle = module, pre, None

    def commit(self) -> nn.Module:
        if self.pre is not None:
            self.handle = self.module.register_forward_pre_hook(self.pre, with_kwargs=True)
        return self.module

    def rollback(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


# ---- recorded hidden states (output_hidden_states=True) under any SP mode ----
#
# transformers records a layer's hidden states with forward hooks of its own
# (utils/output_capturing.py), installed on first use, so they may run before
# or after ours; what they record is the tensor object the layer returned
# (or, for the initial state, the first layer's input after our split).
# Those tensors are this rank's rows.  The SP hooks mark each such object
# with the function that gathers it (mark_rows), whichever order the hooks
# run in; a forward hook on every PreTrainedModel of the sharded model
# (record_full_hidden_states) then swaps each marked tensor in its output
# for the gathered full sequence: all-gather along S, rows put back in
# sequence order (ring_attn's zigzag undone), padding dropped; backward,
# this rank's rows of the gradient, which the loss computed alike on every
# rank makes the same everywhere.  Only the recorded copies are gathered:
# the layers go on with their rows.

_GATHER_MARK = "_shardformer_gather_rows"

#: recorded hidden states gathered by full_sequences, in this process (tests read it)
RECORDED_GATHERS = {"count": 0}


def mark_rows(t, gather):
    """Mark tensor `t` (this rank's rows of a sequence) with `gather`, the
    function that returns its full sequence; returns t.  Under torch.compile
    (a sequence-parallel submodule compiled on its own) refused by name:
    dynamo cannot trace the mark (compile_refusal)."""
    if isinstance(t, torch.Tensor):
        compile_refusal.refuse(t, compile_refusal.sequence_parallel_message("a sequence-parallel module"))
        t.__dict__[_GATHER_MARK] = gather
    return t


def full_sequences(value):
    """`value` with every marked tensor (in nested tuples) replaced by its
    gathered full sequence; anything else as it is."""
    if isinstance(value, torch.Tensor):
        gather = value.__dict__.get(_GATHER_MARK)
        if gather is None:
            return value
        RECORDED_GATHERS["count"] += 1
        return gather(value)
    if type(value) in (tuple, list):
        out = [full_sequences(v) for v in value]
        return value if all(a is b for a, b in zip(out, value)) else type(value)(out)
    return value


def _full_outputs(_module, _args, output):
    from transformers.utils import ModelOutput

    if isinstance(output, ModelOutput):
        for key in list(output.keys()):
            new = full_sequences(output[key])
            if new is not output[key]:
                output[key] = new
        return output
    if isinstance(output, tuple):
        return full_sequences(output)
    return None


def record_full_hidden_states(model: nn.Module) -> list:
    """Forward hooks on `model` and every transformers PreTrainedModel inside
    it: the recorded hidden states in their outputs become full-sequence
    tensors (see mark_rows).  Returns the hooks' handles."""
    from transformers import PreTrainedModel

    owners = [model] + [m for m in model.modules() if m is not model and isinstance(m, PreTrainedModel)]
    return [m.register_forward_hook(_full_outputs) for m in owners]


def mark_layer_rows(module: nn.Module, state: SequenceState, group) -> list:
    """Forward hooks marking `module`'s first input and its output's first
    tensor as this rank's rows (mark_rows), for a layer that runs between a
    split and a gather held elsewhere (ALBERT's shared layers, whose split
    and gather sit on the encoder).  Returns the hooks' handles."""
    pre, post = functools.partial(_mark_input, state, group), functools.partial(_mark_output, state, group)
    return [module.register_forward_pre_hook(pre, with_kwargs=True), module.register_forward_hook(post)]


def _mark_input(state: SequenceState, group, _module, args, kwargs) -> None:
    x, _ = first_input(args, kwargs)
    mark_rows(x, rows_gatherer(state, group))


def _mark_output(state: SequenceState, group, _module, _args, output) -> None:
    mark_rows(output if isinstance(output, torch.Tensor) else output[0], rows_gatherer(state, group))


def rows_gatherer(state: SequenceState, group):
    """The gather of split_gather rows of the forward in progress (its length now)."""
    rows = state.layout if state.layout is not None else SequenceRows.even(group, state.length)
    return lambda t: gather_sequence_rows(t, rows)


def refuse_recorded_hidden_states(model: nn.Module, name: str):
    """A forward pre-hook on the top-level `model`: output_hidden_states=True
    (in the call or the config) raises NotImplementedError, since between the
    layers each rank holds only its rows of the sequence (HF records the
    layers' outputs as they are).  Returns the hook's handle."""
    return model.register_forward_pre_hook(functools.partial(_refuse_hidden_states, name), with_kwargs=True)


def _refuse_hidden_states(name: str, module, args, kwargs) -> None:
    want = kwargs.get("output_hidden_states")
    if want is None:
        want = getattr(getattr(module, "config", None), "output_hidden_states", False)
    if want:
        raise NotImplementedError(
            f"{name}: output_hidden_states=True with sequence parallelism (split_gather): between the "
            f"layers each rank holds only its rows of the sequence; run that forward without it")


class _Hooks:
    """The forward hooks of one module's SequenceLayouts (None: a group of
    one, nothing to do): registered by commit(), removed by rollback().  The
    hooks are this object's methods (not closures), so a model holding them
    pickles; `active` (the block's open saved-tensor hooks) lives only within
    a forward and is not pickled."""

    def __init__(self, module: nn.Module, layouts: SequenceLayouts | None, state: SequenceState, group,
                 overlap: bool = False):
        self.module, self.layouts, self.state, self.group = module, layouts, state, group
        self.overlap = overlap and layouts is not None and layouts.is_block
        self.handles: list = []
        self.active: list = []

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "active"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, active=[])

    def commit(self) -> nn.Module:
        m, spec = self.module, self.layouts
        if spec is None:
            return m
        m.__dict__[STATE_MARK] = self.state     # found by a pipeline stage that starts past the split
        if self.state.recompute == "selective" and spec.layer:
            self.handles += recompute.layer_scope_hooks(m)
        if spec.input is not None and spec.input.saves_rows:
            self.handles.append(m.register_forward_pre_hook(self._block_pre, with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._block_post, always_call=True))
        else:
            if spec.input is not None:
                self.handles.append(m.register_forward_pre_hook(self._input_pre, with_kwargs=True))
            if spec.output is not None:
                self.handles.append(m.register_forward_hook(self._output_post))
        return m

    def _mark(self, y):
        """y marked as this rank's rows of the forward in progress (mark_rows)."""
        return mark_rows(y, rows_gatherer(self.state, self.group))

    def _move(self, move, x):
        """x moved as `move` says (layer/sequence_layout.py's table); a layer's
        rows (its boundary tensors in layout ROWS) marked for output_hidden_states."""
        layer, op = self.layouts.layer, move.op
        if layer and move.src == ROWS:
            x = self._mark(x)
        if op == "split":
            x = split_sequence(x, self.state, self.group)
        elif op == "gather":
            x = gather_sequence(x, self.state, self.group)
        elif op == "gather_partial_grad":
            x = block_input(x, self.state, self.group)
        elif op == "reduce_scatter":
            x = block_output(x, self.state, self.group)
        elif op == "sum_grad":
            x = sum_grad_over_ranks(x, self.group)
        elif op == "keep_rows":
            x = keep_rows(x, self.group)
        if layer and move.dst == ROWS and op != "rows":
            x = self._mark(x)
        return x

    def _input_pre(self, _module, args, kwargs):
        x, rebuild = first_input(args, kwargs)
        return rebuild(self._move(self.layouts.input, x))

    def _output_post(self, _module, _args, output):
        return on_output(output, functools.partial(self._move, self.layouts.output))

    def _block_pre(self, module, args, kwargs):
        """A block's input gathered to the full sequence; in training only
        this rank's rows of it are saved for backward."""
        x, rebuild = first_input(args, kwargs)
        if self.overlap:
            full = gather_block_input(module, x, self.state, self.group)
        else:
            full = block_input(x, self.state, self.group)
        if torch.is_grad_enabled():
            hooks = _save_rows_only(full, x, self.state, self.group)
            hooks.__enter__()
            self.active.append(hooks)
        return rebuild(full)

    def _block_post(self, module, _args, output):
        """The block's output moved (a block: reduce-scattered to this rank's
        rows; "enter": left as it is); always called, so the saved-tensor
        scope closes."""
        while self.active:
            self.active.pop().__exit__(None, None, None)
        if self.overlap:
            release_block_input(module)
        if output is None or self.layouts.output is None:  # raised (always_call), or no output move
            return None
        return on_output(output, functools.partial(self._move, self.layouts.output))

    def rollback(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.module.__dict__.pop(STATE_MARK, None)
