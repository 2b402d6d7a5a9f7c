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
 * The ends of the step (sfk_decode_ends, optional: the caller's where absent):
 *   embedding  x[b] = E_i[id_b - v0] where v0 <= id_b < v0 + real_i, else 0,
 *              then reduce(x): the vocabulary-parallel lookup, each id's row
 *              on exactly one rank, so the sum is that row, exactly;
 *   head       z = r(rms(x) gN) W_i^T (+ b), W_i this rank's rows [rows_i, h]
 *              (padding rows included), as t; every rank's z [B, chunk]
 *              (rows_i <= chunk, the rest zero) all-gathered, and the logits
 *              [B, V] assembled from each rank's real columns: rank r's
 *              ranges (offset, count) of the vocabulary, laid back to back
 *              in its shard, go to those offsets; its padding is dropped.
 * Not here: the rotary table (the caller's), sliding windows.
 */
#ifndef SHARDFORMER_KERNELS_DECODE_H
#define SHARDFORMER_KERNELS_DECODE_H

#include "common.h"

/* In-place sum of buf[0:n] over the ranks. */
typedef sf_status (*sfk_reduce_fn)(void *ctx, float *buf, int64_t n, sf_error *err);
/* out[r * bytes : (r + 1) * bytes] = rank r's in[0:bytes], every rank r. */
typedef sf_status (*sfk_gather_fn)(void *ctx, void *out, const void *in, int64_t bytes, sf_error *err);

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

/* The embedding and the final norm + LM head of the step (decode.h's top),
 * of the step's type t (the head's bias fp32); `embed` / `head` NULL where
 * the caller runs that end. */
typedef struct {
    const void *embed;                 /* [embed_rows, h]: this rank's vocabulary rows */
    int64_t embed_start, embed_real;   /* ids in [embed_start, embed_start + embed_real) are here */
    int64_t vocab;                     /* V: ids in [0, V), logits [B, V] */
    const void *norm;                  /* [h] the final RMSNorm's weight */
    float norm_eps;
    const void *head;                  /* [head_rows, h] */
    const float *head_bias;            /* [head_rows] or NULL */
    int64_t head_rows, chunk;          /* chunk: the most rows any rank holds (the gather's block) */
    int nranks;
    const int64_t *ranges;             /* nranges (rank, offset, count), rank-major, in shard order */
    int64_t nranges;
    void *work;                        /* (nranks + 1) B chunk elements of t */
    sfk_gather_fn gather;
    void *gather_ctx;
} sfk_decode_ends;

/* x [B, h] = the rows of ids [B] (decode.h's embedding), summed over the
 * ranks with s->reduce.  The ids must lie in [0, V) (the caller checks). */
sf_status sfk_decode_embed(const sfk_decode_step *s, const sfk_decode_ends *e, const int64_t *ids, float *x,
                           sf_error *err);

/* logits [B, V] of t from the last hidden states x [B, h] (decode.h's
 * head): the final norm, this rank's product, the gather, the assembly. */
sf_status sfk_decode_logits(const sfk_decode_step *s, const sfk_decode_ends *e, const float *x, void *logits,
                            sf_error *err);

/* x [B, h] in place through layers[0:nlayers]; the caches gain position
 * `past`.  EINVAL for sizes that do not fit (past >= cap, heads not a
 * multiple of kv_heads, ...), ENOMEM, or the reduce's failure. */
sf_status sfk_decode_layers(const sfk_decode_step *s, const sfk_decode_layer *layers, int64_t nlayers,
                            float *x, sf_error *err);

#endif
