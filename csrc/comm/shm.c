/*
 * shm.c -- the shared-memory collectives (see shm.h for the contract).
 *
 * Segment layout (every block 128-byte aligned, every counter on a cache line
 * of its own so ranks never write the same line):
 *
 *     header                      magic, nonce, nranks, sizes; the wake word
 *                                 and the count of ranks sleeping on it
 *     abort                       the first failure (rank, reason) and, per
 *                                 rank, the ranks it was waiting for
 *     ranks[P]                    rank r's barrier count and its two call
 *                                 descriptors, written by r only
 *     posted[P][P], taken[P][P]   mailbox counters of the ordered pair (src,
 *                                 dst); posted also holds the message header
 *     work[P][2][half]            each rank's workspace, two halves
 *     mail[P][P][p2p]             one mailbox buffer per ordered pair
 *
 * Memory ordering: a rank publishes with a release store of its counter after
 * writing data (descriptors and message headers included); a reader acquires
 * the counter before reading the data.  No reliance on x86's strong ordering.
 *
 * Waiting (wait_step): spin briefly, then yield the core, then sleep on a
 * futex on the header's wake word (Linux; elsewhere a growing nanosleep).
 * Every release store another rank may wait for is followed by wake_peers():
 * if any rank counts itself a sleeper, bump the wake word and FUTEX_WAKE.
 * A sleeper counts itself, re-checks its counter, then sleeps only while the
 * wake word still has the value it read before counting itself, so a store
 * made after its re-check always wakes it (seq_cst fences on both sides, the
 * Dekker pattern); and it sleeps at most POLL_S at a time, so the abort
 * record, the poll callback (Ctrl-C) and the timeout are still checked.
 *
 * Sizes: the layout is computed with checked arithmetic (plan()), both when
 * rank 0 sizes the segment and when another rank checks the header it reads.
 * Every byte count of a call is checked before the first copy.
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
#ifdef __linux__
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include "dlpack.h"
#include "tensor_view.h"

#define MAGIC 0x73666f726d73686dull /* "sformshm" */
#define LINE 128
#define POLL_S 0.015 /* how often a sleeping wait calls the poll callback */

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
    _Atomic uint32_t wake;     /* bumped after every store a peer may wait for */
    _Atomic uint32_t sleepers; /* ranks in (or about to enter) a futex wait on `wake` */
} header;

/* Why a rank broke the communicator (the abort record's reason). */
enum { WHY_NONE = 0, WHY_TIMEOUT = 1, WHY_INTERRUPT = 2, WHY_DESYNC = 3 };

typedef struct {
    _Atomic uint64_t word; /* 0, or (reason << 32) | (rank + 1) of the first failure */
    char pad[LINE - sizeof(uint64_t)];
    /* missing[r]: the ranks (bit q) rank r was waiting for when it failed;
     * written by r before it tries to claim `word`. */
    _Atomic uint64_t missing[SF_SHM_MAX_RANKS];
} abort_block;

/* The kinds of collective call a descriptor names. */
enum { K_ALL_REDUCE = 1, K_ALL_GATHER, K_REDUCE_SCATTER, K_BROADCAST, K_BARRIER, K_ALL_TO_ALL,
       K_NKINDS };

/* What a rank is doing in one collective call (see shm.h). */
typedef struct {
    uint64_t seq;   /* the barrier it was published for */
    uint64_t call;  /* the rank's collective number, from 1 */
    uint64_t bytes; /* bytes of the call's tensor argument */
    uint32_t dtype; /* sf_shm_dtype */
    int32_t root;   /* broadcast root, else -1 */
    uint8_t kind, op, algo, pad[5];
} desc;

/* Rank r's line: its barrier count and its two descriptor slots (slot
 * [target & 1] for the barrier numbered target). */
typedef struct {
    _Atomic uint64_t seq;
    desc slot[2];
    char pad[LINE - sizeof(uint64_t) - 2 * sizeof(desc)];
} rank_line;

/* The sender's line of an ordered pair: chunks posted and the header of the
 * message they belong to (written before the first chunk is posted). */
