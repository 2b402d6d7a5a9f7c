/*
 * fingerprint.h -- a 64-bit fingerprint of a block of memory, for checking
 * that the ranks of a group hold the same model before it is sharded.
 *
 * Not cryptographic: it tells accidental differences apart (another seed,
 * another checkpoint, one element changed), which is all the check needs.
 * Plain C over a pointer and a size; no Python.
 */
#ifndef SHARDFORMER_FINGERPRINT_H
#define SHARDFORMER_FINGERPRINT_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

/* *out = the fingerprint of bytes [data, data + nbytes), continuing from
 * `seed` (the fingerprint of what came before, or 0): chaining calls over
 * consecutive chunks gives a fingerprint of the whole that depends on the
 * chunking.  EINVAL for a NULL data or out pointer with bytes to read. */
sf_status sf_fingerprint(const void *data, size_t nbytes, uint64_t seed, uint64_t *out,
                         sf_error *err);

#endif
