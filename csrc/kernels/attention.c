/*
 * attention.c -- flash-style attention forward and backward (see attention.h).
 *
 * Forward: threads take (batch, query head, query tile) rows; for its tile
 * of BQ queries a thread walks the key tiles of BK keys that the causal /
 * window pattern leaves visible, keeping a running max m, a running sum l
 * and an unnormalized output per query (the online softmax), and writes
 * o = acc / l and lse = m + log l at the end.
 *
 * Backward: threads take (batch, key-value head) rows, so that one thread
 * owns dq of every query head of the group and dk / dv of the shared key
 * head: no two threads write the same element and no atomics are needed.
 * For each key tile it recomputes p = exp(s - lse) tile by tile over the
 * visible queries of every head in the group and accumulates dq, dk, dv.
 * With fewer such pairs than threads (one KV head per rank under TP, batch
 * 1), a pair's key tiles are split into parts of about equal work; each part
 * keeps its own fp32 dq, and the parts are summed at the end.
 *
 * Every product is C += A B (or A^T B) over small row-major tiles
 * (matmul_acc), with AVX2+FMA and AVX-512 versions picked at run time;
 * everything else is plain loops.
 * Per-thread scratch is O(BQ * BK + (BQ + BK) * D) floats, plus one
 * key-value head as fp32 ([Sk, D] K transposed and V) in forward, and in
 * backward for 16-bit types (or split pairs) an fp32 dq accumulator of the
 * group's [Hq / Hkv, Sq, D] per thread (per part): nothing is [Sq, Sk].
 */
#include "attention.h"

#include <math.h>
#include <stdlib.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ATT_X86 1
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX512 __attribute__((target("avx512f")))
#endif

#define SFK_MAX_SPLIT 64
#define BQ 64    /* queries per tile */
#define BK 128   /* keys per tile (64 and 128 measured alike at S = 1024, 128 ahead at 2048) */

/* ---- C[M, N] += A[M, K] B[K, N] -----------------------------------------
 * B and C row-major with leading dims; A(i, k) = A[i * ars + k * aks], so A
 * may be a tile read transposed (ars = 1, aks = its leading dim). */

static void matmul_acc_c(int64_t M, int64_t N, int64_t K, const float *A, int64_t ars, int64_t aks,
                         const float *B, int64_t ldb, float *C, int64_t ldc)
{
    for (int64_t i = 0; i < M; i++) {
        float *restrict c = C + i * ldc;
        for (int64_t k = 0; k < K; k++) {
            const float x = A[i * ars + k * aks];
            if (x == 0.0f) continue;     /* masked / dropped probabilities */
            const float *restrict b = B + k * ldb;
            for (int64_t j = 0; j < N; j++) c[j] += x * b[j];
        }
    }
}

#ifdef ATT_X86
/* Four rows of C by 16 columns in eight registers; one broadcast of A and
 * two loads of B per k feed eight FMAs. */
AVX2 static void rows4_cols16(int64_t K, const float *A, int64_t ars, int64_t aks, const float *B,
                              int64_t ldb, float *C, int64_t ldc)
{
    __m256 c[4][2];
    for (int r = 0; r < 4; r++) {
        c[r][0] = _mm256_loadu_ps(C + r * ldc);
        c[r][1] = _mm256_loadu_ps(C + r * ldc + 8);
    }
    for (int64_t k = 0; k < K; k++) {
        __m256 b0 = _mm256_loadu_ps(B + k * ldb), b1 = _mm256_loadu_ps(B + k * ldb + 8);
        for (int r = 0; r < 4; r++) {
            __m256 x = _mm256_broadcast_ss(A + r * ars + k * aks);
            c[r][0] = _mm256_fmadd_ps(x, b0, c[r][0]);
            c[r][1] = _mm256_fmadd_ps(x, b1, c[r][1]);
        }
    }
    for (int r = 0; r < 4; r++) {
        _mm256_storeu_ps(C + r * ldc, c[r][0]);
        _mm256_storeu_ps(C + r * ldc + 8, c[r][1]);
    }
}

AVX2 static void row1_cols8(int64_t K, const float *A, int64_t aks, const float *B, int64_t ldb,
                            float *C)
{
    __m256 c0 = _mm256_loadu_ps(C);
    for (int64_t k = 0; k < K; k++)
        c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(A + k * aks), _mm256_loadu_ps(B + k * ldb), c0);
    _mm256_storeu_ps(C, c0);
}

AVX2 static void matmul_acc_avx2(int64_t M, int64_t N, int64_t K, const float *A, int64_t ars,
                                 int64_t aks, const float *B, int64_t ldb, float *C, int64_t ldc)
{
    const int64_t N16 = N - N % 16, N8 = N - N % 8, M4 = M - M % 4;
    for (int64_t i = 0; i < M4; i += 4)
        for (int64_t j = 0; j < N16; j += 16)
            rows4_cols16(K, A + i * ars, ars, aks, B + j, ldb, C + i * ldc + j, ldc);
    for (int64_t i = M4; i < M; i++)
        for (int64_t j = 0; j < N16; j += 8)
            row1_cols8(K, A + i * ars, aks, B + j, ldb, C + i * ldc + j);
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = N16; j < N8; j += 8)
            row1_cols8(K, A + i * ars, aks, B + j, ldb, C + i * ldc + j);
    if (N8 < N)
        matmul_acc_c(M, N - N8, K, A, ars, aks, B + N8, ldb, C + N8, ldc);
}

/* The same four rows by 32 columns in eight AVX-512 registers.  Measured on
 * the shared 2-core AVX-512 Xeon we develop on (one thread, [1, 8, 1024, 64],
 * causal): forward 29 ms with the AVX2 product, 18 ms with this.  Eight rows
 * (16 accumulators) showed no difference there that the load of the machine
 * did not drown, so four it is. */