typedef struct {
    _Atomic uint64_t posted;
    uint64_t bytes; /* the message's total bytes */
    uint64_t msgno; /* its number on the pair, from 1 */
    uint32_t dtype; /* sf_shm_dtype */
    char pad[LINE - 3 * sizeof(uint64_t) - sizeof(uint32_t)];
} mailbox;

_Static_assert(sizeof(counter) == LINE, "one counter per cache line");
_Static_assert(sizeof(rank_line) == LINE, "one rank line per cache line");
_Static_assert(sizeof(mailbox) == LINE, "one mailbox line per cache line");
_Static_assert(sizeof(abort_block) % LINE == 0, "abort block in whole lines");
_Static_assert(sizeof(header) <= LINE, "header in one line");

struct sf_shm {
    char *base;
    size_t total;
    int nranks, rank;
    size_t half, p2p;
    abort_block *abort;
    rank_line *ranks;
    mailbox *posted;
    counter *taken;
    char *work, *mail;
    uint64_t my_seq;  /* barriers this rank has entered */
    uint64_t calls;   /* collective calls this rank has announced */
    unsigned phase;   /* which workspace half the next chunk uses */
    int announce;     /* the next barrier publishes and checks `next` */
    desc next;
    uint64_t sent[SF_SHM_MAX_RANKS], received[SF_SHM_MAX_RANKS]; /* messages per peer */
    double timeout_s;
    size_t oneshot_max;
    int broken;       /* WHY_* of this rank's own failure, or -1 for a peer's */
    sf_shm_poll_fn poll;
    void *poll_ctx;
    uint64_t sleeps, wakes; /* this rank's futex waits, and wakes it issued */
    char label[SF_SHM_LABEL];
};

static void wake_peers(sf_shm *c);

/* ---- sizes ---------------------------------------------------------------- */

/* x rounded up to a whole line; 1 when that overflows. */
static int align_overflows(size_t x, size_t *out)
{
    if (x > SIZE_MAX - (LINE - 1))
        return 1;
    *out = (x + (LINE - 1)) & ~(size_t)(LINE - 1);
    return 0;
}

typedef struct {
    size_t abort, ranks, posted, taken, work, mail, total;
} seg_layout;

/* The offsets of the blocks for P ranks, halves of `half` bytes and mailboxes
 * of `p2p` bytes (both whole lines).  0, or -1 when the size overflows or
 * passes INT64_MAX (the largest file, and Python's largest size). */
static int plan(size_t P, size_t half, size_t p2p, seg_layout *L)
{
    size_t off = LINE, n; /* the header's line */
    if (P < 1 || P > SF_SHM_MAX_RANKS || half % LINE || p2p % LINE)
        return -1;
    L->abort = off;
    off += sizeof(abort_block);
    L->ranks = off;
    off += P * sizeof(rank_line);
    L->posted = off;
    off += P * P * sizeof(mailbox);
    L->taken = off;
    off += P * P * sizeof(counter); /* fixed part: P <= 64, far from overflow */
    L->work = off;
    if (sf_size_mul_overflows(2 * P, half, &n) || sf_size_add_overflows(off, n, &off))
        return -1;
    L->mail = off;
    if (sf_size_mul_overflows(P * P, p2p, &n) || sf_size_add_overflows(off, n, &off))
        return -1;
    if (off > (size_t)INT64_MAX)
        return -1;
    L->total = off;
    return 0;
}

/* Point c's block pointers into its mapping. */
static void place(sf_shm *c, const seg_layout *L)
{
    c->abort = (abort_block *)(c->base + L->abort);
    c->ranks = (rank_line *)(c->base + L->ranks);
    c->posted = (mailbox *)(c->base + L->posted);
    c->taken = (counter *)(c->base + L->taken);
    c->work = c->base + L->work;
    c->mail = c->base + L->mail;
}

static sf_shm *new_comm(int nranks, int rank, size_t half, size_t p2p)
{
    sf_shm *c = calloc(1, sizeof(*c));
    if (!c)
        return NULL;
    c->nranks = nranks;
    c->rank = rank;
    c->half = half;
    c->p2p = p2p;
    c->timeout_s = 300.0;
    c->oneshot_max = 256 * 1024;
    snprintf(c->label, sizeof(c->label), "shm group of %d ranks", nranks);
    return c;
}

