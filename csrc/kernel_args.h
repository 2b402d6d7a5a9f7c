/*
 * kernel_args.h -- the tensor arguments of one kernel call, shared by the
 * CPython glue of the CPU kernels (kernels_module.c, shardformer._C) and of
 * the CUDA kernels (cuda/module.c, shardformer._cuda): every tensor through
 * the one DLPack gate (sf_take: device, dtype, contiguity, writability), the
 * size checks that relate them, the refusal of outputs that overlap another
 * tensor of the call, and the release of them all.  `views.device` picks the
 * device every tensor must be on (0: CPU, SF_TAKE_CUDA: CUDA).
 */
#ifndef SHARDFORMER_KERNEL_ARGS_H
#define SHARDFORMER_KERNEL_ARGS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "glue.h"
#include "kernels/checks.h"
#include "tensor_view.h"

#define MAXV 16

/* The tensor arguments of one call, released together; `out` marks the
 * writable ones (outputs), `same_ok` a pair allowed to be the very same
 * memory (an intended in-place use). */
typedef struct {
    sf_view v[MAXV];
    unsigned device;               /* SF_TAKE_CUDA for the CUDA glue, 0 (CPU) for _C */
    char label[MAXV][80];
    unsigned char out[MAXV];
    int n;
    const char *fn;
    const sf_view *same_ok[2];
} views;

static inline void drop(views *vs)
{
    for (int i = 0; i < vs->n; i++) sf_view_release(&vs->v[i]);
    vs->n = 0;
}

/* Not an sf_take flag: the argument need not be contiguous, its caller
 * checks the layout it reads (skinny_linear's weight: rows of unit stride,
 * any distance apart). */
#define ARG_STRIDED (1u << 16)

/* sf_take `obj` as argument `name` (dtypes SF_DT_*, flags SF_TAKE_* and
 * ARG_STRIDED) into the next slot of vs; *out is the view, or NULL for None
 * when SF_TAKE_OPTIONAL.  -1 with an exception. */
static inline int arg(views *vs, PyObject *obj, const char *name, unsigned dtypes, unsigned flags,
               sf_view **out)
{
    *out = NULL;
    sf_view *v = &vs->v[vs->n];
    const unsigned take = flags & ARG_STRIDED ? flags & ~ARG_STRIDED : flags | SF_TAKE_CONTIGUOUS;
    int rc = sf_take(vs->fn, obj, name, dtypes, take | vs->device, v);
    if (rc < 0) return -1;
    if (rc == 0) {
        snprintf(vs->label[vs->n], sizeof(vs->label[0]), "%s", name);
        vs->out[vs->n] = (flags & SF_TAKE_WRITE) != 0;
        vs->n++;
        *out = v;
        /* numel * itemsize: the byte size every kernel's pointer arithmetic assumes */
        size_t bytes;
        sf_error err = {0};
        if (sf_set_pyerr(sf_view_nbytes(v, name, &bytes, &err), &err)) return -1;
    }
    return 0;
}

/* The very same memory as each other (same first byte, same size): the
 * in-place use a kernel may declare. */
static inline int same_memory(const sf_view *a, const sf_view *b)
{
    return a->data == b->data && a->numel * a->itemsize == b->numel * b->itemsize;
}

/* No output shares a byte with another tensor of the call (input or output),
 * except the pair in vs->same_ok when it is exactly the same memory.  The
 * views are contiguous (arg), so comparing extents is exact (conservative
 * for an ARG_STRIDED input: its gaps count as its memory).  -1 with
 * ValueError naming both. */
static inline int no_overlap(views *vs)
{
    for (int i = 0; i < vs->n; i++) {
        for (int j = 0; j < vs->n; j++) {
            if (i == j || !vs->out[i] || (vs->out[j] && j < i)) continue;
            const sf_view *a = &vs->v[i], *b = &vs->v[j];
            const int declared = (a == vs->same_ok[0] && b == vs->same_ok[1]) ||
                                 (a == vs->same_ok[1] && b == vs->same_ok[0]);
            if (declared && same_memory(a, b)) continue;
            char an[128], bn[128];
            snprintf(an, sizeof(an), "%s: %s", vs->fn, vs->label[i]);
            snprintf(bn, sizeof(bn), "%s%s", vs->out[j] ? "the output " : "", vs->label[j]);
            sf_error err = {0};
            if (sf_set_pyerr(sf_check_disjoint(a, an, b, bn, &err), &err)) return -1;
        }
    }
    return 0;
}