AVX512 static void rows4_cols32(int64_t K, const float *A, int64_t ars, int64_t aks,
                                const float *B, int64_t ldb, float *C, int64_t ldc)
{
    __m512 c[4][2];
    for (int r = 0; r < 4; r++) {
        c[r][0] = _mm512_loadu_ps(C + r * ldc);
        c[r][1] = _mm512_loadu_ps(C + r * ldc + 16);
    }
    for (int64_t k = 0; k < K; k++) {
        __m512 b0 = _mm512_loadu_ps(B + k * ldb), b1 = _mm512_loadu_ps(B + k * ldb + 16);
        for (int r = 0; r < 4; r++) {
            __m512 x = _mm512_set1_ps(A[r * ars + k * aks]);
            c[r][0] = _mm512_fmadd_ps(x, b0, c[r][0]);
            c[r][1] = _mm512_fmadd_ps(x, b1, c[r][1]);
        }
    }
    for (int r = 0; r < 4; r++) {
        _mm512_storeu_ps(C + r * ldc, c[r][0]);
        _mm512_storeu_ps(C + r * ldc + 16, c[r][1]);
    }
}

#endif

static void matmul_acc_any(int64_t M, int64_t N, int64_t K, const float *A, int64_t ars,
                           int64_t aks, const float *B, int64_t ldb, float *C, int64_t ldc)
{
#ifdef ATT_X86
    if (M >= 4 && N >= 32 && sf_cpu_has_avx512()) {
        const int64_t N32 = N - N % 32, M4 = M - M % 4;
        for (int64_t i = 0; i < M4; i += 4)
            for (int64_t j = 0; j < N32; j += 32)
                rows4_cols32(K, A + i * ars, ars, aks, B + j, ldb, C + i * ldc + j, ldc);
        if (M4 < M)
            matmul_acc_avx2(M - M4, N32, K, A + M4 * ars, ars, aks, B, ldb, C + M4 * ldc, ldc);
        if (N32 < N)
            matmul_acc_avx2(M, N - N32, K, A, ars, aks, B + N32, ldb, C + N32, ldc);
        return;
    }
    if (sf_cpu_has_simd()) { matmul_acc_avx2(M, N, K, A, ars, aks, B, ldb, C, ldc); return; }
#endif
    matmul_acc_c(M, N, K, A, ars, aks, B, ldb, C, ldc);
}

/* C += A B, A [M][K] with leading dim lda */
static void matmul_acc(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                       const float *B, int64_t ldb, float *C, int64_t ldc)
{
    matmul_acc_any(M, N, K, A, lda, 1, B, ldb, C, ldc);
}

/* C += A^T B, A [K][M] with leading dim lda */
static void matmul_acc_tn(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                          const float *B, int64_t ldb, float *C, int64_t ldc)
{
    matmul_acc_any(M, N, K, A, 1, lda, B, ldb, C, ldc);
}

/* Dropout draws: common.h's sfk_dropout_*, keyed by the flattened query row
 * (b, h, P(i)) and the key column Q(j) (attention.h). */
static inline uint32_t drop_key(const sfk_attn *a, int64_t bh, int64_t i)
{
    const int64_t rows = a->drop_seq ? a->drop_seq : a->Sq;
    return sfk_dropout_key(a->seed, bh * rows + (a->qpos ? a->qpos[i] : i));
}

static inline int64_t drop_col(const sfk_attn *a, int64_t j) { return a->kpos ? a->kpos[j] : j; }

/* ---- shared pieces ------------------------------------------------------ */

#ifdef ATT_X86
/* tanh over 16 lanes.  |y| >= 1/4: (1 - e) / (1 + e) with e = exp(-2|y|)
 * (sfk_exp16; e = 0 past its range gives 1), the sign of y put back.  Below,
 * where 1 - e would cancel, the odd series y - y^3/3 + 2y^5/15 - 17y^7/315
 * + 62y^9/2835 (the next term is < 1e-8 of y there). */
AVX512 static inline __m512 tanh16(__m512 y)
{
    const __m512 one = _mm512_set1_ps(1.0f), ay = _mm512_abs_ps(y);
    const __m512 e = sfk_exp16(_mm512_mul_ps(ay, _mm512_set1_ps(-2.0f)));
    const __m512 far = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32((int)0x80000000u));
    const __m512 y2 = _mm512_mul_ps(y, y);
    __m512 p = _mm512_set1_ps(62.0f / 2835.0f);
    p = _mm512_fmadd_ps(p, y2, _mm512_set1_ps(-17.0f / 315.0f));
    p = _mm512_fmadd_ps(p, y2, _mm512_set1_ps(2.0f / 15.0f));
    p = _mm512_fmadd_ps(p, y2, _mm512_set1_ps(-1.0f / 3.0f));
    p = _mm512_fmadd_ps(p, y2, one);
    const __mmask16 near = _mm512_cmp_ps_mask(ay, _mm512_set1_ps(0.25f), _CMP_LT_OQ);
    return _mm512_mask_blend_ps(near, _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(far), sign)),
                                _mm512_mul_ps(p, y));
}

/* soft_cap (below) over 16 lanes at a time. */
AVX512 static void soft_cap_avx512(float *x, int64_t n, float cap, float *dc)
{
    const __m512 c = _mm512_set1_ps(cap), inv = _mm512_set1_ps(1.0f / cap), one = _mm512_set1_ps(1.0f);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = n - j >= 16 ? (__mmask16)0xffffu : (__mmask16)((1u << (n - j)) - 1u);
        const __m512 t = tanh16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + j), inv));
        _mm512_mask_storeu_ps(x + j, m, _mm512_mul_ps(c, t));
        if (dc) _mm512_mask_storeu_ps(dc + j, m, _mm512_fnmadd_ps(t, t, one));
    }
}

/* s[j] = exp(s[j] - shift) in place, and their sum: one pass. */
AVX512 static float exp_sum_avx512(float *s, int64_t n, float shift)
{
    const __m512 sh = _mm512_set1_ps(shift);
    __m512 acc = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 e = sfk_exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), sh));
        _mm512_storeu_ps(s + j, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (j < n) {
        const __mmask16 m = (__mmask16)((1u << (n - j)) - 1u);
        const __m512 e = _mm512_maskz_mov_ps(m, sfk_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), sh)));
        _mm512_mask_storeu_ps(s + j, m, e);
        acc = _mm512_add_ps(acc, e);
    }
    return _mm512_reduce_add_ps(acc);
}
#endif

