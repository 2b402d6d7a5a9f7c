/*
 * checks.c -- the argument checks every kernel shares, CPU (csrc/kernels/)
 * and CUDA (csrc/cuda/): see checks.h.  Plain C, no Python, no threads, so
 * the CUDA extension links it without the CPU kernels.
 */
#include "checks.h"

#include <stdint.h>

sf_status sfk_check_dtype(const char *fn, sfk_dtype t, sf_error *err)
{
    if (t != SFK_F32 && t != SFK_F16 && t != SFK_BF16)
        return sf_fail(err, SF_ETYPE, "%s: element type %d is not float32 (%d), float16 (%d) or "
                       "bfloat16 (%d)", fn, (int)t, SFK_F32, SFK_F16, SFK_BF16);
    return SF_OK;
}

sf_status sfk_check_size(const char *fn, const char *name, int64_t value, sf_error *err)
{
    if (value < 0)
        return sf_fail(err, SF_EINVAL, "%s: %s=%lld must be >= 0", fn, name, (long long)value);
    return SF_OK;
}

sf_status sfk_check_ptr(const char *fn, const char *name, const void *p, int64_t count,
                        sf_error *err)
{
    if (count > 0 && p == NULL)
        return sf_fail(err, SF_EINVAL, "%s: %s is NULL but %lld elements are to be touched", fn,
                       name, (long long)count);
    return SF_OK;
}

sf_status sfk_no_memory(const char *fn, double bytes, sf_error *err)
{
    return sf_fail(err, SF_ENOMEM, "%s: out of memory (could not allocate %.0f bytes of scratch)",
                   fn, bytes);
}

sf_status sfk_float_bytes(const char *fn, const char *what, int64_t count, int64_t per,
                          size_t *bytes, sf_error *err)
{
    int64_t n;
    if (count < 0 || per < 0 || sf_mul_overflows(count, per, &n) ||
        sf_mul_overflows(n, (int64_t)sizeof(float), &n) || (uint64_t)n > (uint64_t)SIZE_MAX)
        return sf_fail(err, SF_EOVERFLOW, "%s: the %s scratch (%lld x %lld floats) overflows "
                       "int64", fn, what, (long long)count, (long long)per);
    *bytes = (size_t)n;
    return SF_OK;
}

/* ---- the checks of each kernel family, CPU and CUDA (see checks.h) ---- */

sf_status sfk_check_norm_args(const char *fn, sfk_dtype t, int64_t rows, int64_t n, const void *x,
                       const float *rstd, sf_error *err)
{
    sf_status rc;
    if ((rc = sfk_check_dtype(fn, t, err)) || (rc = sfk_check_size(fn, "rows", rows, err)) ||
        (rc = sfk_check_size(fn, "n", n, err)) ||
        (rc = sfk_check_ptr(fn, "x", x, n > 0 ? rows : 0, err)) ||
        (rc = sfk_check_ptr(fn, "rstd", rstd, rows, err)))
        return rc;
    return SF_OK;
}

sf_status sfk_check_xent_args(const char *fn, sfk_dtype t, int64_t rows, int64_t n, int64_t real,
                       int64_t vocab_start, const void *logits, const int64_t *labels,
                       sf_error *err)
{
    sf_status rc;
    if ((rc = sfk_check_dtype(fn, t, err)) || (rc = sfk_check_size(fn, "rows", rows, err)) ||
        (rc = sfk_check_size(fn, "n", n, err)) ||
        (rc = sfk_check_size(fn, "vocab_start", vocab_start, err)))
        return rc;
    if (real < 0 || real > n)
        return sf_fail(err, SF_EINVAL, "%s: vocab_real=%lld outside [0, %lld] (the logits have "
                       "%lld columns)", fn, (long long)real, (long long)n, (long long)n);
    if ((rc = sfk_check_ptr(fn, "labels", labels, rows, err)) ||
        (rc = sfk_check_ptr(fn, "logits", logits, n > 0 ? rows : 0, err)))
        return rc;
    return SF_OK;
}

sf_status sfk_check_embedding_args(const char *fn, sfk_dtype t, int64_t d, int64_t real, int64_t count,
                       int64_t vocab_start, const int64_t *ids, sf_error *err)
{
    sf_status rc;
    if ((rc = sfk_check_dtype(fn, t, err)) || (rc = sfk_check_size(fn, "d", d, err)) ||
        (rc = sfk_check_size(fn, "vocab_real", real, err)) ||
        (rc = sfk_check_size(fn, "vocab_start", vocab_start, err)) ||
        (rc = sfk_check_size(fn, "count", count, err)) ||
        (rc = sfk_check_ptr(fn, "ids", ids, count, err)))
        return rc;
    return SF_OK;
}

sf_status sfk_check_elementwise_args(const char *fn, sfk_dtype t, int64_t rows, int64_t n, sf_error *err)
{
    sf_status rc;
    if ((rc = sfk_check_dtype(fn, t, err)) || (rc = sfk_check_size(fn, "rows", rows, err)) ||
        (rc = sfk_check_size(fn, "n", n, err)))
        return rc;
    return SF_OK;
}

sf_status sfk_check_dropout_p(const char *fn, float p, sf_error *err)
{
    if (!(p >= 0.0f && p <= 1.0f))
        return sf_fail(err, SF_EINVAL, "%s: p=%g outside [0, 1]", fn, (double)p);
    return SF_OK;
}
