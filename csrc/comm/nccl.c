/*
 * nccl.c -- the dlopen'ed NCCL entry points and their error reporting.
 *
 * Every call returns an sf_status: SF_EIO when the library cannot be loaded,
 * SF_EUNSUPPORTED when it is not loaded or lacks an entry point, SF_EINVAL
 * for bad arguments, and SF_EEXTERNAL when NCCL itself fails, with a message
 * that carries the ncclResult_t, ncclGetErrorString and, where the library
 * has it, ncclGetLastError.
 * Symbols newer than NCCL 2.0 (ncclGetLastError, ncclSend/ncclRecv from 2.7,
 * ncclCommAbort) and ncclGroupStart/End are looked up optionally and
 * reported missing when absent.
 */
#define _GNU_SOURCE
#include "nccl.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef int nccl_result;
typedef void *nccl_comm;
typedef void *cuda_stream;
typedef struct { char internal[SF_NCCL_UNIQUE_ID_BYTES]; } nccl_unique_id;

static struct {
    void *lib;
    int version;
    char path[512];
    nccl_result (*get_version)(int *);
    const char *(*get_error_string)(nccl_result);
    const char *(*get_last_error)(nccl_comm);
    nccl_result (*get_unique_id)(nccl_unique_id *);
    nccl_result (*comm_init_rank)(nccl_comm *, int, nccl_unique_id, int);
    nccl_result (*comm_destroy)(nccl_comm);
    nccl_result (*comm_abort)(nccl_comm);
    nccl_result (*all_reduce)(const void *, void *, size_t, int, int, nccl_comm, cuda_stream);
    nccl_result (*all_gather)(const void *, void *, size_t, int, nccl_comm, cuda_stream);
    nccl_result (*reduce_scatter)(const void *, void *, size_t, int, int, nccl_comm,
                                  cuda_stream);
    nccl_result (*broadcast)(const void *, void *, size_t, int, int, nccl_comm, cuda_stream);
    nccl_result (*send)(const void *, size_t, int, int, nccl_comm, cuda_stream);
    nccl_result (*recv)(void *, size_t, int, int, nccl_comm, cuda_stream);
    nccl_result (*group_start)(void);
    nccl_result (*group_end)(void);
} N;

#define LOOKUP(field, name)                                                   \
    do {                                                                      \
        *(void **)(&N.field) = dlsym(N.lib, name);                            \
    } while (0)

sf_status sf_nccl_load(const char *path, sf_error *err)
{
    if (N.lib)
        return SF_OK;
    const char *name = path && *path ? path : "libnccl.so.2";
    void *lib = dlopen(name, RTLD_NOW | RTLD_NOLOAD);
    if (!lib)
        lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *why = dlerror();
        return sf_fail(err, SF_EIO, "cannot load %s: %s", name, why ? why : "unknown error");
    }
    N.lib = lib;
    LOOKUP(get_version, "ncclGetVersion");
    LOOKUP(get_error_string, "ncclGetErrorString");
    LOOKUP(get_last_error, "ncclGetLastError");
    LOOKUP(get_unique_id, "ncclGetUniqueId");
    LOOKUP(comm_init_rank, "ncclCommInitRank");
    LOOKUP(comm_destroy, "ncclCommDestroy");
    LOOKUP(comm_abort, "ncclCommAbort");
    LOOKUP(all_reduce, "ncclAllReduce");
    LOOKUP(all_gather, "ncclAllGather");
    LOOKUP(reduce_scatter, "ncclReduceScatter");
    LOOKUP(broadcast, "ncclBroadcast");
    LOOKUP(send, "ncclSend");
    LOOKUP(recv, "ncclRecv");
    LOOKUP(group_start, "ncclGroupStart");
    LOOKUP(group_end, "ncclGroupEnd");
    if (!N.get_version || !N.get_error_string || !N.get_unique_id || !N.comm_init_rank ||
        !N.comm_destroy || !N.all_reduce || !N.all_gather || !N.reduce_scatter ||
        !N.broadcast) {
        dlclose(lib);
        memset(&N, 0, sizeof(N));
        return sf_fail(err, SF_EIO, "%s lacks the NCCL 2.x entry points", name);
    }
    if (N.get_version(&N.version) != 0)
        N.version = 0;
    Dl_info info;
    if (dladdr(*(void **)(&N.get_version), &info) && info.dli_fname)
        snprintf(N.path, sizeof(N.path), "%s", info.dli_fname);
    else
        snprintf(N.path, sizeof(N.path), "%s", name);
    return SF_OK;
}

