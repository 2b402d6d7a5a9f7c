"""Split-gather sequence parallelism in typed layouts: what a module's input
and output are, and what they must become (in the spirit of torchtitan's
PrepareModuleInput / PrepareModuleOutput).

A tensor at a module boundary has a `Layout` over the sequence-parallel
group: where its value lives and where the gradient that reaches it in
backward lives, each one `Placement`:

    SHARD       this rank's rows of the sequence (padded to a multiple of p)
    REPLICATE   the full sequence, the same on every rank
    PARTIAL     the full sequence, a per-rank partial sum (the ranks' sum is meant)

    ROWS               Layout(SHARD, SHARD)          between the blocks of a decoder
    FULL               Layout(REPLICATE, REPLICATE)  a model's input and output
    FULL_PARTIAL_GRAD  Layout(REPLICATE, PARTIAL)    a block's gathered input: each rank's
                                                     column layers give a partial dX
    PARTIAL_SUM        Layout(PARTIAL, REPLICATE)    a block's row-layer output

A `Move(src, dst)` takes a tensor from one layout to the other with one
region operator (shardformer.distributed.mappings; S the sequence length):

    src -> dst                     forward                        backward
    FULL -> ROWS                   pad, keep own rows (S set)     all-gather, padding dropped
    ROWS -> FULL                   all-gather, padding dropped    keep own rows
    ROWS -> FULL_PARTIAL_GRAD      all-gather, padding dropped    pad, reduce-scatter
    PARTIAL_SUM -> ROWS            pad, reduce-scatter            all-gather
    FULL -> FULL_PARTIAL_GRAD      identity                       all-reduce
    FULL_PARTIAL_GRAD -> ROWS      keep own rows                  own rows, zeros elsewhere
    ROWS -> ROWS                   identity (the rows marked)     identity

Any other pair raises ValueError naming it.  `SequenceLayouts(input=...,
output=..., layer=...)` is what SequenceParallelRegion applies to a module:
the move of its first input (a forward pre-hook), of its output's first
tensor (a forward hook), and `layer=True` for a layer that runs between
the split and the gather (its boundary rows are marked for
output_hidden_states and, with sequence_parallel_recompute="selective", it
opens a saved-tensor scope).  A module whose input moves ROWS ->
FULL_PARTIAL_GRAD keeps only this rank's rows of the gathered input for
backward (re-gathered when backward needs them), since the full-sequence
input never outlives its forward.

The layouts the built-in policies use are named constants (SPLIT, GATHER,
MARK_ROWS, BLOCK, ENTER, ENTER_OUTPUT, SUM_GRAD, LEAVE, GATHER_INPUT,
SPLIT_OUTPUT; `a | b` puts both on one module: the first of several layers
is SPLIT | MARK_ROWS), and shardformer.plan.split_gather_layer /
split_gather_ends write a layer stack's regions with them.  The ten role
strings of earlier policies are names for the same values (ROLE_LAYOUTS:
role="block" is BLOCK, SequenceLayouts(input=Move(ROWS, FULL_PARTIAL_GRAD),
output=Move(PARTIAL_SUM, ROWS))); SequenceParallelRegion still takes them,
with a DeprecationWarning naming the constant to write instead.
Adding a layout is one row of MOVES (and its operator) or one
SequenceLayouts value in a policy: no new hook code.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Placement(enum.Enum):
    """Where a tensor's value (or gradient) lives over the sequence-parallel group."""

    SHARD = "shard"
    REPLICATE = "replicate"
    PARTIAL = "partial"


@dataclass(frozen=True, repr=False)
class Layout:
    """A boundary tensor's `value` placement and that of its `grad`."""

    value: Placement
    grad: Placement

    def __repr__(self) -> str:
        return _NAMES.get(self, f"Layout({self.value}, {self.grad})")


ROWS = Layout(Placement.SHARD, Placement.SHARD)
FULL = Layout(Placement.REPLICATE, Placement.REPLICATE)
FULL_PARTIAL_GRAD = Layout(Placement.REPLICATE, Placement.PARTIAL)
PARTIAL_SUM = Layout(Placement.PARTIAL, Placement.REPLICATE)
_NAMES = {ROWS: "ROWS", FULL: "FULL", FULL_PARTIAL_GRAD: "FULL_PARTIAL_GRAD", PARTIAL_SUM: "PARTIAL_SUM"}

#: every supported move, (src, dst) -> the operator's name in layer/sequence.py's _Hooks
MOVES = {
    (FULL, ROWS): "split",
    (ROWS, FULL): "gather",
    (ROWS, FULL_PARTIAL_GRAD): "gather_partial_grad",
    (PARTIAL_SUM, ROWS): "reduce_scatter",
    (FULL, FULL_PARTIAL_GRAD): "sum_grad",
    (FULL_PARTIAL_GRAD, ROWS): "keep_rows",
    (ROWS, ROWS): "rows",
}


@dataclass(frozen=True, repr=False)
class Move:
    """A tensor taken from layout `src` to layout `dst` (one row of MOVES)."""

    src: Layout
    dst: Layout

    def __post_init__(self):
        if not isinstance(self.src, Layout) or not isinstance(self.dst, Layout):
            raise TypeError(f"Move: src and dst must be Layouts (ROWS, FULL, ...), got "
                            f"{type(self.src).__name__} and {type(self.dst).__name__}")
        if (self.src, self.dst) not in MOVES:
            known = ", ".join(f"{a} -> {b}" for a, b in MOVES)
            raise ValueError(f"Move: no sequence-parallel operator takes {self.src} to {self.dst}; "
                             f"supported: {known} (docs/sequence-layouts.md)")

    @property
    def op(self) -> str:
        return MOVES[(self.src, self.dst)]

    @property
    def saves_rows(self) -> bool:
        """A block's gathered input: backward keeps only this rank's rows of it."""
        return (self.src, self.dst) == (ROWS, FULL_PARTIAL_GRAD)

    def __repr__(self) -> str:
        return f"Move({self.src}, {self.dst})"


