/*
 * shm.h -- collectives over a POSIX shared-memory segment, for the ranks of
 * one process group that live on one host.
 *
 * Plain C over pointers and sizes: no Python here (see comm_module.c for the
 * glue).  One segment per group holds a control block (an abort record, one
 * sequence counter per rank, one mailbox per ordered rank pair) and, per
 * rank, a workspace cut in two halves that successive chunks alternate
 * between, so a chunk needs one barrier (two for the reduce-scatter +
 * all-gather all-reduce): a rank writes half h only after a barrier that
 * every rank passed after its last read of half h.
 *
 * Every call must be made by every rank of the group in the same order with
 * the same sizes (as with any collective).  What the ranks check, and what
 * happens when a check fails:
 *
 *   Collectives (all_reduce, all_gather, reduce_scatter, all_to_all, broadcast,
 *   barrier).
 *   Before the first barrier of each call a rank publishes a descriptor
 *   {operation, byte count of its tensor, dtype, reduction op, root, the
 *   resolved all-reduce algorithm, call number} in its own slot of the
 *   segment (two slots per rank, picked by the barrier number's parity: a
 *   rank can be at most one barrier ahead of another, so it never overwrites
 *   a slot someone still reads), with plain stores before the release store
 *   of its sequence counter.  After that barrier every rank reads every
 *   rank's descriptor.  They all read the same descriptors, so when two
 *   differ every rank fails the call together with SF_EMISMATCH, naming rank
 *   0's call and the first rank whose call differs ("collective mismatch at
 *   call #7: rank 0 called all_reduce(sum, 16 bytes, float32, one-shot),
 *   rank 1 called all_gather(32 bytes, uint8)"); no data was exchanged, no
 *   rank moved on, and the communicator stays usable for the next call.  A
 *   call with zero elements still meets the others (so 0 against 4 elements
 *   is a mismatch, not a hang).  Different SHARDFORMER_SHM_ONESHOT_MAX per
 *   rank shows as different algorithms.
 *
 *   Point to point (send, recv).  A message carries a header {total bytes,
 *   dtype, message number on the pair} next to the mailbox counter.  The
 *   receiver checks it against its own call on the first chunk; on mismatch
 *   it takes and discards the sender's remaining chunks (so the sender
 *   completes and the pair stays in step) and fails with SF_EMISMATCH ("rank
 *   1 expected 8 bytes float32 from rank 0, which sent 4 bytes float32").
 *   The sender does not learn of it.  A zero-byte message is still one
 *   (empty) chunk.
 *
 *   Waits spin with a pause instruction, then yield, then sleep.  In their
 *   slow path (every 64 steps) they look at the segment's abort record and
 *   at the clock; every ~15 ms they call the poll callback (sf_shm_set_poll:
 *   the glue checks for Python signals there).  A wait fails
 *     - after the communicator's timeout: SF_ETIMEOUT naming the ranks that
 *       did not arrive;
 *     - when the poll callback reports an interrupt: SF_EINTR (the glue
 *       leaves the exception its signal handler raised in place);
 *     - when another rank aborted: the first rank that timed out or was
 *       interrupted stored (rank, reason, the ranks it waited for) in the
 *       abort record, and every wait of every rank fails within a few
 *       milliseconds: SF_ETIMEOUT naming that rank and the ranks it waited
 *       for when it timed out, SF_EPEER ("rank 1 was interrupted") otherwise.
 *   sf_shm_abort (a rank whose own code raised outside any call) aborts
 *   the same way, SF_EPEER "rank 1 raised".
 *   A timeout, an interrupt or an abort (on any rank) breaks the communicator for the
 *   whole group: every later call fails at once with SF_EPEER naming the
 *   rank and the reason.  A mismatch does not break it.
 *
 * Other failures: SF_EINVAL for bad arguments (and for a segment whose size
 * does not fit in memory), SF_EOVERFLOW for a byte count that overflows, SF_EIO
 * for the system (shm_open, mmap, ...).  Every size is computed with checked
 * arithmetic, and the sizes in a segment's header are checked against each
 * other and the file's size before the segment is used.
 *
 * Threads: one call at a time per sf_shm (the glue refuses overlapping
 * calls); the segment stays mapped until sf_shm_close.
 *
 * Not here: anything across hosts (torch.distributed does that).
 */
#ifndef SHARDFORMER_COMM_SHM_H
#define SHARDFORMER_COMM_SHM_H

#include <stddef.h>
#include <stdint.h>

#define SF_SHM_MAX_RANKS 64
#define SF_SHM_LABEL 160

#include "reduce.h"
#include "status.h"

/* Algorithm for all-reduce: AUTO picks ONESHOT up to oneshot_max bytes. */
typedef enum { SF_AR_AUTO = 0, SF_AR_ONESHOT = 1, SF_AR_RSAG = 2 } sf_ar_algo;

/* The element type of a bytes-moving call, as the ranks compare it: DLPack's
 * (code, bits, lanes) packed by SF_SHM_DTYPE. */
typedef uint32_t sf_shm_dtype;
#define SF_SHM_DTYPE(code, bits, lanes) \
    ((sf_shm_dtype)(code) | (sf_shm_dtype)(bits) << 8 | (sf_shm_dtype)(lanes) << 16)

/* Called every ~15 ms while a wait sleeps; nonzero means "interrupted". */
typedef int (*sf_shm_poll_fn)(void *ctx);