/* ---- setup ------------------------------------------------------------------ */

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
    size_t half, box;
    seg_layout L;
    if (align_overflows(workspace / 2, &half) || align_overflows(p2p, &box) ||
        plan((size_t)nranks, half, box, &L))
        return sf_fail(err, SF_EINVAL,
                    "shm create: a segment for %d ranks with workspace=%zu bytes per rank and "
                    "p2p=%zu bytes per pair of ranks is larger than %lld bytes (set "
                    "SHARDFORMER_SHM_WORKSPACE smaller)",
                    nranks, workspace, p2p, (long long)INT64_MAX);
    sf_shm *c = new_comm(nranks, 0, half, box);
    if (!c)
        return sf_fail(err, SF_ENOMEM, "shm create: out of memory");
    c->total = L.total;
    int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
        int e = errno;
        free(c);
        return sf_fail(err, SF_EIO, "shm_open(%s): %s", name, strerror(e));
    }
    int rc = posix_fallocate(fd, 0, (off_t)c->total);
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
    place(c, &L);
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

/* The header's sizes describe a segment of `total` bytes for `nranks` ranks:
 * whole-line halves and mailboxes whose layout (checked arithmetic) ends
 * exactly at the end of the file.  0 and *L filled, or -1. */
static int header_fits(const header *hd, int nranks, size_t total, seg_layout *L)
{
    if (hd->nranks != (uint64_t)nranks || hd->total != (uint64_t)total)
        return -1;
    if (hd->half < LINE || hd->p2p < LINE)
        return -1;
#if SIZE_MAX < UINT64_MAX
    if (hd->half > SIZE_MAX || hd->p2p > SIZE_MAX)
        return -1;
#endif
    if (plan((size_t)nranks, (size_t)hd->half, (size_t)hd->p2p, L))
        return -1;
    return L->total == total ? 0 : -1;
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
    if (fstat(fd, &st) != 0 || st.st_size < LINE) {
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
    /* One snapshot of the header: what is checked is what is used. */
    header hd;
    memcpy(&hd, p, sizeof(hd));
    atomic_thread_fence(memory_order_acquire);
    if (hd.magic != MAGIC || hd.nonce != nonce || hd.nranks != (uint64_t)nranks) {
        munmap(p, total);
        return sf_fail(err, SF_EINVAL,
                    "segment %s is not the one rank 0 created for this group (header mismatch)",
                    name);
    }
    seg_layout L;
    if (header_fits(&hd, nranks, total, &L)) {
        munmap(p, total);
        return sf_fail(err, SF_EINVAL,
                    "segment %s: its header (nranks=%llu, half=%llu, p2p=%llu, total=%llu "
                    "bytes) does not describe a %zu-byte segment (corrupt or forged header)",
                    name, (unsigned long long)hd.nranks, (unsigned long long)hd.half,
                    (unsigned long long)hd.p2p, (unsigned long long)hd.total, total);
    }
    sf_shm *c = new_comm(nranks, rank, (size_t)hd.half, (size_t)hd.p2p);
    if (!c) {
        munmap(p, total);
        return sf_fail(err, SF_ENOMEM, "shm attach: out of memory");
    }
    c->base = p;
    c->total = total;
    place(c, &L);
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

void sf_shm_set_poll(sf_shm *c, sf_shm_poll_fn fn, void *ctx)
{
    if (!c)
        return;
    c->poll = fn;
    c->poll_ctx = ctx;
}

int sf_shm_rank(const sf_shm *c) { return c ? c->rank : -1; }
int sf_shm_nranks(const sf_shm *c) { return c ? c->nranks : 0; }
size_t sf_shm_workspace(const sf_shm *c) { return c ? 2 * c->half : 0; }
size_t sf_shm_oneshot_max(const sf_shm *c) { return c ? c->oneshot_max : 0; }
double sf_shm_timeout(const sf_shm *c) { return c ? c->timeout_s : 0; }
uint64_t sf_shm_sleeps(const sf_shm *c) { return c ? c->sleeps : 0; }
uint64_t sf_shm_wakes(const sf_shm *c) { return c ? c->wakes : 0; }
size_t sf_shm_segment_bytes(const sf_shm *c) { return c ? c->total : 0; }

/* ---- names for messages ------------------------------------------------------ */

static const char *kind_name(unsigned k)
{
    static const char *const names[K_NKINDS] = {
        [K_ALL_REDUCE] = "all_reduce", [K_ALL_GATHER] = "all_gather",
        [K_REDUCE_SCATTER] = "reduce_scatter", [K_BROADCAST] = "broadcast",
        [K_BARRIER] = "barrier", [K_ALL_TO_ALL] = "all_to_all",
    };
    return k < K_NKINDS && names[k] ? names[k] : "an unknown call";
}

static const char *op_name(unsigned op) { return op == SF_RED_SUM ? "sum" : op == SF_RED_MAX ? "max" : "op?"; }

static const char *dtype_name(sf_shm_dtype d)
{
    SFDLDataType t = {(uint8_t)(d & 0xff), (uint8_t)(d >> 8 & 0xff), (uint16_t)(d >> 16)};
    return sf_dtype_name(t);
}

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

/* " 1 3" for bits 1 and 3 of mask (ranks below nranks); " none" for none. */
static void format_ranks(uint64_t mask, int nranks, char *buf, size_t n)
{
    size_t len = 0;
    buf[0] = '\0';
    for (int q = 0; q < nranks && q < 64; q++) {
        if (!(mask >> q & 1))
            continue;
        int k = snprintf(buf + len, n - len, " %d", q);
        if (k < 0 || (size_t)k >= n - len)
            break;
        len += (size_t)k;
    }
    if (len == 0)
        snprintf(buf, n, " none");
}

/* "all_reduce(sum, 16 bytes, float32, one-shot)" */
static void describe(const desc *d, char *buf, size_t n)
{
    unsigned long long b = (unsigned long long)d->bytes;
    switch (d->kind) {
    case K_ALL_REDUCE:
        snprintf(buf, n, "all_reduce(%s, %llu bytes, %s, %s)", op_name(d->op), b,
                 dtype_name(d->dtype), d->algo == SF_AR_ONESHOT ? "one-shot" : "reduce-scatter + all-gather");
        break;
    case K_REDUCE_SCATTER:
        snprintf(buf, n, "reduce_scatter(%s, %llu bytes, %s)", op_name(d->op), b,
                 dtype_name(d->dtype));
        break;
    case K_ALL_GATHER:
        snprintf(buf, n, "all_gather(%llu bytes, %s)", b, dtype_name(d->dtype));
        break;
    case K_BROADCAST:
        snprintf(buf, n, "broadcast(root %d, %llu bytes, %s)", (int)d->root, b,
                 dtype_name(d->dtype));
        break;
    case K_BARRIER:
        snprintf(buf, n, "barrier()");
        break;
    case K_ALL_TO_ALL:
        snprintf(buf, n, "all_to_all(%llu bytes, %s)", b, dtype_name(d->dtype));
        break;
    default:
        snprintf(buf, n, "%s (kind %u)", kind_name(d->kind), (unsigned)d->kind);
    }
}

/* ---- the abort record ------------------------------------------------------------ */

/* This rank broke the communicator: record why in the segment (unless another
 * rank already did: the first failure is the one everybody reports). */
static void raise_abort(sf_shm *c, int why, uint64_t missing)
{
    c->broken = why;
    atomic_store_explicit(&c->abort->missing[c->rank], missing, memory_order_relaxed);
    uint64_t expected = 0;
    uint64_t word = (uint64_t)why << 32 | (uint64_t)(c->rank + 1);
    atomic_compare_exchange_strong_explicit(&c->abort->word, &expected, word,
                                            memory_order_release, memory_order_relaxed);
    wake_peers(c);        /* sleepers see the abort now, not at their next poll */
}

/* "rank 1 was interrupted", "rank 0 timed out waiting for ranks that did not
 * arrive: 2"; the reason code in *why (WHY_NONE when no rank failed). */
static void abort_story(const sf_shm *c, char *buf, size_t n, int *why)
{
    uint64_t word = atomic_load_explicit(&c->abort->word, memory_order_acquire);
    int who = (int)(word & 0xffffffffu) - 1;
    *why = (int)(word >> 32);
    if (word == 0) {
        snprintf(buf, n, "an earlier failure on this rank");
        return;
    }
    if (who < 0 || who >= c->nranks) {
        snprintf(buf, n, "an unreadable abort record (%#llx)", (unsigned long long)word);
        return;
    }
    char ranks[256];
    uint64_t missing = atomic_load_explicit(&c->abort->missing[who], memory_order_relaxed);
    format_ranks(missing, c->nranks, ranks, sizeof(ranks));
    const char *self = who == c->rank ? " (this rank)" : "";
    switch (*why) {
    case WHY_TIMEOUT:
        snprintf(buf, n, "rank %d%s timed out after waiting for ranks that did not arrive:%s",
                 who, self, ranks);
        break;
    case WHY_INTERRUPT:
        snprintf(buf, n, "rank %d%s was interrupted", who, self);
        break;
    case WHY_DESYNC:
        snprintf(buf, n, "rank %d%s found the group out of step with rank%s", who, self, ranks);
        break;
    default:
        snprintf(buf, n, "rank %d%s failed (reason %d)", who, self, *why);
    }
}

/* A wait saw another rank's abort record: fail this call and break the
 * communicator here too.  A peer's timeout reads as a timeout. */
static sf_status peer_aborted(sf_shm *c, const char *what, sf_error *err)
{
    char story[512];
    int why;
    abort_story(c, story, sizeof(story), &why);
    if (!c->broken)
        c->broken = -1;
    return sf_fail(err, why == WHY_TIMEOUT ? SF_ETIMEOUT : SF_EPEER,
                   "%s: %s on rank %d stopped because %s (the communicator is now broken)",
                   c->label, what, c->rank, story);
}

static sf_status check(sf_shm *c, const char *what, sf_error *err)
{
    if (!c)
        return sf_fail(err, SF_EINVAL, "shm: no communicator");
    c->announce = 0;
    if (c->broken || atomic_load_explicit(&c->abort->word, memory_order_acquire)) {
        char story[512];
        int why;
        abort_story(c, story, sizeof(story), &why);
        if (!c->broken)
            c->broken = -1;
        return sf_fail(err, SF_EPEER, "%s: %s refused: the communicator is broken because %s",
                       c->label, what, story);
    }
    return SF_OK;
}

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

/* Backoff state for one wait: spin, then yield the core, then sleep on the
 * wake word (Linux) or with a growing interval capped at 100 us. */
typedef struct {
    unsigned iter;
    long sleep_ns;
    double deadline, next_poll;
} waiter;

/* Spin briefly, yield up to ~2000 times, then sleep on the futex.  Measured
 * (benchmarks/collectives_under_load.py): going to sleep after ~10 us instead
 * made a quiet 4-64 KiB all-reduce 3-4x slower (the peer arrives a little
 * later than that, and a futex sleep + wake costs more than the wait), and did
 * not help under 2 busy loops on 2 cores, where every waiter loses its core
 * for a scheduler slice either way. */
#define SPIN_STEPS 64
#define YIELD_STEPS 2048

static inline header *hdr(const sf_shm *c) { return (header *)c->base; }

#ifdef __linux__
static void futex_sleep(_Atomic uint32_t *word, uint32_t seen, double seconds)
{
    if (seconds <= 0)
        return;
    struct timespec ts;
    ts.tv_sec = (time_t)seconds;
    ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
    /* EAGAIN (the word moved), EINTR (a signal: the caller polls) and
     * ETIMEDOUT all mean: look again. */
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, seen, &ts, NULL, 0);
}
#endif

/* After a release store that a peer may be waiting for: bump the wake word
 * and wake the sleepers, if any (see "Waiting" at the top). */
static void wake_peers(sf_shm *c)
{
    header *h = hdr(c);
    /* The fence orders the caller's release store before the read of
     * `sleepers`; the wake word is written only when someone sleeps, so the
     * common case touches no shared line for writing. */
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&h->sleepers, memory_order_seq_cst) != 0) {
        atomic_fetch_add_explicit(&h->wake, 1u, memory_order_seq_cst);
#ifdef __linux__
        syscall(SYS_futex, (uint32_t *)&h->wake, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
#endif
        c->wakes++;
    }
}