@dataclass(frozen=True)
class SequenceLayouts:
    """The moves SequenceParallelRegion applies to one module: `input` (its
    first input), `output` (its output's first tensor), either None for
    none, and `layer` (a layer between the split and the gather; see the
    module docstring)."""

    input: Move | None = None
    output: Move | None = None
    layer: bool = False

    def __post_init__(self):
        for side in ("input", "output"):
            move = getattr(self, side)
            if move is not None and not isinstance(move, Move):
                raise TypeError(f"SequenceLayouts: {side} must be a Move(src, dst) or None, "
                                f"got {type(move).__name__}")
        if self.input is None and self.output is None:
            raise ValueError("SequenceLayouts: neither an input nor an output move (docs/sequence-layouts.md)")
        if self.output is not None and self.output.saves_rows and self.input is not None:
            raise ValueError(f"SequenceLayouts: output {self.output} with an input move {self.input} "
                             f"is not supported")

    @property
    def is_block(self) -> bool:
        """A whole tensor-parallel block (role "block"): input gathered, output reduce-scattered."""
        return (self.input is not None and self.input.saves_rows and self.output is not None
                and self.output.op == "reduce_scatter")

    def __or__(self, other: "SequenceLayouts") -> "SequenceLayouts":
        """Both modules' moves on one module (a layer that takes the split and the gather)."""
        for side in ("input", "output"):
            if getattr(self, side) is not None and getattr(other, side) is not None:
                raise ValueError(f"SequenceLayouts: two {side} moves on one module "
                                 f"({getattr(self, side)} and {getattr(other, side)})")
        return SequenceLayouts(self.input or other.input, self.output or other.output, self.layer or other.layer)


#: The layouts the built-in policies use, by name (docs/sequence-layouts.md).
SPLIT = SequenceLayouts(input=Move(FULL, ROWS), layer=True)             # the first layer: split its input
GATHER = SequenceLayouts(output=Move(ROWS, FULL), layer=True)           # the last layer: gather its output
MARK_ROWS = SequenceLayouts(output=Move(ROWS, ROWS), layer=True)        # a layer between: its rows marked
BLOCK = SequenceLayouts(input=Move(ROWS, FULL_PARTIAL_GRAD), output=Move(PARTIAL_SUM, ROWS))
ENTER = SequenceLayouts(input=Move(ROWS, FULL_PARTIAL_GRAD))            # row layers reduce-scatter themselves
ENTER_OUTPUT = SequenceLayouts(output=Move(ROWS, FULL_PARTIAL_GRAD))
SUM_GRAD = SequenceLayouts(output=Move(FULL, FULL_PARTIAL_GRAD))
LEAVE = SequenceLayouts(input=Move(FULL_PARTIAL_GRAD, ROWS))
GATHER_INPUT = SequenceLayouts(input=Move(ROWS, FULL))
SPLIT_OUTPUT = SequenceLayouts(output=Move(FULL, ROWS))

#: the role strings (the older spelling, still accepted from user policies), each a name for its SequenceLayouts
ROLE_LAYOUTS = {
    "split": SPLIT,
    "gather": GATHER,
    "rows": MARK_ROWS,
    "block": BLOCK,
    "enter": ENTER,
    "enter_output": ENTER_OUTPUT,
    "sum_grad": SUM_GRAD,
    "leave": LEAVE,
    "gather_input": GATHER_INPUT,
    "split_output": SPLIT_OUTPUT,
}
ROLES = tuple(ROLE_LAYOUTS)
#: the name of each role's layouts constant above (the deprecation message)
ROLE_CONSTANTS = {"split": "SPLIT", "gather": "GATHER", "rows": "MARK_ROWS", "block": "BLOCK", "enter": "ENTER",
                  "enter_output": "ENTER_OUTPUT", "sum_grad": "SUM_GRAD", "leave": "LEAVE",
                  "gather_input": "GATHER_INPUT", "split_output": "SPLIT_OUTPUT"}


def role_spelled_as_layouts(role) -> str:
    """How `role` (a role string or a tuple of them) is written in layouts:
    ("split", "rows") -> "SPLIT | MARK_ROWS"."""
    names = role if isinstance(role, tuple) else (role,)
    return " | ".join(ROLE_CONSTANTS[name] for name in names)


def as_layouts(role) -> SequenceLayouts:
    """`role` as SequenceLayouts: a SequenceLayouts itself, a role string, or
    a tuple of role strings (their moves combined on one module)."""
    if isinstance(role, SequenceLayouts):
        return role
    names = role if isinstance(role, tuple) and role else (role,)
    bad = [r for r in names if not isinstance(r, str) or r not in ROLE_LAYOUTS]
    if bad:
        raise ValueError(f"SequenceParallelRegion: role must be a SequenceLayouts, one of {ROLES} or a tuple "
                         f"of them, got {role!r} (docs/sequence-layouts.md)")
    out = ROLE_LAYOUTS[names[0]]
    for name in names[1:]:
        out = out | ROLE_LAYOUTS[name]
    return out
