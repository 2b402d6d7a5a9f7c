/*
 * shm.c -- the shared-memory collectives (see shm.h for the contract).
 *
 * Segment layout (every block 128-byte aligned, one counter per cache line
 * so ranks never write the same line):
 *
 *     header                      magic, nonce, nranks, sizes
 *     seq[nranks]                 rank r's barrier count, written by r only
 *     posted[P][P], taken[P][P]   mailbox counters of the ordered pair (src, dst)
 *     work[nranks][2][half]       each rank's workspace, two halves
 *     mail[P][P][p2p]             one mailbox buffer per ordered pair
 *
 * Memory ordering: a rank publishes with a release store of its counter after
 * writing data; a reader acquires the counter before reading the data.  No
 * reliance on x86's strong ordering.
 */
#define _GNU_SOURCE
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAGIC 0x73666f726d73686dull /* "sformshm" */
#define LINE 128
#define ALIGN(x) (((x) + (size_t)LINE - 1) & ~((size_t)LINE - 1))

typedef struct {
    _Atomic uint64_t v;
    char pad[LINE - sizeof(uint64_t)];
} counter;

typedef struct {
    uint64_t magic;
    uint64_t nonce;
    uint64_t nranks;
    uint64_t half;
    uint64_t p2p;
    uint64_t total;
} header;

struct sf_shm {
    char *base;
    size_t total;
    int nranks, rank;
    size_t half, p2p;
    counter *seq;
    counter *posted, *taken;
    char *work, *mail;
    uint64_t my_seq;          /* barriers this rank has entered */
    unsigned phase;           /* which workspace half the next chunk uses */
    double timeout_s;
    size_t oneshot_max;
    int broken;
    char label[SF_SHM_LABEL];
};

static size_t layout(sf_shm *c)
{
    size_t p = (size_t)c->nranks;
    size_t off = ALIGN(sizeof(header));
    size_t seq_off = off;
    off += p * sizeof(counter);
    size_t posted_off = off;
    off += p * p * sizeof(counter);
    size_t taken_off = off;
    off += p * p * sizeof(counter);
    size_t work_off = ALIGN(off);
    off = work_off + p * 2 * c->half;
    size_t mail_off = ALIGN(off);
    off = mail_off + p * p * c->p2p;
    if (c->base) {
        c->seq = (counter *)(c->base + seq_off);
        c->posted = (counter *)(c->base + posted_off);
        c->taken = (counter *)(c->base + taken_off);
        c->work = c->base + work_off;
        c->mail = c->base + mail_off;
    }
    return off;
}

static sf_shm *new_comm(int nranks, int rank, size_t workspace, size_t p2p)
{
    sf_shm *c = calloc(1, sizeof(*c));
    if (!c)
        return NULL;
    c->nranks = nranks;
    c->rank = rank;
    c->half = ALIGN(workspace / 2);
    c->p2p = ALIGN(p2p);
    c->timeout_s = 300.0;
    c->oneshot_max = 256 * 1024;
    snprintf(c->label, sizeof(c->label), "shm group of %d ranks", nranks);
    return c;
}

sf_status sf_shm_create(const char *name, int nranks, size_t workspace, size_t p2p, uint64_t nonce,
                        sf_shm **out, sf_error *err)
{
    if (!name || !out || nranks < 1 || nranks > SF_SHM_MAX_RANKS)
        return sf_fail(err, SF_EINVAL, "shm create: nranks=%d must be in [1, %d]",
                    nranks, SF_SHM_MAX_RANKS);
    if (workspace < 2 * LINE || p2p < LINE)
        return sf_fail(err, SF_EINVAL,
                    "shm create: workspace=%zu bytes (min %d) and p2p=%zu bytes (min %d) too small",
                    workspace, 2 * LINE, p2p, LINE);
    sf_shm *c = new_comm(nranks, 0, workspace, p2p);
    if (!c)
        return sf_fail(err, SF_ENOMEM, "shm create: out of memory");
    c->total = layout(c);
    int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
        int e = errno;
        free(c);
        return sf_fail(err, SF_EIO, "shm_open(%s): %s", name, strerror(e));
    }
    sf_status rc = posix_fallocate(fd, 0, (off_t)c->total);
    if (rc != 0) {
        size_t total = c->total;
        close(fd);
        shm_unlink(name);
        free(c);
        return sf_fail(err, SF_EIO,
                    "cannot reserve %zu bytes in /dev/shm for segment %s: %s (make /dev/shm "
                    "larger, or set SHARDFORMER_SHM_WORKSPACE smaller)",
                    total, name, strerror(rc));
    }
    void *p = mmap(NULL, c->total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int e = errno;
    close(fd);
    if (p == MAP_FAILED) {
        shm_unlink(name);
        size_t total = c->total;
        free(c);
        return sf_fail(err, SF_EIO, "mmap of %zu bytes (%s): %s", total, name,
                    strerror(e));
    }
    c->base = p;
    layout(c);
    header *h = (header *)c->base;
    h->nranks = (uint64_t)nranks;
    h->half = c->half;
    h->p2p = c->p2p;
    h->total = c->total;
    h->nonce = nonce;
    atomic_thread_fence(memory_order_release);
    h->magic = MAGIC;
    *out = c;
    return SF_OK;
}