/* What one backoff step found. */
enum { W_WAIT = 0, W_TIMEOUT, W_ABORT, W_INTR };

static void wait_init(waiter *w)
{
    w->iter = 0;
    w->sleep_ns = 1000;
    w->deadline = -1.0;
    w->next_poll = 0.0;
}

/* One backoff step of a wait for *a >= target.  The abort record, the poll
 * callback (every POLL_S) and the clock are checked every 64 steps while
 * yielding, and after every sleep. */
static int wait_step(waiter *w, sf_shm *c, _Atomic uint64_t *a, uint64_t target)
{
    unsigned i = w->iter;
    if (i < YIELD_STEPS)
        w->iter++;
    if (i < SPIN_STEPS) {
        cpu_relax();
        return W_WAIT;
    }
    if (i < YIELD_STEPS) {
        sched_yield();
        if ((i - SPIN_STEPS) & 63)
            return W_WAIT;
    } else {
#ifdef __linux__
        header *h = hdr(c);
        uint32_t seen = atomic_load_explicit(&h->wake, memory_order_seq_cst);
        atomic_fetch_add_explicit(&h->sleepers, 1u, memory_order_seq_cst);
        atomic_thread_fence(memory_order_seq_cst);
        if (atomic_load_explicit(a, memory_order_acquire) < target) {
            double until = w->next_poll < w->deadline ? w->next_poll : w->deadline;
            double left = until - now_s();
            futex_sleep(&h->wake, seen, left < POLL_S ? (left > 1e-4 ? left : 1e-4) : POLL_S);
            c->sleeps++;
        }
        atomic_fetch_sub_explicit(&h->sleepers, 1u, memory_order_seq_cst);
#else
        (void)a;
        (void)target;
        struct timespec ts = {0, w->sleep_ns};
        nanosleep(&ts, NULL);
        if (w->sleep_ns < 100000)
            w->sleep_ns *= 2;
#endif
    }
    double t = now_s();
    if (w->deadline < 0) {
        w->deadline = t + c->timeout_s;
        w->next_poll = t + POLL_S;
    }
    if (atomic_load_explicit(&c->abort->word, memory_order_acquire))
        return W_ABORT;
    if (c->poll && t >= w->next_poll) {
        w->next_poll = t + POLL_S;
        if (c->poll(c->poll_ctx))
            return W_INTR;
    }
    return t > w->deadline ? W_TIMEOUT : W_WAIT;
}

