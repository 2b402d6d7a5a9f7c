/*
 * tensor_view.c -- DLPack tensor -> sf_view, and the argument checks (see
 * tensor_view.h).  Plain C; the capsule handling is in glue.c.
 */
#include "tensor_view.h"

#include <stdio.h>
#include <string.h>

const char *sf_dtype_name(SFDLDataType dt)
{
    if (dt.lanes != 1)
        return "vector";
    switch (dt.code) {
    case SF_DL_FLOAT:
        return dt.bits == 32 ? "float32" : dt.bits == 16 ? "float16"
             : dt.bits == 64 ? "float64" : "float?";
    case SF_DL_BFLOAT:
        return dt.bits == 16 ? "bfloat16" : "bfloat?";
    case SF_DL_INT:
        return dt.bits == 64 ? "int64" : dt.bits == 32 ? "int32"
             : dt.bits == 16 ? "int16" : dt.bits == 8 ? "int8" : "int?";
    case SF_DL_UINT:
        return dt.bits == 8 ? "uint8" : "uint?";
    case SF_DL_BOOL:
        return "bool";
    default:
        return "unknown";
    }
}

unsigned sf_dtype_bit(SFDLDataType dt)
{
    if (dt.lanes != 1)
        return 0;
    switch (dt.code) {
    case SF_DL_FLOAT:
        return dt.bits == 32 ? SF_DT_F32 : dt.bits == 16 ? SF_DT_F16 : dt.bits == 64 ? SF_DT_F64 : 0;
    case SF_DL_BFLOAT:
        return dt.bits == 16 ? SF_DT_BF16 : 0;
    case SF_DL_INT:
        return dt.bits == 8 ? SF_DT_I8 : dt.bits == 16 ? SF_DT_I16 : dt.bits == 32 ? SF_DT_I32
             : dt.bits == 64 ? SF_DT_I64 : 0;
    case SF_DL_UINT:
        return dt.bits == 8 ? SF_DT_U8 : 0;
    case SF_DL_BOOL:
        return dt.bits == 8 ? SF_DT_BOOL : 0;
    default:
        return 0;
    }
}

sf_status sf_view_init(sf_view *v, const SFDLTensor *t, int readonly, const char *name,
                       sf_error *err)
{
    memset(v, 0, sizeof(*v));
    if (t->ndim < 0 || t->ndim > SF_MAX_DIMS)
        return sf_fail(err, SF_EINVAL, "%s: %d dimensions (at most %d supported)", name,
                       (int)t->ndim, SF_MAX_DIMS);
    if (t->dtype.lanes != 1 || t->dtype.bits == 0 || t->dtype.bits % 8 != 0)
        return sf_fail(err, SF_ETYPE, "%s: unsupported DLPack dtype (code %u, %u bits, %u lanes)",
                       name, (unsigned)t->dtype.code, (unsigned)t->dtype.bits,
                       (unsigned)t->dtype.lanes);
    v->ndim = t->ndim;
    v->dtype = t->dtype;
    v->device = t->device;
    v->itemsize = t->dtype.bits / 8;
    v->readonly = readonly;
    v->data = (char *)t->data + t->byte_offset;
    v->numel = 1;
    for (int d = 0; d < v->ndim; d++) {
        if (t->shape[d] < 0)
            return sf_fail(err, SF_EINVAL, "%s: negative size in dimension %d (%lld)", name, d,
                           (long long)t->shape[d]);
        v->shape[d] = t->shape[d];
        if (sf_mul_overflows(v->numel, t->shape[d], &v->numel))
            return sf_fail(err, SF_EOVERFLOW, "%s: the element count overflows int64 at "
                           "dimension %d", name, d);
    }
    /* NULL strides mean compact row-major: spell them out.  The running
     * product can only overflow past a dimension of size 0 (numel fits), where
     * no stride is ever used: those are left 0. */
    int64_t stride = 1;
    int wrapped = 0;
    for (int d = v->ndim - 1; d >= 0; d--) {
        v->strides[d] = t->strides ? t->strides[d] : wrapped ? 0 : stride;
        wrapped = wrapped || sf_mul_overflows(stride, v->shape[d], &stride);
    }
    return SF_OK;
}

int sf_view_is_contiguous(const sf_view *v)
{
    if (v->numel == 0)
        return 1;                  /* (and every prefix product below fits numel) */
    int64_t expected = 1;
    for (int d = v->ndim - 1; d >= 0; d--) {
        if (v->shape[d] != 1 && v->strides[d] != expected)
            return 0;
        expected *= v->shape[d];
    }
    return 1;
}