/* s[j] = exp(s[j] - shift) in place; returns their sum. */
static float exp_sum(float *s, int64_t n, float shift)
{
#ifdef ATT_X86
    if (sf_cpu_has_avx512()) return exp_sum_avx512(s, n, shift);
#endif
    sfk_scaled_exp(s, s, n, shift, 1.0f, 0.0f);
    float sum = 0.0f;
    for (int64_t j = 0; j < n; j++) sum += s[j];
    return sum;
}

/* Rows [first, first + n) of a [*, D] array of type t as fp32: the array
 * itself for fp32, else converted into scratch. */
static const float *rows_f32(sfk_dtype t, const void *base, int64_t first, int64_t n, int64_t D,
                             float *scratch)
{
    const char *p = (const char *)base + (size_t)(first * D) * (size_t)sfk_size(t);
    if (t == SFK_F32) return (const float *)p;
    sfk_load(t, p, n * D, scratch);
    return scratch;
}

/* dst[D][ld] = src[n][D] transposed (columns n..ld left as they are). */
static void transpose_in(const float *src, int64_t n, int64_t D, float *dst, int64_t ld)
{
    for (int64_t j = 0; j < n; j++)
        for (int64_t d = 0; d < D; d++) dst[d * ld + j] = src[j * D + d];
}

/* src[n][D] as key tiles of BK: tile t at dst + t * D * BK is [D][BK], keys
 * t * BK.. transposed (rows of a tile are BK floats apart, not n: K^T rows
 * n floats apart alias in the cache for n a large power of two). */
static void transpose_tiles(const float *src, int64_t n, int64_t D, float *dst)
{
    for (int64_t j0 = 0; j0 < n; j0 += BK)
        transpose_in(src + j0 * D, n - j0 < BK ? n - j0 : BK, D, dst + j0 * D, BK);
}

/* Keys [lo, hi) of the tile (j0, nj) that query i can see by the causal /
 * window pattern (the mask and bias come later). */
static void visible(const sfk_attn *a, int64_t i, int64_t j0, int64_t nj, int64_t *lo, int64_t *hi)
{
    const int64_t qi = i + a->Sk - a->Sq;
    int64_t l = 0, h = nj;
    if (a->causal && qi + 1 - j0 < h) h = qi + 1 - j0;
    if (a->window > 0) {
        if (qi - a->window + 1 - j0 > l) l = qi - a->window + 1 - j0;
        if (!a->causal && qi + a->window - j0 < h) h = qi + a->window - j0;
    }
    if (h < 0) h = 0;
    if (l > h) l = h;
    *lo = l;
    *hi = h;
}

/* x <- cap tanh(x / cap) over x[0:n]; dc[0:n] (unless NULL) = the
 * derivative 1 - tanh^2(x / cap) of each. */
static void soft_cap(float *x, int64_t n, float cap, float *dc)
{
#ifdef ATT_X86
    if (sf_cpu_has_avx512()) { soft_cap_avx512(x, n, cap, dc); return; }
#endif
    const float inv = 1.0f / cap;
    for (int64_t j = 0; j < n; j++) {
        const float t = tanhf(x[j] * inv);
        x[j] = cap * t;
        if (dc) dc[j] = 1.0f - t * t;
    }
}

/* S[ni][BK] = the logits s_ij of queries i0.. of head h against keys j0..
 * (Q [ni][D], Kt [D][ldk] from key j0 on): -inf where masked.  With
 * soft-capping and dC not NULL, dC[ni][BK] = dc_ij / dx_ij (0 where the
 * causal / window pattern hides the key). */
static void tile_logits(const sfk_attn *a, int64_t b, int64_t h, int64_t i0, int64_t ni,
                        int64_t j0, int64_t nj, const float *Q, const float *Kt, int64_t ldk,
                        float *S, float *dC)
{
    const int64_t D = a->D, off = a->Sk - a->Sq;
    for (int64_t i = 0; i < ni; i++) memset(S + i * BK, 0, (size_t)nj * sizeof(float));
    matmul_acc(ni, nj, D, Q, D, Kt, ldk, S, BK);
    const float slope = a->alibi ? a->alibi[h] : 0.0f;
    for (int64_t i = 0; i < ni; i++) {
        float *restrict s = S + i * BK;
        int64_t lo, hi;
        visible(a, i0 + i, j0, nj, &lo, &hi);
        for (int64_t j = 0; j < lo; j++) s[j] = -INFINITY;
        for (int64_t j = hi; j < nj; j++) s[j] = -INFINITY;
        if (a->scale != 1.0f)
            for (int64_t j = lo; j < hi; j++) s[j] *= a->scale;
        if (a->softcap > 0.0f) {
            float *dc = dC ? dC + i * BK : NULL;
            if (dc) memset(dc, 0, (size_t)nj * sizeof(float));
            soft_cap(s + lo, hi - lo, a->softcap, dc ? dc + lo : NULL);
        }
        if (a->bias) {
            const float *br = a->bias + b * a->bias_st[0] + h * a->bias_st[1] + (i0 + i) * a->bias_st[2];
            const int64_t st = a->bias_st[3];
            for (int64_t j = lo; j < hi; j++) s[j] += br[(j0 + j) * st];
        }
        if (a->alibi) {
            const int64_t qi = i0 + i + off;
            for (int64_t j = lo; j < hi; j++) {
                int64_t dist = qi - (j0 + j);
                s[j] -= slope * (float)(dist < 0 ? -dist : dist);
            }
        }
        if (a->mask) {
            const uint8_t *mr = a->mask + b * a->mask_st[0] + h * a->mask_st[1] + (i0 + i) * a->mask_st[2];
            const int64_t st = a->mask_st[3];
            for (int64_t j = lo; j < hi; j++)
                if (!mr[(j0 + j) * st]) s[j] = -INFINITY;
        }
    }
}

