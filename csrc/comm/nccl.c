/*
 * nccl.c -- the dlopen'ed NCCL entry points and their error reporting.
 *
 * Every call returns 0 or a nonzero ncclResult_t with a message that carries
 * ncclGetErrorString and, where the library has it, ncclGetLastError.
 * Symbols newer than NCCL 2.0 (ncclGetLastError, ncclSend/ncclRecv from 2.7,
 * ncclCommAbort) are looked up optionally and reported missing when absent.
 */
#define _GNU_SOURCE
#include "nccl.h"

#include <dlfcn.h>
#include <stdarg.h>
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
} N;

static int fail(char *err, size_t len, int code, const char *fmt, ...)
{
    if (err && len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, len, fmt, ap);
        va_end(ap);
    }
    return code;
}

#define LOOKUP(field, name)                                                   \
    do {                                                                      \
        *(void **)(&N.field) = dlsym(N.lib, name);                            \
    } while (0)

int sf_nccl_load(const char *path, char *err, size_t errlen)
{
    if (N.lib)
        return 0;
    const char *name = path && *path ? path : "libnccl.so.2";
    void *lib = dlopen(name, RTLD_NOW | RTLD_NOLOAD);
    if (!lib)
        lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *why = dlerror();
        return fail(err, errlen, 1, "cannot load %s: %s", name, why ? why : "unknown error");
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
    if (!N.get_version || !N.get_error_string || !N.get_unique_id || !N.comm_init_rank ||
        !N.comm_destroy || !N.all_reduce || !N.all_gather || !N.reduce_scatter ||
        !N.broadcast) {
        dlclose(lib);
        memset(&N, 0, sizeof(N));
        return fail(err, errlen, 1, "%s lacks the NCCL 2.x entry points", name);
    }
    if (N.get_version(&N.version) != 0)
        N.version = 0;
    Dl_info info;
    if (dladdr(*(void **)(&N.get_version), &info) && info.dli_fname)
        snprintf(N.path, sizeof(N.path), "%s", info.dli_fname);
    else
        snprintf(N.path, sizeof(N.path), "%s", name);
    return 0;
}

int sf_nccl_version(void) { return N.lib ? N.version : 0; }
const char *sf_nccl_path(void) { return N.lib ? N.path : ""; }

static int check_result(nccl_result r, nccl_comm comm, const char *what, char *err,
                        size_t errlen)
{
    if (r == 0)
        return 0;
    const char *s = N.get_error_string ? N.get_error_string(r) : "unknown";
    const char *last = N.get_last_error ? N.get_last_error(comm) : NULL;
    return fail(err, errlen, r, "%s failed: NCCL error %d (%s)%s%s", what, r, s ? s : "?",
                last && *last ? ": " : "", last && *last ? last : "");
}

static int need(void *fn, const char *what, char *err, size_t errlen)
{
    if (!N.lib)
        return fail(err, errlen, 1, "%s: NCCL is not loaded", what);
    if (!fn)
        return fail(err, errlen, 1, "%s: this NCCL (version %d) lacks the entry point", what,
                    N.version);
    return 0;
}

int sf_nccl_unique_id(unsigned char id[SF_NCCL_UNIQUE_ID_BYTES], char *err, size_t errlen)
{
    if (need(*(void **)(&N.get_unique_id), "ncclGetUniqueId", err, errlen))
        return 1;
    nccl_unique_id u;
    int rc = check_result(N.get_unique_id(&u), NULL, "ncclGetUniqueId", err, errlen);
    if (!rc)
        memcpy(id, u.internal, SF_NCCL_UNIQUE_ID_BYTES);
    return rc;
}

int sf_nccl_comm_init(void **comm, int nranks, const unsigned char id[SF_NCCL_UNIQUE_ID_BYTES],
                      int rank, char *err, size_t errlen)
{
    if (need(*(void **)(&N.comm_init_rank), "ncclCommInitRank", err, errlen))
        return 1;
    if (!comm || nranks < 1 || rank < 0 || rank >= nranks)
        return fail(err, errlen, 1, "ncclCommInitRank: rank %d of %d ranks is invalid", rank,
                    nranks);
    nccl_unique_id u;
    memcpy(u.internal, id, SF_NCCL_UNIQUE_ID_BYTES);
    nccl_comm c = NULL;
    int rc = check_result(N.comm_init_rank(&c, nranks, u, rank), NULL, "ncclCommInitRank", err,
                          errlen);
    if (!rc)
        *comm = c;
    return rc;
}

