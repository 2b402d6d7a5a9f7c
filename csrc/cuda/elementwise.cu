/*
 * cuda/elementwise.cu -- bias+GeLU, SwiGLU and bias+dropout+residual-add on
 * the GPU, the math of csrc/kernels/elementwise.h (u = x + b, fp32):
 *
 *   bias_gelu erf:  y = u Phi(u), Phi(u) = erfc(-u / sqrt 2) / 2 (no 1 + erf
 *                   to cancel in the left tail); gelu' = Phi(u) + u phi(u),
 *                   phi(u) = exp(-u^2 / 2) / sqrt(2 pi)
 *   bias_gelu tanh: y = u s, s = sigmoid(2a) = 1 / (1 + e), e = exp(-2a),
 *                   a = sqrt(2/pi) (u + 0.044715 u^3);
 *                   gelu' = s + 2 u s (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 u^2),
 *                   1 - s = 1 / (1 + 1 / e)
 *   swiglu:         y = g / (1 + exp(-g)) * u; dg = dy u s (1 + g (1 - s)),
 *                   du = dy g s, s = sigmoid(g)
 *   bias_dropout_add: y = r + keep * (x + b) / (1 - p); dx = dy keep / (1 - p),
 *                   with the keep mask of dropout_hash.h: the CPU kernel's
 *                   mask, bit for bit, for the same (seed, row, column)
 *   db = sum over rows of dx (fp32, before rounding; column_sums).
 */
#include "cuda/common.cuh"
#include "dropout_hash.h"

namespace sfc {
namespace {

constexpr float kSqrt1_2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;
constexpr float kTanhK = 0.79788456080286536f;   /* sqrt(2 / pi) */
constexpr float kTanhC = 0.044715f;

__device__ __forceinline__ float gelu(float u, int tanh_form)
{
    if (tanh_form) return u / (1.0f + expf(-2.0f * kTanhK * (u + kTanhC * u * u * u)));
    return u * 0.5f * erfcf(-u * kSqrt1_2);
}

__device__ __forceinline__ float gelu_grad(float u, int tanh_form)
{
    if (tanh_form) {
        const float e = expf(-2.0f * kTanhK * (u + kTanhC * u * u * u));
        const float s = 1.0f / (1.0f + e), sc = 1.0f / (1.0f + 1.0f / e);
        return s + 2.0f * u * s * sc * kTanhK * (1.0f + 3.0f * kTanhC * u * u);
    }
    return 0.5f * erfcf(-u * kSqrt1_2) + u * expf(-0.5f * u * u) * kInvSqrt2Pi;
}

template <typename T>
struct GeluFwd {
    const T *x;
    const float *b;
    T *y;
    int64_t n;
    int tanh_form;
    __device__ void operator()(int64_t i) const
    {
        const float u = load(x, i) + (b ? b[i % n] : 0.0f);
        store(y, i, gelu(u, tanh_form));
    }
};

/* dx at flat index i, in fp32 (GeluBwd stores it; GeluDb sums it) */
template <typename T>
struct GeluDx {
    const T *dy, *x;
    const float *b;
    int64_t n;
    int tanh_form;
    __device__ float at(int64_t i) const
    {
        const float u = load(x, i) + (b ? b[i % n] : 0.0f);
        return load(dy, i) * gelu_grad(u, tanh_form);
    }
};

template <typename T>
struct GeluBwd {
    GeluDx<T> f;
    T *dx;
    __device__ void operator()(int64_t i) const { store(dx, i, f.at(i)); }
};

template <typename T>
struct ColumnOf {                  /* (f.at(r * n + j), 0): the summand of db */
    T f;
    int64_t n;
    __device__ float2 operator()(int64_t r, int64_t j) const { return make_float2(f.at(r * n + j), 0.0f); }
};

template <typename T>
struct SwiGLU {
    const T *dy, *g, *u;           /* dy NULL: forward */
    T *o1, *o2;                    /* forward: y; backward: dgate, dup */
    __device__ void operator()(int64_t i) const
    {
        const float gi = load(g, i), ui = load(u, i), e = expf(-gi);
        if (!dy) {
            store(o1, i, gi / (1.0f + e) * ui);
            return;
        }
        const float s = 1.0f / (1.0f + e), d = load(dy, i);
        store(o1, i, d * ui * s * (1.0f + gi * (1.0f - s)));
        store(o2, i, d * gi * s);
    }
};

/* keep * v * scale (v itself when p == 0), the dropout of row r, column j */
struct Dropout {
    float p, scale;
    uint32_t thresh;
    uint64_t seed;
    __device__ float apply(float v, int64_t r, int64_t j) const
    {
        if (p <= 0.0f) return v;
        return sfk_dropout_kept(sfk_dropout_key(seed, r), j, thresh) ? v * scale : 0.0f;
    }
};

inline Dropout make_dropout(float p, uint64_t seed)
{
    return Dropout{p, p > 0.0f ? (p < 1.0f ? 1.0f / (1.0f - p) : 0.0f) : 1.0f,
                   sfk_dropout_threshold(p), seed};
}

template <typename T>
struct BdaFwd {
    const T *x, *res;
    const float *b;
    T *y;
    int64_t n;
    Dropout drop;
    __device__ void operator()(int64_t i) const
    {
        const int64_t r = i / n, j = i - r * n;
        const float v = load(x, i) + (b ? b[j] : 0.0f);
        store(y, i, drop.apply(v, r, j) + load(res, i));
    }
};

template <typename T>
struct BdaDx {
    const T *dy;
    int64_t n;
    Dropout drop;
    __device__ float at(int64_t i) const
    {
        const int64_t r = i / n;
        return drop.apply(load(dy, i), r, i - r * n);
    }
};

template <typename T>
struct BdaBwd {
    BdaDx<T> f;
    T *dx;
    __device__ void operator()(int64_t i) const { store(dx, i, f.at(i)); }
};

/* the CPU kernels' checks (kernels/checks.h), and rows x n within int64 into *total */
sf_status check(const char *fn, sfk_dtype t, int64_t rows, int64_t n, int64_t *total, sf_error *err)
{
    sf_status rc = sfk_check_elementwise_args(fn, t, rows, n, err);
    return rc ? rc : elements(fn, rows, n, total, err);
}

/* db zeroed when there is no element (rows or n 0), as on the CPU */
sf_status zero_db(const char *fn, float *db, int64_t n, cudaStream_t stream, sf_error *err)
{
    if (!db) return SF_OK;
    return cuda_call(fn, "cudaMemsetAsync", cudaMemsetAsync(db, 0, (size_t)n * sizeof(float), stream), err);
}

}  // namespace
}  // namespace sfc

