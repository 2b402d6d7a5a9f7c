/*
 * cuda/embedding.cu -- vocabulary-parallel embedding on the GPU, the
 * contract of csrc/kernels/embedding.h:
 *
 *   forward:  out[i] = W[ids[i] - vocab_start] when the id is one of this
 *             shard's [vocab_start, vocab_start + real), else 0; with
 *             vocab >= 0 every id must be in [0, vocab) (ERANGE, checked
 *             before any work, naming the id furthest outside)
 *   backward: dW[ids[i] - vocab_start] += dout[i] for this shard's ids but
 *             padding_local (a local row, -1 for none); dW is fp32 and
 *             accumulates (the caller zeroes it).  Atomic adds: equal ids
 *             add in no fixed order.
 */
#include "cuda/common.cuh"

namespace sfc {
namespace {

__device__ __forceinline__ int64_t local_row(int64_t id, int64_t vocab_start, int64_t real)
{
    return id >= vocab_start && id - vocab_start < real ? id - vocab_start : -1;
}

template <typename T>
struct Lookup {
    const T *w;
    const int64_t *ids;
    T *out;
    int64_t d, real, vocab_start;
    __device__ void operator()(int64_t e) const
    {
        const int64_t i = e / d, c = e - i * d, k = local_row(ids[i], vocab_start, real);
        if (k >= 0) out[e] = w[k * d + c];
        else store(out, e, 0.0f);
    }
};

template <typename T>
struct ScatterAdd {
    const T *dout;
    const int64_t *ids;
    float *dw;
    int64_t d, real, vocab_start, padding;
    __device__ void operator()(int64_t e) const
    {
        const int64_t i = e / d, c = e - i * d, k = local_row(ids[i], vocab_start, real);
        if (k >= 0 && k != padding) atomicAdd(dw + k * d + c, load(dout, e));
    }
};

/* the CPU kernels' checks (kernels/checks.h), and count x d within int64 */
sf_status check(const char *fn, sfk_dtype t, int64_t d, int64_t real, int64_t count,
                int64_t vocab_start, const int64_t *ids, sf_error *err)
{
    int64_t total;
    sf_status rc = sfk_check_embedding_args(fn, t, d, real, count, vocab_start, ids, err);
    return rc ? rc : elements(fn, count, d, &total, err);
}

}  // namespace
}  // namespace sfc

using namespace sfc;

extern "C" sf_status sfc_embedding_forward(sfk_dtype t, const void *weight, int64_t d, int64_t real,
                                           const int64_t *ids, int64_t count, int64_t vocab_start,
                                           int64_t vocab, void *out, cudaStream_t stream,
                                           sf_error *err)
{
    static const char fn[] = "embedding_forward (CUDA)";
    const int64_t rows = d > 0 ? count : 0;
    sf_status rc;
    if ((rc = check(fn, t, d, real, count, vocab_start, ids, err)) ||
        (rc = sfk_check_ptr(fn, "out", out, rows, err)) ||
        (rc = sfk_check_ptr(fn, "weight", weight, rows > 0 ? real : 0, err)))
        return rc;
    if (vocab >= 0 && count > 0) {
        int64_t first, id, lo, hi;
        if ((rc = id_range(fn, ids, count, 0, 0, vocab, stream, &first, &id, &lo, &hi, err)))
            return rc;
        if (lo < 0 || hi >= vocab)
            return sf_fail(err, SF_ERANGE, "%s: index %lld is out of range for the vocabulary of "
                           "%lld (token ids must be in [0, %lld))", fn,
                           (long long)(hi >= vocab ? hi : lo), (long long)vocab, (long long)vocab);
    }
    if (rows == 0)
        return SF_OK;                          /* the output is empty */
    SFC_DISPATCH(t, launch_each(Lookup<T>{(const T *)weight, ids, (T *)out, d, real, vocab_start},
                                count * d, stream));
    return launched(fn, err);
}

extern "C" sf_status sfc_embedding_backward(sfk_dtype t, const void *dout, const int64_t *ids,
                                            int64_t count, int64_t d, int64_t real,
                                            int64_t vocab_start, int64_t padding_local,
                                            float *dweight, cudaStream_t stream, sf_error *err)
{
    static const char fn[] = "embedding_backward (CUDA)";
    const int64_t rows = d > 0 ? count : 0;
    sf_status rc;
    if ((rc = check(fn, t, d, real, count, vocab_start, ids, err)) ||
        (rc = sfk_check_ptr(fn, "dout", dout, rows, err)) ||
        (rc = sfk_check_ptr(fn, "dweight", dweight, rows > 0 ? real : 0, err)))
        return rc;
    if (rows == 0)
        return SF_OK;                          /* nothing to add */
    SFC_DISPATCH(t, launch_each(ScatterAdd<T>{(const T *)dout, ids, dweight, d, real, vocab_start,
                                              padding_local},
                                count * d, stream));
    return launched(fn, err);
}
