"""Checkpoints of sharded models.

full.py        gather_full_state_dict / load_full_state_dict: HF-shaped tensors
               in memory, any TP size.
reader.py      CheckpointReader: a HF checkpoint's names, shapes and dtypes from
               the headers, and any rank's slices of its tensors.
pretrained.py  load_pretrained: a HF checkpoint into a sharded (or plain) model,
               each rank reading only its slices (ShardFormer.from_pretrained
               builds on it).
save.py        save_pretrained / push_to_hub: an ordinary HF checkpoint from a
               sharded model, streamed tensor by tensor.
sharded.py     save_sharded / load_sharded: every rank's own shards and a
               manifest; loads at the same or another TP size.
dcp.py         get_state_dict / set_state_dict: state dicts (model and
               optimizer) for torch.distributed.checkpoint, every split
               tensor placed exactly (PlacedShard), reshardable on load.
state.py       save_state / load_state: the whole training state (model,
               optimizer, scheduler, step, random state) through DCP,
               atomic, optionally asynchronous; exact resume.
mapped.py      tensors over a checkpoint file's bytes, mapped copy-on-write
               (what from_pretrained aliases), and materialize_mapped.
atomic.py      directories that appear complete or not at all (both savers).
"""
from .dcp import PlacedShard, get_state_dict, set_state_dict
from .full import gather_full_state_dict, load_full_state_dict, shard_info  # noqa: F401
from .mapped import materialize_mapped
from .pretrained import load_pretrained
from .reader import CheckpointReader
from .save import bind_hf_methods, push_to_hub, save_pretrained  # noqa: F401
from .sharded import load_sharded, save_sharded
from .state import SaveHandle, load_state, save_state

_shard_info = shard_info   # the name tests and user code imported before it was public

__all__ = ["CheckpointReader", "PlacedShard", "gather_full_state_dict", "get_state_dict", "load_full_state_dict",
           "load_pretrained", "load_sharded", "load_state", "materialize_mapped", "push_to_hub", "save_pretrained",
           "save_sharded", "save_state", "SaveHandle", "set_state_dict"]