int sf_nccl_version(void) { return N.lib ? N.version : 0; }
const char *sf_nccl_path(void) { return N.lib ? N.path : ""; }

static sf_status check_result(nccl_result r, nccl_comm comm, const char *what, sf_error *err)
{
    if (r == 0)
        return SF_OK;
    const char *s = N.get_error_string ? N.get_error_string(r) : "unknown";
    const char *last = N.get_last_error ? N.get_last_error(comm) : NULL;
    return sf_fail(err, SF_EEXTERNAL, "%s failed: NCCL error %d (%s)%s%s", what, r, s ? s : "?",
                last && *last ? ": " : "", last && *last ? last : "");
}

static sf_status need(void *fn, const char *what, sf_error *err)
{
    if (!N.lib)
        return sf_fail(err, SF_EUNSUPPORTED, "%s: NCCL is not loaded", what);
    if (!fn)
        return sf_fail(err, SF_EUNSUPPORTED, "%s: this NCCL (version %d) lacks the entry point",
                       what, N.version);
    return SF_OK;
}

/* The NCCL call needs `what` loaded and a communicator. */
#define NEED(field, what)                                                     \
    do {                                                                      \
        sf_status rc_ = need(*(void **)(&N.field), what, err);                \
        if (rc_)                                                              \
            return rc_;                                                       \
        if (!comm)                                                            \
            return sf_fail(err, SF_EINVAL, "%s: no communicator", what);      \
    } while (0)

sf_status sf_nccl_unique_id(unsigned char id[SF_NCCL_UNIQUE_ID_BYTES], sf_error *err)
{
    sf_status rc = need(*(void **)(&N.get_unique_id), "ncclGetUniqueId", err);
    if (rc)
        return rc;
    nccl_unique_id u;
    rc = check_result(N.get_unique_id(&u), NULL, "ncclGetUniqueId", err);
    if (!rc)
        memcpy(id, u.internal, SF_NCCL_UNIQUE_ID_BYTES);
    return rc;
}

sf_status sf_nccl_comm_init(void **comm, int nranks,
                            const unsigned char id[SF_NCCL_UNIQUE_ID_BYTES], int rank,
                            sf_error *err)
{
    if (!comm || !id || nranks < 1 || rank < 0 || rank >= nranks)
        return sf_fail(err, SF_EINVAL, "ncclCommInitRank: rank %d of %d ranks is invalid", rank,
                       nranks);
    sf_status rc = need(*(void **)(&N.comm_init_rank), "ncclCommInitRank", err);
    if (rc)
        return rc;
    nccl_unique_id u;
    memcpy(u.internal, id, SF_NCCL_UNIQUE_ID_BYTES);
    nccl_comm c = NULL;
    rc = check_result(N.comm_init_rank(&c, nranks, u, rank), NULL, "ncclCommInitRank", err);
    if (!rc)
        *comm = c;
    return rc;
}

sf_status sf_nccl_comm_destroy(void *comm, int abort_it, sf_error *err)
{
    if (!comm)
        return SF_OK;
    if (abort_it && N.comm_abort)
        return check_result(N.comm_abort(comm), NULL, "ncclCommAbort", err);
    sf_status rc = need(*(void **)(&N.comm_destroy), "ncclCommDestroy", err);
    if (rc)
        return rc;
    return check_result(N.comm_destroy(comm), NULL, "ncclCommDestroy", err);
}

#define STREAM(s) ((cuda_stream)(s))

sf_status sf_nccl_all_reduce(void *comm, const void *send, void *recv, size_t count, int dtype,
                             int op, uintptr_t stream, sf_error *err)
{
    NEED(all_reduce, "ncclAllReduce");
    return check_result(N.all_reduce(send, recv, count, dtype, op, comm, STREAM(stream)), comm,
                        "ncclAllReduce", err);
}

