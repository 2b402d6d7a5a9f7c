/*
 * tensor_view.h -- a checked view of a tensor handed to _C, and the checks
 * every tensor-taking entry point runs before touching memory.
 *
 * Plain C over the DLPack structs: sf_view_init() validates what a producer
 * handed over (dimensions, dtype, sizes) and the sf_check_* functions test
 * what an entry point needs.  Each returns an sf_status with a message naming
 * the argument.  Getting the DLPack capsule out of a Python object, and
 * releasing it, is the glue's job: sf_take() in glue.h is the one gate every
 * entry point uses.
 */
#ifndef SHARDFORMER_TENSOR_VIEW_H
#define SHARDFORMER_TENSOR_VIEW_H

#include <stddef.h>
#include <stdint.h>

#include "dlpack.h"
#include "status.h"

/* The most dimensions any layer of the C core accepts (tensors, copies). */
#define SF_MAX_DIMS 16

typedef struct {
    char *data;                    /* first element (byte_offset applied) */
    int ndim;
    int64_t shape[SF_MAX_DIMS];
    int64_t strides[SF_MAX_DIMS];  /* in elements, always filled in */
    int64_t numel;
    int itemsize;                  /* bytes per element */
    SFDLDataType dtype;
    SFDLDevice device;
    int readonly;
    void *owner;                   /* the glue's DLPack capsule; NULL when none */
} sf_view;

/* Element types as bits, for sets of accepted dtypes (SF_DT_ANY: no check). */
enum {
    SF_DT_ANY = 0,
    SF_DT_F32 = 1u << 0,
    SF_DT_F16 = 1u << 1,
    SF_DT_BF16 = 1u << 2,
    SF_DT_F64 = 1u << 3,
    SF_DT_I8 = 1u << 4,
    SF_DT_U8 = 1u << 5,
    SF_DT_I16 = 1u << 6,
    SF_DT_I32 = 1u << 7,
    SF_DT_I64 = 1u << 8,
    SF_DT_BOOL = 1u << 9,
};
#define SF_DT_FLOAT (SF_DT_F32 | SF_DT_F16 | SF_DT_BF16)

/* Fill `v` (owner left NULL) from a producer's tensor; `name` is the
 * argument, for messages.  EINVAL (ndim, negative sizes), ETYPE (dtype),
 * EOVERFLOW (element count). */
sf_status sf_view_init(sf_view *v, const SFDLTensor *t, int readonly, const char *name,
                       sf_error *err);

/* Row-major contiguous (dimensions of size 1 may have any stride); an empty
 * view is contiguous, as in torch. */
int sf_view_is_contiguous(const sf_view *v);
/* numel * itemsize, or EOVERFLOW when it does not fit size_t. */
sf_status sf_view_nbytes(const sf_view *v, const char *name, size_t *out, sf_error *err);

/* Where a strided tensor lies in memory: the byte offsets [*lo, *hi) it can
 * reach relative to its first element (negative strides reach below it);
 * [0, 0) when it has no elements.  EOVERFLOW naming `name` when a
 * stride x size product or the sum does not fit int64. */
sf_status sf_extent(int ndim, const int64_t *shape, const int64_t *strides, int itemsize,
                    const char *name, int64_t *lo, int64_t *hi, sf_error *err);

/* 1 when the byte ranges [a + alo, a + ahi) and [b + blo, b + bhi) share a
 * byte (empty ranges share none). */
int sf_bytes_intersect(const char *a, int64_t alo, int64_t ahi, const char *b, int64_t blo,
                       int64_t bhi);

/* SF_OK when no two indices of the tensor address the same element; EINVAL
 * naming `name` when two may: a stride of 0 in a dimension of size > 1 (an
 * expand()ed tensor) or strides that interleave (as_strided).  Sufficient,
 * not necessary: sorted by |stride|, each dimension must step past all the
 * smaller ones; the layouts torch and NumPy make (slices, transposes, steps)
 * pass.  EOVERFLOW when the reach of the strides overflows int64. */
sf_status sf_check_no_self_overlap(int ndim, const int64_t *shape, const int64_t *strides,
                                   const char *name, sf_error *err);

/* Outputs of an entry point: `out` must not share memory with `other` (an
 * input or another output).  The views' extents are compared, which is
 * exact for contiguous views and conservative for strided ones.  EINVAL
 * naming both. */
sf_status sf_check_disjoint(const sf_view *out, const char *oname, const sf_view *other,
                            const char *other_name, sf_error *err);

const char *sf_dtype_name(SFDLDataType dt);
/* The SF_DT_* bit of dt, 0 for a dtype outside the list. */
unsigned sf_dtype_bit(SFDLDataType dt);

/* Checks; each returns SF_OK or an error naming `name`. */
sf_status sf_check_cpu(const sf_view *v, const char *name, sf_error *err);       /* EINVAL */
sf_status sf_check_cuda(const sf_view *v, const char *name, sf_error *err);      /* EINVAL */
sf_status sf_check_contiguous(const sf_view *v, const char *name, sf_error *err); /* EINVAL */
sf_status sf_check_writable(const sf_view *v, const char *name, sf_error *err);  /* EINVAL */
/* dtype in `dtypes` (SF_DT_* bits; SF_DT_ANY passes everything): ETYPE. */
sf_status sf_check_dtype(const sf_view *v, const char *name, unsigned dtypes, sf_error *err);
sf_status sf_check_same_dtype(const sf_view *a, const char *aname, const sf_view *b,
                              const char *bname, sf_error *err);                 /* ETYPE */

#endif
