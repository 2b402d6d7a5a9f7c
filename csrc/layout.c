/*
 * layout.c -- which slice of a weight each rank owns, and the copy that cuts
 * it out.  Everything a sharded layer needs to know about its shape comes
 * from here, so the index math lives in exactly one place.
 *
 * Split specs (sf_spec) are here too: how a dimension cut by a spec -- plain
 * units, a padded vocabulary, attention heads, grouped q/k/v, fused segments
 * -- falls to each rank.
 *
 * Not here: anything Python.  The glue in module.c parses arguments, releases
 * the GIL and turns the error codes into exceptions.
 */
#include "layout.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "tensor_view.h"

#define FAIL(code, ...) return sf_fail(err, (code), __VA_ARGS__)

static sf_status check_group(int64_t parts, int64_t rank, sf_error *err)
{
    if (parts < 1)
        FAIL(SF_EINVAL, "tensor_parallel_size=%" PRId64 " must be >= 1", parts);
    if (rank < 0 || rank >= parts)
        FAIL(SF_EINVAL, "rank=%" PRId64 " outside [0, %" PRId64 ")", rank, parts);
    return SF_OK;
}

sf_status sf_split_units(int64_t units, int64_t parts, int64_t rank,
                         int64_t *start, int64_t *count, sf_error *err)
{
    sf_status rc = check_group(parts, rank, err);
    if (rc)
        return rc;
    if (units < 0)
        FAIL(SF_EINVAL, "cannot split %" PRId64 " units", units);
    int64_t base = units / parts, extra = units % parts;
    *count = base + (rank < extra ? 1 : 0);
    *start = rank * base + (rank < extra ? rank : extra);
    return SF_OK;
}

sf_status sf_heads_layout(int64_t num_heads, int64_t num_kv_heads, int64_t parts, int64_t rank,
                          int64_t *q_start, int64_t *q_count,
                          int64_t *kv_start, int64_t *kv_count, sf_error *err)
{
    sf_status rc = check_group(parts, rank, err);
    if (rc)
        return rc;
    if (num_heads < 1 || num_kv_heads < 1)
        FAIL(SF_EINVAL, "num_attention_heads=%" PRId64 " and num_key_value_heads=%" PRId64
             " must both be >= 1", num_heads, num_kv_heads);
    if (num_heads % num_kv_heads != 0)
        FAIL(SF_EINVAL, "num_attention_heads=%" PRId64 " is not a multiple of "
             "num_key_value_heads=%" PRId64, num_heads, num_kv_heads);
    int64_t group = num_heads / num_kv_heads;

    if (num_kv_heads >= parts) {
        rc = sf_split_units(num_kv_heads, parts, rank, kv_start, kv_count, err);
        if (rc)
            return rc;
        *q_start = *kv_start * group;
        *q_count = *kv_count * group;
        return SF_OK;
    }
    /* Fewer KV heads than ranks: replicate each KV head over `replicas` ranks. */
    if (parts % num_kv_heads != 0) {
        if (group == 1)
            FAIL(SF_EINVAL, "num_attention_heads=%" PRId64 " cannot be split over "
                 "tensor_parallel_size=%" PRId64 " (every rank needs at least one head)",
                 num_heads, parts);
        FAIL(SF_EINVAL, "num_key_value_heads=%" PRId64 " cannot be split over "
             "tensor_parallel_size=%" PRId64 " (fewer KV heads than ranks must divide "
             "the number of ranks, so that each KV head is replicated on the same "
             "number of ranks)", num_kv_heads, parts);
    }
    int64_t replicas = parts / num_kv_heads;
    if (group < replicas)
        FAIL(SF_EINVAL, "num_attention_heads=%" PRId64 " cannot be split over "
             "tensor_parallel_size=%" PRId64 " (every rank needs at least one head; "
             "num_key_value_heads=%" PRId64 ")", num_heads, parts, num_kv_heads);
    int64_t within_start = 0, within_count = 0;
    rc = sf_split_units(group, replicas, rank % replicas, &within_start, &within_count,
                        err);
    if (rc)
        return rc;
    *kv_start = rank / replicas;
    *kv_count = 1;
    *q_start = *kv_start * group + within_start;
    *q_count = within_count;
    return SF_OK;
}

