/*
 * decode.h -- one decode step of a tensor-parallel Llama-shaped decoder:
 * every layer for one new token per sequence, with the two all-reduces of
 * each layer made through a callback, so the whole layer loop runs in C.
 *
 * Shapes (B sequences, h hidden, on this rank: Hq query heads, Hk KV heads,
 * Hq = Hk G, head size d, F MLP features; L = past + 1 positions):
 *
 *   a    = rms(x) g1                                   x [B, h]
 *   q, k, v = a Wq^T (+ bq), a Wk^T, a Wv^T             Wq [Hq d, h], Wk, Wv [Hk d, h]
 *   q, k = qn(q), kn(k)                                per-head RMSNorm over d (Qwen3), optional
 *   q, k = q cos + rot(q) sin, ...                      rot([u1, u2]) = [-u2, u1], cos / sin [B or 1, d]
 *   K[b, j, past] = k, V[b, j, past] = v               K, V [B, Hk, cap, d], cap >= L
 *   s_t  = q . K[b, j(h), t] scale + bias_t            j(h) = h / G (GQA), t < L;
 *                                                      bias_t = -FLT_MAX where mask[b, t] == 0
 *   o_h  = sum_t softmax(s)_t V[b, j(h), t]            o [B, Hq d]
 *   x    = x + (reduce(o Wo^T) (+ bo))                 Wo [h, Hq d]: row shard, summed over ranks
 *   m    = rms(x) g2
 *   g, u = m Wg^T (+ bg), m Wu^T (+ bu)                Wg, Wu [F, h]
 *   x    = x + (reduce((silu(g) u) Wd^T) (+ bd))       Wd [h, F]
 *
 * Types.  fp32 (t = F32): the weights, the cache and the arithmetic, in
 * the order of HF's modules, so the result equals HF's forward up to the
 * order of the fp32 sums.  bf16 / fp16 (t = BF16 / F16): the weights and
 * the cache of t; every value computed in fp32 and rounded to t (r() below)
 * where HF's modules (and the sharded model's all-reduce) hand over a
 * tensor of t:
 *   rms:       r(r(v rstd) g), rstd from fp32 squares (LlamaRMSNorm);
 *   linear:    r(fp32 sum (+ b)) (the skinny kernel on t);
 *   rope:      r(r(q cos) + r(rot(q) sin));
 *   attention: s_t = r(r(q . K_t) scale) (+ mask), softmax in fp32,
 *              p = r(softmax), o = r(sum_t p_t V_t);
 *   reduce:    r(fp32 sum of the ranks' r(y)), then r(x + r(y + b));
 *   MLP:       r(r(silu(g)) u).
 * x arrives and leaves as fp32 values of t.  The matmuls are sfk_skinny_linear (linear.h).  `reduce` sums
 * a [B, h] buffer over the ranks in place (the shm communicator's
 * all-reduce, csrc/comm/); a failure it reports ends the step with its
 * status and message.  Plain C over pointers and sizes: no Python here
 * (kernels_module.c holds the glue).
 *
 * Not here: the embedding, the rotary table, the final norm and the LM head
 * (the caller's, before and after), sliding windows.
 */
#ifndef SHARDFORMER_KERNELS_DECODE_H
#define SHARDFORMER_KERNELS_DECODE_H

#include "common.h"

/* In-place sum of buf[0:n] over the ranks. */
typedef sf_status (*sfk_reduce_fn)(void *ctx, float *buf, int64_t n, sf_error *err);

/* One layer's weights and its cache, of the step's type t (fp32, bf16 or
 * fp16; the biases fp32), contiguous; NULL where absent.  q, k, v and gate,
 * up are this rank's shards as the modules hold them (no packed copy). */
typedef struct {
    const void *ln1, *ln2;             /* [h] */
    float eps1, eps2;
    const void *wq, *wk, *wv;          /* [Hq d, h], [Hk d, h], [Hk d, h] */
    const float *bq, *bk, *bv;         /* [Hq d], [Hk d], [Hk d] */
    const void *q_norm, *k_norm;       /* [d] each, both or neither */
    float qk_eps;
    const void *wo;                    /* [h, Hq d] */
    const float *bo;                   /* [h] (added after the reduce) */
    const void *wg, *wu;               /* [F, h] each */
    const float *bg, *bu;              /* [F] each */
    const void *wd;                    /* [h, F] */
    const float *bd;                   /* [h] (added after the reduce) */
    void *k_cache, *v_cache;           /* [B, Hk, cap, d] */
    float scale;                       /* the attention's scaling */
} sfk_decode_layer;

typedef struct {
    sfk_dtype dtype;                   /* t: the weights', the cache's and HF's activations' type */
    int64_t batch, hidden, heads, kv_heads, head_dim, ffn;
    int64_t cap;                       /* positions each cache holds */
    int64_t past;                      /* positions cached before this token (< cap) */
    const float *cos, *sin;            /* [rope_rows, d], rope_rows 1 or B (values of t) */
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
