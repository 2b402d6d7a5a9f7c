/*
 * decode.h -- one decode step of a tensor-parallel Llama-shaped decoder:
 * every layer for one new token per sequence, with the two all-reduces of
 * each layer made through a callback, so the whole layer loop runs in C.
 *
 * Shapes (B sequences, h hidden, on this rank: Hq query heads, Hk KV heads,
 * Hq = Hk G, head size d, F MLP features; L = past + 1 positions):
 *
 *   a    = rms(x) g1                                   x [B, h]
 *   qkv  = a Wqkv^T (+ bqkv)                           Wqkv [(Hq + 2 Hk) d, h]: q, k, v rows packed
 *   q, k = qn(q), kn(k)                                per-head RMSNorm over d (Qwen3), optional
 *   q, k = q cos + rot(q) sin, ...                      rot([u1, u2]) = [-u2, u1], cos / sin [B or 1, d]
 *   K[b, j, past] = k, V[b, j, past] = v               K, V [B, Hk, cap, d], cap >= L
 *   s_t  = q . K[b, j(h), t] scale + bias_t            j(h) = h / G (GQA), t < L;
 *                                                      bias_t = -FLT_MAX where mask[b, t] == 0
 *   o_h  = sum_t softmax(s)_t V[b, j(h), t]            o [B, Hq d]
 *   x    = x + (reduce(o Wo^T) (+ bo))                 Wo [h, Hq d]: row shard, summed over ranks
 *   m    = rms(x) g2
 *   gu   = m Wgu^T (+ bgu)                             Wgu [2F, h]: gate rows, then up rows
 *   x    = x + (reduce((silu(g) u) Wd^T) (+ bd))       Wd [h, F]
 *
 * fp32 throughout (the weights, the cache, the arithmetic), in the order of
 * HF's modules, so the result equals HF's forward up to the order of the
 * fp32 sums.  The matmuls are sfk_skinny_linear (linear.h).  `reduce` sums
 * a [B, h] buffer over the ranks in place (the shm communicator's
 * all-reduce, csrc/comm/); a failure it reports ends the step with its
 * status and message.  Plain C over pointers and sizes: no Python here
 * (kernels_module.c holds the glue).
 *
 * Not here: the embedding, the rotary table, the final norm and the LM head
 * (the caller's, before and after), 16-bit types, sliding windows.
 */
#ifndef SHARDFORMER_KERNELS_DECODE_H
#define SHARDFORMER_KERNELS_DECODE_H

#include "common.h"

/* In-place sum of buf[0:n] over the ranks. */
typedef sf_status (*sfk_reduce_fn)(void *ctx, float *buf, int64_t n, sf_error *err);

/* One layer's weights (fp32, contiguous) and its cache; NULL where absent. */
typedef struct {
    const float *ln1, *ln2;            /* [h] */
    float eps1, eps2;
    const float *wqkv, *bqkv;          /* [(Hq + 2 Hk) d, h], [(Hq + 2 Hk) d] */
    const float *q_norm, *k_norm;      /* [d] each, both or neither */
    float qk_eps;
    const float *wo, *bo;              /* [h, Hq d], [h] (added after the reduce) */
    const float *wgu, *bgu;            /* [2F, h], [2F] */
    const float *wd, *bd;              /* [h, F], [h] (added after the reduce) */
    float *k_cache, *v_cache;          /* [B, Hk, cap, d] */
    float scale;                       /* the attention's scaling */
} sfk_decode_layer;

typedef struct {
    int64_t batch, hidden, heads, kv_heads, head_dim, ffn;
    int64_t cap;                       /* positions each cache holds */
    int64_t past;                      /* positions cached before this token (< cap) */
    const float *cos, *sin;            /* [rope_rows, d], rope_rows 1 or B */
    int64_t rope_rows;
    const int64_t *mask;               /* [B, past + 1], 0 = padding; NULL: none */
    sfk_reduce_fn reduce;
    void *reduce_ctx;
} sfk_decode_step;

/* x [B, h] in place through layers[0:nlayers]; the caches gain position
 * `past`.  EINVAL for sizes that do not fit (past >= cap, heads not a
 * multiple of kv_heads, ...), ENOMEM, or the reduce's failure. */
sf_status sfk_decode_layers(const sfk_decode_step *s, const sfk_decode_layer *layers, int64_t nlayers,
                            float *x, sf_error *err);

#endif