sf_status sf_vocab_layout(int64_t vocab, int64_t parts, int64_t rank, int64_t multiple,
                          int64_t *padded, int64_t *start, int64_t *per_rank, int64_t *real,
                          sf_error *err)
{
    sf_status rc = check_group(parts, rank, err);
    if (rc)
        return rc;
    if (vocab < 1)
        FAIL(SF_EINVAL, "vocab_size=%" PRId64 " must be >= 1", vocab);
    if (multiple < 1)
        FAIL(SF_EINVAL, "make_vocab_size_divisible_by=%" PRId64 " must be >= 1", multiple);
    /* parts * multiple and the rounded-up vocabulary must fit in int64. */
    if (multiple > INT64_MAX / parts)
        FAIL(SF_EINVAL, "tensor_parallel_size=%" PRId64 " * make_vocab_size_divisible_by=%"
             PRId64 " overflows int64", parts, multiple);
    int64_t step = parts * multiple;
    if (vocab > INT64_MAX - (step - 1))
        FAIL(SF_EINVAL, "vocab_size=%" PRId64 " padded to a multiple of %" PRId64
             " overflows int64", vocab, step);
    *padded = (vocab + step - 1) / step * step;
    *per_rank = *padded / parts;
    *start = rank * *per_rank;
    int64_t end = *start + *per_rank;
    if (end > vocab)
        end = vocab;
    *real = end > *start ? end - *start : 0;
    return SF_OK;
}

/* ------------------------------------------------------------------------
 * Split specs: a dimension cut by a spec (layout.h), rank by rank
 * ---------------------------------------------------------------------- */

void sf_range_list_free(sf_range_list *l)
{
    free(l->v);
    l->v = NULL;
    l->n = l->cap = 0;
}

static sf_status push_range(sf_range_list *l, int64_t offset, int64_t length, sf_error *err)
{
    if (l->n == l->cap) {
        if (l->cap > INT64_MAX / 2 || (size_t)l->cap > SIZE_MAX / 2 / sizeof(sf_range))
            FAIL(SF_ENOMEM, "too many ranges");
        int64_t cap = l->cap ? 2 * l->cap : 8;
        sf_range *v = realloc(l->v, (size_t)cap * sizeof(sf_range));
        if (v == NULL)
            FAIL(SF_ENOMEM, "out of memory for %" PRId64 " ranges", cap);
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n].offset = offset;
    l->v[l->n].length = length;
    l->n++;
    return SF_OK;
}

static sf_status length_overflow(const sf_spec *s, sf_error *err)
{
    FAIL(SF_EOVERFLOW, "split spec %s: its length overflows int64", s->describe);
}

sf_status sf_spec_expected(const sf_spec *s, int64_t *out, sf_error *err)
{
    *out = -1;
    if (s->kind == SF_SPEC_HEADS || s->kind == SF_SPEC_GROUPED) {
        if (s->head_dim > 0) {
            int64_t units, kv2;
            if (s->kind == SF_SPEC_HEADS)
                units = s->part ? s->num_kv_heads : s->num_heads;
            else if (sf_mul_overflows(s->num_kv_heads, 2, &kv2) ||
                     __builtin_add_overflow(s->num_heads, kv2, &units))
                return length_overflow(s, err);
            if (sf_mul_overflows(units, s->head_dim, out))
                return length_overflow(s, err);
        }
        return SF_OK;
    }
    if (s->kind == SF_SPEC_FUSED) {
        int64_t sum = 0;
        for (int64_t i = 0; i < s->nsegments; i++) {
            int64_t e;
            sf_status rc = sf_spec_expected(&s->segments[i], &e, err);
            if (rc)
                return rc;
            if (e < 0)
                return SF_OK;
            if (__builtin_add_overflow(sum, e, &sum))
                return length_overflow(s, err);
        }
        *out = sum;
    }
    return SF_OK;
}

/* The ranks' query / KV heads of a grouped [q heads of group 0 | k | v | q heads
 * of group 1 | ...] layout, `width` indices per head. */
