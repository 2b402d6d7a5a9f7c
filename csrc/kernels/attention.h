/*
 * attention.h -- scaled dot-product attention, forward and backward, in the
 * flash style: keys are visited in tiles with an online softmax, the per-row
 * log-sum-exp is kept for backward, and no [Sq, Sk] matrix is ever built
 * (each thread holds a few [tile, tile] and [tile, D] buffers).
 *
 * Shapes (B = batch, Hq / Hkv = query / key-value heads, Hq a multiple of
 * Hkv, S = sequence, D = head size), all contiguous, type t:
 *   q, o, dq, dout [B, Hq, Sq, D]     k, v, dk, dv [B, Hkv, Sk, D]
 *   lse [B, Hq, Sq] fp32
 * Query head h reads key-value head h / (Hq / Hkv) (GQA / MQA, no copies).
 *
 * Math, with off = Sk - Sq (queries are the last Sq positions of the keys,
 * "bottom-right" alignment, as for a KV cache):
 *   x_ij = scale * q_i . k_j,  c_ij = x_ij, or (soft-capping, cap > 0)
 *          c_ij = cap * tanh(x_ij / cap)
 *   s_ij = c_ij + bias_ij - slope_h * |i + off - j|
 *   s_ij = -inf where mask_ij == 0, or (causal) j > i + off, or (window W > 0)
 *          i + off - j >= W, or (window and not causal) j - (i + off) >= W
 *   p_ij = softmax_j(s_ij),  lse_i = log sum_j exp(s_ij)
 *   o_i  = sum_j p_ij z_ij / (1 - dropout) v_j,  z_ij in {0, 1} drawn from
 *          (seed, b, h, P(i), Q(j)) by a counter-based hash (redrawn in
 *          backward): P(i) = qpos[i], Q(j) = kpos[j] when given (the global
 *          positions of a block of a longer sequence of drop_seq rows, so
 *          that the blocks of a split sequence draw what one call over the
 *          whole sequence draws), else i and j
 * A row with every key masked gives o_i = 0 and lse_i = +inf (its gradients
 * are 0).
 * Backward (delta_i = dout_i . o_i, dp_ij = z_ij / (1 - dropout) dout_i . v_j):
 *   ds_ij = p_ij (dp_ij - delta_i),  dx_ij = ds_ij (soft-capping: ds_ij
 *           (1 - tanh^2(x_ij / cap)), the derivative of c_ij)
 *   dq_i = scale sum_j dx_ij k_j,  dk_j = scale sum_{h in group, i} dx_ij q_i,
 *   dv_j = sum_{h in group, i} p_ij z_ij / (1 - dropout) dout_i,  dbias_ij = ds_ij
 *
 * bias (fp32) and mask (bytes, nonzero = attend) are optional and read at
 * b * st[0] + h * st[1] + i * st[2] + j * st[3]: a stride of 0 broadcasts
 * that dimension (a key padding mask [B, Sk] is strides {Sk, 0, 0, 1}).
 *
 * Not here: head sizes that differ between k and v, attention sinks; those
 * stay with the caller's own attention.
 */
#ifndef SHARDFORMER_KERNELS_ATTENTION_H
#define SHARDFORMER_KERNELS_ATTENTION_H

#include "common.h"

typedef struct {
    sfk_dtype t;
    int64_t B, Hq, Hkv, Sq, Sk, D;
    float scale;
    int causal;
    int64_t window;          /* 0: none */
    const float *alibi;      /* [Hq] slopes, or NULL */
    const float *bias;       /* or NULL */
    int64_t bias_st[4];
    const uint8_t *mask;     /* or NULL */
    int64_t mask_st[4];
    float dropout;           /* in [0, 1] */
    uint64_t seed;
    float softcap;           /* 0: none; else finite > 0, the cap of c_ij */
    /* dropout coordinates: query row i of head (b, h) draws as row
     * (b Hq + h) drop_seq + qpos[i] and key j as column kpos[j]; NULL
     * positions: i and j; drop_seq 0: Sq.  Positions in [0, drop_seq). */
    const int64_t *qpos, *kpos;
    int64_t drop_seq;
} sfk_attn;

/* Parameters out of range (negative sizes or window, Hq not a multiple of
 * Hkv, dropout outside [0, 1], softcap negative or not finite, a dropout
 * position outside [0, drop_seq)) are EINVAL, sizes whose products overflow
 * int64 EOVERFLOW, each with a message naming the parameter. */
sf_status sfk_attention_forward(const sfk_attn *a, const void *q, const void *k, const void *v,
                                void *o, float *lse, sf_error *err);
/* dbias: NULL, or fp32 [B, Hq, Sq, Sk] receiving ds (the caller sums it over
 * the dimensions its bias broadcasts). */
sf_status sfk_attention_backward(const sfk_attn *a, const void *q, const void *k, const void *v,
                                 const void *o, const void *dout, const float *lse, void *dq,
                                 void *dk, void *dv, float *dbias, sf_error *err);
/* keep [B, Hq, Sq, Sk]: the dropout draws z_ij of (a->seed, a->dropout) at
 * the positions of a (qpos, kpos, drop_seq), for tests. */
sf_status sfk_attention_dropout_keep(const sfk_attn *a, uint8_t *keep, sf_error *err);

#endif