/* Key tiles [jlo, jhi) any query of [i0, i0 + ni) can see. */
static void key_range(const sfk_attn *a, int64_t i0, int64_t ni, int64_t *jlo, int64_t *jhi)
{
    int64_t lo, hi, l2, h2;
    visible(a, i0, 0, a->Sk, &lo, &hi);
    visible(a, i0 + ni - 1, 0, a->Sk, &l2, &h2);
    /* lo grows and hi grows with i under causal/window; the union is [lo, h2) */
    if (hi > h2) h2 = hi;
    if (l2 < lo) lo = l2;
    *jlo = lo;
    *jhi = h2 > lo ? h2 : lo;
}

/* Element counts of the arrays of an attention call. */
typedef struct {
    int64_t rows_q;   /* B * Hq * Sq: lse */
    int64_t nq;       /* B * Hq * Sq * D: q, o, dout, dq */
    int64_t nk;       /* B * Hkv * Sk * D: k, v, dk, dv */
    int64_t nbias;    /* B * Hq * Sq * Sk: dbias, keep */
} attn_sizes;

/* The dropout coordinates of a (attention.h): drop_seq >= 0, the rows
 * B Hq drop_seq within int64, every position in [0, drop_seq or Sq / Sk). */
static sf_status check_positions(const char *fn, const sfk_attn *a, sf_error *err)
{
    sf_status rc;
    if ((rc = sfk_check_size(fn, "drop_seq", a->drop_seq, err)))
        return rc;
    const int64_t rows = a->drop_seq ? a->drop_seq : a->Sq, cols = a->drop_seq ? a->drop_seq : a->Sk;
    int64_t n;
    if (sf_mul_overflows(a->B, a->Hq, &n) || sf_mul_overflows(n, rows, &n))
        return sf_fail(err, SF_EOVERFLOW, "%s: B=%lld x Hq=%lld x drop_seq=%lld overflows int64",
                       fn, (long long)a->B, (long long)a->Hq, (long long)rows);
    const int64_t *pos[2] = {a->qpos, a->kpos}, len[2] = {a->Sq, a->Sk}, lim[2] = {rows, cols};
    static const char *const name[2] = {"qpos", "kpos"};
    for (int w = 0; w < 2; w++)
        if (!pos[w] && len[w] > lim[w])      /* i (j) itself is the position */
            return sf_fail(err, SF_EINVAL, "%s: %lld %s without %s exceed drop_seq=%lld", fn,
                           (long long)len[w], w ? "keys" : "queries", name[w], (long long)lim[w]);
    for (int w = 0; w < 2; w++)
        for (int64_t i = 0; pos[w] && i < len[w]; i++)
            if (pos[w][i] < 0 || pos[w][i] >= lim[w])
                return sf_fail(err, SF_EINVAL, "%s: %s[%lld]=%lld outside [0, %lld)", fn, name[w],
                               (long long)i, (long long)pos[w][i], (long long)lim[w]);
    return SF_OK;
}

/* Check *a and fill *an with it normalized: a window no query-key distance
 * reaches (>= Sq and >= Sk) is no window, so that the index arithmetic of
 * visible() / query_range() never adds a huge window to a position. */
static sf_status check(const char *fn, const sfk_attn *a, sfk_attn *an, attn_sizes *z,
                       sf_error *err)
{
    if (!a)
        return sf_fail(err, SF_EINVAL, "%s: no parameters (a is NULL)", fn);
    *an = *a;
    sf_status rc;
    if ((rc = sfk_check_dtype(fn, a->t, err)) || (rc = sfk_check_size(fn, "B", a->B, err)) ||
        (rc = sfk_check_size(fn, "Hq", a->Hq, err)) || (rc = sfk_check_size(fn, "Hkv", a->Hkv, err)) ||
        (rc = sfk_check_size(fn, "Sq", a->Sq, err)) || (rc = sfk_check_size(fn, "Sk", a->Sk, err)) ||
        (rc = sfk_check_size(fn, "D", a->D, err)) || (rc = sfk_check_size(fn, "window", a->window, err)))
        return rc;
    if (a->Hq > 0 && (a->Hkv == 0 || a->Hq % a->Hkv != 0))
        return sf_fail(err, SF_EINVAL, "%s: %lld query heads are not a multiple of %lld key-value "
                       "heads", fn, (long long)a->Hq, (long long)a->Hkv);
    if (!(a->dropout >= 0.0f && a->dropout <= 1.0f))
        return sf_fail(err, SF_EINVAL, "%s: dropout=%g outside [0, 1]", fn, (double)a->dropout);
    if (!(a->softcap >= 0.0f && isfinite(a->softcap)))
        return sf_fail(err, SF_EINVAL, "%s: softcap=%g must be finite and > 0 (0: no soft-capping)",
                       fn, (double)a->softcap);
    int64_t bh, bkv;
    if (sf_mul_overflows(a->B, a->Hq, &bh) || sf_mul_overflows(bh, a->Sq, &z->rows_q) ||
        sf_mul_overflows(z->rows_q, a->D, &z->nq) || sf_mul_overflows(z->rows_q, a->Sk, &z->nbias) ||
        sf_mul_overflows(a->B, a->Hkv, &bkv) || sf_mul_overflows(bkv, a->Sk, &z->nk) ||
        sf_mul_overflows(z->nk, a->D, &z->nk))
        return sf_fail(err, SF_EOVERFLOW, "%s: the sizes B=%lld Hq=%lld Hkv=%lld Sq=%lld Sk=%lld "
                       "D=%lld overflow int64", fn, (long long)a->B, (long long)a->Hq,
                       (long long)a->Hkv, (long long)a->Sq, (long long)a->Sk, (long long)a->D);
    if ((rc = check_positions(fn, a, err)))
        return rc;
    if (an->window >= an->Sq && an->window >= an->Sk)
        an->window = 0;
    return SF_OK;
}