sf_status sf_view_nbytes(const sf_view *v, const char *name, size_t *out, sf_error *err)
{
    /* numel and itemsize are non-negative (sf_view_init) */
    if (v->itemsize > 0 && (uint64_t)v->numel > (uint64_t)SIZE_MAX / (uint64_t)v->itemsize)
        return sf_fail(err, SF_EOVERFLOW, "%s: %lld elements of %d bytes overflow size_t", name,
                       (long long)v->numel, v->itemsize);
    *out = (size_t)v->numel * (size_t)v->itemsize;
    return SF_OK;
}

sf_status sf_extent(int ndim, const int64_t *shape, const int64_t *strides, int itemsize,
                    const char *name, int64_t *lo, int64_t *hi, sf_error *err)
{
    *lo = *hi = 0;
    for (int d = 0; d < ndim; d++)
        if (shape[d] == 0)
            return SF_OK;
    int64_t below = 0, above = 0, step;
    for (int d = 0; d < ndim; d++) {
        if (sf_mul_overflows(strides[d], shape[d] - 1, &step) ||
            (step < 0 ? __builtin_add_overflow(below, step, &below)
                      : __builtin_add_overflow(above, step, &above)))
            return sf_fail(err, SF_EOVERFLOW, "%s: the memory its strides reach overflows int64 "
                           "(dimension %d: size %lld, stride %lld)", name, d,
                           (long long)shape[d], (long long)strides[d]);
    }
    /* elements -> bytes, the last element's own bytes included */
    if (sf_mul_overflows(below, itemsize, lo) || sf_mul_overflows(above, itemsize, hi) ||
        __builtin_add_overflow(*hi, itemsize, hi))
        return sf_fail(err, SF_EOVERFLOW, "%s: the memory its strides reach overflows int64 "
                       "bytes", name);
    return SF_OK;
}

int sf_bytes_intersect(const char *a, int64_t alo, int64_t ahi, const char *b, int64_t blo,
                       int64_t bhi)
{
    if (alo >= ahi || blo >= bhi)
        return 0;
    /* unsigned address arithmetic: defined for any offsets */
    const uintptr_t a0 = (uintptr_t)a + (uintptr_t)alo, a1 = (uintptr_t)a + (uintptr_t)ahi;
    const uintptr_t b0 = (uintptr_t)b + (uintptr_t)blo, b1 = (uintptr_t)b + (uintptr_t)bhi;
    return a0 < b1 && b0 < a1;
}

/* |s|, saturated at INT64_MAX (a stride of INT64_MIN reaches past any memory
 * anyway; the reach computed from it overflows and is refused). */
static int64_t abs_stride(int64_t s) { return s >= 0 ? s : s == INT64_MIN ? INT64_MAX : -s; }

sf_status sf_check_no_self_overlap(int ndim, const int64_t *shape, const int64_t *strides,
                                   const char *name, sf_error *err)
{
    int order[SF_MAX_DIMS], n = 0;
    for (int d = 0; d < ndim && d < SF_MAX_DIMS; d++) {
        if (shape[d] == 0)
            return SF_OK;          /* no elements: nothing to overlap */
        if (shape[d] == 1)
            continue;
        if (strides[d] == 0)
            return sf_fail(err, SF_EINVAL, "%s: dimension %d has size %lld but stride 0 (an "
                           "expand()ed or broadcast tensor): its elements share memory, so it "
                           "cannot be written; pass a tensor of its own (.contiguous())", name,
                           d, (long long)shape[d]);
        /* insertion sort by |stride| (at most SF_MAX_DIMS dimensions) */
        int k = n++;
        while (k > 0 && abs_stride(strides[order[k - 1]]) > abs_stride(strides[d])) {
            order[k] = order[k - 1];
            k--;
        }
        order[k] = d;
    }
    int64_t reach = 0;             /* the largest offset the smaller strides reach */
    for (int i = 0; i < n; i++) {
        const int d = order[i];
        const int64_t st = abs_stride(strides[d]);
        if (st <= reach)
            return sf_fail(err, SF_EINVAL, "%s: dimension %d (size %lld, stride %lld) steps "
                           "into the span of its smaller strides, so two indices may address "
                           "the same element (an as_strided tensor?); it cannot be written: "
                           "pass a tensor of its own (.contiguous())", name, d,
                           (long long)shape[d], (long long)strides[d]);
        int64_t span;
        if (sf_mul_overflows(st, shape[d] - 1, &span) ||
            __builtin_add_overflow(reach, span, &reach))
            return sf_fail(err, SF_EOVERFLOW, "%s: the memory its strides reach overflows "
                           "int64 (dimension %d: size %lld, stride %lld)", name, d,
                           (long long)shape[d], (long long)strides[d]);
    }
    return SF_OK;
}