static sf_status grouped_rank(const sf_spec *s, int64_t full, int64_t base, int64_t parts,
                              int64_t rank, sf_range_list *out, int64_t *length, sf_error *err)
{
    int64_t n = s->num_heads, kv = s->num_kv_heads, qs, qc, ks, kc;
    if (n < 1 || kv < 1 || n % kv)
        FAIL(SF_EINVAL, "num_attention_heads=%" PRId64 " is not a positive multiple of "
             "num_kv_heads=%" PRId64, n, kv);
    int64_t rows, kv2; /* q heads + a k and a v head per group */
    if (sf_mul_overflows(kv, 2, &kv2) || __builtin_add_overflow(n, kv2, &rows))
        return length_overflow(s, err);
    if (full % rows)
        FAIL(SF_EINVAL, "length %" PRId64 " is not a multiple of the %" PRId64
             " grouped q/k/v heads", full, rows);
    int64_t width = full / rows, g = n / kv;
    sf_status rc = sf_heads_layout(n, kv, parts, rank, &qs, &qc, &ks, &kc, err);
    for (int64_t j = ks; rc == SF_OK && j < ks + kc; j++) {
        int64_t group = j * (g + 2) * width;
        int64_t first = qs > j * g ? qs : j * g;
        int64_t last = qs + qc < (j + 1) * g ? qs + qc : (j + 1) * g;
        if (last > first)
            rc = push_range(out, base + group + (first - j * g) * width, (last - first) * width,
                            err);
        if (rc == SF_OK)
            rc = push_range(out, base + group + g * width, 2 * width, err);
        *length += ((last > first ? last - first : 0) + 2) * width;
    }
    return rc;
}

/* The lengths of a fused spec's segments in a dimension of length `full`:
 * those the segments state, the rest sharing what is left equally. */
static sf_status fused_lengths(const sf_spec *s, int64_t full, int64_t *lens, sf_error *err)
{
    int64_t nseg = s->nsegments, unknown = 0, known_sum = 0;
    for (int64_t i = 0; i < nseg; i++) {
        sf_status rc = sf_spec_expected(&s->segments[i], &lens[i], err);
        if (rc)
            return rc;
        if (lens[i] < 0)
            unknown++;
        else if (__builtin_add_overflow(known_sum, lens[i], &known_sum))
            return length_overflow(s, err);
    }
    if (unknown == nseg) {
        if (full % nseg)
            FAIL(SF_EINVAL, "length %" PRId64 " is not divisible into %" PRId64
                 " fused segments", full, nseg);
        for (int64_t i = 0; i < nseg; i++)
            lens[i] = full / nseg;
    } else if (unknown > 0) {
        int64_t rest = full - known_sum;
        if (rest < 0 || rest % unknown)
            FAIL(SF_EINVAL, "length %" PRId64 " cannot hold the fused segments %s", full,
                 s->describe);
        for (int64_t i = 0; i < nseg; i++)
            if (lens[i] < 0)
                lens[i] = rest / unknown;
    }
    return SF_OK;
}

sf_status sf_spec_rank(const sf_spec *s, int64_t full, int64_t base, int64_t parts, int64_t rank,
                       sf_range_list *out, int64_t *length, sf_error *err)
{
    sf_status rc;
    switch (s->kind) {
    case SF_SPEC_SPLIT: {
        int64_t start, count;
        if (s->unit < 1 || full % s->unit)
            FAIL(SF_EINVAL, "length %" PRId64 " is not a multiple of the split unit %" PRId64,
                 full, s->unit);
        if ((rc = sf_split_units(full / s->unit, parts, rank, &start, &count, err)))
            return rc;
        *length += count * s->unit;
        return push_range(out, base + start * s->unit, count * s->unit, err);
    }
    case SF_SPEC_VOCAB: {
        int64_t padded, start, per_rank, real;
        if ((rc = sf_vocab_layout(full, parts, rank, s->unit, &padded, &start, &per_rank, &real,
                                  err)))
            return rc;
        *length += per_rank;
        return real ? push_range(out, base + start, real, err) : SF_OK;
    }
    case SF_SPEC_HEADS: {
        int64_t qs, qc, ks, kc, count = s->part ? s->num_kv_heads : s->num_heads;
        if (count < 1 || full % count)
            FAIL(SF_EINVAL, "length %" PRId64 " is not a multiple of the %" PRId64 " %s heads",
                 full, count, s->part ? "key/value" : "query");
        int64_t width = full / count;
        if ((rc = sf_heads_layout(s->num_heads, s->num_kv_heads, parts, rank, &qs, &qc, &ks, &kc,
                                  err)))
            return rc;
        int64_t start = s->part ? ks : qs, cnt = s->part ? kc : qc;
        *length += cnt * width;
        return push_range(out, base + start * width, cnt * width, err);
    }
    case SF_SPEC_GROUPED:
        return grouped_rank(s, full, base, parts, rank, out, length, err);
    case SF_SPEC_FUSED: {
        if (s->nsegments < 1 || (size_t)s->nsegments > SIZE_MAX / sizeof(int64_t))
            FAIL(SF_EINVAL, "split spec %s: a fused spec needs segments", s->describe);
        int64_t *lens = calloc((size_t)s->nsegments, sizeof(int64_t));
        if (lens == NULL)
            FAIL(SF_ENOMEM, "out of memory for %" PRId64 " fused segments", s->nsegments);
        rc = fused_lengths(s, full, lens, err);
        int64_t offset = base;
        for (int64_t i = 0; rc == SF_OK && i < s->nsegments; i++) {
            rc = sf_spec_rank(&s->segments[i], lens[i], offset, parts, rank, out, length, err);
            offset += lens[i];
        }
        free(lens);
        return rc;
    }
    }
    FAIL(SF_EINVAL, "split spec %s: unknown kind %d", s->describe, (int)s->kind);
}

