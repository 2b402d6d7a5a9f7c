/*
 * cuda/cross_entropy.cu -- vocabulary-shard cross-entropy on the GPU, the
 * contract of csrc/kernels/cross_entropy.h:
 *
 *   forward, per row over the `real` columns of this shard:
 *     max[r] = max_j z_j (-inf when real == 0), sumexp[r] = sum_j exp(z_j - max[r]),
 *     target[r] = z_y when label y is a real column of this shard else 0,
 *     sumz[r] = sum_j z_j (when sumz is given)
 *   backward: grad[r, j] = scale[r] * (exp(z_j - lse[r]) - eps / vocab)
 *             - scale[r] * (1 - eps) [j == y] on real columns, 0 on padding
 *             columns and on rows with scale 0 (ignored); grad may be logits.
 *
 * Forward: one block per row; each thread keeps an online (max, sum) over
 * its columns (rescaling the sum when the max grows), merged over the block.
 */
#include "cuda/common.cuh"

namespace sfc {
namespace {

/* label r as a column of this shard, -1 when ignored or another shard's */
__device__ __forceinline__ int64_t local_label(const int64_t *labels, int64_t r, int64_t ignore,
                                               int64_t vocab_start, int64_t real)
{
    const int64_t y = labels[r];
    if (y == ignore || y < vocab_start) return -1;
    return y - vocab_start < real ? y - vocab_start : -1;
}

template <typename T>
__global__ void xent_fwd(const T *logits, int64_t rows, int64_t n, int64_t real,
                         const int64_t *labels, int64_t vocab_start, int64_t ignore, float *max,
                         float *sumexp, float *target, float *sumz)
{
    __shared__ float shm[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *row = logits + r * n;
        float m = -INFINITY, s = 0.0f, sz = 0.0f;
        bool nan = false;                     /* a NaN logit: the row's sum-exp is NaN (torch's) */
        for (int64_t j = threadIdx.x; j < real; j += blockDim.x) {
            const float z = load(row, j);
            nan = nan || z != z;
            if (z > m) {
                s = s * expf(m - z) + 1.0f;   /* exp(-inf) = 0 when m was -inf */
                m = z;
            } else if (m != -INFINITY) {
                s += expf(z - m);
            }
            sz += z;
        }
        const float bm = block_max(m, shm);
        const float bs = block_sum(nan ? NAN : m == -INFINITY ? 0.0f : s * expf(m - bm), shm);
        const float bz = sumz ? block_sum(sz, shm) : 0.0f;
        if (threadIdx.x == 0) {
            max[r] = bm;
            sumexp[r] = bs;
            if (sumz) sumz[r] = bz;
            const int64_t y = local_label(labels, r, ignore, vocab_start, real);
            target[r] = y >= 0 ? load(row, y) : 0.0f;
        }
    }
}

template <typename T>
struct XentGrad {
    const T *logits;
    T *grad;                       /* may be logits: each element is read, then written, by one thread */
    const int64_t *labels;
    const float *lse, *scale;
    int64_t n, real, vocab_start, ignore;
    float eps, smooth;
    __device__ void operator()(int64_t i) const
    {
        const int64_t r = i / n, j = i - r * n;
        const float g = scale[r];
        if (g == 0.0f || j >= real) {  /* ignored row, padding column */
            store(grad, i, 0.0f);
            return;
        }
        float v = g * expf(load(logits, i) - lse[r]) - g * smooth;
        if (j == local_label(labels, r, ignore, vocab_start, real)) v -= g * (1.0f - eps);
        store(grad, i, v);
    }
};

/* the CPU kernels' checks (kernels/checks.h), and rows x n within int64 */
sf_status check(const char *fn, sfk_dtype t, int64_t rows, int64_t n, int64_t real,
                int64_t vocab_start, const void *logits, const int64_t *labels, sf_error *err)
{
    int64_t total;
    sf_status rc = sfk_check_xent_args(fn, t, rows, n, real, vocab_start, logits, labels, err);
    return rc ? rc : elements(fn, rows, n, &total, err);
}

}  // namespace
}  // namespace sfc

using namespace sfc;

extern "C" sf_status sfc_xent_forward(sfk_dtype t, const void *logits, int64_t rows, int64_t n,
                                      int64_t real, const int64_t *labels, int64_t vocab_start,
                                      int64_t ignore_index, int64_t vocab, float *max,
                                      float *sumexp, float *target, float *sumz,
                                      cudaStream_t stream, sf_error *err)
{
    static const char fn[] = "xent_forward (CUDA)";
    sf_status rc;
    if ((rc = check(fn, t, rows, n, real, vocab_start, logits, labels, err)) ||
        (rc = sfk_check_ptr(fn, "max", max, rows, err)) ||
        (rc = sfk_check_ptr(fn, "sumexp", sumexp, rows, err)) ||
        (rc = sfk_check_ptr(fn, "target", target, rows, err)))
        return rc;
    if (vocab >= 0 && rows > 0) {
        /* every label in [0, vocab) or ignore_index, before any work (as on the CPU) */
        int64_t first, y, lo, hi;
        if ((rc = id_range(fn, labels, rows, 1, ignore_index, vocab, stream, &first, &y, &lo, &hi,
                           err)))
            return rc;
        if (first < rows)
            return sf_fail(err, SF_ERANGE, "%s: label %lld (row %lld) is out of range for the "
                           "vocabulary of %lld (labels must be in [0, %lld) or ignore_index=%lld)",
                           fn, (long long)y, (long long)first, (long long)vocab, (long long)vocab,
                           (long long)ignore_index);
    }
    if (rows == 0)
        return SF_OK;
    SFC_DISPATCH(t, xent_fwd<T><<<blocks_for(rows, 1), kThreads, 0, stream>>>(
                        (const T *)logits, rows, n, real, labels, vocab_start, ignore_index, max,
                        sumexp, target, sumz));
    return launched(fn, err);
}

extern "C" sf_status sfc_xent_backward(sfk_dtype t, const void *logits, void *grad, int64_t rows,
                                       int64_t n, int64_t real, const int64_t *labels,
                                       int64_t vocab_start, int64_t ignore_index, const float *lse,
                                       const float *scale, float eps, int64_t vocab,
                                       cudaStream_t stream, sf_error *err)
{
    static const char fn[] = "xent_backward (CUDA)";
    sf_status rc;
    if ((rc = check(fn, t, rows, n, real, vocab_start, logits, labels, err)) ||
        (rc = sfk_check_size(fn, "vocab", vocab, err)) ||
        (rc = sfk_check_ptr(fn, "lse", lse, rows, err)) ||
        (rc = sfk_check_ptr(fn, "scale", scale, rows, err)) ||
        (rc = sfk_check_ptr(fn, "grad", grad, n > 0 ? rows : 0, err)))
        return rc;
    if (rows == 0 || n == 0)
        return SF_OK;                          /* the gradient is empty */
    const float smooth = vocab > 0 ? eps / (float)vocab : 0.0f;
    SFC_DISPATCH(t, launch_each(XentGrad<T>{(const T *)logits, (T *)grad, labels, lse, scale, n,
                                            real, vocab_start, ignore_index, eps, smooth},
                                rows * n, stream));
    return launched(fn, err);
}