sf_status sf_check_disjoint(const sf_view *out, const char *oname, const sf_view *other,
                            const char *other_name, sf_error *err)
{
    int64_t olo, ohi, alo, ahi;
    sf_status rc;
    if ((rc = sf_extent(out->ndim, out->shape, out->strides, out->itemsize, oname, &olo, &ohi,
                        err)) ||
        (rc = sf_extent(other->ndim, other->shape, other->strides, other->itemsize, other_name,
                        &alo, &ahi, err)))
        return rc;
    if (sf_bytes_intersect(out->data, olo, ohi, other->data, alo, ahi))
        return sf_fail(err, SF_EINVAL, "%s overlaps %s in memory: an output may not share "
                       "memory with an input or another output (the result would depend on "
                       "the order of the writes); pass a separate tensor", oname, other_name);
    return SF_OK;
}

sf_status sf_check_cpu(const sf_view *v, const char *name, sf_error *err)
{
    if (v->device.device_type != SF_DL_CPU)
        return sf_fail(err, SF_EINVAL, "%s: expected a CPU tensor, got DLPack device type %d "
                       "(device %d)", name, (int)v->device.device_type, (int)v->device.device_id);
    return SF_OK;
}

sf_status sf_check_cuda(const sf_view *v, const char *name, sf_error *err)
{
    if (v->device.device_type != SF_DL_CUDA)
        return sf_fail(err, SF_EINVAL, "%s: expected a CUDA tensor, got %s (DLPack device type "
                       "%d, device %d)", name,
                       v->device.device_type == SF_DL_CPU ? "a CPU tensor" : "another device",
                       (int)v->device.device_type, (int)v->device.device_id);
    return SF_OK;
}

sf_status sf_check_contiguous(const sf_view *v, const char *name, sf_error *err)
{
    if (!sf_view_is_contiguous(v))
        return sf_fail(err, SF_EINVAL, "%s: expected a contiguous tensor (call .contiguous() "
                       "first)", name);
    return SF_OK;
}

sf_status sf_check_writable(const sf_view *v, const char *name, sf_error *err)
{
    if (v->readonly)
        return sf_fail(err, SF_EINVAL, "%s: tensor is read-only", name);
    return SF_OK;
}

static const struct { unsigned bit; const char *name; } DT_NAMES[] = {
    {SF_DT_F32, "float32"}, {SF_DT_F16, "float16"}, {SF_DT_BF16, "bfloat16"},
    {SF_DT_F64, "float64"}, {SF_DT_I8, "int8"},     {SF_DT_U8, "uint8"},
    {SF_DT_I16, "int16"},   {SF_DT_I32, "int32"},   {SF_DT_I64, "int64"},
    {SF_DT_BOOL, "bool"},
};

sf_status sf_check_dtype(const sf_view *v, const char *name, unsigned dtypes, sf_error *err)
{
    if (dtypes == SF_DT_ANY || (sf_dtype_bit(v->dtype) & dtypes))
        return SF_OK;
    /* "float32, float16 or bfloat16" */
    char list[160] = "";
    size_t len = 0;
    int total = 0, k = 0;
    for (size_t i = 0; i < sizeof(DT_NAMES) / sizeof(DT_NAMES[0]); i++)
        total += (dtypes & DT_NAMES[i].bit) != 0;
    for (size_t i = 0; i < sizeof(DT_NAMES) / sizeof(DT_NAMES[0]) && len < sizeof(list); i++) {
        if (!(dtypes & DT_NAMES[i].bit))
            continue;
        const char *sep = k == 0 ? "" : k == total - 1 ? " or " : ", ";
        len += (size_t)snprintf(list + len, sizeof(list) - len, "%s%s", sep, DT_NAMES[i].name);
        k++;
    }
    return sf_fail(err, SF_ETYPE, "%s: expected %s, got %s", name, list,
                   sf_dtype_name(v->dtype));
}

sf_status sf_check_same_dtype(const sf_view *a, const char *aname, const sf_view *b,
                              const char *bname, sf_error *err)
{
    if (a->dtype.code != b->dtype.code || a->dtype.bits != b->dtype.bits)
        return sf_fail(err, SF_ETYPE, "%s has dtype %s but %s has dtype %s", aname,
                       sf_dtype_name(a->dtype), bname, sf_dtype_name(b->dtype));
    return SF_OK;
}