/* ---- forward ------------------------------------------------------------ */

typedef struct {
    const sfk_attn *a;
    const void *q, *k, *v;
    void *o;
    float *lse;
    int64_t nqt;
    size_t scratch;    /* bytes of each thread's buffers (see forward_rows) */
    int err;
} fwd_ctx;

static void forward_rows(void *arg, int64_t r0, int64_t r1, int tid)
{
    (void)tid;
    fwd_ctx *c = arg;
    const sfk_attn *a = c->a;
    const int64_t D = a->D, g = a->Hq / a->Hkv;
    const sfk_dtype t = a->t;
    /* Qf [BQ][D] | S [BQ][BK] | acc [BQ][D] | m, l [BQ] | Kt [Sk / BK][D][BK] | Vf [Sk][D]:
     * the key-value head of the current rows, K transposed tile by tile (and V
     * as fp32 for 16-bit types), made once per head and reused by the
     * consecutive query tiles of that head this thread takes. */
    const int64_t Sk = a->Sk, Skr = sfk_ceil_div(Sk, BK) * BK;
    float *buf = malloc(c->scratch);
    if (!buf) { c->err = SF_ENOMEM; return; }
    float *Qf = buf, *S = Qf + BQ * D, *acc = S + BQ * BK, *m = acc + BQ * D, *l = m + BQ;
    float *Kt = l + BQ, *Vf = Kt + Skr * D;
    int64_t cached = -1;
    /* the scale goes into the query tile (one [BQ, D] pass instead of one
     * per key tile): the logits come out scaled from the product */
    sfk_attn unit = *a;
    unit.scale = 1.0f;
    const float inv = a->dropout < 1.0f ? 1.0f / (1.0f - a->dropout) : 0.0f;
    const uint32_t thresh = sfk_dropout_threshold(a->dropout);
    for (int64_t r = r0; r < r1; r++) {
        const int64_t bh = r / c->nqt, b = bh / a->Hq, h = bh % a->Hq;
        const int64_t i0 = (r % c->nqt) * BQ, ni = a->Sq - i0 < BQ ? a->Sq - i0 : BQ;
        const int64_t kvrow = (b * a->Hkv + h / g) * Sk;
        const float *Q = rows_f32(t, c->q, bh * a->Sq + i0, ni, D, Qf);
        for (int64_t e = 0; e < ni * D; e++) Qf[e] = Q[e] * a->scale;
        Q = Qf;
        if (cached != kvrow) {
            /* Vf holds the fp32 keys for a moment on the way to Kt */
            transpose_tiles(rows_f32(t, c->k, kvrow, Sk, D, Vf), Sk, D, Kt);
            if (t != SFK_F32) sfk_load(t, (const char *)c->v + (size_t)(kvrow * D) * 2, Sk * D, Vf);
            cached = kvrow;
        }
        const float *Vh = t == SFK_F32 ? (const float *)c->v + kvrow * D : Vf;
        for (int64_t i = 0; i < ni; i++) { m[i] = -INFINITY; l[i] = 0.0f; }
        memset(acc, 0, (size_t)(ni * D) * sizeof(float));
        int64_t jlo, jhi;
        key_range(a, i0, ni, &jlo, &jhi);
        for (int64_t j0 = jlo / BK * BK; j0 < jhi; j0 += BK) {
            const int64_t nj = jhi - j0 < BK ? jhi - j0 : BK;
            const float *V = Vh + j0 * D;
            tile_logits(&unit, b, h, i0, ni, j0, nj, Q, Kt + j0 * D, BK, S, NULL);
            for (int64_t i = 0; i < ni; i++) {
                float *s = S + i * BK;
                const float bm = sfk_max(s, nj);   /* NaN where a score is: the row's result is NaN */
                const float mnew = bm != bm ? bm : fmaxf(m[i], bm);
                if (mnew == -INFINITY) {           /* nothing visible yet */
                    memset(s, 0, (size_t)nj * sizeof(float));
                    continue;
                }
                const float alpha = expf(m[i] - mnew);
                l[i] = l[i] * alpha + exp_sum(s, nj, mnew);
                m[i] = mnew;
                if (alpha != 1.0f)
                    for (int64_t d = 0; d < D; d++) acc[i * D + d] *= alpha;
                if (a->dropout > 0.0f) {
                    const uint32_t key = drop_key(a, bh, i0 + i);
                    for (int64_t j = 0; j < nj; j++)
                        s[j] = sfk_dropout_kept(key, drop_col(a, j0 + j), thresh) ? s[j] * inv : 0.0f;
                }
            }
            matmul_acc(ni, D, nj, S, BK, V, D, acc, D);
        }
        for (int64_t i = 0; i < ni; i++) {
            const float rl = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
            for (int64_t d = 0; d < D; d++) acc[i * D + d] *= rl;
            c->lse[bh * a->Sq + i0 + i] = l[i] > 0.0f ? m[i] + logf(l[i]) : l[i] != l[i] ? l[i] : INFINITY;
        }
        sfk_store(t, acc, ni * D, (char *)c->o + (size_t)((bh * a->Sq + i0) * D) * (size_t)sfk_size(t));
    }
    free(buf);
}

