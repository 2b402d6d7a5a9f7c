"""The split and the gather of a sequence around one module (split-gather
sequence parallelism of an encoder whose layers are reused: ALBERT's
AlbertTransformer runs its layer groups num_hidden_layers times, so its
hidden states are split at the encoder's input and gathered at its output,
not at a layer list's first and last entries).  With S the sequence and p
the group size: the encoder's input FULL -> ROWS (padded to a multiple of
p, this rank's S'/p rows; backward all-gather), its output's first tensor
or last_hidden_state ROWS -> FULL (all-gather, padding dropped; backward
this rank's rows).  shardformer.spec.SplitGatherSpec(ends="module")."""
from __future__ import annotations

import torch

from .parallel_module import ShardPlan, plan_directly
from .sequence import SequenceState, gather_sequence, split_sequence


class EncoderEnds:
    """The split of a module's input and the gather of its output's first
    tensor (or a ModelOutput's last_hidden_state) along the sequence, for an
    encoder whose layers are reused (ALBERT): both ends on the encoder
    module itself (SPLIT | GATHER of shardformer.layer.sequence,
    for a module that returns a ModelOutput)."""

    @classmethod
    def plan_shard(cls, module, tp_size: int, rank: int, state=None, **kwargs):
        if not isinstance(state, SequenceState):
            raise TypeError(f"EncoderEnds: state must be a SequenceState, got {type(state).__name__}")
        return ShardPlan(tp_size, rank)

    @classmethod
    def prepare_native_module(cls, module, process_group=None, plan=None, state=None, **kwargs):
        if plan is None:
            plan = plan_directly(cls, module, process_group, state=state)
        return _EndHooks(module, state, process_group, active=plan.tp_size > 1)

    @classmethod
    def from_native_module(cls, module, process_group=None, plan=None, state=None, **kwargs):
        return cls.prepare_native_module(module, process_group, plan=plan, state=state).commit()


class _EndHooks:
    def __init__(self, module, state, group, active: bool):
        self.module, self.state, self.group, self.active = module, state, group, active
        self.handles: list = []

    def commit(self):
        if not self.active:
            return self.module
        self.handles = [self.module.register_forward_pre_hook(self.split_input, with_kwargs=True),
                        self.module.register_forward_hook(self.gather_output)]
        return self.module

    def split_input(self, _module, args, kwargs):
        """The encoder's input hidden states cut to this rank's rows (methods,
        not closures: the model pickles)."""
        if args:
            return (split_sequence(args[0], self.state, self.group),) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": split_sequence(kwargs["hidden_states"], self.state, self.group)}

    def gather_output(self, _module, _args, output):
        """The encoder's output rows gathered to the full sequence."""
        if isinstance(output, torch.Tensor):
            return gather_sequence(output, self.state, self.group)
        if isinstance(output, tuple):
            return (gather_sequence(output[0], self.state, self.group),) + tuple(output[1:])
        output.last_hidden_state = gather_sequence(output.last_hidden_state, self.state, self.group)
        return output

    def rollback(self):
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
