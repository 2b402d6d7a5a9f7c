/*
 * shm.h -- collectives over a POSIX shared-memory segment, for the ranks of
 * one process group that live on one host.
 *
 * Plain C over pointers and sizes: no Python here (see comm_module.c for the
 * glue).  One segment per group holds a control block (one sequence counter
 * per rank, one mailbox per ordered rank pair) and, per rank, a workspace cut
 * in two halves that successive chunks alternate between, so a chunk needs
 * one barrier (two for the reduce-scatter + all-gather all-reduce): a rank
 * writes half h only after a barrier that every rank passed after its last
 * read of half h.
 *
 * Every call must be made by every rank of the group in the same order with
 * the same sizes (as with any collective).  Waits spin with a pause
 * instruction, then yield, then sleep, and give up after the communicator's
 * timeout, naming the ranks that did not arrive (SF_ETIMEOUT); the
 * communicator is then broken and refuses further calls (SF_EPEER).  Every
 * function that can fail returns an sf_status with a message in `err`:
 * SF_EINVAL for bad arguments, SF_EIO for the system (shm_open, mmap, ...).
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

typedef struct sf_shm sf_shm;

/* Rank 0: create the segment `name` (O_EXCL, mode 0600), reserve its space
 * with posix_fallocate, map it and write `nonce` into its header.
 * workspace: bytes per rank (split in two halves); p2p: bytes per ordered pair. */
sf_status sf_shm_create(const char *name, int nranks, size_t workspace, size_t p2p, uint64_t nonce,
                        sf_shm **out, sf_error *err);
/* Other ranks: map the existing segment and check its header against
 * nranks and nonce (which proves it is the segment rank 0 made). */
sf_status sf_shm_attach(const char *name, int nranks, int rank, uint64_t nonce, sf_shm **out,
                        sf_error *err);
sf_status sf_shm_unlink(const char *name, sf_error *err);
void sf_shm_close(sf_shm *c);

void sf_shm_configure(sf_shm *c, const char *label, double timeout_s, size_t oneshot_max);
int sf_shm_rank(const sf_shm *c);
int sf_shm_nranks(const sf_shm *c);
size_t sf_shm_workspace(const sf_shm *c);
size_t sf_shm_oneshot_max(const sf_shm *c);
double sf_shm_timeout(const sf_shm *c);
size_t sf_shm_segment_bytes(const sf_shm *c);

/* In-place all-reduce of n elements at buf. */
sf_status sf_shm_all_reduce(sf_shm *c, void *buf, size_t n, sf_red_dtype t, sf_red_op op,
                            sf_ar_algo algo, sf_error *err);
/* out (nranks * bytes) = concat over ranks of in (bytes). */
sf_status sf_shm_all_gather(sf_shm *c, void *out, const void *in, size_t bytes, sf_error *err);
/* out (n elements) = this rank's n-element block of the reduction over ranks
 * of in (nranks * n elements). */
sf_status sf_shm_reduce_scatter(sf_shm *c, void *out, const void *in, size_t n, sf_red_dtype t,
                                sf_red_op op, sf_error *err);
sf_status sf_shm_broadcast(sf_shm *c, void *buf, size_t bytes, int root, sf_error *err);
sf_status sf_shm_send(sf_shm *c, const void *buf, size_t bytes, int dst, sf_error *err);
sf_status sf_shm_recv(sf_shm *c, void *buf, size_t bytes, int src, sf_error *err);
/* A barrier over the group (also used by tests). */
sf_status sf_shm_barrier(sf_shm *c, sf_error *err);

#endif
