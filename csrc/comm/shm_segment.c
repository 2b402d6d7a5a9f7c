/*
 * shm_segment.c -- the shared-memory segment: its layout (see
 * shm_internal.h), create / attach / unlink / close, the settings and the
 * accessors.
 *
 * Sizes: the layout is computed with checked arithmetic (plan()), both when
 * rank 0 sizes the segment and when another rank checks the header it reads.
 */
#define _GNU_SOURCE
#include "shm_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

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
    shm_register_self(c);
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
    shm_register_self(c);
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
