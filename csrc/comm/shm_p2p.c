/*
 * shm_p2p.c -- send and recv through one mailbox per ordered pair of ranks;
 * a message's header travels with its first chunk and the receiver checks
 * it against its own call (see shm.h).
 */
#include "shm_internal.h"

#include <stdio.h>
#include <string.h>

/* ---- point to point: one mailbox per ordered pair ------------------------ */

static inline size_t pair(const sf_shm *c, int src, int dst)
{
    return (size_t)src * (size_t)c->nranks + (size_t)dst;
}

/* Chunks a message of `bytes` takes: at least one, so that an empty message
 * still carries its header. */
static uint64_t chunks_of(uint64_t bytes, size_t p2p)
{
    return bytes == 0 ? 1 : bytes / p2p + (bytes % p2p != 0);
}

static sf_status wait_counter(sf_shm *c, _Atomic uint64_t *a, uint64_t target, const char *what,
                              int peer, sf_error *err)
{
    waiter w;
    shm_wait_init(&w);
    while (atomic_load_explicit(a, memory_order_acquire) < target) {
        int why = shm_wait_step(&w, c, a, target);
        if (why)
            return shm_wait_failed(c, why, what, (uint64_t)1 << peer, err);
    }
    return SF_OK;
}

static sf_status check_peer(sf_shm *c, const char *what, const void *buf, size_t bytes, int peer,
                            sf_error *err)
{
    if (peer < 0 || peer >= c->nranks || peer == c->rank || (bytes && !buf))
        return sf_fail(err, SF_EINVAL, "%s: %s: bad peer rank %d (self %d of %d) or buffer",
                       c->label, what, peer, c->rank, c->nranks);
    return SF_OK;
}

sf_status sf_shm_send(sf_shm *c, const void *buf, size_t bytes, sf_shm_dtype dt, int dst,
                      sf_error *err)
{
    sf_status rc = shm_check(c, "send", err);
    if (rc || (rc = check_peer(c, "send", buf, bytes, dst, err)))
        return rc;
    size_t k = pair(c, c->rank, dst);
    mailbox *mb = &c->posted[k];
    _Atomic uint64_t *taken = &c->taken[k].v;
    char *box = c->mail + k * c->p2p;
    uint64_t msgno = ++c->sent[dst];
    size_t off = 0;
    do {
        size_t cnt = bytes - off < c->p2p ? bytes - off : c->p2p;
        uint64_t mine = atomic_load_explicit(&mb->posted, memory_order_relaxed);
        rc = wait_counter(c, taken, mine, "send", dst, err);  /* box empty */
        if (rc)
            return rc;
        if (off == 0) {  /* the header, published with the first chunk */
            mb->bytes = bytes;
            mb->msgno = msgno;
            mb->dtype = dt;
        }
        if (cnt)  /* an empty message may come with no buffer at all */
            memcpy(box, (const char *)buf + off, cnt);
        atomic_store_explicit(&mb->posted, mine + 1, memory_order_release);
        shm_wake_peers(c);
        off += cnt;
    } while (off < bytes);
    return SF_OK;
}

/* The first chunk's header did not match this rank's recv: take (and drop)
 * every chunk of the sender's message, so it completes and the pair stays in
 * step, then say what each side had. */
static sf_status recv_mismatch(sf_shm *c, int src, size_t bytes, sf_shm_dtype dt, uint64_t msgno,
                               uint64_t seen, sf_error *err)
{
    size_t k = pair(c, src, c->rank);
    mailbox *mb = &c->posted[k];
    _Atomic uint64_t *taken = &c->taken[k].v;
    uint64_t sbytes = mb->bytes, smsg = mb->msgno;
    sf_shm_dtype sdt = mb->dtype;
    uint64_t left = chunks_of(sbytes, c->p2p);
    atomic_store_explicit(taken, ++seen, memory_order_release);
    shm_wake_peers(c);
    while (--left) {
        sf_status rc = wait_counter(c, &mb->posted, seen + 1, "recv", src, err);
        if (rc)
            return rc;
        atomic_store_explicit(taken, ++seen, memory_order_release);
        shm_wake_peers(c);
    }
    char numbers[96] = "";
    if (smsg != msgno)
        snprintf(numbers, sizeof(numbers), " (its message #%llu to rank %d)",
                 (unsigned long long)smsg, c->rank);
    return sf_fail(err, SF_EMISMATCH,
                   "%s: send/recv mismatch on message #%llu from rank %d: rank %d expected %zu "
                   "bytes %s from rank %d, which sent %llu bytes %s%s",
                   c->label, (unsigned long long)msgno, src, c->rank, bytes, shm_dtype_name(dt),
                   src, (unsigned long long)sbytes, shm_dtype_name(sdt), numbers);
}

sf_status sf_shm_recv(sf_shm *c, void *buf, size_t bytes, sf_shm_dtype dt, int src,
                      sf_error *err)
{
    sf_status rc = shm_check(c, "recv", err);
    if (rc || (rc = check_peer(c, "recv", buf, bytes, src, err)))
        return rc;
    size_t k = pair(c, src, c->rank);
    mailbox *mb = &c->posted[k];
    _Atomic uint64_t *taken = &c->taken[k].v;
    const char *box = c->mail + k * c->p2p;
    uint64_t msgno = ++c->received[src];
    size_t off = 0;
    do {
        size_t cnt = bytes - off < c->p2p ? bytes - off : c->p2p;
        uint64_t seen = atomic_load_explicit(taken, memory_order_relaxed);
        rc = wait_counter(c, &mb->posted, seen + 1, "recv", src, err);
        if (rc)
            return rc;
        if (off == 0 && (mb->bytes != bytes || mb->dtype != dt || mb->msgno != msgno))
            return recv_mismatch(c, src, bytes, dt, msgno, seen, err);
        if (cnt)
            memcpy((char *)buf + off, box, cnt);
        atomic_store_explicit(taken, seen + 1, memory_order_release);
        shm_wake_peers(c);
        off += cnt;
    } while (off < bytes);
    return SF_OK;
}
