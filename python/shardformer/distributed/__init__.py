"""Collectives (one communicator per group and device type, backend chosen
once) and the autograd region operators."""
from .collectives import (
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    backend_for,
    broadcast,
    rank,
    recv,
    reduce_scatter_tensor,
    send,
    world_size,
)
from .communicator import Communicator, get_communicator, reset_communicators
from .failures import PeerFailed
from .mappings import (
    all_to_all_along,
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_tp_region,
    sync_replicated_grad,
)

__all__ = [
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "backend_for",
    "broadcast",
    "rank",
    "recv",
    "reduce_scatter_tensor",
    "send",
    "world_size",
    "Communicator",
    "PeerFailed",
    "get_communicator",
    "reset_communicators",
    "all_to_all_along",
    "copy_to_tp_region",
    "gather_from_sequence_region",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_tp_region",
    "sync_replicated_grad",
]