/* A wait ended without its counter: fail the call with the reason (why from
 * wait_step); `missing` has a bit for each rank still awaited. */
static sf_status wait_failed(sf_shm *c, int why, const char *what, uint64_t missing,
                             sf_error *err)
{
    char ranks[256];
    format_ranks(missing, c->nranks, ranks, sizeof(ranks));
    switch (why) {
    case W_TIMEOUT:
        raise_abort(c, WHY_TIMEOUT, missing);
        return sf_fail(err, SF_ETIMEOUT,
                       "%s: %s timed out after %.3g s on rank %d; ranks that did not arrive:%s "
                       "(the communicator is now broken)",
                       c->label, what, c->timeout_s, c->rank, ranks);
    case W_INTR:
        raise_abort(c, WHY_INTERRUPT, missing);
        return sf_fail(err, SF_EINTR,
                       "%s: %s interrupted on rank %d while waiting for ranks%s (the "
                       "communicator is now broken)", c->label, what, c->rank, ranks);
    default:
        return peer_aborted(c, what, err);
    }
}

/* The ranks whose barrier count is below target. */
static uint64_t not_arrived(const sf_shm *c, uint64_t target)
{
    uint64_t mask = 0;
    for (int q = 0; q < c->nranks; q++)
        if (atomic_load_explicit(&c->ranks[q].seq, memory_order_acquire) < target)
            mask |= (uint64_t)1 << q;
    return mask;
}

