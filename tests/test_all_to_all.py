"""All-to-all (Ulysses sequence parallelism): `all_to_all_single` on every
communicator that runs on CPU (shm, torch/gloo, the checked wrapper, a group
of one) and the `all_to_all_along` region operator.  The rank-side functions
are in tests/checks/all_to_all.py."""
from __future__ import annotations

import pytest
import torch

from checks import all_to_all as a2a
from shardformer import _C
from shardformer.distributed import all_to_all_along, all_to_all_single
from shardformer.distributed import communicator as cm

SHAPES = [(1,), (3, 5), (2, 3, 4), (0, 4)]  # dimension 0 per rank (times p in the check)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_single_equals_reference(pool, tp, backend):
    dtypes = ["float32", "bfloat16", "int32", "int64"]
    if backend == "shm":  # moves bytes: any dtype, with odd element sizes
        dtypes += ["float16", "float64", "uint8", "bool"]
    for res in pool.run(a2a.single_vs_reference, tp, backend, dtypes, SHAPES):
        assert res["backend"] == backend
        assert res["done"] == len(dtypes) * len(SHAPES) + 1
        assert res["c_calls"] == (res["done"] if backend == "shm" else 0), res


def test_single_three_ranks_auto(pool):
    """A group size that is not a power of two, backend picked automatically (shm)."""
    for res in pool.run(a2a.single_vs_reference, 3, "auto", ["float32", "int8"], SHAPES):
        assert res["backend"] == "shm" and res["c_calls"] == res["done"], res


@pytest.mark.parametrize("tp", [2, 4])
def test_shm_messages_larger_than_workspace(pool, tp):
    for res in pool.run(a2a.large_messages, tp):
        assert max(res["rounds"]) >= 4, res  # several rounds per block
        assert res["workspace"] == 2 << 20 and res["c_calls"] == 1, res


@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_bad_arguments_raise_before_communicating(pool, backend):
    for res in pool.run(a2a.bad_arguments, 2, backend):
        assert res["c_calls_bad"] == 0, res
        assert res["c_calls"] == (1 if backend == "shm" else 0), res
        for key, want in {
            "shape": "out has shape (4, 4) but tensor has shape (4, 3)",
            "dtype": "out is torch.int32 but tensor is torch.float32 (shape (4, 3))",
            "divisible": "dimension 0 of length 5 is not divisible by the group size 2",
            "scalar": "tensor is a scalar",
            "overlap": "share memory",
            "partial_overlap": "share memory",
            "along_divisible": "scatter_dim=1 of length 5 (shape (2, 5, 4, 3), gather_dim=2) is not "
                               "divisible by the group size 2",
            "along_dim": "scatter_dim=4 is out of range for a tensor of shape (2, 4, 4, 3)",
        }.items():
            assert res[key].startswith("ValueError") and want in res[key], (key, res[key])
        if backend == "shm":
            assert res["c_numel"].startswith("ValueError") and "out has 4 elements but tensor has 5" in res["c_numel"]
            assert "not divisible into 2 equal blocks" in res["c_blocks"], res["c_blocks"]
            assert res["c_dtype"].startswith(("ValueError", "TypeError")) and "int32" in res["c_dtype"], res["c_dtype"]


@pytest.mark.parametrize("tp", [2, 4])
def test_shm_mismatch_raises_on_every_rank(pool, tp):
    res = pool.run(a2a.mismatched_calls, tp, "shm", False)
    for r, out in enumerate(res):
        assert out["type"] == "ShmBackend"
        for key in ("count", "dtype", "kind"):
            assert out[key].startswith("RuntimeError") and "collective mismatch" in out[key], (r, key, out[key])
        assert f"rank 0 called all_to_all({8 * tp} bytes, float32), rank 1 called all_to_all({16 * tp} bytes, " \
               f"float32)" in out["count"], out["count"]
        assert f"rank 1 called all_to_all({8 * tp} bytes, int32)" in out["dtype"], out["dtype"]
        assert f"rank 1 called all_gather({8 * tp} bytes, float32)" in out["kind"], out["kind"]
        assert out["after"] is True


