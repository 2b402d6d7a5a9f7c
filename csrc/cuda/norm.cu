/*
 * cuda/norm.cu -- LayerNorm / RMSNorm forward and backward on the GPU, the
 * math of csrc/kernels/norm.h:
 *
 *   LayerNorm: y = (x - mu) * rstd * w + b,  mu = mean(x), rstd = 1/sqrt(var(x) + eps)
 *   RMSNorm:   y = x * rstd * w,             rstd = 1/sqrt(mean(x^2) + eps)
 *   backward (xh = (x - mu) * rstd, g = dy * w):
 *     LayerNorm: dx = rstd * (g - mean(g) - xh * mean(g * xh))
 *     RMSNorm:   dx = rstd * (g - xh * mean(g * xh))
 *     dw = sum over rows of dy * xh,  db = sum over rows of dy.
 *
 * One block per row (grid-stride over rows); the row statistics are two
 * passes (mean, then the squared deviations), as on the CPU.  dw / db are a
 * second, column-wise kernel (common.cuh column_sums): deterministic.
 */
#include "cuda/common.cuh"

namespace sfc {
namespace {

template <typename T>
__global__ void norm_fwd(int rms, const T *x, int64_t rows, int64_t n, const float *w,
                         const float *b, float eps, T *y, float *mean, float *rstd)
{
    __shared__ float shm[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = x + r * n;
        T *yr = y + r * n;
        float mu = 0.0f, s = 0.0f;
        if (!rms) {
            for (int64_t j = threadIdx.x; j < n; j += blockDim.x) s += load(xr, j);
            mu = block_sum(s, shm) / (float)n;
            s = 0.0f;
        }
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
            const float d = load(xr, j) - mu;
            s += d * d;
        }
        const float var = block_sum(s, shm) / (float)n;
        const float rs = 1.0f / sqrtf(var + eps);
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
            float v = (load(xr, j) - mu) * rs;
            if (w) v *= w[j];
            if (b && !rms) v += b[j];
            store(yr, j, v);
        }
        if (threadIdx.x == 0) {
            if (mean) mean[r] = mu;
            rstd[r] = rs;
        }
    }
}

template <typename T>
__global__ void norm_bwd(int rms, const T *dy, const T *x, int64_t rows, int64_t n, const float *w,
                         const float *mean, const float *rstd, T *dx)
{
    __shared__ float shm[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = x + r * n, *dyr = dy + r * n;
        const float mu = rms ? 0.0f : mean[r], rs = rstd[r];
        float sg = 0.0f, sgx = 0.0f;
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
            const float g = load(dyr, j) * (w ? w[j] : 1.0f), xh = (load(xr, j) - mu) * rs;
            sg += g;
            sgx += g * xh;
        }
        const float mg = rms ? 0.0f : block_sum(sg, shm) / (float)n;
        const float mgx = block_sum(sgx, shm) / (float)n;
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
            const float xh = (load(xr, j) - mu) * rs;
            store(dx + r * n, j, rs * (load(dyr, j) * (w ? w[j] : 1.0f) - mg - xh * mgx));
        }
    }
}

/* (dy * xh, dy) at (r, j): the summands of dw and db. */
template <typename T>
struct NormParamGrad {
    const T *dy, *x;
    const float *mean, *rstd;
    int64_t n;
    __device__ float2 operator()(int64_t r, int64_t j) const
    {
        const float d = load(dy, r * n + j);
        const float xh = (load(x, r * n + j) - (mean ? mean[r] : 0.0f)) * rstd[r];
        return make_float2(d * xh, d);
    }
};

/* the CPU kernels' checks (kernels/checks.h), and rows x n within int64 */
sf_status check(const char *fn, sfk_dtype t, int64_t rows, int64_t n, const void *x,
                const float *rstd, sf_error *err)
{
    int64_t total;
    sf_status rc = sfk_check_norm_args(fn, t, rows, n, x, rstd, err);
    return rc ? rc : elements(fn, rows, n, &total, err);
}

}  // namespace
}  // namespace sfc

using namespace sfc;

extern "C" sf_status sfc_norm_forward(int rms, sfk_dtype t, const void *x, int64_t rows, int64_t n,
                                      const float *w, const float *b, float eps, void *y,
                                      float *mean, float *rstd, cudaStream_t stream, sf_error *err)
{
    static const char fn[] = "norm_forward (CUDA)";
    sf_status rc;
    if ((rc = check(fn, t, rows, n, x, rstd, err)) ||
        (rc = sfk_check_ptr(fn, "y", y, n > 0 ? rows : 0, err)))
        return rc;
    if (rows == 0)
        return SF_OK;                          /* every output is empty */
    SFC_DISPATCH(t, (norm_fwd<T><<<blocks_for(rows, 1), kThreads, 0, stream>>>(
                         rms, (const T *)x, rows, n, w, b, eps, (T *)y, mean, rstd)));
    return launched(fn, err);
}

extern "C" sf_status sfc_norm_backward(int rms, sfk_dtype t, const void *dy, const void *x,
                                       int64_t rows, int64_t n, const float *w, const float *mean,
                                       const float *rstd, void *dx, float *dw, float *db,
                                       cudaStream_t stream, sf_error *err)
{
    static const char fn[] = "norm_backward (CUDA)";
    sf_status rc;
    if ((rc = check(fn, t, rows, n, x, rstd, err)) ||
        (rc = sfk_check_ptr(fn, "dy", dy, n > 0 ? rows : 0, err)) ||
        (rc = sfk_check_ptr(fn, "dx", dx, n > 0 ? rows : 0, err)) ||
        (!rms && (rc = sfk_check_ptr(fn, "mean (LayerNorm)", mean, rows, err))))
        return rc;
    if (rows == 0 || n == 0) {
        /* dx is empty; no row contributes to the weight gradients */
        if (dw && (rc = cuda_call(fn, "cudaMemsetAsync",
                                  cudaMemsetAsync(dw, 0, (size_t)n * sizeof(float), stream), err)))
            return rc;
        if (db && (rc = cuda_call(fn, "cudaMemsetAsync",
                                  cudaMemsetAsync(db, 0, (size_t)n * sizeof(float), stream), err)))
            return rc;
        return SF_OK;
    }
    SFC_DISPATCH(t, {
        norm_bwd<T><<<blocks_for(rows, 1), kThreads, 0, stream>>>(
            rms, (const T *)dy, (const T *)x, rows, n, w, rms ? nullptr : mean, rstd, (T *)dx);
        if (dw || db)
            launch_column_sums(NormParamGrad<T>{(const T *)dy, (const T *)x, rms ? nullptr : mean,
                                                rstd, n},
                               rows, n, dw, db, stream);
    });
    return launched(fn, err);
}
