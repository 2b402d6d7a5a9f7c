/*
 * cuda/kernels.h -- the CUDA forms of the kernels in csrc/kernels/, as plain
 * launchers over device pointers and sizes (extern "C", callable from C).
 *
 * Each takes what its CPU form takes (same argument order, same meaning,
 * same math: see norm.h, cross_entropy.h, embedding.h, elementwise.h in
 * csrc/kernels/), plus the stream to enqueue on, and returns an sf_status
 * with a message in *err like the CPU kernels (status.h).  Element types
 * are sfk_dtype (fp32 / fp16 / bf16); arithmetic is fp32, 16-bit results
 * are rounded to nearest even once.  Every pointer is device memory of the
 * current device (sfc_device_enter); the launchers return once the work is
 * enqueued, except where they must read device memory to refuse bad input
 * before any work (the vocabulary range checks of xent_forward /
 * embedding_forward when vocab >= 0: one small copy and a stream sync).
 * A failed launch is SF_EEXTERNAL naming the kernel and CUDA's message.
 *
 * Differences from the CPU forms, all within rounding:
 *   - sums run in a different order (per-thread partials, tree reductions);
 *   - embedding_backward adds with atomics (the order of equal ids varies);
 *   - the dropout mask is the CPU one, bit for bit (dropout_hash.h).
 */
#ifndef SHARDFORMER_CUDA_KERNELS_H
#define SHARDFORMER_CUDA_KERNELS_H

#include <stdint.h>

#include "kernels/checks.h"
#include "status.h"

#ifdef __CUDACC__
#include <cuda_runtime.h>
#else
typedef struct CUstream_st *cudaStream_t;   /* as cuda_runtime's driver_types.h declares it */
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Make `device` current for the calls that follow, *prev the device that
 * was; sfc_device_leave(prev) restores it.  EEXTERNAL when CUDA refuses
 * (no such device, no driver). */
sf_status sfc_device_enter(int device, int *prev, sf_error *err);
void sfc_device_leave(int prev);
/* Number of CUDA devices the runtime sees (0 when none or no driver). */
int sfc_device_count(void);

sf_status sfc_norm_forward(int rms, sfk_dtype t, const void *x, int64_t rows, int64_t n,
                           const float *w, const float *b, float eps, void *y, float *mean,
                           float *rstd, cudaStream_t stream, sf_error *err);
sf_status sfc_norm_backward(int rms, sfk_dtype t, const void *dy, const void *x, int64_t rows,
                            int64_t n, const float *w, const float *mean, const float *rstd,
                            void *dx, float *dw, float *db, cudaStream_t stream, sf_error *err);

sf_status sfc_xent_forward(sfk_dtype t, const void *logits, int64_t rows, int64_t n, int64_t real,
                           const int64_t *labels, int64_t vocab_start, int64_t ignore_index,
                           int64_t vocab, float *max, float *sumexp, float *target, float *sumz,
                           cudaStream_t stream, sf_error *err);
sf_status sfc_xent_backward(sfk_dtype t, const void *logits, void *grad, int64_t rows, int64_t n,
                            int64_t real, const int64_t *labels, int64_t vocab_start,
                            int64_t ignore_index, const float *lse, const float *scale,
                            float eps, int64_t vocab, cudaStream_t stream, sf_error *err);

sf_status sfc_embedding_forward(sfk_dtype t, const void *weight, int64_t d, int64_t real,
                                const int64_t *ids, int64_t count, int64_t vocab_start,
                                int64_t vocab, void *out, cudaStream_t stream, sf_error *err);
sf_status sfc_embedding_backward(sfk_dtype t, const void *dout, const int64_t *ids, int64_t count,
                                 int64_t d, int64_t real, int64_t vocab_start,
                                 int64_t padding_local, float *dweight, cudaStream_t stream,
                                 sf_error *err);

sf_status sfc_bias_gelu_forward(sfk_dtype t, const void *x, const float *b, int64_t rows,
                                int64_t n, int tanh_approx, void *y, cudaStream_t stream,
                                sf_error *err);
sf_status sfc_bias_gelu_backward(sfk_dtype t, const void *dy, const void *x, const float *b,
                                 int64_t rows, int64_t n, int tanh_approx, void *dx, float *db,
                                 cudaStream_t stream, sf_error *err);
sf_status sfc_swiglu_forward(sfk_dtype t, const void *gate, const void *up, int64_t numel,
                             void *y, cudaStream_t stream, sf_error *err);
sf_status sfc_swiglu_backward(sfk_dtype t, const void *dy, const void *gate, const void *up,
                              int64_t numel, void *dgate, void *dup, cudaStream_t stream,
                              sf_error *err);
sf_status sfc_bias_dropout_add_forward(sfk_dtype t, const void *x, const float *b,
                                       const void *res, int64_t rows, int64_t n, float p,
                                       uint64_t seed, void *y, cudaStream_t stream,
                                       sf_error *err);
sf_status sfc_bias_dropout_add_backward(sfk_dtype t, const void *dy, int64_t rows, int64_t n,
                                        float p, uint64_t seed, void *dx, float *db,
                                        cudaStream_t stream, sf_error *err);

#ifdef __cplusplus
}
#endif

#endif /* SHARDFORMER_CUDA_KERNELS_H */