/* ---- descriptors ------------------------------------------------------------ */

/* The call about to start: its first barrier publishes and checks this. */
static void announce(sf_shm *c, unsigned kind, uint64_t bytes, sf_shm_dtype dt, unsigned op,
                     int root, unsigned algo)
{
    memset(&c->next, 0, sizeof(c->next));
    c->next.call = ++c->calls;
    c->next.bytes = bytes;
    c->next.dtype = dt;
    c->next.root = root;
    c->next.kind = (uint8_t)kind;
    c->next.op = (uint8_t)op;
    c->next.algo = (uint8_t)algo;
    c->announce = 1;
}

static int same_call(const desc *a, const desc *b)
{
    return a->call == b->call && a->kind == b->kind && a->bytes == b->bytes &&
           a->dtype == b->dtype && a->op == b->op && a->root == b->root && a->algo == b->algo;
}

/* After the first barrier of a call: every rank's descriptor for this
 * barrier against rank 0's.  Every rank reads the same slots, so every rank
 * returns the same answer. */
static sf_status verify(sf_shm *c, uint64_t target, sf_error *err)
{
    desc d0 = c->ranks[0].slot[target & 1];
    for (int r = 0; r < c->nranks; r++) {
        desc d = c->ranks[r].slot[target & 1];
        if (d.seq != target) {
            /* r reached this barrier inside another call: the barrier counts
             * no longer line up, nothing later can be trusted. */
            raise_abort(c, WHY_DESYNC, (uint64_t)1 << r);
            return sf_fail(err, SF_EPEER,
                           "%s: rank %d reached barrier #%llu of call #%llu (%s) inside another "
                           "call; the group is out of step (the communicator is now broken)",
                           c->label, r, (unsigned long long)target,
                           (unsigned long long)c->next.call, kind_name(c->next.kind));
        }
        if (r > 0 && !same_call(&d0, &d)) {
            char a[192], b[192], at[48] = "";
            describe(&d0, a, sizeof(a));
            describe(&d, b, sizeof(b));
            if (d.call != d0.call)
                snprintf(at, sizeof(at), " as its call #%llu", (unsigned long long)d.call);
            return sf_fail(err, SF_EMISMATCH,
                           "%s: collective mismatch at call #%llu: rank 0 called %s, rank %d "
                           "called %s%s", c->label, (unsigned long long)d0.call, a, r, b, at);
        }
    }
    return SF_OK;
}

