/*
 * dropout_hash.h -- the dropout draws of every kernel, CPU (csrc/kernels/)
 * and CUDA (csrc/cuda/) alike, so one seed gives one mask on either device.
 *
 * Counter-based, so backward redraws the mask instead of storing it: row
 * `row` gets a key hashed from (seed, row), and element j of the row is kept
 * when the top 24 bits of mix(key + j * golden) are >= p * 2^24.  Shared by
 * bias-dropout-add and attention.  Integer arithmetic only (wrapping uint32
 * products), so host and device give the same bits.
 *
 * Plain C (also C++ under nvcc, where SF_HD marks the functions for both
 * host and device), static inline, no Python.
 */
#ifndef SHARDFORMER_DROPOUT_HASH_H
#define SHARDFORMER_DROPOUT_HASH_H

#include <stdint.h>

#ifdef __CUDACC__
#define SF_HD __host__ __device__
#else
#define SF_HD
#endif

static inline SF_HD uint32_t sfk_mix32(uint32_t h)
{
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    return h ^ (h >> 16);
}

static inline SF_HD uint32_t sfk_dropout_key(uint64_t seed, int64_t row)
{
    uint32_t r = sfk_mix32((uint32_t)row * 0x9e3779b9u + (uint32_t)((uint64_t)row >> 32));
    return sfk_mix32((uint32_t)seed ^ sfk_mix32((uint32_t)(seed >> 32) ^ r));
}

static inline SF_HD int sfk_dropout_kept(uint32_t key, int64_t j, uint32_t thresh)
{
    return (sfk_mix32(key + (uint32_t)j * 0x9e3779b9u) >> 8) >= thresh;
}

static inline SF_HD uint32_t sfk_dropout_threshold(float p) { return (uint32_t)((double)p * 16777216.0); }

#endif /* SHARDFORMER_DROPOUT_HASH_H */
