"""Issue 33 items 2 and 3: the communicator owns the backend (asynchronous
calls with wait handles on every backend) and sequence parallelism spoken in
typed input / output layouts (shardformer.distributed.mappings)."""
import pytest

from checks import regions as check


@pytest.mark.parametrize("tp", [2, 4])
def test_async_handles_on_gloo_and_shm(pool, tp):
    """all_gather / reduce_scatter / all_reduce with async_op=True and the ring exchange, on the torch
    (gloo) and shm backends, on 2 and 4 ranks (4: a ring whose neighbours differ in both directions)."""
    for report in pool.run(check.async_handles, tp, ("torch", "shm")):
        assert set(report) == {"torch", "shm"}


def test_role_strings_are_typed_layouts():
    """Each role string names a SequenceLayouts (input / output moves between typed layouts); tuples combine."""
    from shardformer.layer.sequence import (FULL, FULL_PARTIAL_GRAD, PARTIAL_SUM, ROLE_LAYOUTS, ROWS, Move,
                                            SequenceLayouts, SequenceParallelRegion, as_layouts)

    assert SequenceParallelRegion.ROLES == tuple(ROLE_LAYOUTS) and len(ROLE_LAYOUTS) == 10
    block = SequenceLayouts(input=Move(ROWS, FULL_PARTIAL_GRAD), output=Move(PARTIAL_SUM, ROWS))
    assert as_layouts("block") == block and block.is_block and as_layouts(block) is block
    assert as_layouts(("split", "gather")) == SequenceLayouts(Move(FULL, ROWS), Move(ROWS, FULL), layer=True)
    assert as_layouts("enter").output is None and as_layouts("enter").input.saves_rows
    assert repr(as_layouts("leave")) == "SequenceLayouts(input=Move(FULL_PARTIAL_GRAD, ROWS), output=None, layer=False)"


def test_bad_layouts_refused_before_anything_changes():
    """A move no operator makes, two moves on one side, both or neither of role= / layouts=, overlap on a
    non-block: ValueError / TypeError naming what disagrees, and the module keeps no hook."""
    import torch

    from shardformer.layer.sequence import (FULL, PARTIAL_SUM, ROWS, Move, SequenceLayouts, SequenceParallelRegion,
                                            SequenceState, as_layouts)

    with pytest.raises(ValueError, match=r"takes ROWS to PARTIAL_SUM; supported: FULL -> ROWS"):
        Move(ROWS, PARTIAL_SUM)
    with pytest.raises(TypeError, match="must be Layouts"):
        Move("rows", FULL)
    with pytest.raises(ValueError, match="two output moves"):
        as_layouts(("gather", "rows"))
    with pytest.raises(ValueError, match=r"role must be a SequenceLayouts, one of .*got 'blocks'"):
        as_layouts("blocks")
    with pytest.raises(ValueError, match="neither an input nor an output move"):
        SequenceLayouts()
    module, state = torch.nn.Linear(2, 2), SequenceState()
    for kwargs, error, text in [
        ({"role": "block", "layouts": as_layouts("block")}, ValueError, "exactly one of role= and layouts="),
        ({}, ValueError, "exactly one of role= and layouts="),
        ({"layouts": "block"}, TypeError, "layouts must be a SequenceLayouts, got str"),
        ({"layouts": as_layouts("enter"), "overlap": True}, ValueError, r"overlap=True needs a block"),
    ]:
        with pytest.raises(error, match=text):
            SequenceParallelRegion.from_native_module(module, None, state=state, **kwargs)
        assert not module._forward_pre_hooks and not module._forward_hooks


@pytest.mark.parametrize("tp", [2, 4])
def test_typed_layouts_equal_unsharded(pool, tp):
    """Llama (blocks, split / rows / gather) and GPT-2 (regions entered, the row layer reduce-scatters) with
    every region given as typed layouts, against the unsharded model; TP=4: 6 heads / 2 KV heads, uneven."""
    for name in ("LlamaForCausalLM", "GPT2LMHeadModel"):
        for report in pool.run(check.typed_layouts_equal_unsharded, tp, name):
            assert report["regions"] > 0


def test_typed_layouts_default_config_overlap(pool2):
    """The plain ShardConfig() (the world as the group) with enable_sequence_overlap: typed blocks that overlap."""
    pool2.run(check.typed_layouts_equal_unsharded, 2, "LlamaForCausalLM", True, True)
