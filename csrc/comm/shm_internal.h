/*
 * shm_internal.h -- what the files of the shared-memory collectives share
 * (not part of the interface; see shm.h for the contract).
 *
 *   shm_segment.c      the segment: layout, create / attach / unlink / close,
 *                      settings and accessors;
 *   shm_wait.c         waiting (spin, yield, futex), waking peers, the abort
 *                      record, timeouts and interrupts;
 *   shm_barrier.c      call descriptors, the barrier that publishes and checks
 *                      them, sf_shm_barrier;
 *   shm_collectives.c  all_reduce, all_gather, reduce_scatter, all_to_all,
 *                      broadcast over the workspaces;
 *   shm_p2p.c          send / recv through one mailbox per ordered pair.
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
 */
#ifndef SHARDFORMER_SHM_INTERNAL_H
#define SHARDFORMER_SHM_INTERNAL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "shm.h"

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
/* WHY_RAISED: the rank's own code raised (sf_shm_abort); its missing[] word holds
 * the caller's token instead of a rank mask. */
/* WHY_EXITED: a waiting rank found peers' processes gone; missing[] holds them. */
enum { WHY_NONE = 0, WHY_TIMEOUT = 1, WHY_INTERRUPT = 2, WHY_DESYNC = 3, WHY_RAISED = 4,
       WHY_EXITED = 5 };

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
    uint8_t kind, op, algo;
    uint8_t phase;  /* sf_shm_phase the caller set: forward or backward (autograd) */
    uint8_t pad[4];
} desc;

/* Rank r's line: its barrier count and its two descriptor slots (slot
 * [target & 1] for the barrier numbered target). */
typedef struct {
    _Atomic uint64_t seq;
    desc slot[2];
    uint64_t pidns;  /* the inode of r's pid namespace (0: unknown), written by r at set-up */
    int32_t pid;     /* r's process, for peers that wait for r (shm_gone_ranks) */
    char pad[LINE - 2 * sizeof(uint64_t) - 2 * sizeof(desc) - sizeof(int32_t)];
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
    unsigned call_phase; /* sf_shm_phase of the calls from now on (sf_shm_set_phase) */
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

/* ---- waiting (shm_wait.c) ------------------------------------------------ */

/* Record this process in its rank line (pid, pid namespace): at set-up. */
void shm_register_self(sf_shm *c);
/* The ranks (bit q) whose processes are gone: peers in this rank's pid
 * namespace whose pid no longer exists or is a zombie. */
uint64_t shm_gone_ranks(const sf_shm *c);

/* Backoff state for one wait: spin, then yield the core, then sleep on the
 * wake word (Linux) or with a growing interval capped at 100 us. */
typedef struct {
    unsigned iter;
    long sleep_ns;
    double deadline, next_poll;
} waiter;

/* What one backoff step found. */
enum { W_WAIT = 0, W_TIMEOUT, W_ABORT, W_INTR };

void shm_wait_init(waiter *w);
/* One backoff step of a wait for *a >= target (W_WAIT to go on). */
int shm_wait_step(waiter *w, sf_shm *c, _Atomic uint64_t *a, uint64_t target);
/* A wait ended without its counter (why from wait_step): fail the call and,
 * for a timeout or an interrupt, break the communicator. */
sf_status shm_wait_failed(sf_shm *c, int why, const char *what, uint64_t missing, sf_error *err);
/* After a release store a peer may wait for: wake the sleepers, if any. */
void shm_wake_peers(sf_shm *c);
/* This rank broke the communicator: record why (the first failure wins). */
void shm_raise_abort(sf_shm *c, int why, uint64_t missing);
/* The start of every call: refuse it when the communicator is broken. */
sf_status shm_check(sf_shm *c, const char *what, sf_error *err);

/* ---- descriptors and the barrier (shm_barrier.c) ------------------------- */

/* The name of a dtype code, for messages. */
const char *shm_dtype_name(sf_shm_dtype d);
/* The call about to start: its first barrier publishes and checks this. */
void shm_announce(sf_shm *c, unsigned kind, uint64_t bytes, sf_shm_dtype dt, unsigned op,
                  int root, unsigned algo);
/* Arrive and wait for every rank (the first barrier of a call checks the
 * descriptors). */
sf_status shm_barrier(sf_shm *c, const char *what, sf_error *err);
/* The end of a call: its first barrier if no chunk ran one (zero bytes). */
sf_status shm_finish(sf_shm *c, const char *what, sf_error *err);

#endif /* SHARDFORMER_SHM_INTERNAL_H */