sf_status sf_shm_attach(const char *name, int nranks, int rank, uint64_t nonce, sf_shm **out,
                        sf_error *err)
{
    if (!name || !out || nranks < 1 || nranks > SF_SHM_MAX_RANKS || rank < 0 || rank >= nranks)
        return sf_fail(err, SF_EINVAL, "shm attach: rank %d of %d ranks is invalid",
                    rank, nranks);
    int fd = shm_open(name, O_RDWR, 0600);
    if (fd < 0)
        return sf_fail(err, SF_EIO, "shm_open(%s): %s (rank %d is not on the host "
                    "of rank 0)", name, strerror(errno), rank);
    struct stat st;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size < sizeof(header)) {
        close(fd);
        return sf_fail(err, SF_EIO, "segment %s is too small or unreadable", name);
    }
    size_t total = (size_t)st.st_size;
    void *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int e = errno;
    close(fd);
    if (p == MAP_FAILED)
        return sf_fail(err, SF_EIO, "mmap of %zu bytes (%s): %s", total, name,
                    strerror(e));
    header *h = (header *)p;
    if (h->magic != MAGIC || h->nonce != nonce || h->nranks != (uint64_t)nranks ||
        h->total != total) {
        munmap(p, total);
        return sf_fail(err, SF_EINVAL,
                    "segment %s is not the one rank 0 created for this group (header mismatch)",
                    name);
    }
    atomic_thread_fence(memory_order_acquire);
    sf_shm *c = new_comm(nranks, rank, 2 * (size_t)h->half, (size_t)h->p2p);
    if (!c) {
        munmap(p, total);
        return sf_fail(err, SF_ENOMEM, "shm attach: out of memory");
    }
    c->half = (size_t)h->half;
    c->p2p = (size_t)h->p2p;
    c->base = p;
    c->total = total;
    if (layout(c) != total) {
        sf_shm_close(c);
        return sf_fail(err, SF_EINVAL, "segment %s has an inconsistent layout", name);
    }
    *out = c;
    return SF_OK;
}

sf_status sf_shm_unlink(const char *name, sf_error *err)
{
    if (!name)
        return sf_fail(err, SF_EINVAL, "shm unlink: no name");
    if (shm_unlink(name) != 0 && errno != ENOENT)
        return sf_fail(err, SF_EIO, "shm_unlink(%s): %s", name, strerror(errno));
    return SF_OK;
}

void sf_shm_close(sf_shm *c)
{
    if (!c)
        return;
    if (c->base)
        munmap(c->base, c->total);
    free(c);
}

void sf_shm_configure(sf_shm *c, const char *label, double timeout_s, size_t oneshot_max)
{
    if (!c)
        return;
    if (label)
        snprintf(c->label, sizeof(c->label), "%s", label);
    if (timeout_s > 0)
        c->timeout_s = timeout_s;
    c->oneshot_max = oneshot_max;
}

int sf_shm_rank(const sf_shm *c) { return c ? c->rank : -1; }
int sf_shm_nranks(const sf_shm *c) { return c ? c->nranks : 0; }
size_t sf_shm_workspace(const sf_shm *c) { return c ? 2 * c->half : 0; }
size_t sf_shm_oneshot_max(const sf_shm *c) { return c ? c->oneshot_max : 0; }
double sf_shm_timeout(const sf_shm *c) { return c ? c->timeout_s : 0; }
size_t sf_shm_segment_bytes(const sf_shm *c) { return c ? c->total : 0; }

/* ---- waiting ------------------------------------------------------------ */

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Backoff state for one wait: spin, then yield the core, then sleep with a
 * growing interval (capped at 100 us so a late peer costs little latency). */
typedef struct {
    unsigned iter;
    long sleep_ns;
    double deadline;
} waiter;

static void wait_init(waiter *w, const sf_shm *c)
{
    w->iter = 0;
    w->sleep_ns = 1000;
    w->deadline = -1.0;
    (void)c;
}

/* One backoff step; returns 1 once the timeout has passed. */
static int wait_step(waiter *w, const sf_shm *c)
{
    unsigned i = w->iter++;
    if (i < 64) {
        cpu_relax();
        return 0;
    }
    if (w->deadline < 0)
        w->deadline = now_s() + c->timeout_s;
    if (i < 2048) {
        sched_yield();
    } else {
        struct timespec ts = {0, w->sleep_ns};
        nanosleep(&ts, NULL);
        if (w->sleep_ns < 100000)
            w->sleep_ns *= 2;
    }
    return (i & 63) == 0 && now_s() > w->deadline;
}