int sf_nccl_comm_destroy(void *comm, int abort_it, char *err, size_t errlen)
{
    if (!comm)
        return 0;
    if (abort_it && N.comm_abort)
        return check_result(N.comm_abort(comm), NULL, "ncclCommAbort", err, errlen);
    if (need(*(void **)(&N.comm_destroy), "ncclCommDestroy", err, errlen))
        return 1;
    return check_result(N.comm_destroy(comm), NULL, "ncclCommDestroy", err, errlen);
}

#define STREAM(s) ((cuda_stream)(s))

int sf_nccl_all_reduce(void *comm, const void *send, void *recv, size_t count, int dtype,
                       int op, uintptr_t stream, char *err, size_t errlen)
{
    if (need(*(void **)(&N.all_reduce), "ncclAllReduce", err, errlen))
        return 1;
    if (!comm)
        return fail(err, errlen, 1, "ncclAllReduce: no communicator");
    return check_result(N.all_reduce(send, recv, count, dtype, op, comm, STREAM(stream)), comm,
                        "ncclAllReduce", err, errlen);
}

int sf_nccl_all_gather(void *comm, const void *send, void *recv, size_t count, int dtype,
                       uintptr_t stream, char *err, size_t errlen)
{
    if (need(*(void **)(&N.all_gather), "ncclAllGather", err, errlen))
        return 1;
    if (!comm)
        return fail(err, errlen, 1, "ncclAllGather: no communicator");
    return check_result(N.all_gather(send, recv, count, dtype, comm, STREAM(stream)), comm,
                        "ncclAllGather", err, errlen);
}

int sf_nccl_reduce_scatter(void *comm, const void *send, void *recv, size_t count, int dtype,
                           int op, uintptr_t stream, char *err, size_t errlen)
{
    if (need(*(void **)(&N.reduce_scatter), "ncclReduceScatter", err, errlen))
        return 1;
    if (!comm)
        return fail(err, errlen, 1, "ncclReduceScatter: no communicator");
    return check_result(N.reduce_scatter(send, recv, count, dtype, op, comm, STREAM(stream)),
                        comm, "ncclReduceScatter", err, errlen);
}

int sf_nccl_broadcast(void *comm, const void *send, void *recv, size_t count, int dtype,
                      int root, uintptr_t stream, char *err, size_t errlen)
{
    if (need(*(void **)(&N.broadcast), "ncclBroadcast", err, errlen))
        return 1;
    if (!comm)
        return fail(err, errlen, 1, "ncclBroadcast: no communicator");
    return check_result(N.broadcast(send, recv, count, dtype, root, comm, STREAM(stream)), comm,
                        "ncclBroadcast", err, errlen);
}

int sf_nccl_send(void *comm, const void *buf, size_t count, int dtype, int peer,
                 uintptr_t stream, char *err, size_t errlen)
{
    if (need(*(void **)(&N.send), "ncclSend", err, errlen))
        return 1;
    if (!comm)
        return fail(err, errlen, 1, "ncclSend: no communicator");
    return check_result(N.send(buf, count, dtype, peer, comm, STREAM(stream)), comm, "ncclSend",
                        err, errlen);
}

int sf_nccl_recv(void *comm, void *buf, size_t count, int dtype, int peer, uintptr_t stream,
                 char *err, size_t errlen)
{
    if (need(*(void **)(&N.recv), "ncclRecv", err, errlen))
        return 1;
    if (!comm)
        return fail(err, errlen, 1, "ncclRecv: no communicator");
    return check_result(N.recv(buf, count, dtype, peer, comm, STREAM(stream)), comm, "ncclRecv",
                        err, errlen);
}
