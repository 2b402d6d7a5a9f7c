/*
 * embedding.c -- vocabulary-parallel embedding lookup and its scatter-add
 * (see embedding.h).  Forward copies rows (split over threads by ids);
 * backward runs on one thread, since two ids may hit the same row; grad
 * links each row's ids into a list first, then splits the rows over threads
 * (each row written by one thread only).
 */
#include "embedding.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    sfk_dtype t;
    const void *w;
    const int64_t *ids;
    void *out;
    int64_t d, real, vocab_start;
} emb_ctx;

/* id's row in this shard [vocab_start, vocab_start + real), -1 when another
 * shard's (vocab_start >= 0, so id - vocab_start cannot overflow once
 * id >= vocab_start). */
static int64_t local_row(int64_t id, int64_t vocab_start, int64_t real)
{
    return id >= vocab_start && id - vocab_start < real ? id - vocab_start : -1;
}

static void lookup_rows(void *arg, int64_t i0, int64_t i1, int tid)
{
    (void)tid;
    emb_ctx *c = arg;
    const size_t row = (size_t)c->d * (size_t)sfk_size(c->t);
    for (int64_t i = i0; i < i1; i++) {
        const int64_t k = local_row(c->ids[i], c->vocab_start, c->real);
        char *o = (char *)c->out + (size_t)i * row;
        if (k >= 0) memcpy(o, (const char *)c->w + (size_t)k * row, row);
        else memset(o, 0, row);
    }
}

/* Every id in [0, vocab): one min / max pass, then ERANGE (IndexError) naming
 * the id furthest outside, with the message HF models give. */
static sf_status check_ids(const char *fn, const int64_t *ids, int64_t count, int64_t vocab,
                           sf_error *err)
{
    if (count == 0)
        return SF_OK;
    int64_t lo = ids[0], hi = ids[0];
    for (int64_t i = 1; i < count; i++) {
        lo = ids[i] < lo ? ids[i] : lo;
        hi = ids[i] > hi ? ids[i] : hi;
    }
    if (lo >= 0 && hi < vocab)
        return SF_OK;
    return sf_fail(err, SF_ERANGE, "%s: index %lld is out of range for the vocabulary of %lld "
                   "(token ids must be in [0, %lld))", fn, (long long)(hi >= vocab ? hi : lo),
                   (long long)vocab, (long long)vocab);
}

sf_status sfk_embedding_forward(sfk_dtype t, const void *weight, int64_t d, int64_t real,
                                const int64_t *ids, int64_t count, int64_t vocab_start,
                                int64_t vocab, void *out, sf_error *err)
{
    static const char fn[] = "embedding_forward";
    const int64_t rows = d > 0 ? count : 0;
    sf_status rc;
    if ((rc = sfk_check_embedding_args(fn, t, d, real, count, vocab_start, ids, err)) ||
        (rc = sfk_check_ptr(fn, "out", out, rows, err)) ||
        (rc = sfk_check_ptr(fn, "weight", weight, rows > 0 ? real : 0, err)) ||
        (vocab >= 0 && (rc = check_ids(fn, ids, count, vocab, err))))
        return rc;
    if (rows == 0)
        return SF_OK;                          /* the output is empty */
    emb_ctx c = {t, weight, ids, out, d, real, vocab_start};
    sfk_parallel_rows(count, sfk_threads_for(count, d), lookup_rows, &c);
    return SF_OK;
}

sf_status sfk_embedding_backward(sfk_dtype t, const void *dout, const int64_t *ids, int64_t count,
                                 int64_t d, int64_t real, int64_t vocab_start,
                                 int64_t padding_local, float *dweight, sf_error *err)
{
    static const char fn[] = "embedding_backward";
    const int64_t rows = d > 0 ? count : 0;
    sf_status rc;
    size_t bytes;
    if ((rc = sfk_check_embedding_args(fn, t, d, real, count, vocab_start, ids, err)) ||
        (rc = sfk_check_ptr(fn, "dout", dout, rows, err)) ||
        (rc = sfk_check_ptr(fn, "dweight", dweight, rows > 0 ? real : 0, err)))
        return rc;
    if (rows == 0)
        return SF_OK;                          /* nothing to add */
    if ((rc = sfk_float_bytes(fn, "row", d, 1, &bytes, err)))
        return rc;
    float *buf = t == SFK_F32 ? NULL : malloc(bytes);
    if (t != SFK_F32 && !buf) return sfk_no_memory(fn, (double)bytes, err);
    for (int64_t i = 0; i < count; i++) {
        const int64_t k = local_row(ids[i], vocab_start, real);
        if (k < 0 || k == padding_local) continue;
        const float *g = sfk_row(t, dout, i, d, buf);
        float *w = dweight + (size_t)k * (size_t)d;
        for (int64_t j = 0; j < d; j++) w[j] += g[j];
    }
    free(buf);
    return SF_OK;
}