typedef struct sf_shm sf_shm;

/* Rank 0: create the segment `name` (O_EXCL, mode 0600), reserve its space
 * with posix_fallocate, map it and write `nonce` into its header.
 * workspace: bytes per rank (split in two halves); p2p: bytes per ordered pair.
 * EINVAL when the segment would not fit in memory (the message names the
 * sizes). */
sf_status sf_shm_create(const char *name, int nranks, size_t workspace, size_t p2p, uint64_t nonce,
                        sf_shm **out, sf_error *err);
/* Other ranks: map the existing segment and check its header against
 * nranks and nonce (which proves it is the segment rank 0 made), and its
 * sizes against each other and the file's size. */
sf_status sf_shm_attach(const char *name, int nranks, int rank, uint64_t nonce, sf_shm **out,
                        sf_error *err);
sf_status sf_shm_unlink(const char *name, sf_error *err);
/* Unmap and free.  Never while a call on c is running (the glue counts them). */
void sf_shm_close(sf_shm *c);

void sf_shm_configure(sf_shm *c, const char *label, double timeout_s, size_t oneshot_max);
/* The callback the waits of the next calls poll (NULL: none). */
void sf_shm_set_poll(sf_shm *c, sf_shm_poll_fn fn, void *ctx);
int sf_shm_rank(const sf_shm *c);
int sf_shm_nranks(const sf_shm *c);
size_t sf_shm_workspace(const sf_shm *c);
size_t sf_shm_oneshot_max(const sf_shm *c);
double sf_shm_timeout(const sf_shm *c);
/* This rank's futex sleeps while waiting for peers, and the wakes it issued
 * to sleeping peers (counts since the communicator was made). */
uint64_t sf_shm_sleeps(const sf_shm *c);
uint64_t sf_shm_wakes(const sf_shm *c);
size_t sf_shm_segment_bytes(const sf_shm *c);

/* This rank failed outside any call (its caller raised): break the
 * communicator for the whole group, as a timeout would, so that every wait
 * of every rank fails within milliseconds with SF_EPEER ("rank 1 raised").
 * `token` (nonzero) is kept with the record for the peers to read: the
 * caller's key for its own account of the failure (shardformer keeps it in
 * the torch.distributed store).  The first failure of a group is the one
 * recorded; a later call changes nothing but this rank's state. */
void sf_shm_abort(sf_shm *c, uint64_t token);
/* The group's abort record: 0 when no rank broke it, else 1 with the rank
 * that did (*rank), the reason (*why: 1 timeout, 2 interrupt, 3 out of
 * step, 4 raised) and, for 4, its token (*token; else the ranks it waited
 * for, a bit mask). */
int sf_shm_abort_record(const sf_shm *c, int *rank, int *why, uint64_t *token);

/* The phase of this rank's collective calls from now on: 0 forward, 1
 * backward (the caller says which: inside autograd's backward or not).  It
 * travels in the call's descriptor, so a forward call on one rank never
 * pairs with a backward call of the same kind and size on another (a rank
 * that skipped the rest of a backward): the call fails on every rank with
 * SF_EMISMATCH naming both ranks and both calls. */
void sf_shm_set_phase(sf_shm *c, unsigned phase);
/* Where group rank r stands: the barriers it entered (*seq) and the phase of
 * the call whose descriptor it published last (*phase; 0 before any). */
void sf_shm_rank_state(const sf_shm *c, int r, uint64_t *seq, unsigned *phase);

/* In-place all-reduce of n elements at buf. */
sf_status sf_shm_all_reduce(sf_shm *c, void *buf, size_t n, sf_red_dtype t, sf_red_op op,
                            sf_ar_algo algo, sf_error *err);
/* out (nranks * bytes) = concat over ranks of in (bytes). */
sf_status sf_shm_all_gather(sf_shm *c, void *out, const void *in, size_t bytes, sf_shm_dtype dt,
                            sf_error *err);
/* out (n elements) = this rank's n-element block of the reduction over ranks
 * of in (nranks * n elements). */
sf_status sf_shm_reduce_scatter(sf_shm *c, void *out, const void *in, size_t n, sf_red_dtype t,
                                sf_red_op op, sf_error *err);
/* All-to-all of blocks of `bytes`: in and out hold nranks blocks each;
 * block j of in goes to rank j, block i of out comes from rank i.  The
 * ranks compare the whole input's byte count (nranks * bytes) and dtype.
 * Blocks larger than the workspace move in rounds of half / (nranks - 1)
 * bytes per block, one barrier each.  out == in (exactly) is allowed; other
 * overlaps are not. */
sf_status sf_shm_all_to_all(sf_shm *c, void *out, const void *in, size_t bytes, sf_shm_dtype dt,
                            sf_error *err);
sf_status sf_shm_broadcast(sf_shm *c, void *buf, size_t bytes, sf_shm_dtype dt, int root,
                           sf_error *err);
sf_status sf_shm_send(sf_shm *c, const void *buf, size_t bytes, sf_shm_dtype dt, int dst,
                      sf_error *err);
sf_status sf_shm_recv(sf_shm *c, void *buf, size_t bytes, sf_shm_dtype dt, int src,
                      sf_error *err);
/* A barrier over the group (also used by tests). */
sf_status sf_shm_barrier(sf_shm *c, sf_error *err);

#endif