sf_status sfk_attention_forward(const sfk_attn *a, const void *q, const void *k, const void *v,
                                void *o, float *lse, sf_error *err)
{
    static const char fn[] = "attention_forward";
    attn_sizes z = {0, 0, 0, 0};
    sfk_attn an;
    sf_status rc;
    if ((rc = check(fn, a, &an, &z, err)))
        return rc;
    if (z.rows_q == 0) return SF_OK;
    /* D = 0: o is empty, but lse is not, and it would take the whole
     * [Sq, Sk] walk (bias, mask, alibi) to compute; ops.attention returns the
     * empty result without the kernel, as torch's SDPA does. */
    if (a->D == 0)
        return sf_fail(err, SF_EINVAL, "%s: head size D=0 (q, k, v [.., 0]): the output is "
                       "empty and there is nothing to attend with; lse would cost the whole "
                       "Sq=%lld x Sk=%lld walk for nothing (ops.attention returns the empty "
                       "result without the kernel)", fn, (long long)a->Sq, (long long)a->Sk);
    if ((rc = sfk_check_ptr(fn, "q", q, z.nq, err)) || (rc = sfk_check_ptr(fn, "o", o, z.nq, err)) ||
        (rc = sfk_check_ptr(fn, "lse", lse, z.rows_q, err)) ||
        (rc = sfk_check_ptr(fn, "k", k, z.nk, err)) || (rc = sfk_check_ptr(fn, "v", v, z.nk, err)))
        return rc;
    fwd_ctx c = {.a = &an, .q = q, .k = k, .v = v, .o = o, .lse = lse,
                 .nqt = sfk_ceil_div(a->Sq, BQ)};
    /* Qf, acc [BQ][D] | S [BQ][BK] | m, l [BQ] | Kt [Skr][D] | Vf [Sk][D] (forward_rows) */
    int64_t per_d;
    if (sf_mul_overflows(sfk_ceil_div(a->Sk, BK), BK, &per_d) ||
        __builtin_add_overflow(per_d, a->Sk, &per_d) || __builtin_add_overflow(per_d, 2 * BQ, &per_d))
        return sf_fail(err, SF_EOVERFLOW, "%s: Sk=%lld overflows the scratch size", fn,
                       (long long)a->Sk);
    if ((rc = sfk_float_bytes(fn, "key-value head", per_d, a->D, &c.scratch, err)))
        return rc;
    c.scratch += (size_t)(BQ * BK + 2 * BQ) * sizeof(float);
    const int64_t rows = a->B * a->Hq * c.nqt;       /* <= rows_q */
    sfk_parallel_rows(rows, sfk_threads_for(rows, sfk_sat_mul(sfk_sat_mul(BQ, a->Sk + 1), a->D + 1)),
                      forward_rows, &c);
    if (c.err)
        return sfk_no_memory(fn, (double)c.scratch, err);
    return SF_OK;
}

/* ---- backward ----------------------------------------------------------- */

typedef struct {
    const sfk_attn *a;
    const void *q, *k, *v, *o, *dout;
    const float *lse;
    void *dq, *dk, *dv;
    float *dbias;
    /* With fewer (batch, key-value head) pairs than threads, each pair's key
     * tiles are split in `nsplit` parts of about equal work (first tile of
     * part p: split[p]); each part accumulates its dq into dqpart, summed at
     * the end. */
    int64_t nsplit, split[SFK_MAX_SPLIT + 1];
    float *dqpart;
    size_t scratch;    /* bytes of each thread's buffers (see backward_rows) */
    int err;
} bwd_ctx;

/* Queries [lo, hi) that can see some key of the tile (j0, nj). */
static void query_range(const sfk_attn *a, int64_t j0, int64_t nj, int64_t *lo, int64_t *hi)
{
    const int64_t off = a->Sk - a->Sq;
    int64_t l = 0, h = a->Sq;
    if (a->causal && j0 - off > l) l = j0 - off;
    if (a->window > 0) {
        if (j0 + nj - 1 - off + a->window < h) h = j0 + nj - 1 - off + a->window;
        if (!a->causal && j0 - off - a->window + 1 > l) l = j0 - off - a->window + 1;
    }
    *lo = l;
    *hi = h > l ? h : l;
}