/* ---- barrier -------------------------------------------------------------- */

/* Arrive, wait for every rank; the first barrier of a call also publishes
 * this rank's descriptor (before the release store) and checks everyone's. */
static sf_status barrier(sf_shm *c, const char *what, sf_error *err)
{
    uint64_t target = ++c->my_seq;
    rank_line *me = &c->ranks[c->rank];
    int first = c->announce;
    if (first) {
        c->next.seq = target;
        me->slot[target & 1] = c->next;
        c->announce = 0;
    }
    atomic_store_explicit(&me->seq, target, memory_order_release);
    wake_peers(c);
    waiter w;
    wait_init(&w);
    for (int r = 0; r < c->nranks; r++) {
        if (r == c->rank)
            continue;
        while (atomic_load_explicit(&c->ranks[r].seq, memory_order_acquire) < target) {
            int why = wait_step(&w, c, &c->ranks[r].seq, target);
            if (why)
                return wait_failed(c, why, what, not_arrived(c, target), err);
        }
    }
    return first ? verify(c, target, err) : SF_OK;
}

/* The end of a call: its first barrier if no chunk ran one (zero bytes). */
static sf_status finish(sf_shm *c, const char *what, sf_error *err)
{
    return c->announce ? barrier(c, what, err) : SF_OK;
}

sf_status sf_shm_barrier(sf_shm *c, sf_error *err)
{
    sf_status rc = check(c, "barrier", err);
    if (rc)
        return rc;
    announce(c, K_BARRIER, 0, 0, 0, -1, 0);
    return barrier(c, "barrier", err);
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
    sf_status rc = check(c, "all_reduce", err);
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
    announce(c, K_ALL_REDUCE, bytes, red_code(t), op, -1, algo);
    rc = algo == SF_AR_ONESHOT ? allreduce_oneshot(c, buf, n, t, op, err)
                               : allreduce_rsag(c, buf, n, t, op, err);
    return rc ? rc : finish(c, "all_reduce", err);
}

