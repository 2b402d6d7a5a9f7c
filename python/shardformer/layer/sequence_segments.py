"""Split-gather sequence parallelism of a stack whose layers cut their
hidden states into consecutive segments and run each through modules of its
own: BLIP-2's Q-Former, whose sequence is [queries; text] (query_length
rows of learned queries, then text tokens).  Its layer runs the self
attention on the whole sequence, then the cross attention (to the image
features) and the query feed-forward on hidden_states[:, :query_length],
the text feed-forward on hidden_states[:, query_length:].

A contiguous split of [queries; text] would give the ranks different numbers
of query rows (some none), so their cross attentions and feed-forwards would
run different collectives.  Here each segment is split over the p ranks on
its own (distributed.mappings.segment_rows): with Q queries and T text
tokens, rank r holds

    [ queries r*cq .. (r+1)*cq - 1 ; text r*ct .. (r+1)*ct - 1 ]    cq = ceil(Q/p), ct = ceil(T/p)

(the rows past Q or T padding), and every layer is called with
query_length = cq, so HF's own slicing hands the query modules this rank's
query rows and the text modules its text rows.  Then:

    self attention      its input gathered into sequence order (the whole
                        sequence's SequenceState, layout = segment_rows);
                        its output put back into all-gather order with the
                        padding rows (GatherOrderInput on the module after
                        it), so the row layer's reduce-scatter leaves each
                        rank its own rows of both segments
    query modules       split-gather regions over the query segment alone
    text modules        split-gather regions over the text segment alone
                        (their own SequenceStates, contiguous blocks)

SegmentSplit, on every layer of the stack, sets the segments' lengths and
the layout at the first layer's input (the full sequence split: backward,
all-gathered), rewrites each layer's query_length to cq and gathers the last
layer's output (backward: this rank's rows).  With one segment (the
Q-Former on queries only, or on text only) the layout is contiguous blocks
of that segment, as everywhere else.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from .. import distributed as D
from ..distributed.mappings import gather_sequence_rows, segment_rows, split_sequence_rows
from .parallel_module import ShardPlan, plan_directly
from .sequence import PreHook, SequenceState, first_input, mark_rows, on_output, rows_gatherer


class Segments:
    """The shared state of one segmented stack: `whole`, the SequenceState of
    the whole sequence (its layout set per forward), and one SequenceState
    per segment name (contiguous blocks of that segment).  `local_first`:
    this rank's rows of the first segment in the forward in progress."""

    def __init__(self, names: tuple[str, ...] = ("query", "text")):
        self.whole = SequenceState()
        self.segments = {name: SequenceState() for name in names}
        self.local_first = 0

    def __getitem__(self, name: str) -> SequenceState:
        return self.segments[name]

    def __deepcopy__(self, memo):
        return self          # like SequenceState: the hooks of a copied model keep the same state

    def begin(self, full: torch.Tensor, first: int, group) -> None:
        """A forward of `full` [batch, S, hidden] whose first `first` rows are
        the first segment (queries) and the rest the second (text)."""
        lengths = (first, full.shape[1] - first)
        for state, n in zip(self.segments.values(), lengths):
            state.length = n
        self.whole.length = full.shape[1]
        self.whole.layout = segment_rows(group, lengths)
        self.whole.split_in_forward = True
        self.local_first = -(-first // D.world_size(group)) if first else 0


class SegmentSplit:
    """Hooks on one layer of a segmented stack (see the module docstring):
    kwarg `segments` (Segments, shared by the stack), `first` (the split at
    its input), `last` (the gather at its output), `kwarg` (the layer's
    keyword argument holding the first segment's length: "query_length")."""

    @classmethod
    def plan_shard(cls, module: nn.Module, tp_size: int, rank: int, segments=None, **kwargs) -> ShardPlan:
        if not isinstance(segments, Segments):
            raise TypeError(f"SegmentSplit: segments must be a Segments, got {type(segments).__name__}")
        return ShardPlan(tp_size, rank)

    @classmethod
    def prepare_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                              segments=None, first: bool = False, last: bool = False, kwarg: str = "query_length",
                              **kwargs) -> "_SegmentHooks":
        if plan is None:
            plan = plan_directly(cls, module, process_group, segments=segments)
        return _SegmentHooks(module, segments, first, last, kwarg, process_group, plan.tp_size > 1)

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                           **kwargs) -> nn.Module:
        return cls.prepare_native_module(module, process_group, plan=plan, **kwargs).commit()


class _SegmentHooks:
    def __init__(self, module, segments: Segments, first: bool, last: bool, kwarg: str, group, active: bool):
        self.module, self.segments, self.first, self.last = module, segments, first, last
        self.kwarg, self.group, self.active = kwarg, group, active
        self.handles: list = []

    def commit(self) -> nn.Module:
        if self.active:
            self.handles.append(self.module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(self.module.register_forward_hook(self._post))
        return self.module

    def rollback(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _pre(self, _module, args, kwargs):
        seg = self.segments
        x, rebuild = first_input(args, kwargs)
        if self.first:
            seg.begin(x, int(kwargs.get(self.kwarg) or 0), self.group)
            x = split_sequence_rows(x, seg.whole.layout)
        mark_rows(x, rows_gatherer(seg.whole, self.group))
        args, kwargs = rebuild(x)
        return args, {**kwargs, self.kwarg: seg.local_first}

    def _post(self, _module, _args, output):
        whole = self.segments.whole
        if self.last:
            return on_output(output, lambda y: gather_sequence_rows(y, whole.layout))
        on_output(output, functools.partial(mark_rows, gather=rows_gatherer(whole, self.group)))
        return None


class GatherOrderInput:
    """A forward pre-hook on the module that takes an attention's output (the
    full sequence, in sequence order) into a row layer that reduce-scatters
    it: that first input padded and put in all-gather order
    (SequenceRows.in_gather_order of the SequenceState `state`'s layout), so
    the reduce-scatter leaves each rank its own rows.  Backward: the
    gradient's rows put back in sequence order, padding dropped."""

    @classmethod
    def plan_shard(cls, module: nn.Module, tp_size: int, rank: int, state=None, **kwargs) -> ShardPlan:
        if not isinstance(state, SequenceState):
            raise TypeError(f"GatherOrderInput: state must be a SequenceState, got {type(state).__name__}")
        return ShardPlan(tp_size, rank)

    @classmethod
    def prepare_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                              state=None, **kwargs) -> PreHook:
        if plan is None:
            plan = plan_directly(cls, module, process_group, state=state)
        return PreHook(module, functools.partial(_to_gather_order, state) if plan.tp_size > 1 else None)

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, plan: ShardPlan | None = None,
                           **kwargs) -> nn.Module:
        return cls.prepare_native_module(module, process_group, plan=plan, **kwargs).commit()


def _to_gather_order(state: SequenceState, _module, args, kwargs):
    """GatherOrderInput's pre-hook: the first input put in all-gather order."""
    x, rebuild = first_input(args, kwargs)
    return rebuild(state.layout.in_gather_order(x))
