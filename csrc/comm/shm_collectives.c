/*
 * shm_collectives.c -- all_reduce (one-shot, or reduce-scatter + all-gather),
 * all_gather, reduce_scatter, all_to_all and broadcast over the ranks'
 * workspaces.  Each call is cut in chunks of a workspace half; a chunk needs
 * one barrier (two for the reduce-scatter + all-gather all-reduce).  Every
 * byte count of a call is checked before the first copy.
 */
#include "shm_internal.h"

#include <string.h>

#include "dlpack.h"

/* The sf_shm_dtype of a reduction type. */
static sf_shm_dtype red_code(sf_red_dtype t)
{
    switch (t) {
    case SF_RED_F16: return SF_SHM_DTYPE(SF_DL_FLOAT, 16, 1);
    case SF_RED_BF16: return SF_SHM_DTYPE(SF_DL_BFLOAT, 16, 1);
    case SF_RED_F64: return SF_SHM_DTYPE(SF_DL_FLOAT, 64, 1);
    case SF_RED_I32: return SF_SHM_DTYPE(SF_DL_INT, 32, 1);
    case SF_RED_I64: return SF_SHM_DTYPE(SF_DL_INT, 64, 1);
    default: return SF_SHM_DTYPE(SF_DL_FLOAT, 32, 1);
    }
}

/* Rank r's half for the current chunk; the caller advances c->phase after. */
static inline char *half_of(const sf_shm *c, int r)
{
    return c->work + ((size_t)r * 2 + (c->phase & 1u)) * c->half;
}

/* ---- collectives -------------------------------------------------------- */

/* Every rank copies its chunk in; after one barrier each reduces all of
 * them, in rank order, into its own output. */
static sf_status allreduce_oneshot(sf_shm *c, char *buf, size_t n, sf_red_dtype t, sf_red_op op,
                                   sf_error *err)
{
    size_t es = sf_red_size(t), per = c->half / es;
    const void *src[SF_SHM_MAX_RANKS];
    for (size_t off = 0; off < n; off += per) {
        size_t cnt = n - off < per ? n - off : per;
        memcpy(half_of(c, c->rank), buf + off * es, cnt * es);
        sf_status rc = shm_barrier(c, "all_reduce", err);
        if (rc)
            return rc;
        for (int r = 0; r < c->nranks; r++)
            src[r] = half_of(c, r);
        rc = sf_reduce(t, op, buf + off * es, src, c->nranks, cnt, 1, err);
        if (rc)
            return rc;
        c->phase++;
    }
    return SF_OK;
}

static inline void slice_of(size_t cnt, int parts, int r, size_t *start, size_t *len)
{
    size_t per = (cnt + (size_t)parts - 1) / (size_t)parts;
    per = (per + 15) & ~(size_t)15;  /* 64-byte slices for 4-byte types */
    size_t s = per * (size_t)r;
    *start = s < cnt ? s : cnt;
    *len = s < cnt ? (cnt - s < per ? cnt - s : per) : 0;
}

/* Copy in, barrier, rank r reduces slice r of every half into its own half,
 * barrier, every rank copies every reduced slice out. */
static sf_status allreduce_rsag(sf_shm *c, char *buf, size_t n, sf_red_dtype t, sf_red_op op,
                                sf_error *err)
{
    size_t es = sf_red_size(t), per = c->half / es;
    const void *src[SF_SHM_MAX_RANKS];
    for (size_t off = 0; off < n; off += per) {
        size_t cnt = n - off < per ? n - off : per;
        memcpy(half_of(c, c->rank), buf + off * es, cnt * es);
        sf_status rc = shm_barrier(c, "all_reduce", err);
        if (rc)
            return rc;
        size_t s, len;
        slice_of(cnt, c->nranks, c->rank, &s, &len);
        for (int r = 0; r < c->nranks; r++)
            src[r] = half_of(c, r) + s * es;
        if (len && (rc = sf_reduce(t, op, half_of(c, c->rank) + s * es, src, c->nranks, len, 1,
                                   err)))
            return rc;
        rc = shm_barrier(c, "all_reduce", err);
        if (rc)
            return rc;
        for (int r = 0; r < c->nranks; r++) {
            slice_of(cnt, c->nranks, r, &s, &len);
            if (len)
                memcpy(buf + (off + s) * es, half_of(c, r) + s * es, len * es);
        }
        c->phase++;
    }
    return SF_OK;
}