/* Copy a box (all of shard's dims, with `dim` restricted to [s_off, s_off+len)
 * in the shard and [f_off, f_off+len) in the full tensor). */
static void copy_box(const sf_strided *full, const sf_strided *shard, int dim,
                     int64_t f_off, int64_t s_off, int64_t len, int itemsize, int to_full)
{
    int nd = full->ndim;
    int64_t idx[SF_MAX_DIMS] = {0};
    int64_t box[SF_MAX_DIMS];
    for (int d = 0; d < nd; d++)
        box[d] = d == dim ? len : shard->shape[d];
    for (int d = 0; d < nd; d++)
        if (box[d] == 0)
            return;
    int last = nd - 1;
    int inner_memcpy = full->strides[last] == 1 && shard->strides[last] == 1;
    for (;;) {
        /* Offsets of the row starting at idx (idx[last] == 0). */
        char *f = full->data, *s = shard->data;
        for (int d = 0; d < last; d++) {
            int64_t fi = idx[d] + (d == dim ? f_off : 0);
            int64_t si = idx[d] + (d == dim ? s_off : 0);
            f += fi * full->strides[d] * itemsize;
            s += si * shard->strides[d] * itemsize;
        }
        if (last == dim) {
            f += f_off * full->strides[last] * itemsize;
            s += s_off * shard->strides[last] * itemsize;
        }
        char *dst = to_full ? f : s;
        const char *src = to_full ? s : f;
        int64_t dst_stride = (to_full ? full->strides[last] : shard->strides[last]) * itemsize;
        int64_t src_stride = (to_full ? shard->strides[last] : full->strides[last]) * itemsize;
        /* memcpy: sf_copy_ranges hands us a source that shares no memory with
         * the destination (it stages one that does) */
        if (inner_memcpy) {
            memcpy(dst, src, (size_t)(box[last] * itemsize));
        } else {
            for (int64_t i = 0; i < box[last]; i++)
                memcpy(dst + i * dst_stride, src + i * src_stride, (size_t)itemsize);
        }
        /* Advance the multi-index over dims 0..last-1. */
        int d = last - 1;
        while (d >= 0) {
            if (++idx[d] < box[d])
                break;
            idx[d] = 0;
            d--;
        }
        if (d < 0)
            return;
    }
}

static void zero_box(const sf_strided *t, int dim, int64_t off, int64_t len, int itemsize)
{
    /* Zeroing is a copy from nothing: reuse copy_box's walk with a scratch
     * zero row would need a buffer; walk directly instead. */
    int nd = t->ndim;
    int64_t idx[SF_MAX_DIMS] = {0};
    int64_t box[SF_MAX_DIMS];
    for (int d = 0; d < nd; d++)
        box[d] = d == dim ? len : t->shape[d];
    for (int d = 0; d < nd; d++)
        if (box[d] == 0)
            return;
    for (;;) {
        char *p = t->data;
        for (int d = 0; d < nd; d++)
            p += (idx[d] + (d == dim ? off : 0)) * t->strides[d] * itemsize;
        memset(p, 0, (size_t)itemsize);
        int d = nd - 1;
        while (d >= 0) {
            if (++idx[d] < box[d])
                break;
            idx[d] = 0;
            d--;
        }
        if (d < 0)
            return;
    }
}

/* A compact row-major copy of `t` in *copy (malloc'ed; the caller frees it),
 * with its strides in `strides`.  EOVERFLOW / ENOMEM naming `name`. */
