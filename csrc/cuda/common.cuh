/*
 * cuda/common.cuh -- what the .cu files share: element loads / stores
 * (fp32 arithmetic, 16-bit stores rounded to nearest even), a block-wide
 * sum, grid sizing for grid-stride loops, the dtype switch that instantiates
 * a kernel for the three types, and the launch-error check.
 */
#ifndef SHARDFORMER_CUDA_COMMON_CUH
#define SHARDFORMER_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda/kernels.h"

namespace sfc {

constexpr int kThreads = 256;              /* threads per block, a multiple of 32 */
constexpr int64_t kMaxBlocks = 1 << 20;    /* grid-stride loops cover the rest */

__device__ __forceinline__ float load(const float *p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const __half *p, int64_t i) { return __half2float(p[i]); }
__device__ __forceinline__ float load(const __nv_bfloat16 *p, int64_t i) { return __bfloat162float(p[i]); }

__device__ __forceinline__ void store(float *p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__half *p, int64_t i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ void store(__nv_bfloat16 *p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }

/* Blocks for `work` items of `per` items per block, at least 1, at most kMaxBlocks. */
inline unsigned blocks_for(int64_t work, int64_t per)
{
    int64_t b = work / per + (work % per != 0);
    return (unsigned)(b < 1 ? 1 : b > kMaxBlocks ? kMaxBlocks : b);
}

/* Sum of v over the block (blockDim.x a multiple of 32, at most 1024); every
 * thread gets the result.  `shm` holds 32 floats; the call synchronizes the
 * block twice, so it may be called again right after. */
__device__ __forceinline__ float block_sum(float v, float *shm)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();                       /* shm free from any earlier call */
    if (lane == 0) shm[warp] = v;
    __syncthreads();
    v = lane < nw ? shm[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Max of v over the block, as block_sum. */
__device__ __forceinline__ float block_max(float v, float *shm)
{
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) shm[warp] = v;
    __syncthreads();
    v = lane < nw ? shm[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* f(i) for every i in [0, total), grid-stride (the elementwise kernels). */
template <class F>
__global__ void each(F f, int64_t total)
{
    const int64_t step = (int64_t)blockDim.x * gridDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) f(i);
}

template <class F>
inline void launch_each(const F &f, int64_t total, cudaStream_t stream)
{
    each<<<blocks_for(total, kThreads), kThreads, 0, stream>>>(f, total);
}

/* Column sums over a [rows, n] array: out0[j] = sum_r f(r, j).x, out1[j] =
 * sum_r f(r, j).y (each output may be NULL), in fp32: the weight and bias
 * gradients.  A block takes 32 columns (one per lane: coalesced) and
 * kColLanes row lanes, whose partial sums it adds in shared memory; no
 * atomics, so the sums are the same on every run. */
constexpr int kColLanes = 16;

template <class F>
__global__ void column_sums(F f, int64_t rows, int64_t n, float *out0, float *out1)
{
    __shared__ float s0[kColLanes][33], s1[kColLanes][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    for (int64_t j0 = (int64_t)blockIdx.x * 32; j0 < n; j0 += (int64_t)gridDim.x * 32) {
        const int64_t j = j0 + tx;
        float a = 0.0f, b = 0.0f;
        if (j < n)
            for (int64_t r = ty; r < rows; r += kColLanes) {
                const float2 v = f(r, j);
                a += v.x;
                b += v.y;
            }
        s0[ty][tx] = a;
        s1[ty][tx] = b;
        __syncthreads();
        if (ty == 0 && j < n) {
            for (int k = 1; k < kColLanes; k++) { a += s0[k][tx]; b += s1[k][tx]; }
            if (out0) out0[j] = a;
            if (out1) out1[j] = b;
        }
        __syncthreads();
    }
}

template <class F>
inline void launch_column_sums(const F &f, int64_t rows, int64_t n, float *out0, float *out1,
                               cudaStream_t stream)
{
    column_sums<<<blocks_for(n, 32), dim3(32, kColLanes), 0, stream>>>(f, rows, n, out0, out1);
}

/* rows * n into *total; EOVERFLOW naming the kernel when it overflows int64. */
inline sf_status elements(const char *fn, int64_t rows, int64_t n, int64_t *total, sf_error *err)
{
    if (sf_mul_overflows(rows, n, total))
        return sf_fail(err, SF_EOVERFLOW, "%s: rows x n (%lld x %lld) overflows int64", fn,
                       (long long)rows, (long long)n);
    return SF_OK;
}

/* The id checks of xent_forward / embedding_forward on device ids
 * (common.cu): over ids[0:count], *first = the first index whose id is
 * outside [0, vocab) and not `ignore` (when has_ignore), count when none;
 * *lo / *hi the smallest / largest id (INT64_MAX / INT64_MIN when count is
 * 0), and *first_id the id at *first.  Synchronizes the stream. */
sf_status id_range(const char *fn, const int64_t *ids, int64_t count, int has_ignore,
                   int64_t ignore, int64_t vocab, cudaStream_t stream, int64_t *first,
                   int64_t *first_id, int64_t *lo, int64_t *hi, sf_error *err);

/* SF_EEXTERNAL naming the kernel when the launch failed, else SF_OK. */
inline sf_status launched(const char *fn, sf_error *err)
{
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return sf_fail(err, SF_EEXTERNAL, "%s: CUDA kernel launch failed: %s (%s)", fn,
                       cudaGetErrorString(e), cudaGetErrorName(e));
    return SF_OK;
}

/* SF_EEXTERNAL naming the kernel and the CUDA call that failed. */
inline sf_status cuda_call(const char *fn, const char *what, cudaError_t e, sf_error *err)
{
    if (e != cudaSuccess)
        return sf_fail(err, SF_EEXTERNAL, "%s: %s failed: %s (%s)", fn, what,
                       cudaGetErrorString(e), cudaGetErrorName(e));
    return SF_OK;
}

}  // namespace sfc

/* Run `body` with T the element type of `t` (float, __half, __nv_bfloat16);
 * the caller has checked t with sfk_check_dtype. */
#define SFC_DISPATCH(t, ...)                                          \
    do {                                                              \
        if ((t) == SFK_F32) { using T = float; __VA_ARGS__; }         \
        else if ((t) == SFK_F16) { using T = __half; __VA_ARGS__; }   \
        else { using T = __nv_bfloat16; __VA_ARGS__; }                \
    } while (0)

#endif /* SHARDFORMER_CUDA_COMMON_CUH */
