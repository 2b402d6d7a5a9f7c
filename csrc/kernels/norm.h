/*
 * norm.h -- LayerNorm and RMSNorm over the last dimension of x [rows, n].
 *
 *   LayerNorm: y = (x - mu) * rstd * w + b,  mu = mean(x), rstd = 1/sqrt(var(x) + eps)
 *   RMSNorm:   y = x * rstd * w,             rstd = 1/sqrt(mean(x^2) + eps)
 *
 * x, y, dy, dx have type t; w, b, dw, db, mean, rstd are fp32.  w / b may be
 * NULL (no affine weight / no bias), as may dw / db (not wanted).
 * Backward (xh = normalized x, g = dy * w):
 *   LayerNorm: dx = rstd * (g - mean(g) - xh * mean(g * xh))
 *   RMSNorm:   dx = rstd * (g - xh * mean(g * xh))
 *   dw = sum over rows of dy * xh,  db = sum over rows of dy.
 */
#ifndef SHARDFORMER_KERNELS_NORM_H
#define SHARDFORMER_KERNELS_NORM_H

#include "common.h"

/* rms = 0: LayerNorm (mean written when not NULL); rms = 1: RMSNorm (b ignored). */
sf_status sfk_norm_forward(int rms, sfk_dtype t, const void *x, int64_t rows, int64_t n,
                           const float *w, const float *b, float eps, void *y, float *mean,
                           float *rstd, sf_error *err);
sf_status sfk_norm_backward(int rms, sfk_dtype t, const void *dy, const void *x, int64_t rows,
                            int64_t n, const float *w, const float *mean, const float *rstd,
                            void *dx, float *dw, float *db, sf_error *err);

#endif