sf_status sf_shm_all_gather(sf_shm *c, void *out, const void *in, size_t bytes, sf_shm_dtype dt,
                            sf_error *err)
{
    sf_status rc = check(c, "all_gather", err);
    if (rc)
        return rc;
    size_t all;
    if (bytes && (!out || !in))
        return sf_fail(err, SF_EINVAL, "%s: all_gather: null buffer", c->label);
    if (sf_size_mul_overflows(bytes, (size_t)c->nranks, &all))
        return sf_fail(err, SF_EOVERFLOW, "%s: all_gather: %d ranks x %zu bytes overflow",
                       c->label, c->nranks, bytes);
    announce(c, K_ALL_GATHER, bytes, dt, 0, -1, 0);
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
    return finish(c, "all_gather", err);
}

sf_status sf_shm_reduce_scatter(sf_shm *c, void *out, const void *in, size_t n, sf_red_dtype t,
                                sf_red_op op, sf_error *err)
{
    sf_status rc = check(c, "reduce_scatter", err);
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
    announce(c, K_REDUCE_SCATTER, in_bytes, red_code(t), op, -1, 0);
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
    return finish(c, "reduce_scatter", err);
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
    sf_status rc = check(c, "all_to_all", err);
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
    announce(c, K_ALL_TO_ALL, all, dt, 0, -1, 0);
    size_t own = (size_t)c->rank * bytes; /* this rank's block: left in place, or copied */
    for (size_t off = 0; off < bytes; off += per) {
        size_t cnt = bytes - off < per ? bytes - off : per;
        char *mine = half_of(c, c->rank);
        for (size_t q = 0; q < P; q++)
            if (q != (size_t)c->rank)
                memcpy(mine + slot_for(q, (size_t)c->rank) * cnt,
                       (const char *)in + q * bytes + off, cnt);
        rc = barrier(c, "all_to_all", err);
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
    return finish(c, "all_to_all", err);
}

sf_status sf_shm_broadcast(sf_shm *c, void *buf, size_t bytes, sf_shm_dtype dt, int root,
                           sf_error *err)
{
    sf_status rc = check(c, "broadcast", err);
    if (rc)
        return rc;
    if (root < 0 || root >= c->nranks || (bytes && !buf))
        return sf_fail(err, SF_EINVAL, "%s: broadcast: root %d not in [0, %d)",
                    c->label, root, c->nranks);
    announce(c, K_BROADCAST, bytes, dt, 0, root, 0);
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
    return finish(c, "broadcast", err);
}

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
    wait_init(&w);
    while (atomic_load_explicit(a, memory_order_acquire) < target) {
        int why = wait_step(&w, c, a, target);
        if (why)
            return wait_failed(c, why, what, (uint64_t)1 << peer, err);
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
    sf_status rc = check(c, "send", err);
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
        wake_peers(c);
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
    wake_peers(c);
    while (--left) {
        sf_status rc = wait_counter(c, &mb->posted, seen + 1, "recv", src, err);
        if (rc)
            return rc;
        atomic_store_explicit(taken, ++seen, memory_order_release);
        wake_peers(c);
    }
    char numbers[96] = "";
    if (smsg != msgno)
        snprintf(numbers, sizeof(numbers), " (its message #%llu to rank %d)",
                 (unsigned long long)smsg, c->rank);
    return sf_fail(err, SF_EMISMATCH,
                   "%s: send/recv mismatch on message #%llu from rank %d: rank %d expected %zu "
                   "bytes %s from rank %d, which sent %llu bytes %s%s",
                   c->label, (unsigned long long)msgno, src, c->rank, bytes, dtype_name(dt), src,
                   (unsigned long long)sbytes, dtype_name(sdt), numbers);
}

sf_status sf_shm_recv(sf_shm *c, void *buf, size_t bytes, sf_shm_dtype dt, int src,
                      sf_error *err)
{
    sf_status rc = check(c, "recv", err);
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
        wake_peers(c);
        off += cnt;
    } while (off < bytes);
    return SF_OK;
}
