/*
 * cross_entropy.h -- cross-entropy over a vocabulary shard of the logits.
 *
 * Logits z [rows, n] hold this rank's columns [vocab_start, vocab_start + n)
 * of the (padded) vocabulary; the first `real` columns are real words, the
 * rest padding that neither forward nor backward looks at.
 */
#ifndef SHARDFORMER_KERNELS_CROSS_ENTROPY_H
#define SHARDFORMER_KERNELS_CROSS_ENTROPY_H

#include "common.h"

/* Per row, in one pass over the real columns:
 *   max[r]    = max_j z_j                       (-inf when real == 0)
 *   sumexp[r] = sum_j exp(z_j - max[r])
 *   target[r] = z_y when label y is a real column of this shard, else 0
 *   sumz[r]   = sum_j z_j                       (only when sumz != NULL)
 * Rows whose label is ignore_index get target 0.  With vocab >= 0 (the real,
 * unpadded vocabulary of all shards) every other label must be in
 * [0, vocab): ERANGE naming the first one outside, before any work (labels
 * are the same on every rank, so the check needs no collective); vocab < 0
 * checks nothing.  vocab_start must be >= 0. */
sf_status sfk_xent_forward(sfk_dtype t, const void *logits, int64_t rows, int64_t n, int64_t real,
                           const int64_t *labels, int64_t vocab_start, int64_t ignore_index,
                           int64_t vocab, float *max, float *sumexp, float *target, float *sumz,
                           sf_error *err);

/* grad[r, j] = scale[r] * (exp(z_j - lse[r]) - eps / vocab - (1 - eps) [j == y])
 * for real columns j, 0 for padding columns and for ignored rows.  `grad`
 * (type t) may be `logits` itself. */
sf_status sfk_xent_backward(sfk_dtype t, const void *logits, void *grad, int64_t rows, int64_t n,
                            int64_t real, const int64_t *labels, int64_t vocab_start,
                            int64_t ignore_index, const float *lse, const float *scale,
                            float eps, int64_t vocab, sf_error *err);

#endif