typedef struct {
    sfk_dtype t;
    const void *dout;
    const int64_t *head, *next;   /* row k's ids: head[k], next[head[k]], ... (-1 ends) */
    void *dw;
    float *scratch;                /* per thread: 2 d floats (the sum, a converted dout row) */
    int64_t d, real;
} grad_ctx;

static void write_grad_rows(void *arg, int64_t r0, int64_t r1, int tid)
{
    grad_ctx *c = arg;
    const size_t row = (size_t)c->d * (size_t)sfk_size(c->t);
    float *acc = c->scratch + (size_t)tid * 2 * (size_t)c->d, *buf = acc + c->d;
    for (int64_t k = r0; k < r1; k++) {
        char *o = (char *)c->dw + (size_t)k * row;
        int64_t i = k < c->real ? c->head[k] : -1;
        if (i < 0) {
            memset(o, 0, row);
            continue;
        }
        /* fp32 rows sum in place; 16-bit ones in acc, rounded once at the end */
        float *w = c->t == SFK_F32 ? (float *)o : acc;
        for (int64_t j = 0; j < c->d; j++) w[j] = 0.0f;
        for (; i >= 0; i = c->next[i]) {
            const float *g = sfk_row(c->t, c->dout, i, c->d, buf);
            for (int64_t j = 0; j < c->d; j++) w[j] += g[j];
        }
        if (c->t != SFK_F32) sfk_store(c->t, acc, c->d, o);
    }
}

sf_status sfk_embedding_grad(sfk_dtype t, const void *dout, const int64_t *ids, int64_t count,
                             int64_t d, int64_t rows, int64_t real, int64_t vocab_start,
                             int64_t padding_local, void *dweight, sf_error *err)
{
    static const char fn[] = "embedding_grad";
    sf_status rc;
    size_t links, sums;
    if ((rc = sfk_check_embedding_args(fn, t, d, real, count, vocab_start, ids, err)) ||
        (rc = sfk_check_size(fn, "rows", rows, err)) ||
        (rc = sfk_check_ptr(fn, "dout", dout, d > 0 ? count : 0, err)) ||
        (rc = sfk_check_ptr(fn, "dweight", dweight, d > 0 ? rows : 0, err)))
        return rc;
    if (real > rows)
        return sf_fail(err, SF_EINVAL, "%s: vocab_real=%lld is more than the %lld rows of dweight", fn,
                       (long long)real, (long long)rows);
    if (d == 0 || rows == 0)
        return SF_OK;                          /* nothing to write */
    const int nt = sfk_threads_for(rows, d);
    if ((rc = sfk_float_bytes(fn, "id links", real + count, 2, &links, err)) ||
        (rc = sfk_float_bytes(fn, "row sums", d, 2 * (int64_t)nt, &sums, err)))
        return rc;
    /* links: head[real] then next[count], int64 (2 floats' bytes each) */
    int64_t *head = malloc(links + sizeof(int64_t));   /* never malloc(0) */
    float *scratch = malloc(sums);
    if (!head || !scratch) {
        free(head);
        free(scratch);
        return sfk_no_memory(fn, (double)links + (double)sums, err);
    }
    int64_t *next = head + real;
    for (int64_t k = 0; k < real; k++) head[k] = -1;
    for (int64_t i = count - 1; i >= 0; i--) {   /* pushed in reverse: each list ascends */
        const int64_t k = local_row(ids[i], vocab_start, real);
        if (k < 0 || k == padding_local) continue;
        next[i] = head[k];
        head[k] = i;
    }
    grad_ctx c = {t, dout, head, next, dweight, scratch, d, real};
    sfk_parallel_rows(rows, nt, write_grad_rows, &c);
    free(head);
    free(scratch);
    return SF_OK;
}
