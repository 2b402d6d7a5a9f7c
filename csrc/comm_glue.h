/*
 * comm_glue.h -- the argument checks the shm and NCCL glue share
 * (comm_module.c, comm_nccl_module.c); registration of their methods.
 */
#ifndef SHARDFORMER_COMM_GLUE_H
#define SHARDFORMER_COMM_GLUE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "tensor_view.h"

/* big.numel == nranks * small.numel (checked multiplication); 0 or -1 with
 * ValueError / OverflowError naming `bigname`. */
int sf_check_blocks(const char *fn, const char *bigname, const sf_view *big, const sf_view *small,
                    int nranks);

/* out and tensor: the same number of elements, a multiple of nranks; 0 or
 * -1 with ValueError. */
int sf_check_all_to_all(const char *fn, const sf_view *out, const sf_view *in, int nranks);

/* A C function run on an shm communicator with the GIL released. */
struct sf_shm;
typedef sf_status (*sf_shm_native_fn)(struct sf_shm *comm, void *ctx, sf_error *err);

/* Run fn on the shm communicator of capsule `cap` (from shm_create /
 * shm_attach) with the GIL released, polling for signals, as every shm call
 * runs (one at a time per communicator; a close during it waits for it).
 * 0, or -1 with an exception. */
int sf_shm_run_native(PyObject *cap, sf_shm_native_fn fn, void *ctx);

/* Add the shm / NCCL functions to the module; -1 with an exception. */
int sf_register_comm(PyObject *m);
int sf_register_nccl(PyObject *m);

#endif
