/*
 * nccl.h -- NCCL loaded at run time with dlopen, built without CUDA or NCCL
 * headers: the few types and entry points we call are declared here from
 * NCCL's stable C ABI (ncclResult_t, ncclDataType_t, ncclRedOp_t are ints,
 * ncclComm_t and cudaStream_t are opaque pointers, ncclUniqueId is 128 bytes).
 *
 * Plain C; comm_module.c is the Python glue (it checks the tensors, through
 * DLPack, before anything here runs).  Nothing here needs a GPU to compile or
 * to report why NCCL is unavailable.  Every call returns an sf_status
 * (status.h); see nccl.c for which.
 */
#ifndef SHARDFORMER_COMM_NCCL_H
#define SHARDFORMER_COMM_NCCL_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

#define SF_NCCL_UNIQUE_ID_BYTES 128

/* NCCL's data type and reduction codes (ABI values). */
enum { SF_NCCL_INT8 = 0, SF_NCCL_UINT8 = 1, SF_NCCL_INT32 = 2, SF_NCCL_UINT32 = 3,
       SF_NCCL_INT64 = 4, SF_NCCL_UINT64 = 5, SF_NCCL_FLOAT16 = 6, SF_NCCL_FLOAT32 = 7,
       SF_NCCL_FLOAT64 = 8, SF_NCCL_BFLOAT16 = 9 };
enum { SF_NCCL_SUM = 0, SF_NCCL_PROD = 1, SF_NCCL_MAX = 2, SF_NCCL_MIN = 3 };

/* Load libnccl.so.2 (or `path` when not NULL): first the copy already in the
 * process (RTLD_NOLOAD), else a fresh dlopen.  SF_OK, or SF_EIO with the
 * reason in err.  Idempotent. */
sf_status sf_nccl_load(const char *path, sf_error *err);
/* NCCL's version code (e.g. 22005 for 2.20.5); 0 when not loaded. */
int sf_nccl_version(void);
/* Where the library came from (dladdr), or "" when not loaded. */
const char *sf_nccl_path(void);

sf_status sf_nccl_unique_id(unsigned char id[SF_NCCL_UNIQUE_ID_BYTES], sf_error *err);
sf_status sf_nccl_comm_init(void **comm, int nranks, const unsigned char id[SF_NCCL_UNIQUE_ID_BYTES],
                            int rank, sf_error *err);
sf_status sf_nccl_comm_destroy(void *comm, int abort_it, sf_error *err);

/* The collectives, enqueued on `stream` (a cudaStream_t as an integer). */
sf_status sf_nccl_all_reduce(void *comm, const void *send, void *recv, size_t count, int dtype,
                             int op, uintptr_t stream, sf_error *err);
sf_status sf_nccl_all_gather(void *comm, const void *send, void *recv, size_t count, int dtype,
                             uintptr_t stream, sf_error *err);
sf_status sf_nccl_reduce_scatter(void *comm, const void *send, void *recv, size_t count, int dtype,
                                 int op, uintptr_t stream, sf_error *err);
sf_status sf_nccl_broadcast(void *comm, const void *send, void *recv, size_t count, int dtype,
                            int root, uintptr_t stream, sf_error *err);
/* All-to-all: send and recv hold nranks blocks of `count` elements; block j
 * of send goes to rank j, block i of recv comes from rank i.  One group
 * (ncclGroupStart/End) of nranks ncclSend + ncclRecv pairs (NCCL >= 2.7);
 * send and recv must not overlap (the Python layer refuses it).
 * SF_EINVAL for a dtype code this file has no size for, SF_EOVERFLOW when
 * nranks * count * size overflows. */
sf_status sf_nccl_all_to_all(void *comm, const void *send, void *recv, size_t count, int dtype,
                             int nranks, uintptr_t stream, sf_error *err);
sf_status sf_nccl_send(void *comm, const void *buf, size_t count, int dtype, int peer,
                       uintptr_t stream, sf_error *err);
sf_status sf_nccl_recv(void *comm, void *buf, size_t count, int dtype, int peer, uintptr_t stream,
                       sf_error *err);

#endif