@pytest.mark.parametrize("tp", [2, 4])
def test_checked_torch_mismatch_raises_on_every_rank(pool, tp):
    res = pool.run(a2a.mismatched_calls, tp, "torch", True)
    for r, out in enumerate(res):
        assert out["type"] == "CheckedCommunicator"
        for key in ("count", "dtype", "kind"):
            assert out[key].startswith("RuntimeError") and "SHARDFORMER_CHECK_COLLECTIVES" in out[key], (r, key)
        assert f"rank 0 calls all_to_all_single of {2 * tp} float32 elements in all" in out["count"], out["count"]
        assert f"all_to_all_single of {4 * tp} float32 elements in all" in out["count"], out["count"]
        assert f"all_to_all_single of {2 * tp} int32 elements in all" in out["dtype"], out["dtype"]
        assert "all_gather_into_tensor" in out["kind"], out["kind"]
        if r == 1:
            assert out["bad_args"].startswith("ValueError") and "out has shape" in out["bad_args"], out
        else:
            assert "rank(s) [1]" in out["bad_args"] and "rejected" in out["bad_args"], out["bad_args"]
        assert out["after"] is True


PAIRS = [(1, 2), (2, 1), (0, 3), (-1, 1)]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_along_forward_backward(pool, tp, backend):
    for res in pool.run(a2a.along_forward_backward, tp, backend, PAIRS):
        # forward + backward per (pair, dtype), and the round trip's two forwards
        assert res["c_calls"] == (2 * 2 * len(PAIRS) + 2 if backend == "shm" else 0), res


@pytest.mark.parametrize("tp", [2, 4])
def test_shm_c_path_runs(pool, tp):
    for res in pool.run(a2a.shm_path_counts, tp):
        assert res == {"backend": "shm", "type": "ShmBackend", "single": 1, "along": 2,
                       "mappings_has": True}, res


def test_group_of_one():
    """No process group: all_to_all_along is the identity, all_to_all_single a copy."""
    saved = a2a._set_env(cm.ENV, None)
    cm.reset_communicators()
    try:
        x = torch.randn(2, 4, 3, 5)
        assert all_to_all_along(x, 1, 2) is x
        out = torch.empty_like(x)
        assert all_to_all_single(out, x) is out and torch.equal(out, x)
        with pytest.raises(ValueError, match="out has shape"):
            all_to_all_single(torch.empty(3), x)
        with pytest.raises(ValueError, match="gather_dim=-5 is out of range"):
            all_to_all_along(x, 1, -5)
    finally:
        a2a._set_env(cm.ENV, saved)
        cm.reset_communicators()


def test_c_entry_points_check_their_arguments():
    with pytest.raises(TypeError, match="shm communicator"):
        _C.shm_all_to_all(object(), torch.ones(2), torch.ones(2))
    # NCCL: the tensors are checked first (CUDA, contiguous, one dtype), then the communicator
    with pytest.raises(ValueError, match="nccl_all_to_all: out: expected a CUDA tensor"):
        _C.nccl_all_to_all(object(), torch.ones(2), torch.ones(2))


def test_nccl_glue_checks_before_the_communicator():
    """No GPU here: the NCCL entry point takes (fake) CUDA tensors through the
    DLPack gate and gets as far as the communicator; NcclCommunicator.all_to_all
    hands its tensors to it."""
    import numpy as np

    from shardformer.distributed import nccl
    from test_c_core import FakeTensor

    f32 = FakeTensor(np.zeros(12, np.float32), device_type=2)
    with pytest.raises(TypeError, match="^nccl_all_to_all: expected an NCCL communicator"):
        _C.nccl_all_to_all(None, f32, FakeTensor(np.zeros(12, np.float32), device_type=2), 0)
    with pytest.raises(TypeError, match="out has dtype float32 but tensor has dtype int64"):
        _C.nccl_all_to_all(None, f32, FakeTensor(np.zeros(12, np.int64), device_type=2), 0)
    comm = nccl.NcclCommunicator.__new__(nccl.NcclCommunicator)
    comm.rank, comm.size, comm._comm = 0, 2, "not a communicator"
    with pytest.raises(ValueError, match="nccl_all_to_all: out: expected a CUDA tensor"):
        comm.all_to_all(torch.empty(4), torch.ones(4, requires_grad=True))
