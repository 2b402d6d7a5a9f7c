/*
 * layout.h -- shard layout arithmetic and the shard copy kernel.
 *
 * Plain C over integers and pointers; no Python.  Every function returns an
 * sf_status (status.h) and, on error, writes a message naming the argument
 * into `err`: EINVAL for bad layouts, ERANGE for ranges outside a tensor.
 *
 * Vocabulary used throughout:
 *   parts  -- the tensor-parallel size (number of ranks in the group)
 *   rank   -- this rank's index in the group, 0 <= rank < parts
 *   unit   -- the smallest piece a dimension may be cut into (a head's width,
 *             a vocabulary padding multiple, 1 for plain features)
 * Uneven splits give the first (units % parts) ranks one unit more.
 */
#ifndef SHARDFORMER_LAYOUT_H
#define SHARDFORMER_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

typedef struct {
    int64_t offset; /* first index along the split dimension */
    int64_t length; /* number of indices */
} sf_range;

/* Units [*start, *start + *count) of `units` belong to `rank`. */
sf_status sf_split_units(int64_t units, int64_t parts, int64_t rank,
                         int64_t *start, int64_t *count, sf_error *err);

/* Attention heads of one rank.  KV heads are split over the ranks; when
 * there are fewer KV heads than ranks, each KV head is replicated on
 * parts / num_kv_heads consecutive ranks, which split its query group.
 * Query heads always follow their KV head (q head h uses kv head
 * h / (num_heads / num_kv_heads)). */
sf_status sf_heads_layout(int64_t num_heads, int64_t num_kv_heads, int64_t parts, int64_t rank,
                          int64_t *q_start, int64_t *q_count,
                          int64_t *kv_start, int64_t *kv_count, sf_error *err);

/* Vocabulary padded to a multiple of parts * multiple, split evenly.
 * Rows [*start, *start + *per_rank) of the padded table are this rank's;
 * the first *real of them are real rows (the rest are padding). */
sf_status sf_vocab_layout(int64_t vocab, int64_t parts, int64_t rank, int64_t multiple,
                          int64_t *padded, int64_t *start, int64_t *per_rank, int64_t *real,
                          sf_error *err);

/* A split spec: how one dimension is cut (shardformer.layout's SplitSpec).
 *   SPLIT    equal runs of `unit` indices
 *   VOCAB    a vocabulary padded to a multiple of parts * unit (sf_vocab_layout)
 *   HEADS    the query (part 0) or KV (part 1) heads of sf_heads_layout
 *   GROUPED  [q heads of KV group 0 | k | v | q heads of group 1 | ...]
 *   FUSED    segments laid end to end, each cut by its own spec
 * head_dim, when > 0, fixes the length the spec describes (HEADS, GROUPED). */
typedef enum { SF_SPEC_SPLIT, SF_SPEC_VOCAB, SF_SPEC_HEADS, SF_SPEC_GROUPED, SF_SPEC_FUSED } sf_spec_kind;

typedef struct sf_spec {
    sf_spec_kind kind;
    const char *describe;          /* the spec in words, for messages */
    int64_t unit;                  /* SPLIT: the unit; VOCAB: the padding multiple */
    int64_t num_heads, num_kv_heads, head_dim, part; /* HEADS, GROUPED */
    const struct sf_spec *segments; /* FUSED */
    int64_t nsegments;
} sf_spec;

/* A growable list of ranges (malloc'd; sf_range_list_free). */
typedef struct {
    sf_range *v;
    int64_t n, cap;
} sf_range_list;

void sf_range_list_free(sf_range_list *l);

/* The full length `spec` describes, or -1 in *out when it does not say
 * (EOVERFLOW when it overflows int64). */
sf_status sf_spec_expected(const sf_spec *spec, int64_t *out, sf_error *err);

/* Append the ranges of a dimension of length `full` cut by `spec` that
 * `rank` of `parts` holds, offset by `base`, to *out; add their count (with
 * a vocabulary's padding rows) to *length.  EINVAL when `full` does not fit
 * the spec, EOVERFLOW, ENOMEM. */
sf_status sf_spec_rank(const sf_spec *spec, int64_t full, int64_t base, int64_t parts, int64_t rank,
                       sf_range_list *out, int64_t *length, sf_error *err);

/* Strided tensor descriptor for the copy kernel. */
typedef struct {
    char *data;
    int ndim;
    const int64_t *shape;
    const int64_t *strides; /* elements */
} sf_strided;

/* Gather direction (to_full == 0): copy the `n` ranges of `full` along `dim`
 * into `shard`, back to back, then zero the rest of `shard` along `dim`.
 * Scatter direction (to_full == 1): the inverse, writing the back-to-back
 * pieces of `shard` into the ranges of `full` (the tail of `shard` past the
 * ranges is ignored).  Both tensors may be arbitrarily strided; they must
 * agree on every dimension except `dim`, and have 1 to SF_MAX_DIMS
 * (tensor_view.h) dimensions.  The destination (`shard`, or `full` when
 * to_full) must not overlap itself (EINVAL: a stride 0 in a dimension of
 * size > 1, as expand() makes, or interleaved strides); a source that shares
 * memory with it is copied first, so the result is always that of separate
 * tensors.  EOVERFLOW when the memory a tensor's strides reach overflows
 * int64, ENOMEM when that copy cannot be made. */
sf_status sf_copy_ranges(const sf_strided *full, const sf_strided *shard, int dim,
                         const sf_range *ranges, int n, int itemsize, int to_full,
                         sf_error *err);

#endif
