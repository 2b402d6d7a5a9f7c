/*
 * tensor_view.h -- a borrowed, checked view of a tensor handed to _C.
 *
 * Every _C entry point that takes a tensor turns it into an sf_view through
 * the DLPack protocol (`obj.__dlpack__()`), then checks what it needs
 * (dtype, device, contiguity, writability) with the helpers below, which set
 * a Python exception naming the argument when a check fails.
 *
 * Ownership: the DLPack capsule is kept in `owner` and released by
 * sf_view_release().  We never rename the capsule ("used_dltensor"), so the
 * producer's capsule destructor frees the managed tensor when `owner` dies.
 */
#ifndef SHARDFORMER_TENSOR_VIEW_H
#define SHARDFORMER_TENSOR_VIEW_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "dlpack.h"

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
    PyObject *owner;               /* the capsule; NULL once released */
} sf_view;

/* Fill `v` from any object exporting __dlpack__.  0 on success; -1 with a
 * Python exception set (TypeError/ValueError naming `argname`). */
int sf_view_acquire(PyObject *obj, const char *argname, sf_view *v);
void sf_view_release(sf_view *v);

int sf_view_is_contiguous(const sf_view *v);
const char *sf_dtype_name(SFDLDataType dt);

/* Checks; each returns 0 or -1 with an exception naming `argname`. */
int sf_check_cpu(const sf_view *v, const char *argname);
int sf_check_contiguous(const sf_view *v, const char *argname);
int sf_check_writable(const sf_view *v, const char *argname);
int sf_check_same_dtype(const sf_view *a, const char *aname,
                        const sf_view *b, const char *bname);
/* dtype must be one of: float32, float16, bfloat16 */
int sf_check_float(const sf_view *v, const char *argname);

#endif