static sf_status timed_out(sf_shm *c, sf_error *err, const char *what, const char *who)
{
    c->broken = 1;
    return sf_fail(err, SF_ETIMEOUT,
                "%s: %s timed out after %.3g s on rank %d; %s (the communicator is now broken)",
                c->label, what, c->timeout_s, c->rank, who);
}

static sf_status barrier(sf_shm *c, const char *what, sf_error *err)
{
    uint64_t target = ++c->my_seq;
    atomic_store_explicit(&c->seq[c->rank].v, target, memory_order_release);
    waiter w;
    wait_init(&w, c);
    for (int r = 0; r < c->nranks; r++) {
        if (r == c->rank)
            continue;
        while (atomic_load_explicit(&c->seq[r].v, memory_order_acquire) < target) {
            if (wait_step(&w, c)) {
                char who[512];
                size_t len = (size_t)snprintf(who, sizeof(who), "ranks that did not arrive:");
                for (int q = 0; q < c->nranks && len < sizeof(who) - 8; q++)
                    if (atomic_load_explicit(&c->seq[q].v, memory_order_acquire) < target)
                        len += (size_t)snprintf(who + len, sizeof(who) - len, " %d", q);
                return timed_out(c, err, what, who);
            }
        }
    }
    return SF_OK;
}

static sf_status check(sf_shm *c, sf_error *err)
{
    if (!c)
        return sf_fail(err, SF_EINVAL, "shm: no communicator");
    if (c->broken)
        return sf_fail(err, SF_EPEER,
                    "%s: the communicator is broken by an earlier timeout", c->label);
    return SF_OK;
}

sf_status sf_shm_barrier(sf_shm *c, sf_error *err)
{
    sf_status rc = check(c, err);
    return rc ? rc : barrier(c, "barrier", err);
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
        sf_status rc = barrier(c, "all_reduce", err);
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
        sf_status rc = barrier(c, "all_reduce", err);
        if (rc)
            return rc;
        size_t s, len;
        slice_of(cnt, c->nranks, c->rank, &s, &len);
        for (int r = 0; r < c->nranks; r++)
            src[r] = half_of(c, r) + s * es;
        if (len && (rc = sf_reduce(t, op, half_of(c, c->rank) + s * es, src, c->nranks, len, 1,
                                   err)))
            return rc;
        rc = barrier(c, "all_reduce", err);
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
    sf_status rc = check(c, err);
    if (rc)
        return rc;
    size_t es = sf_red_size(t);
    if (!es || (op != SF_RED_SUM && op != SF_RED_MAX) || (n && !buf) || c->half < es)
        return sf_fail(err, SF_EINVAL, "%s: all_reduce: bad dtype, op or buffer",
                    c->label);
    if (c->nranks == 1 || n == 0)
        return SF_OK;
    if (algo == SF_AR_AUTO)
        algo = n * es <= c->oneshot_max ? SF_AR_ONESHOT : SF_AR_RSAG;
    return algo == SF_AR_ONESHOT ? allreduce_oneshot(c, buf, n, t, op, err)
                                 : allreduce_rsag(c, buf, n, t, op, err);
}

sf_status sf_shm_all_gather(sf_shm *c, void *out, const void *in, size_t bytes, sf_error *err)
{
    sf_status rc = check(c, err);
    if (rc)
        return rc;
    if (bytes && (!out || !in))
        return sf_fail(err, SF_EINVAL, "%s: all_gather: null buffer", c->label);
    for (size_t off = 0; off < bytes; off += c->half) {
        size_t cnt = bytes - off < c->half ? bytes - off : c->half;
        memcpy(half_of(c, c->rank), (const char *)in + off, cnt);
        rc = barrier(c, "all_gather", err);
        if (rc)
            return rc;
        for (int r = 0; r < c->nranks; r++)
            memcpy((char *)out + (size_t)r * bytes + off, half_of(c, r), cnt);
        c->phase++;
    }
    return SF_OK;
}