sf_status sf_shm_all_reduce(sf_shm *c, void *buf, size_t n, sf_red_dtype t, sf_red_op op,
                            sf_ar_algo algo, sf_error *err)
{
    sf_status rc = shm_check(c, "all_reduce", err);
    if (rc)
        return rc;
    size_t es = sf_red_size(t), bytes;
    if (!es || (op != SF_RED_SUM && op != SF_RED_MAX) || (n && !buf) || c->half < es ||
        (unsigned)algo > SF_AR_RSAG)
        return sf_fail(err, SF_EINVAL, "%s: all_reduce: bad dtype, op, algorithm or buffer",
                    c->label);
    if (sf_size_mul_overflows(n, es, &bytes))
        return sf_fail(err, SF_EOVERFLOW, "%s: all_reduce: %zu elements of %zu bytes overflow",
                       c->label, n, es);
    if (c->nranks == 1)
        return SF_OK;
    if (algo == SF_AR_AUTO)
        algo = bytes <= c->oneshot_max ? SF_AR_ONESHOT : SF_AR_RSAG;
    shm_announce(c, K_ALL_REDUCE, bytes, red_code(t), op, -1, algo);
    rc = algo == SF_AR_ONESHOT ? allreduce_oneshot(c, buf, n, t, op, err)
                               : allreduce_rsag(c, buf, n, t, op, err);
    return rc ? rc : shm_finish(c, "all_reduce", err);
}

sf_status sf_shm_all_gather(sf_shm *c, void *out, const void *in, size_t bytes, sf_shm_dtype dt,
                            sf_error *err)
{
    sf_status rc = shm_check(c, "all_gather", err);
    if (rc)
        return rc;
    size_t all;
    if (bytes && (!out || !in))
        return sf_fail(err, SF_EINVAL, "%s: all_gather: null buffer", c->label);
    if (sf_size_mul_overflows(bytes, (size_t)c->nranks, &all))
        return sf_fail(err, SF_EOVERFLOW, "%s: all_gather: %d ranks x %zu bytes overflow",
                       c->label, c->nranks, bytes);
    shm_announce(c, K_ALL_GATHER, bytes, dt, 0, -1, 0);
    for (size_t off = 0; off < bytes; off += c->half) {
        size_t cnt = bytes - off < c->half ? bytes - off : c->half;
        memcpy(half_of(c, c->rank), (const char *)in + off, cnt);
        rc = shm_barrier(c, "all_gather", err);
        if (rc)
            return rc;
        for (int r = 0; r < c->nranks; r++)
            memcpy((char *)out + (size_t)r * bytes + off, half_of(c, r), cnt);
        c->phase++;
    }
    return shm_finish(c, "all_gather", err);
}

sf_status sf_shm_reduce_scatter(sf_shm *c, void *out, const void *in, size_t n, sf_red_dtype t,
                                sf_red_op op, sf_error *err)
{
    sf_status rc = shm_check(c, "reduce_scatter", err);
    if (rc)
        return rc;
    size_t es = sf_red_size(t);
    size_t P = (size_t)c->nranks, in_elems, in_bytes;
    if (!es || (op != SF_RED_SUM && op != SF_RED_MAX) || (n && (!out || !in)))
        return sf_fail(err, SF_EINVAL, "%s: reduce_scatter: bad dtype, op or buffer",
                    c->label);
    if (sf_size_mul_overflows(n, P, &in_elems) || sf_size_mul_overflows(in_elems, es, &in_bytes))
        return sf_fail(err, SF_EOVERFLOW, "%s: reduce_scatter: %zu ranks x %zu elements of %zu "
                       "bytes overflow", c->label, P, n, es);
    size_t per = c->half / (es * P);
    if (n && per == 0)
        return sf_fail(err, SF_EINVAL, "%s: reduce_scatter: workspace too small",
                    c->label);
    shm_announce(c, K_REDUCE_SCATTER, in_bytes, red_code(t), op, -1, 0);
    const void *src[SF_SHM_MAX_RANKS];
    for (size_t off = 0; off < n; off += per) {
        size_t cnt = n - off < per ? n - off : per;
        char *mine = half_of(c, c->rank);
        for (size_t q = 0; q < P; q++)
            memcpy(mine + q * cnt * es, (const char *)in + (q * n + off) * es, cnt * es);
        rc = shm_barrier(c, "reduce_scatter", err);
        if (rc)
            return rc;
        for (int r = 0; r < c->nranks; r++)
            src[r] = half_of(c, r) + (size_t)c->rank * cnt * es;
        rc = sf_reduce(t, op, (char *)out + off * es, src, c->nranks, cnt, 1, err);
        if (rc)
            return rc;
        c->phase++;
    }
    return shm_finish(c, "reduce_scatter", err);
}