sf_status sf_nccl_all_gather(void *comm, const void *send, void *recv, size_t count, int dtype,
                             uintptr_t stream, sf_error *err)
{
    NEED(all_gather, "ncclAllGather");
    return check_result(N.all_gather(send, recv, count, dtype, comm, STREAM(stream)), comm,
                        "ncclAllGather", err);
}

sf_status sf_nccl_reduce_scatter(void *comm, const void *send, void *recv, size_t count, int dtype,
                                 int op, uintptr_t stream, sf_error *err)
{
    NEED(reduce_scatter, "ncclReduceScatter");
    return check_result(N.reduce_scatter(send, recv, count, dtype, op, comm, STREAM(stream)),
                        comm, "ncclReduceScatter", err);
}

sf_status sf_nccl_broadcast(void *comm, const void *send, void *recv, size_t count, int dtype,
                            int root, uintptr_t stream, sf_error *err)
{
    NEED(broadcast, "ncclBroadcast");
    return check_result(N.broadcast(send, recv, count, dtype, root, comm, STREAM(stream)), comm,
                        "ncclBroadcast", err);
}

sf_status sf_nccl_send(void *comm, const void *buf, size_t count, int dtype, int peer,
                       uintptr_t stream, sf_error *err)
{
    NEED(send, "ncclSend");
    return check_result(N.send(buf, count, dtype, peer, comm, STREAM(stream)), comm, "ncclSend",
                        err);
}

sf_status sf_nccl_recv(void *comm, void *buf, size_t count, int dtype, int peer, uintptr_t stream,
                       sf_error *err)
{
    NEED(recv, "ncclRecv");
    return check_result(N.recv(buf, count, dtype, peer, comm, STREAM(stream)), comm, "ncclRecv",
                        err);
}

/* Bytes of one element of NCCL data type `dtype`; 0 for a code not known here. */
static size_t nccl_elem_size(int dtype)
{
    switch (dtype) {
    case SF_NCCL_INT8: case SF_NCCL_UINT8: return 1;
    case SF_NCCL_FLOAT16: case SF_NCCL_BFLOAT16: return 2;
    case SF_NCCL_INT32: case SF_NCCL_UINT32: case SF_NCCL_FLOAT32: return 4;
    case SF_NCCL_INT64: case SF_NCCL_UINT64: case SF_NCCL_FLOAT64: return 8;
    default: return 0;
    }
}

sf_status sf_nccl_all_to_all(void *comm, const void *send, void *recv, size_t count, int dtype,
                             int nranks, uintptr_t stream, sf_error *err)
{
    NEED(send, "ncclSend (all_to_all)");
    NEED(recv, "ncclRecv (all_to_all)");
    NEED(group_start, "ncclGroupStart (all_to_all)");
    NEED(group_end, "ncclGroupEnd (all_to_all)");
    size_t es = nccl_elem_size(dtype), block, total;
    if (!es || nranks < 1)
        return sf_fail(err, SF_EINVAL, "all_to_all: NCCL dtype %d or %d ranks is invalid", dtype,
                       nranks);
    if (sf_size_mul_overflows(count, es, &block) ||
        sf_size_mul_overflows(block, (size_t)nranks, &total))
        return sf_fail(err, SF_EOVERFLOW, "all_to_all: %d ranks x %zu elements of %zu bytes "
                       "overflow", nranks, count, es);
    if (total && (!send || !recv))
        return sf_fail(err, SF_EINVAL, "all_to_all: null buffer");
    sf_status rc = check_result(N.group_start(), comm, "ncclGroupStart", err);
    if (rc)
        return rc;
    /* Every send and recv of the group is enqueued before the group ends; a
     * failure stops enqueueing, and the group is still closed. */
    for (int r = 0; r < nranks && !rc; r++) {
        const char *s = (const char *)send + (size_t)r * block;
        char *d = (char *)recv + (size_t)r * block;
        rc = check_result(N.send(s, count, dtype, r, comm, STREAM(stream)), comm, "ncclSend", err);
        if (!rc)
            rc = check_result(N.recv(d, count, dtype, r, comm, STREAM(stream)), comm, "ncclRecv",
                              err);
    }
    nccl_result end = N.group_end();
    if (rc)
        return rc;
    return check_result(end, comm, "ncclGroupEnd", err);
}
