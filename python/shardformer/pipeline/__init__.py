"""Pipeline parallelism: stages of a model's layers on the ranks of a pipeline
group, run by a schedule over micro-batches.

    from shardformer.pipeline import PipelineStageManager, OneForwardOneBackwardSchedule

    sm = PipelineStageManager(pp_group)
    model, shared_params = ShardFormer(ShardConfig(tensor_parallel_process_group=tp_group,
                                                   pipeline_stage_manager=sm)).optimize(model)
    out = OneForwardOneBackwardSchedule(sm, num_microbatches=4).forward_backward_step(model, batch)
    out["loss"]           # the full-batch loss, on every rank of the pipeline

stage_manager.py  which stage this rank is; the layers of each stage
stages.py         the split of a model (policy data: StageSplit) and one stage's run
p2p.py            activations and gradients between stages
schedule.py       GPipe, 1F1B, interleaved 1F1B
zero_bubble.py    ZB-H1 and ZB-V (backward split into B and W)
weight_grads.py   the linears' weight gradients deferred from B to W
"""
from .schedule import GPipeSchedule, InterleavedSchedule, OneForwardOneBackwardSchedule, PipelineSchedule
from .stage_manager import PipelineStageManager
from .stages import StageSplit, StageStack, runtime_of
from .zero_bubble import ZeroBubbleSchedule, ZeroBubbleVSchedule

__all__ = ["PipelineStageManager", "PipelineSchedule", "GPipeSchedule", "OneForwardOneBackwardSchedule",
           "InterleavedSchedule", "ZeroBubbleSchedule", "ZeroBubbleVSchedule", "StageSplit", "StageStack", "runtime_of"]
