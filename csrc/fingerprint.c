/*
 * fingerprint.c -- see fingerprint.h.
 *
 * Four independent lanes each fold one 8-byte word of every 32-byte block
 * (multiply, rotate, multiply), so the loop runs at memory speed rather
 * than at the latency of one multiply chain; the lanes, the tail bytes and
 * the length are then folded together and finalized with a 64-bit avalanche
 * (every input bit affects every output bit).
 */
#include "fingerprint.h"

#include <string.h>

#define K1 0x9E3779B97F4A7C15ULL
#define K2 0xC2B2AE3D27D4EB4FULL
#define K3 0x165667B19E3779F9ULL

static inline uint64_t rotl(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static inline uint64_t fold(uint64_t lane, uint64_t word)
{
    lane += word * K2;
    lane = rotl(lane, 31);
    return lane * K1;
}

static inline uint64_t avalanche(uint64_t h)
{
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDULL;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ULL;
    h ^= h >> 33;
    return h;
}

static inline uint64_t load64(const unsigned char *p)
{
    uint64_t w;
    memcpy(&w, p, sizeof w);  /* any alignment; compiles to one load */
    return w;
}

sf_status sf_fingerprint(const void *data, size_t nbytes, uint64_t seed, uint64_t *out,
                         sf_error *err)
{
    if (!out || (nbytes > 0 && !data))
        return sf_fail(err, SF_EINVAL, "fingerprint: %s is NULL (%zu bytes to read)",
                       out ? "data" : "out", nbytes);
    const unsigned char *p = (const unsigned char *)data;
    uint64_t a = seed + K1 + K2, b = seed + K2, c = seed, d = seed - K1;
    size_t i = 0;
    for (; nbytes - i >= 32; i += 32) {
        a = fold(a, load64(p + i));
        b = fold(b, load64(p + i + 8));
        c = fold(c, load64(p + i + 16));
        d = fold(d, load64(p + i + 24));
    }
    uint64_t h = rotl(a, 1) + rotl(b, 7) + rotl(c, 12) + rotl(d, 18);
    h ^= (uint64_t)nbytes * K3;
    for (; nbytes - i >= 8; i += 8)
        h = rotl(h ^ fold(0, load64(p + i)), 27) * K1 + K3;
    for (; i < nbytes; i++)
        h = rotl(h ^ ((uint64_t)p[i] * K3), 11) * K1;
    *out = avalanche(h ^ seed);
    return SF_OK;
}