static void backward_rows(void *arg, int64_t r0, int64_t r1, int tid)
{
    (void)tid;
    bwd_ctx *c = arg;
    const sfk_attn *a = c->a;
    const sfk_dtype t = a->t;
    const int64_t D = a->D, g = a->Hq / a->Hkv, Sq = a->Sq;
    const size_t sz = (size_t)sfk_size(t);
    /* accumulate dq in the output itself (fp32, one part per pair) */
    const int direct = t == SFK_F32 && c->nsplit == 1;
    /* Qf, dOf [BQ][D] | Kf, Vf, dKa, dVa [BK][D] | Kt, Vt [D][BK] | S, dP, T, dC [BQ][BK] |
     * delta [g][Sq] | dQa [g][Sq][D] (16-bit types): c->scratch bytes (bwd_scratch) */
    float *buf = malloc(c->scratch);
    if (!buf) { c->err = SF_ENOMEM; return; }
    float *Qf = buf, *dOf = Qf + BQ * D, *Kf = dOf + BQ * D, *Vf = Kf + BK * D, *dKa = Vf + BK * D;
    float *dVa = dKa + BK * D, *Kt = dVa + BK * D, *Vt = Kt + D * BK, *S = Vt + D * BK;
    float *dP = S + BQ * BK, *T = dP + BQ * BK, *dC = T + BK * BQ, *delta = dC + BK * BQ;
    float *dQbuf = delta + g * Sq;
    const int capped = a->softcap > 0.0f;
    const float inv = a->dropout < 1.0f ? 1.0f / (1.0f - a->dropout) : 0.0f;
    const uint32_t thresh = sfk_dropout_threshold(a->dropout);
    for (int64_t r = r0; r < r1; r++) {
        const int64_t pair = r / c->nsplit, part = r % c->nsplit;
        const int64_t b = pair / a->Hkv, h0 = (pair % a->Hkv) * g, kvrow = pair * a->Sk;
        const int64_t qrow0 = (b * a->Hq + h0) * Sq;       /* first query row of the group */
        float *dQa = direct ? (float *)c->dq + qrow0 * D
                   : c->nsplit > 1 ? c->dqpart + (size_t)(r * g * Sq * D) : dQbuf;
        memset(dQa, 0, (size_t)(g * Sq * D) * sizeof(float));
        for (int64_t i0 = 0; i0 < g * Sq; i0 += BQ) {      /* delta = rowsum(dout * o) */
            const int64_t ni = g * Sq - i0 < BQ ? g * Sq - i0 : BQ;
            const float *dO = rows_f32(t, c->dout, qrow0 + i0, ni, D, dOf);
            const float *O = rows_f32(t, c->o, qrow0 + i0, ni, D, Qf);
            for (int64_t i = 0; i < ni; i++) {
                float s = 0.0f;
                for (int64_t d = 0; d < D; d++) s += dO[i * D + d] * O[i * D + d];
                delta[i0 + i] = s;
            }
        }
        const int64_t jend = c->split[part + 1] * BK < a->Sk ? c->split[part + 1] * BK : a->Sk;
        for (int64_t j0 = c->split[part] * BK; j0 < jend; j0 += BK) {
            const int64_t nj = a->Sk - j0 < BK ? a->Sk - j0 : BK;
            const float *K = rows_f32(t, c->k, kvrow + j0, nj, D, Kf);
            transpose_in(K, nj, D, Kt, BK);
            transpose_in(rows_f32(t, c->v, kvrow + j0, nj, D, Vf), nj, D, Vt, BK);
            memset(dKa, 0, (size_t)(2 * BK * D) * sizeof(float));    /* dKa and dVa */
            int64_t qlo, qhi;
            query_range(a, j0, nj, &qlo, &qhi);
            for (int64_t hg = 0; hg < g; hg++) {
                const int64_t h = h0 + hg, qrow = qrow0 + hg * Sq;
                for (int64_t i0 = qlo; i0 < qhi; i0 += BQ) {
                    const int64_t ni = qhi - i0 < BQ ? qhi - i0 : BQ;
                    const float *Q = rows_f32(t, c->q, qrow + i0, ni, D, Qf);
                    const float *dO = rows_f32(t, c->dout, qrow + i0, ni, D, dOf);
                    tile_logits(a, b, h, i0, ni, j0, nj, Q, Kt, BK, S, capped ? dC : NULL);
                    for (int64_t i = 0; i < ni; i++) {
                        float *s = S + i * BK;
                        const float lse = c->lse[qrow + i0 + i];
                        sfk_scaled_exp(s, s, nj, lse, 1.0f, 0.0f);   /* p = exp(s - lse) */
                        memset(dP + i * BK, 0, (size_t)nj * sizeof(float));
                    }
                    matmul_acc(ni, nj, D, dO, D, Vt, BK, dP, BK);   /* dout . v */
                    const float *Pd = S;        /* p with the dropout applied */
                    if (a->dropout > 0.0f) {
                        for (int64_t i = 0; i < ni; i++) {
                            const uint32_t key = drop_key(a, b * a->Hq + h, i0 + i);
                            const float *s = S + i * BK;
                            float *pd = T + i * BK, *dp = dP + i * BK;
                            for (int64_t j = 0; j < nj; j++) {
                                const int z = sfk_dropout_kept(key, drop_col(a, j0 + j), thresh);
                                pd[j] = z ? s[j] * inv : 0.0f;
                                dp[j] = z ? dp[j] * inv : 0.0f;
                            }
                        }
                        Pd = T;
                    }
                    matmul_acc_tn(nj, D, ni, Pd, BK, dO, D, dVa, D);   /* dv += p~^T dout */
                    for (int64_t i = 0; i < ni; i++) {
                        float *s = S + i * BK;
                        const float *dp = dP + i * BK, dl = delta[hg * Sq + i0 + i];
                        for (int64_t j = 0; j < nj; j++) s[j] = s[j] * (dp[j] - dl);   /* ds */
                        if (c->dbias)
                            memcpy(c->dbias + (size_t)((qrow + i0 + i) * a->Sk + j0), s,
                                   (size_t)nj * sizeof(float));
                        if (capped) {           /* through the cap: dx = ds dc/dx */
                            const float *dc = dC + i * BK;
                            for (int64_t j = 0; j < nj; j++) s[j] *= a->scale * dc[j];
                        } else {
                            for (int64_t j = 0; j < nj; j++) s[j] *= a->scale;
                        }
                    }
                    matmul_acc(ni, D, nj, S, BK, K, D, dQa + (hg * Sq + i0) * D, D);
                    matmul_acc_tn(nj, D, ni, S, BK, Q, D, dKa, D);
                }
            }
            sfk_store(t, dKa, nj * D, (char *)c->dk + (size_t)((kvrow + j0) * D) * sz);
            sfk_store(t, dVa, nj * D, (char *)c->dv + (size_t)((kvrow + j0) * D) * sz);
        }
        if (!direct && c->nsplit == 1)
            sfk_store(t, dQa, g * Sq * D, (char *)c->dq + (size_t)(qrow0 * D) * sz);
    }
    free(buf);
}

/* The bytes of backward_rows' buffers (listed there), overflow-checked. */
static sf_status bwd_scratch(const char *fn, const sfk_attn *a, int direct_or_split,
                             size_t *bytes, sf_error *err)
{
    const int64_t gsq = a->Hq / a->Hkv * a->Sq;     /* <= B * Hq * Sq, which fits */
    int64_t n, tiles;
    if (sf_mul_overflows(2 * BQ + 6 * BK, a->D, &tiles) ||
        __builtin_add_overflow(tiles, 4 * BQ * BK, &n) || __builtin_add_overflow(n, gsq, &n) ||
        (!direct_or_split && (sf_mul_overflows(gsq, a->D, &tiles) ||
                              __builtin_add_overflow(n, tiles, &n))))
        return sf_fail(err, SF_EOVERFLOW, "%s: the scratch for Sq=%lld D=%lld (%lld query heads "
                       "per key-value head) overflows int64", fn, (long long)a->Sq,
                       (long long)a->D, (long long)(a->Hq / a->Hkv));
    return sfk_float_bytes(fn, "per-thread", n, 1, bytes, err);
}