/* Per round, every rank stages, for each other rank q, the next piece of
 * its block q in its own half; after the barrier it takes its piece from
 * every other rank's half.  Its own block never goes through the segment,
 * so a half holds P - 1 slots: rank q's slot in rank s's half is q, or q - 1
 * above s (slot_for). */
static inline size_t slot_for(size_t q, size_t s) { return q < s ? q : q - 1; }

sf_status sf_shm_all_to_all(sf_shm *c, void *out, const void *in, size_t bytes, sf_shm_dtype dt,
                            sf_error *err)
{
    sf_status rc = shm_check(c, "all_to_all", err);
    if (rc)
        return rc;
    size_t P = (size_t)c->nranks, all;
    if (bytes && (!out || !in))
        return sf_fail(err, SF_EINVAL, "%s: all_to_all: null buffer", c->label);
    if (sf_size_mul_overflows(bytes, P, &all))
        return sf_fail(err, SF_EOVERFLOW, "%s: all_to_all: %zu ranks x %zu bytes overflow",
                       c->label, P, bytes);
    if (out != in && all) {
        uintptr_t o = (uintptr_t)out, i = (uintptr_t)in;
        if (o - i < all || i - o < all) /* unsigned: one is below the other + all */
            return sf_fail(err, SF_EINVAL, "%s: all_to_all: input and output overlap",
                           c->label);
    }
    size_t per = c->half / (P > 1 ? P - 1 : 1); /* bytes of each block per round */
    if (per > 64)
        per &= ~(size_t)63;   /* whole cache lines per slot */
    if (bytes && per == 0)
        return sf_fail(err, SF_EINVAL, "%s: all_to_all: workspace of %zu bytes too small for "
                       "%zu ranks", c->label, 2 * c->half, P);
    shm_announce(c, K_ALL_TO_ALL, all, dt, 0, -1, 0);
    size_t own = (size_t)c->rank * bytes; /* this rank's block: left in place, or copied */
    for (size_t off = 0; off < bytes; off += per) {
        size_t cnt = bytes - off < per ? bytes - off : per;
        char *mine = half_of(c, c->rank);
        for (size_t q = 0; q < P; q++)
            if (q != (size_t)c->rank)
                memcpy(mine + slot_for(q, (size_t)c->rank) * cnt,
                       (const char *)in + q * bytes + off, cnt);
        rc = shm_barrier(c, "all_to_all", err);
        if (rc)
            return rc;
        if (out != in) /* after the (first) barrier: a mismatched call writes nothing */
            memcpy((char *)out + own + off, (const char *)in + own + off, cnt);
        for (int r = 0; r < c->nranks; r++)
            if (r != c->rank)
                memcpy((char *)out + (size_t)r * bytes + off,
                       half_of(c, r) + slot_for((size_t)c->rank, (size_t)r) * cnt, cnt);
        c->phase++;
    }
    return shm_finish(c, "all_to_all", err);
}

sf_status sf_shm_broadcast(sf_shm *c, void *buf, size_t bytes, sf_shm_dtype dt, int root,
                           sf_error *err)
{
    sf_status rc = shm_check(c, "broadcast", err);
    if (rc)
        return rc;
    if (root < 0 || root >= c->nranks || (bytes && !buf))
        return sf_fail(err, SF_EINVAL, "%s: broadcast: root %d not in [0, %d)",
                    c->label, root, c->nranks);
    shm_announce(c, K_BROADCAST, bytes, dt, 0, root, 0);
    for (size_t off = 0; off < bytes; off += c->half) {
        size_t cnt = bytes - off < c->half ? bytes - off : c->half;
        if (c->rank == root)
            memcpy(half_of(c, root), (char *)buf + off, cnt);
        rc = shm_barrier(c, "broadcast", err);
        if (rc)
            return rc;
        if (c->rank != root)
            memcpy((char *)buf + off, half_of(c, root), cnt);
        c->phase++;
    }
    return shm_finish(c, "broadcast", err);
}