/* Shorthands: data in (float32/float16/bfloat16), data out, fp32 in / out,
 * int64 ids, each optionally None. */
#define IN SF_DT_FLOAT, 0
#define OUT SF_DT_FLOAT, SF_TAKE_WRITE
#define F32 SF_DT_F32, 0
#define F32_OUT SF_DT_F32, SF_TAKE_WRITE
#define F32_OPT SF_DT_F32, SF_TAKE_OPTIONAL
#define F32_OUT_OPT SF_DT_F32, SF_TAKE_WRITE | SF_TAKE_OPTIONAL
#define I64 SF_DT_I64, 0
#define I64_OPT SF_DT_I64, SF_TAKE_OPTIONAL

static inline sfk_dtype kdtype(const sf_view *v)
{
    if (v->dtype.code == SF_DL_BFLOAT) return SFK_BF16;
    return v->dtype.bits == 16 ? SFK_F16 : SFK_F32;
}

static inline int64_t last_dim(const sf_view *v) { return v->ndim ? v->shape[v->ndim - 1] : 1; }

/* numel / last_dim without dividing (last_dim may be 0): the product of the
 * leading dimensions, which cannot overflow (a prefix of numel's product is
 * bounded by numel unless a later dimension is 0: then checked). */
static inline int lead_rows(views *vs, const sf_view *v, int64_t *rows)
{
    int64_t r = 1;
    for (int d = 0; d + 1 < v->ndim; d++)
        if (sf_mul_overflows(r, v->shape[d], &r)) {
            PyErr_Format(PyExc_OverflowError, "%s: the leading dimensions overflow int64", vs->fn);
            return -1;
        }
    *rows = r;
    return 0;
}

static inline int want_numel(views *vs, const sf_view *v, const char *name, int64_t n)
{
    if (v && v->numel != n) {
        PyErr_Format(PyExc_ValueError, "%s: %s has %lld elements, expected %lld", vs->fn, name,
                     (long long)v->numel, (long long)n);
        return -1;
    }
    return 0;
}

/* a * b, or -1 with OverflowError naming what it counts. */
static inline int mul(views *vs, const char *what, int64_t a, int64_t b, int64_t *out)
{
    if (sf_mul_overflows(a, b, out)) {
        PyErr_Format(PyExc_OverflowError, "%s: %s (%lld x %lld) overflows int64", vs->fn, what,
                     (long long)a, (long long)b);
        return -1;
    }
    return 0;
}

static inline int same_dtype(views *vs, const sf_view *a, const char *an, const sf_view *b,
                      const char *bn)
{
    (void)vs;
    if (!a || !b) return 0;
    sf_error err = {0};
    return sf_set_pyerr(sf_check_same_dtype(a, an, b, bn, &err), &err);
}

static inline PyObject *finish(views *vs, sf_status rc, const sf_error *err)
{
    drop(vs);
    if (sf_set_pyerr(rc, err)) return NULL;
    Py_RETURN_NONE;
}

static inline PyObject *fail(views *vs)
{
    drop(vs);
    return NULL;
}

/* Check that no output overlaps another tensor of the call, then run the
 * kernel without the GIL: `rc = call;` */
#define RUN(call)                                                             \
    if (no_overlap(&vs)) return fail(&vs);                                    \
    sf_error err = {0};                                                       \
    sf_status rc;                                                             \
    Py_BEGIN_ALLOW_THREADS                                                    \
    rc = (call);                                                              \
    Py_END_ALLOW_THREADS                                                      \
    return finish(&vs, rc, &err)

#define FLOATP(v) ((v) ? (float *)(v)->data : NULL)

#endif /* SHARDFORMER_KERNEL_ARGS_H */
