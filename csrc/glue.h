/*
 * glue.h -- what every CPython glue file of _C shares (module.c,
 * comm_module.c, kernels_module.c):
 *
 *   sf_set_pyerr   the one mapper from an sf_status and its message to a
 *                  Python exception (the type of each status is in status.h;
 *                  glue-level argument errors are still raised directly);
 *   sf_take        the one DLPack gate: consume obj.__dlpack__() into an
 *                  sf_view and check device, dtype, contiguity and
 *                  writability, raising an exception that names the argument;
 *   sf_view_release  give the capsule back.
 *
 * Ownership: the DLPack capsule is kept in view->owner and released by
 * sf_view_release().  We never rename the capsule ("used_dltensor"), so the
 * producer's capsule destructor frees the managed tensor when `owner` dies.
 */
#ifndef SHARDFORMER_GLUE_H
#define SHARDFORMER_GLUE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "status.h"
#include "tensor_view.h"

/* 0 when rc is SF_OK; else set the exception of rc with err->msg (or the
 * status name when the message is empty) and return -1.  For SF_EINTR an
 * exception already set (by a signal handler the call ran) is left as it is. */
int sf_set_pyerr(sf_status rc, const sf_error *err);

/* What sf_take requires of a tensor besides its dtype. */
enum {
    SF_TAKE_WRITE = 1u << 0,      /* writable (DLPack 1.0 read-only flag clear) */
    SF_TAKE_CONTIGUOUS = 1u << 1, /* row-major contiguous (empty tensors pass) */
    SF_TAKE_OPTIONAL = 1u << 2,   /* None is accepted: sf_take returns 1 */
    SF_TAKE_CUDA = 1u << 3,       /* a CUDA tensor instead of a CPU one */
    SF_TAKE_ANY_DEVICE = 1u << 4, /* no device check (tensor_info) */
};

/* Acquire `obj` as argument `name` of entry point `fn` (NULL: messages start
 * with the argument name alone) and check it: device (CPU unless
 * SF_TAKE_CUDA / SF_TAKE_ANY_DEVICE), dtype in `dtypes` (SF_DT_* bits,
 * SF_DT_ANY for any), then the SF_TAKE_* flags.
 *   0   *v holds the tensor: sf_view_release(v) when done;
 *   1   obj is None and SF_TAKE_OPTIONAL was given: *v holds nothing;
 *  -1   an exception is set (TypeError / ValueError / OverflowError) and
 *       *v holds nothing. */
int sf_take(const char *fn, PyObject *obj, const char *name, unsigned dtypes, unsigned flags,
            sf_view *v);

void sf_view_release(sf_view *v);

#endif