using namespace sfc;

extern "C" sf_status sfc_bias_gelu_forward(sfk_dtype t, const void *x, const float *b, int64_t rows,
                                           int64_t n, int tanh_approx, void *y,
                                           cudaStream_t stream, sf_error *err)
{
    static const char fn[] = "bias_gelu_forward (CUDA)";
    int64_t total;
    sf_status rc;
    if ((rc = check(fn, t, rows, n, &total, err)) || (rc = sfk_check_ptr(fn, "x", x, total, err)) ||
        (rc = sfk_check_ptr(fn, "y", y, total, err)))
        return rc;
    if (total == 0) return SF_OK;
    SFC_DISPATCH(t, launch_each(GeluFwd<T>{(const T *)x, b, (T *)y, n, tanh_approx}, total, stream));
    return launched(fn, err);
}

extern "C" sf_status sfc_bias_gelu_backward(sfk_dtype t, const void *dy, const void *x,
                                            const float *b, int64_t rows, int64_t n,
                                            int tanh_approx, void *dx, float *db,
                                            cudaStream_t stream, sf_error *err)
{
    static const char fn[] = "bias_gelu_backward (CUDA)";
    int64_t total;
    sf_status rc;
    if ((rc = check(fn, t, rows, n, &total, err)) || (rc = sfk_check_ptr(fn, "dy", dy, total, err)) ||
        (rc = sfk_check_ptr(fn, "x", x, total, err)) || (rc = sfk_check_ptr(fn, "dx", dx, total, err)))
        return rc;
    if (total == 0) return zero_db(fn, db, n, stream, err);
    SFC_DISPATCH(t, {
        const GeluDx<T> f{(const T *)dy, (const T *)x, b, n, tanh_approx};
        launch_each(GeluBwd<T>{f, (T *)dx}, total, stream);
        if (db) launch_column_sums(ColumnOf<GeluDx<T>>{f, n}, rows, n, db, nullptr, stream);
    });
    return launched(fn, err);
}