static sf_status stage(const sf_strided *t, int itemsize, const char *name, int64_t *strides,
                       void **copy, sf_error *err)
{
    int64_t numel = 1, bytes;
    for (int d = t->ndim - 1; d >= 0; d--) {
        strides[d] = numel;
        if (sf_mul_overflows(numel, t->shape[d], &numel))
            FAIL(SF_EOVERFLOW, "%s: its element count overflows int64", name);
    }
    if (sf_mul_overflows(numel, itemsize, &bytes) || (uint64_t)bytes > (uint64_t)SIZE_MAX)
        FAIL(SF_EOVERFLOW, "%s: %" PRId64 " elements of %d bytes overflow size_t", name, numel,
             itemsize);
    *copy = malloc(bytes > 0 ? (size_t)bytes : 1);
    if (*copy == NULL)
        FAIL(SF_ENOMEM, "%s shares memory with the destination and a copy of it (%" PRId64
             " bytes) could not be allocated", name, bytes);
    sf_strided to = {*copy, t->ndim, t->shape, strides};
    copy_box(t, &to, 0, 0, 0, t->shape[0], itemsize, 0);
    return SF_OK;
}

sf_status sf_copy_ranges(const sf_strided *full, const sf_strided *shard, int dim,
                         const sf_range *ranges, int n, int itemsize, int to_full,
                         sf_error *err)
{
    if (full->ndim != shard->ndim)
        FAIL(SF_EINVAL, "full tensor has %d dimensions but shard has %d",
             full->ndim, shard->ndim);
    if (full->ndim < 1 || full->ndim > SF_MAX_DIMS)
        FAIL(SF_EINVAL, "tensors must have 1 to %d dimensions, got %d", SF_MAX_DIMS, full->ndim);
    if (dim < 0 || dim >= full->ndim)
        FAIL(SF_EINVAL, "dim=%d outside [0, %d)", dim, full->ndim);
    for (int d = 0; d < full->ndim; d++)
        if (d != dim && full->shape[d] != shard->shape[d])
            FAIL(SF_EINVAL, "full and shard differ in dimension %d (%" PRId64 " vs %" PRId64 ")",
                 d, full->shape[d], shard->shape[d]);
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        const sf_range *r = &ranges[i];
        /* Written so that nothing overflows: offset + length may not fit. */
        if (r->offset < 0 || r->length < 0 || r->offset > full->shape[dim] ||
            r->length > full->shape[dim] - r->offset)
            FAIL(SF_ERANGE, "range %d (offset %" PRId64 ", length %" PRId64 ") outside "
                 "dimension %d of size %" PRId64, i, r->offset, r->length, dim,
                 full->shape[dim]);
        /* total <= shard->shape[dim] so far, so the subtraction cannot overflow. */
        if (r->length > shard->shape[dim] - total)
            FAIL(SF_ERANGE, "ranges cover more indices than the shard holds (%" PRId64
                 ") along dimension %d: range %d adds %" PRId64 " to the %" PRId64
                 " before it", shard->shape[dim], dim, i, r->length, total);
        total += r->length;
    }

    /* Where both lie: bounds every offset copy_box computes (no product below
     * can overflow once these fit), and says whether they share memory. */
    const sf_strided *dst = to_full ? full : shard, *src = to_full ? shard : full;
    const char *dst_name = to_full ? "full" : "shard", *src_name = to_full ? "shard" : "full";
    int64_t dlo, dhi, slo, shi;
    sf_status rc;
    if ((rc = sf_extent(dst->ndim, dst->shape, dst->strides, itemsize, dst_name, &dlo, &dhi, err)) ||
        (rc = sf_extent(src->ndim, src->shape, src->strides, itemsize, src_name, &slo, &shi, err)) ||
        (rc = sf_check_no_self_overlap(dst->ndim, dst->shape, dst->strides, dst_name, err)))
        return rc;
    /* A source sharing memory with the destination (copy_shard(x, x, ...), a
     * slice of it) is read from a copy taken first, so that every element is
     * read before anything is written: the result is that of separate tensors
     * whatever the ranges and strides. */
    sf_strided staged = *src;
    int64_t compact[SF_MAX_DIMS];
    void *copy = NULL;
    if (sf_bytes_intersect(dst->data, dlo, dhi, src->data, slo, shi)) {
        if ((rc = stage(src, itemsize, src_name, compact, &copy, err)))
            return rc;
        staged.data = copy;
        staged.strides = compact;
    }
    const sf_strided *f = to_full ? full : &staged, *s = to_full ? &staged : shard;
    int64_t s_off = 0;
    for (int i = 0; i < n; i++) {
        copy_box(f, s, dim, ranges[i].offset, s_off, ranges[i].length, itemsize, to_full);
        s_off += ranges[i].length;
    }
    if (!to_full && s_off < shard->shape[dim])
        zero_box(shard, dim, s_off, shard->shape[dim] - s_off, itemsize);
    free(copy);
    return SF_OK;
}
