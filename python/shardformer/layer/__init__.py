"""Parallel layers that the sharder substitutes for HuggingFace modules."""
from .dropout import DropoutForParallelInput, DropoutForReplicatedInput
from .embedding import Embedding1D, VocabParallelEmbedding1D
from .linear import (
    FusedLinear1D_Col,
    GPT2FusedLinearConv1D_Col,
    GPT2FusedLinearConv1D_Row,
    Linear1D_Col,
    Linear1D_Row,
    VocabParallelLMHead1D,
)
from .loss import cross_entropy_1d
from .normalization import FusedLayerNorm, FusedRMSNorm
from .parallel_module import ParallelModule, ShardPlan
from .sequence import SequenceParallelRegion, SequenceState

__all__ = [
    "DropoutForParallelInput",
    "DropoutForReplicatedInput",
    "Embedding1D",
    "FusedLayerNorm",
    "FusedLinear1D_Col",
    "FusedRMSNorm",
    "GPT2FusedLinearConv1D_Col",
    "GPT2FusedLinearConv1D_Row",
    "Linear1D_Col",
    "Linear1D_Row",
    "ParallelModule",
    "SequenceParallelRegion",
    "SequenceState",
    "ShardPlan",
    "VocabParallelEmbedding1D",
    "VocabParallelLMHead1D",
    "cross_entropy_1d",
]
