"""The region operators: every autograd function that carries a collective,
as a conjugate pair (forward collective, backward collective), one module
per family:

    tensor.py         tensor-parallel regions (replicated <-> split along a
                      weight's dimension, DimShard layouts)
    sequence.py       sequence regions (split along the sequence, padded,
                      contiguous or zigzag rows; partial sums reduce-scattered)
    heads.py          head regions (Ulysses all-to-all, attention weights
                      gathered along the heads)
    gather_linear.py  the column-parallel linear that gathers its own input
                      rows with asynchronous, overlapped collectives

    operator                            forward                  backward
    copy_to_tp_region                   identity                 all-reduce
    reduce_from_tp_region               all-reduce               identity
    scatter_to_tp_region                keep own slice           all-gather
    gather_from_tp_region               all-gather               keep own slice
    sync_replicated_grad                identity                 sum grads over ranks
                                                                 that hold the same rows
    split_sequence_rows                 keep own rows (padded)   all-gather (rows placed,
                                                                 padding dropped)
    gather_sequence_rows                all-gather (rows         keep own rows
                                        placed, pad dropped)
    keep_sequence_rows                  keep own rows            zeros elsewhere (partial)
    gather_from_sequence_region         all-gather (seq)         reduce-scatter (seq)
    reduce_scatter_to_sequence_region   reduce-scatter (seq)     all-gather (seq)
    reduce_scatter_rows                 pad, reduce-scatter      all-gather, pad dropped
                                        (tokens)
    all_to_all_along                    all-to-all (scatter one  all-to-all, the two
                                        dim, gather another)     dims swapped
    gather_heads                        all-gather (heads)       keep own heads
    GatherRowsLinear                   all-gather X, X A^T      re-gather X, reduce-scatter dX

Every collective runs on the group's communicator (communicator.py), and
asynchronous ones through its async_op calls: no operator here or in
layer/ asks which backend it runs on.  The ring attention kernel
(layer/ring_attention.py) keeps its autograd function next to the flash
kernel it drives; its K/V travel by the communicator's `exchange`.
"""
from .gather_linear import GatherRowsLinear, start_all_gather, start_reduce_scatter
from .heads import all_to_all_along, gather_heads
from .sequence import (
    SequenceRows,
    all_gather_even,
    gather_from_sequence_region,
    gather_sequence_rows,
    keep_sequence_rows,
    pad_to,
    padded_length,
    reduce_scatter_rows,
    reduce_scatter_to_sequence_region,
    segment_rows,
    split_sequence_rows,
    token_dim,
)
from .tensor import (
    gather_along,
    split_along,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
    sync_replicated_grad,
)

__all__ = [
    "SequenceRows",
    "all_to_all_along",
    "copy_to_tp_region",
    "gather_from_sequence_region",
    "gather_from_tp_region",
    "gather_heads",
    "gather_sequence_rows",
    "keep_sequence_rows",
    "pad_to",
    "segment_rows",
    "padded_length",
    "reduce_from_tp_region",
    "reduce_scatter_rows",
    "reduce_scatter_to_sequence_region",
    "scatter_to_tp_region",
    "split_sequence_rows",
    "start_all_gather",
    "start_reduce_scatter",
    "sync_replicated_grad",
    "token_dim",
]
