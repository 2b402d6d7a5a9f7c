/*
 * status.h -- the one error convention of shardformer's C core.
 *
 * Every plain-C function that can fail (layout.c, tensor_view.c,
 * fingerprint.c, kernels/, comm/) returns an sf_status and, on failure,
 * writes a message into a caller-provided sf_error with sf_fail():
 *
 *     sf_error err = {0};
 *     sf_status rc = sf_split_units(units, parts, rank, &start, &count, &err);
 *     if (rc) ... err.msg says why, naming the argument and the numbers ...
 *
 * The CPython glue turns (status, message) into an exception with the one
 * mapper in glue.h (sf_set_pyerr); the exception type of each status is
 * listed below.  Plain C, no Python.
 */
#ifndef SHARDFORMER_STATUS_H
#define SHARDFORMER_STATUS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {   /* the CUDA sources (C++) call these too */
#endif

typedef enum {
    SF_OK = 0,
    SF_EINVAL,       /* an argument's value is wrong             -> ValueError */
    SF_ETYPE,        /* an argument's type or dtype is wrong      -> TypeError */
    SF_ERANGE,       /* an index or range is out of bounds        -> IndexError */
    SF_EOVERFLOW,    /* a size or product overflows               -> OverflowError */
    SF_ENOMEM,       /* an allocation failed                      -> MemoryError */
    SF_ETIMEOUT,     /* a peer did not arrive in time             -> TimeoutError */
    SF_EPEER,        /* a communicator is broken (earlier failure) -> RuntimeError */
    SF_EINTR,        /* interrupted by a signal -> the exception the signal handler
                      * raised (left in place), else KeyboardInterrupt */
    SF_EIO,          /* a system call or library load failed      -> OSError */
    SF_EUNSUPPORTED, /* not available here (library, entry point) -> RuntimeError */
    SF_EEXTERNAL,    /* an external library (NCCL) reported an error -> RuntimeError */
    SF_EMISMATCH,    /* ranks made different calls (collective)  -> RuntimeError */
    SF_NSTATUS
} sf_status;

/* Room for one message; longer ones are truncated. */
#define SF_ERRLEN 1024

typedef struct {
    sf_status code;
    char msg[SF_ERRLEN];
} sf_error;

/* "SF_EINVAL", ...; "SF_E?" for a value outside the enum. */
const char *sf_status_name(sf_status code);

/* Record `code` and the printf-style message in *err (when err is not NULL)
 * and return `code`, so that a failure is one statement:
 *     return sf_fail(err, SF_EINVAL, "rank=%d outside [0, %d)", rank, n); */
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
sf_status sf_fail(sf_error *err, sf_status code, const char *fmt, ...);

/* a * b into *out; 1 (and *out unspecified) when it overflows int64. */
static inline int sf_mul_overflows(int64_t a, int64_t b, int64_t *out)
{
    return __builtin_mul_overflow(a, b, out);
}

/* The same for byte counts and offsets: a * b, a + b into *out; 1 when it
 * overflows size_t. */
static inline int sf_size_mul_overflows(size_t a, size_t b, size_t *out)
{
    return __builtin_mul_overflow(a, b, out);
}

static inline int sf_size_add_overflows(size_t a, size_t b, size_t *out)
{
    return __builtin_add_overflow(a, b, out);
}

#ifdef __cplusplus
}
#endif

#endif /* SHARDFORMER_STATUS_H */
