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
    /* NULL strides mean compact row-major: spell them out. */
    int64_t stride = 1;
    for (int d = v->ndim - 1; d >= 0; d--) {
        v->strides[d] = t->strides ? t->strides[d] : stride;
        stride *= v->shape[d];
    }
    return SF_OK;
}

int sf_view_is_contiguous(const sf_view *v)
{
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