sf_status sf_shm_reduce_scatter(sf_shm *c, void *out, const void *in, size_t n, sf_red_dtype t,
                                sf_red_op op, sf_error *err)
{
    sf_status rc = check(c, err);
    if (rc)
        return rc;
    size_t es = sf_red_size(t);
    size_t P = (size_t)c->nranks;
    if (!es || (op != SF_RED_SUM && op != SF_RED_MAX) || (n && (!out || !in)))
        return sf_fail(err, SF_EINVAL, "%s: reduce_scatter: bad dtype, op or buffer",
                    c->label);
    size_t per = c->half / (es * P);
    if (n && per == 0)
        return sf_fail(err, SF_EINVAL, "%s: reduce_scatter: workspace too small",
                    c->label);
    const void *src[SF_SHM_MAX_RANKS];
    for (size_t off = 0; off < n; off += per) {
        size_t cnt = n - off < per ? n - off : per;
        char *mine = half_of(c, c->rank);
        for (size_t q = 0; q < P; q++)
            memcpy(mine + q * cnt * es, (const char *)in + (q * n + off) * es, cnt * es);
        rc = barrier(c, "reduce_scatter", err);
        if (rc)
            return rc;
        for (int r = 0; r < c->nranks; r++)
            src[r] = half_of(c, r) + (size_t)c->rank * cnt * es;
        rc = sf_reduce(t, op, (char *)out + off * es, src, c->nranks, cnt, 1, err);
        if (rc)
            return rc;
        c->phase++;
    }
    return SF_OK;
}

sf_status sf_shm_broadcast(sf_shm *c, void *buf, size_t bytes, int root, sf_error *err)
{
    sf_status rc = check(c, err);
    if (rc)
        return rc;
    if (root < 0 || root >= c->nranks || (bytes && !buf))
        return sf_fail(err, SF_EINVAL, "%s: broadcast: root %d not in [0, %d)",
                    c->label, root, c->nranks);
    for (size_t off = 0; off < bytes; off += c->half) {
        size_t cnt = bytes - off < c->half ? bytes - off : c->half;
        if (c->rank == root)
            memcpy(half_of(c, root), (char *)buf + off, cnt);
        rc = barrier(c, "broadcast", err);
        if (rc)
            return rc;
        if (c->rank != root)
            memcpy((char *)buf + off, half_of(c, root), cnt);
        c->phase++;
    }
    return SF_OK;
}

/* ---- point to point: one mailbox per ordered pair ------------------------ */

static inline size_t pair(const sf_shm *c, int src, int dst)
{
    return (size_t)src * (size_t)c->nranks + (size_t)dst;
}

static sf_status wait_counter(sf_shm *c, _Atomic uint64_t *a, uint64_t target, const char *what,
                              int peer, sf_error *err)
{
    waiter w;
    wait_init(&w, c);
    while (atomic_load_explicit(a, memory_order_acquire) < target) {
        if (wait_step(&w, c)) {
            char who[64];
            snprintf(who, sizeof(who), "peer rank %d did not arrive", peer);
            return timed_out(c, err, what, who);
        }
    }
    return SF_OK;
}

sf_status sf_shm_send(sf_shm *c, const void *buf, size_t bytes, int dst, sf_error *err)
{
    sf_status rc = check(c, err);
    if (rc)
        return rc;
    if (dst < 0 || dst >= c->nranks || dst == c->rank || (bytes && !buf))
        return sf_fail(err, SF_EINVAL, "%s: send: bad destination rank %d (self %d of %d)",
                    c->label, dst, c->rank, c->nranks);
    size_t k = pair(c, c->rank, dst);
    _Atomic uint64_t *posted = &c->posted[k].v, *taken = &c->taken[k].v;
    char *box = c->mail + k * c->p2p;
    for (size_t off = 0; off < bytes; off += c->p2p) {
        size_t cnt = bytes - off < c->p2p ? bytes - off : c->p2p;
        uint64_t mine = atomic_load_explicit(posted, memory_order_relaxed);
        rc = wait_counter(c, taken, mine, "send", dst, err);  /* box empty */
        if (rc)
            return rc;
        memcpy(box, (const char *)buf + off, cnt);
        atomic_store_explicit(posted, mine + 1, memory_order_release);
    }
    return SF_OK;
}

sf_status sf_shm_recv(sf_shm *c, void *buf, size_t bytes, int src, sf_error *err)
{
    sf_status rc = check(c, err);
    if (rc)
        return rc;
    if (src < 0 || src >= c->nranks || src == c->rank || (bytes && !buf))
        return sf_fail(err, SF_EINVAL, "%s: recv: bad source rank %d (self %d of %d)",
                    c->label, src, c->rank, c->nranks);
    size_t k = pair(c, src, c->rank);
    _Atomic uint64_t *posted = &c->posted[k].v, *taken = &c->taken[k].v;
    const char *box = c->mail + k * c->p2p;
    for (size_t off = 0; off < bytes; off += c->p2p) {
        size_t cnt = bytes - off < c->p2p ? bytes - off : c->p2p;
        uint64_t seen = atomic_load_explicit(taken, memory_order_relaxed);
        rc = wait_counter(c, posted, seen + 1, "recv", src, err);
        if (rc)
            return rc;
        memcpy((char *)buf + off, box, cnt);
        atomic_store_explicit(taken, seen + 1, memory_order_release);
    }
    return SF_OK;
}
