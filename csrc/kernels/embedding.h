/*
 * embedding.h -- lookup in this rank's rows of a vocabulary-split table.
 *
 * The table W [rows, d] holds vocabulary ids [vocab_start, vocab_start +
 * real) in its first `real` rows (the rest is padding).
 *   forward:  out[i] = W[ids[i] - vocab_start] when the id is one of ours, else 0;
 *             with vocab >= 0 (the real vocabulary of all shards) every id must
 *             be in [0, vocab) (ERANGE otherwise, checked in one pass before
 *             any work; ids are the same on every rank, so no collective is
 *             needed); vocab < 0 checks nothing
 *   backward: dW[ids[i] - vocab_start] += dout[i] for our ids, skipping
 *             padding_idx (local row index, -1 for none); dW is fp32 and
 *             accumulates (the caller zeroes it).
 *   grad:     the same sums written, not accumulated: every row of dW [rows, d]
 *             (dout's dtype; rows >= real) is written once -- the sum over
 *             i of dout[i] (in ascending i, in fp32, rounded to the dtype once)
 *             for a row some id of ours hits, 0 for every other row (padding
 *             rows, padding_idx, untouched rows).  dW may hold anything
 *             before: no zeroed buffer is needed, so a recycled one serves.
 * vocab_start must be >= 0.
 */
#ifndef SHARDFORMER_KERNELS_EMBEDDING_H
#define SHARDFORMER_KERNELS_EMBEDDING_H

#include "common.h"

sf_status sfk_embedding_forward(sfk_dtype t, const void *weight, int64_t d, int64_t real,
                                const int64_t *ids, int64_t count, int64_t vocab_start,
                                int64_t vocab, void *out, sf_error *err);
sf_status sfk_embedding_backward(sfk_dtype t, const void *dout, const int64_t *ids, int64_t count,
                                 int64_t d, int64_t real, int64_t vocab_start,
                                 int64_t padding_local, float *dweight, sf_error *err);

sf_status sfk_embedding_grad(sfk_dtype t, const void *dout, const int64_t *ids, int64_t count,
                             int64_t d, int64_t rows, int64_t real, int64_t vocab_start,
                             int64_t padding_local, void *dweight, sf_error *err);

#endif
