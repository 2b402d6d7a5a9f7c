"""Ranks that must agree do, or raise naming the ranks within seconds (issue 30):
generate() samples in lock-step whatever each rank seeded (equal to the
unsharded model seeded as rank 0), clip_grad_norm_ refuses gradients present
on some ranks only, mesh() / PipelineStageManager / optimize() check their
arguments across ranks before waiting on each other, pipeline and tensor
parallelism over the same ranks is refused, and optimize() from two threads
at once is serialized."""
import contextlib

import pytest

from checks import agree as check


@contextlib.contextmanager
def short_calls(pool, seconds: float = 60):
    """A stuck call (today's hangs) fails in `seconds`, not the pool's 240."""
    old = pool.call_timeout
    pool.call_timeout = seconds
    try:
        yield
    finally:
        pool.call_timeout = old


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_generate_samples_in_lockstep(pool, name, tp):
    out = pool.run(check.generate_in_lockstep, tp, name)
    assert all(o == out[0] for o in out)


def test_generate_in_lockstep_default_group(pool):
    out = pool.run(check.generate_in_lockstep, 4, "LlamaForCausalLM", default_group=True)
    assert all(o == out[0] for o in out)


@pytest.mark.parametrize("how", ["settings", "inputs", "logits"])
def test_generate_diverging_ranks_named(pool, how):
    with short_calls(pool):
        pool.run(check.generate_diverging_refused, 2, "LlamaForCausalLM", how)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("which", ["replicated", "sharded"])
def test_clip_refuses_gradient_missing_on_some_ranks(pool, which, tp):
    with short_calls(pool):
        pool.run(check.grad_missing_refused, tp, which)


def test_mesh_sizes_disagree(pool):
    with short_calls(pool):
        msgs = pool.run(check.mesh_sizes_disagree, 4)
    assert len(set(msgs)) >= 1


@pytest.mark.parametrize("default_group", [False, True])
def test_tp_and_pp_over_the_same_ranks_refused(pool, default_group):
    with short_calls(pool):
        pool.run(check.tp_and_pp_same_ranks_refused, 4 if default_group else 2, default_group)


def test_stage_managers_disagree(pool):
    with short_calls(pool):
        pool.run(check.stage_managers_disagree, 2)


def test_optimize_switches_disagree(pool):
    with short_calls(pool):
        pool.run(check.optimize_disagrees, 2)


def test_optimize_groups_disagree(pool):
    with short_calls(pool):
        pool.run(check.optimize_groups_disagree, 4)


@pytest.mark.parametrize("default_group", [False, True])
def test_concurrent_optimize(pool, default_group):
    with short_calls(pool):
        out = pool.run(check.concurrent_optimize, 4 if default_group else 2, default_group)
    assert all(len(o) == 2 for o in out)