extern "C" sf_status sfc_swiglu_forward(sfk_dtype t, const void *gate, const void *up, int64_t numel,
                                        void *y, cudaStream_t stream, sf_error *err)
{
    static const char fn[] = "swiglu_forward (CUDA)";
    int64_t total;
    sf_status rc;
    if ((rc = check(fn, t, 1, numel, &total, err)) || (rc = sfk_check_ptr(fn, "gate", gate, numel, err)) ||
        (rc = sfk_check_ptr(fn, "up", up, numel, err)) || (rc = sfk_check_ptr(fn, "y", y, numel, err)))
        return rc;
    if (numel == 0) return SF_OK;
    SFC_DISPATCH(t, launch_each(SwiGLU<T>{nullptr, (const T *)gate, (const T *)up, (T *)y, nullptr},
                                numel, stream));
    return launched(fn, err);
}

extern "C" sf_status sfc_swiglu_backward(sfk_dtype t, const void *dy, const void *gate, const void *up,
                                         int64_t numel, void *dgate, void *dup, cudaStream_t stream,
                                         sf_error *err)
{
    static const char fn[] = "swiglu_backward (CUDA)";
    int64_t total;
    sf_status rc;
    if ((rc = check(fn, t, 1, numel, &total, err)) || (rc = sfk_check_ptr(fn, "dy", dy, numel, err)) ||
        (rc = sfk_check_ptr(fn, "gate", gate, numel, err)) ||
        (rc = sfk_check_ptr(fn, "up", up, numel, err)) ||
        (rc = sfk_check_ptr(fn, "dgate", dgate, numel, err)) ||
        (rc = sfk_check_ptr(fn, "dup", dup, numel, err)))
        return rc;
    if (numel == 0) return SF_OK;
    SFC_DISPATCH(t, launch_each(SwiGLU<T>{(const T *)dy, (const T *)gate, (const T *)up, (T *)dgate,
                                          (T *)dup},
                                numel, stream));
    return launched(fn, err);
}

extern "C" sf_status sfc_bias_dropout_add_forward(sfk_dtype t, const void *x, const float *b,
                                                  const void *res, int64_t rows, int64_t n, float p,
                                                  uint64_t seed, void *y, cudaStream_t stream,
                                                  sf_error *err)
{
    static const char fn[] = "bias_dropout_add_forward (CUDA)";
    int64_t total;
    sf_status rc;
    if ((rc = check(fn, t, rows, n, &total, err)) || (rc = sfk_check_dropout_p(fn, p, err)) ||
        (rc = sfk_check_ptr(fn, "x", x, total, err)) ||
        (rc = sfk_check_ptr(fn, "residual", res, total, err)) ||
        (rc = sfk_check_ptr(fn, "y", y, total, err)))
        return rc;
    if (total == 0) return SF_OK;
    SFC_DISPATCH(t, launch_each(BdaFwd<T>{(const T *)x, (const T *)res, b, (T *)y, n,
                                          make_dropout(p, seed)},
                                total, stream));
    return launched(fn, err);
}

extern "C" sf_status sfc_bias_dropout_add_backward(sfk_dtype t, const void *dy, int64_t rows,
                                                   int64_t n, float p, uint64_t seed, void *dx,
                                                   float *db, cudaStream_t stream, sf_error *err)
{
    static const char fn[] = "bias_dropout_add_backward (CUDA)";
    int64_t total;
    sf_status rc;
    if ((rc = check(fn, t, rows, n, &total, err)) || (rc = sfk_check_dropout_p(fn, p, err)) ||
        (rc = sfk_check_ptr(fn, "dy", dy, total, err)) || (rc = sfk_check_ptr(fn, "dx", dx, total, err)))
        return rc;
    if (total == 0) return zero_db(fn, db, n, stream, err);
    SFC_DISPATCH(t, {
        const BdaDx<T> f{(const T *)dy, n, make_dropout(p, seed)};
        launch_each(BdaBwd<T>{f, (T *)dx}, total, stream);
        if (db) launch_column_sums(ColumnOf<BdaDx<T>>{f, n}, rows, n, db, nullptr, stream);
    });
    return launched(fn, err);
}