sf_status sfk_attention_backward(const sfk_attn *a, const void *q, const void *k, const void *v,
                                 const void *o, const void *dout, const float *lse, void *dq,
                                 void *dk, void *dv, float *dbias, sf_error *err)
{
    static const char fn[] = "attention_backward";
    attn_sizes z = {0, 0, 0, 0};
    sfk_attn an;
    sf_status rc;
    if ((rc = check(fn, a, &an, &z, err)))
        return rc;
    if ((rc = sfk_check_ptr(fn, "q", q, z.nq, err)) || (rc = sfk_check_ptr(fn, "o", o, z.nq, err)) ||
        (rc = sfk_check_ptr(fn, "dout", dout, z.nq, err)) ||
        (rc = sfk_check_ptr(fn, "dq", dq, z.nq, err)) ||
        (rc = sfk_check_ptr(fn, "lse", lse, z.rows_q, err)) ||
        (rc = sfk_check_ptr(fn, "k", k, z.nk, err)) || (rc = sfk_check_ptr(fn, "v", v, z.nk, err)) ||
        (rc = sfk_check_ptr(fn, "dk", dk, z.nk, err)) || (rc = sfk_check_ptr(fn, "dv", dv, z.nk, err)))
        return rc;
    size_t nbias_bytes;
    if ((rc = sfk_float_bytes(fn, "dbias", z.nbias, 1, &nbias_bytes, err)))
        return rc;
    if (dbias) memset(dbias, 0, nbias_bytes);
    const int64_t pairs = a->B * a->Hkv, g = a->Hkv > 0 ? a->Hq / a->Hkv : 0;
    /* D = 0: dq, dk, dv are empty and ds = p (dout . v - dout . o) = 0: done */
    if (pairs == 0 || a->D == 0) return SF_OK;
    a = &an;
    bwd_ctx c = {.a = a, .q = q, .k = k, .v = v, .o = o, .dout = dout, .lse = lse, .dq = dq,
                 .dk = dk, .dv = dv, .dbias = dbias, .nsplit = 1};
    const int64_t nkt = sfk_ceil_div(a->Sk, BK);
    int nt = sfk_threads_for(sfk_sat_mul(pairs, nkt),
                             sfk_sat_mul(sfk_sat_mul(g, a->Sq + 1), sfk_sat_mul(BK, a->D + 1)));
    if (pairs < nt && nkt > 1) {
        c.nsplit = (nt + pairs - 1) / pairs;
        if (c.nsplit > nkt) c.nsplit = nkt;
        if (c.nsplit > SFK_MAX_SPLIT) c.nsplit = SFK_MAX_SPLIT;
    }
    /* Part boundaries by work: tile t costs the queries that can see it (in
     * double: a heuristic, exact below 2^53, and no product to overflow). */
    double total = 0.0;
    for (int64_t kt = 0; c.nsplit > 1 && kt < nkt; kt++) {
        int64_t lo, hi;
        query_range(a, kt * BK, a->Sk - kt * BK < BK ? a->Sk - kt * BK : BK, &lo, &hi);
        total += (double)(hi - lo) + 1.0;
    }
    c.split[0] = 0;
    int64_t p = 1;
    double acc = 0.0;
    for (int64_t kt = 0; kt < nkt && p < c.nsplit; kt++) {
        int64_t lo, hi;
        query_range(a, kt * BK, a->Sk - kt * BK < BK ? a->Sk - kt * BK : BK, &lo, &hi);
        acc += (double)(hi - lo) + 1.0;
        while (p < c.nsplit && acc * (double)c.nsplit >= total * (double)p) c.split[p++] = kt + 1;
    }
    while (p <= c.nsplit) c.split[p++] = nkt;
    const size_t qn = (size_t)(g * a->Sq * a->D);          /* <= the elements of q */
    if ((rc = bwd_scratch(fn, a, (a->t == SFK_F32 && c.nsplit == 1) || c.nsplit > 1, &c.scratch,
                          err)))
        return rc;
    if (c.nsplit > 1) {
        size_t part_bytes;
        if ((rc = sfk_float_bytes(fn, "dq partial", pairs * c.nsplit, (int64_t)qn, &part_bytes,
                                  err)))
            return rc;
        c.dqpart = calloc(part_bytes, 1);
        if (!c.dqpart)
            return sfk_no_memory(fn, (double)part_bytes, err);
    }
    const int64_t rows = pairs * c.nsplit;
    sfk_parallel_rows(rows, nt < rows ? nt : (int)rows, backward_rows, &c);
    if (c.nsplit > 1) {
        if (c.err == SF_OK) {
            for (int64_t pr = 0; pr < pairs; pr++) {
                float *sum = c.dqpart + (size_t)(pr * c.nsplit) * qn;
                for (int64_t part = 1; part < c.nsplit; part++) {
                    const float *x = sum + (size_t)part * qn;
                    for (size_t e = 0; e < qn; e++) sum[e] += x[e];
                }
                const int64_t b = pr / a->Hkv, h0 = (pr % a->Hkv) * g;
                sfk_store(a->t, sum, (int64_t)qn,
                          (char *)dq + (size_t)((b * a->Hq + h0) * a->Sq * a->D) * (size_t)sfk_size(a->t));
            }
        }
        free(c.dqpart);
    }
    if (c.err)
        return sfk_no_memory(fn, (double)c.scratch, err);
    return SF_OK;
}

sf_status sfk_attention_dropout_keep(const sfk_attn *a, uint8_t *keep, sf_error *err)
{
    static const char fn[] = "attention_dropout_keep";
    attn_sizes z = {0, 0, 0, 0};
    sfk_attn an;
    sf_status rc;
    if ((rc = check(fn, a, &an, &z, err)) || (rc = sfk_check_ptr(fn, "keep", keep, z.nbias, err)))
        return rc;
    if (z.nbias == 0)
        return SF_OK;                          /* keep is empty (Sq rows of no key) */
    const int64_t rows = z.rows_q;
    const uint32_t thresh = sfk_dropout_threshold(a->dropout);
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t key = drop_key(a, r / a->Sq, r % a->Sq);
        for (int64_t j = 0; j < a->Sk; j++)
            keep[r * a->Sk + j] =
                (uint8_t)(a->dropout <= 0.0f || sfk_dropout_kept(key, drop_col(a, j), thresh));
    }
    return SF_OK;
}
