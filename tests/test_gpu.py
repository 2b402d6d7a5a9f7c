"""The CPU checks on a CUDA GPU (marked `gpu`: skipped without one;
scripts/device_check.sh runs them, docs/gpu.md): two rank processes share
the one GPU over gloo with CUDA tensors (NCCL refuses two ranks on one
device), so the collectives take the staged route of
StagedTorchCommunicator for the operations gloo cannot run on CUDA.

  * every family at TP=2 (one class each), against the unsharded model on
    the same GPU, fp32 without TF32: forward, loss, every gradient, after a step;
  * the plain ShardConfig() (default group = the world);
  * a lazy model moved to CUDA, sharded and loaded from a HF checkpoint;
  * sequence parallelism: split_gather, all_to_all, ring_attn, overlap;
  * a 2-stage 1F1B pipeline;
  * the direct NCCL path (SHARDFORMER_COMM=nccl) when two GPUs are visible.
"""
import pytest
import torch

import zoo
from checks import cuda_comm, gpu, lazy

pytestmark = pytest.mark.gpu

FAMILIES = {family: classes[0] for family, classes in zoo.family_classes().items()}


@pytest.mark.parametrize("name", sorted(FAMILIES.values()))
def test_family_tp2(pool2, name):
    reports = pool2.run(gpu.family, 2, name)
    assert all(r["tp"] == 2 for r in reports)


def test_default_group(world_pool):
    world_pool(2).run(gpu.default_group, 2, "LlamaForCausalLM")


def test_lazy_pretrained_to_cuda(pool2, tmp_path):
    lazy.save_reference("LlamaForCausalLM", str(tmp_path))
    pool2.run(gpu.lazy_pretrained, 2, "LlamaForCausalLM", str(tmp_path))


@pytest.mark.parametrize("mode", ["split_gather", "all_to_all", "ring_attn"])
def test_sequence_parallel(pool2, mode):
    pool2.run(gpu.sp, 2, "LlamaForCausalLM", mode)


def test_sequence_overlap(pool2):
    reports = pool2.run(gpu.sp_overlap, 2, "GPT2LMHeadModel")
    assert all(r["overlapped"] > 0 for r in reports)


def test_pipeline_1f1b(pool2):
    reports = pool2.run(gpu.pp, 2, "LlamaForCausalLM", "1f1b", 4)
    assert all(r["sent"] > 0 for r in reports)


def test_direct_nccl(pool2):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"the direct NCCL path needs a GPU per rank: {torch.cuda.device_count()} visible "
                    f"(NCCL refuses two ranks on one device)")
    reports = pool2.run(cuda_comm.direct_nccl, 2)
    assert "all_to_all_single" in reports[0]["checked"]
