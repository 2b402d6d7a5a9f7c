/*
 * layout_spec.c -- the split specs of shardformer.layout, resolved: the spec
 * data (tuples, below) read and cut into per-rank index ranges with the
 * arithmetic of layout.c.  Used by the planner (plan_shard requests, see
 * sharder_walk.c) and by Python directly (resolve_split, resolve_plan).
 *
 * Split spec data (shardformer.layout.SplitSpec.data), a tuple per spec:
 *   ("split",   describe, unit)
 *   ("vocab",   describe, multiple)
 *   ("fused",   describe, (segment spec, ...))
 *   ("heads",   describe, num_heads, num_kv_heads, head_dim or 0, part 0=q 1=kv)
 *   ("grouped", describe, num_heads, num_kv_heads, head_dim or 0)
 * A resolved layout is the tuple of shardformer.layout.DimShard's fields:
 *   (full, length, ranges, all_ranges, all_lengths, rank, tp_size, replicated)
 */
#include "sharder.h"
#include "sharder_internal.h"

#include <stdint.h>
#include <string.h>

#include "glue.h"
#include "layout.h"

typedef struct {
    sf_range *v;
    Py_ssize_t n, cap;
} range_list;

static int ranges_push(range_list *l, int64_t offset, int64_t length)
{
    if (l->n == l->cap) {
        /* cap * sizeof(sf_range) must fit in a Py_ssize_t (PyMem's limit). */
        if (l->cap > PY_SSIZE_T_MAX / 2 / (Py_ssize_t)sizeof(sf_range)) {
            PyErr_NoMemory();
            return -1;
        }
        Py_ssize_t cap = l->cap ? 2 * l->cap : 8;
        sf_range *v = PyMem_Realloc(l->v, (size_t)cap * sizeof(sf_range));
        if (v == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n].offset = offset;
    l->v[l->n].length = length;
    l->n++;
    return 0;
}

/* The kind of a spec tuple and its describe() string (both borrowed). */
static int spec_head(PyObject *spec, const char **kind, PyObject **describe, Py_ssize_t nfields)
{
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) < 2 ||
        !PyUnicode_Check(PyTuple_GET_ITEM(spec, 0))) {
        PyErr_Format(PyExc_TypeError, "split spec data: expected (kind, describe, ...), got %.100s",
                     Py_TYPE(spec)->tp_name);
        return -1;
    }
    *kind = PyUnicode_AsUTF8(PyTuple_GET_ITEM(spec, 0));
    if (*kind == NULL)
        return -1;
    *describe = PyTuple_GET_ITEM(spec, 1);
    if (nfields >= 0 && PyTuple_GET_SIZE(spec) != nfields) {
        PyErr_Format(PyExc_TypeError, "split spec data '%s': expected %zd fields, got %zd", *kind,
                     nfields, PyTuple_GET_SIZE(spec));
        return -1;
    }
    return 0;
}

static int spec_int(PyObject *spec, Py_ssize_t i, int64_t *out)
{
    long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(spec, i));
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = (int64_t)v;
    return 0;
}

static int layout_err(sf_status rc, const sf_error *err)
{
    return sf_set_pyerr(rc, err) ? -1 : 0;
}

static int spec_fields(PyObject *spec, const char *kind, Py_ssize_t n)
{
    if (PyTuple_GET_SIZE(spec) != n) {
        PyErr_Format(PyExc_TypeError, "split spec data '%s': expected %zd fields, got %zd", kind,
                     n, PyTuple_GET_SIZE(spec));
        return -1;
    }
    return 0;
}

/* The segments tuple of a 'fused' spec (borrowed), or NULL with an exception. */
static PyObject *fused_segments(PyObject *spec, const char *kind)
{
    if (spec_fields(spec, kind, 3) < 0)
        return NULL;
    PyObject *segs = PyTuple_GET_ITEM(spec, 2);
    if (!PyTuple_Check(segs) || PyTuple_GET_SIZE(segs) == 0) {
        PyErr_SetString(PyExc_TypeError, "split spec data 'fused': segments must be a non-empty tuple");
        return NULL;
    }
    return segs;
}

static int length_overflow(PyObject *describe)
{
    PyErr_Format(PyExc_OverflowError, "split spec %S: its length overflows int64", describe);
    return -1;
}

/* The full length a spec describes, or -1 when it does not say. */
static int spec_expected(PyObject *spec, int64_t *out)
{
    const char *kind;
    PyObject *describe;
    *out = -1;
    if (spec_head(spec, &kind, &describe, -1) < 0)
        return -1;
    if (strcmp(kind, "heads") == 0 || strcmp(kind, "grouped") == 0) {
        int heads = kind[0] == 'h';
        int64_t n, kv, hd, part = 0;
        if (spec_fields(spec, kind, heads ? 6 : 5) < 0 || spec_int(spec, 2, &n) < 0 ||
            spec_int(spec, 3, &kv) < 0 || spec_int(spec, 4, &hd) < 0 ||
            (heads && spec_int(spec, 5, &part) < 0))
            return -1;
        if (hd > 0) {
            int64_t units, kv2;
            if (heads)
                units = part ? kv : n;
            else if (sf_mul_overflows(kv, 2, &kv2) || __builtin_add_overflow(n, kv2, &units))
                return length_overflow(describe);
            if (sf_mul_overflows(units, hd, out))
                return length_overflow(describe);
        }
        return 0;
    }
    if (strcmp(kind, "fused") == 0) {
        PyObject *segs = fused_segments(spec, kind);
        if (segs == NULL)
            return -1;
        int64_t sum = 0;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(segs); i++) {
            int64_t e;
            if (spec_expected(PyTuple_GET_ITEM(segs, i), &e) < 0)
                return -1;
            if (e < 0)
                return 0;
            if (__builtin_add_overflow(sum, e, &sum))
                return length_overflow(describe);
        }
        *out = sum;
    }
    return 0;
}

/* Append the ranges that rank `r` of `tp` holds of a dimension of length
 * `full` cut by `spec` (offset by `base`) to *out; add its shard length. */
static int spec_rank(PyObject *spec, int64_t full, int64_t base, int64_t tp, int64_t r,
                     range_list *out, int64_t *length)
{
    const char *kind;
    PyObject *describe;
    sf_error err = {0};
    if (spec_head(spec, &kind, &describe, -1) < 0)
        return -1;
    if (strcmp(kind, "split") == 0) {
        int64_t unit, start, count;
        if (spec_fields(spec, kind, 3) < 0 || spec_int(spec, 2, &unit) < 0)
            return -1;
        if (unit < 1 || full % unit) {
            PyErr_Format(PyExc_ValueError, "length %lld is not a multiple of the split unit %lld",
                         (long long)full, (long long)unit);
            return -1;
        }
        if (layout_err(sf_split_units(full / unit, tp, r, &start, &count, &err), &err) < 0)
            return -1;
        *length += count * unit;
        return ranges_push(out, base + start * unit, count * unit);
    }
    if (strcmp(kind, "vocab") == 0) {
        int64_t multiple, padded, start, per_rank, real;
        if (spec_fields(spec, kind, 3) < 0 || spec_int(spec, 2, &multiple) < 0)
            return -1;
        if (layout_err(sf_vocab_layout(full, tp, r, multiple, &padded, &start, &per_rank, &real,
                                       &err), &err) < 0)
            return -1;
        *length += per_rank;
        return real ? ranges_push(out, base + start, real) : 0;
    }
    if (strcmp(kind, "heads") == 0) {
        int64_t n, kv, hd, part, qs, qc, ks, kc;
        if (spec_fields(spec, kind, 6) < 0 || spec_int(spec, 2, &n) < 0 ||
            spec_int(spec, 3, &kv) < 0 || spec_int(spec, 4, &hd) < 0 || spec_int(spec, 5, &part) < 0)
            return -1;
        int64_t count = part ? kv : n;
        if (count < 1 || full % count) {
            PyErr_Format(PyExc_ValueError, "length %lld is not a multiple of the %lld %s heads",
                         (long long)full, (long long)count, part ? "key/value" : "query");
            return -1;
        }
        int64_t width = full / count;
        if (layout_err(sf_heads_layout(n, kv, tp, r, &qs, &qc, &ks, &kc, &err), &err) < 0)
            return -1;
        int64_t start = part ? ks : qs, cnt = part ? kc : qc;
        *length += cnt * width;
        return ranges_push(out, base + start * width, cnt * width);
    }
    if (strcmp(kind, "grouped") == 0) {
        int64_t n, kv, hd, qs, qc, ks, kc;
        if (spec_fields(spec, kind, 5) < 0 || spec_int(spec, 2, &n) < 0 ||
            spec_int(spec, 3, &kv) < 0 || spec_int(spec, 4, &hd) < 0)
            return -1;
        if (n < 1 || kv < 1 || n % kv) {
            PyErr_Format(PyExc_ValueError,
                         "num_attention_heads=%lld is not a positive multiple of num_kv_heads=%lld",
                         (long long)n, (long long)kv);
            return -1;
        }
        int64_t rows, kv2; /* q heads + a k and a v head per group */
        if (sf_mul_overflows(kv, 2, &kv2) || __builtin_add_overflow(n, kv2, &rows))
            return length_overflow(describe);
        if (full % rows) {
            PyErr_Format(PyExc_ValueError,
                         "length %lld is not a multiple of the %lld grouped q/k/v heads",
                         (long long)full, (long long)rows);
            return -1;
        }
        int64_t width = full / rows, g = n / kv;
        if (layout_err(sf_heads_layout(n, kv, tp, r, &qs, &qc, &ks, &kc, &err), &err) < 0)
            return -1;
        for (int64_t j = ks; j < ks + kc; j++) {
            int64_t group = j * (g + 2) * width;
            int64_t first = qs > j * g ? qs : j * g;
            int64_t last = qs + qc < (j + 1) * g ? qs + qc : (j + 1) * g;
            if (last > first && ranges_push(out, base + group + (first - j * g) * width,
                                            (last - first) * width) < 0)
                return -1;
            if (ranges_push(out, base + group + g * width, 2 * width) < 0)
                return -1;
            *length += ((last > first ? last - first : 0) + 2) * width;
        }
        return 0;
    }
    if (strcmp(kind, "fused") == 0) {
        PyObject *segs = fused_segments(spec, kind);
        if (segs == NULL)
            return -1;
        Py_ssize_t nseg = PyTuple_GET_SIZE(segs), unknown = 0;
        int64_t known_sum = 0;
        int64_t *lens = PyMem_Calloc((size_t)nseg, sizeof(int64_t));
        if (lens == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        int rc = -1;
        for (Py_ssize_t i = 0; i < nseg; i++) {
            if (spec_expected(PyTuple_GET_ITEM(segs, i), &lens[i]) < 0)
                goto fused_done;
            if (lens[i] < 0)
                unknown++;
            else if (__builtin_add_overflow(known_sum, lens[i], &known_sum)) {
                length_overflow(describe);
                goto fused_done;
            }
        }
        if (unknown == nseg) {
            if (full % nseg) {
                PyErr_Format(PyExc_ValueError,
                             "length %lld is not divisible into %zd fused segments",
                             (long long)full, nseg);
                goto fused_done;
            }
            for (Py_ssize_t i = 0; i < nseg; i++)
                lens[i] = full / nseg;
        } else if (unknown > 0) {
            int64_t rest = full - known_sum;
            if (rest < 0 || rest % unknown) {
                PyErr_Format(PyExc_ValueError, "length %lld cannot hold the fused segments %S",
                             (long long)full, describe);
                goto fused_done;
            }
            for (Py_ssize_t i = 0; i < nseg; i++)
                if (lens[i] < 0)
                    lens[i] = rest / unknown;
        }
        int64_t offset = base;
        for (Py_ssize_t i = 0; i < nseg; i++) {
            if (spec_rank(PyTuple_GET_ITEM(segs, i), lens[i], offset, tp, r, out, length) < 0)
                goto fused_done;
            offset += lens[i];
        }
        rc = 0;
fused_done:
        PyMem_Free(lens);
        return rc;
    }
    PyErr_Format(PyExc_TypeError, "split spec data: unknown kind '%s'", kind);
    return -1;
}

static PyObject *ranges_tuple(const range_list *l)
{
    PyObject *t = PyTuple_New(l->n);
    if (t == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < l->n; i++) {
        PyObject *pair = Py_BuildValue("(LL)", (long long)l->v[i].offset,
                                       (long long)l->v[i].length);
        if (pair == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, pair);
    }
    return t;
}

/* The DimShard fields of `rank` for a dimension of length `full` cut by
 * `spec` over `tp` ranks; `what` names the dimension in the messages. */
static PyObject *resolve_split(PyObject *spec, int64_t full, int64_t tp, int64_t rank,
                               PyObject *what)
{
    sf_error err = {0};
    int64_t s, c;
    if (tp < 1 || rank < 0 || rank >= tp) { /* the layout's own message for a bad group */
        layout_err(sf_split_units(1, tp, rank, &s, &c, &err), &err);
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "rank=%lld outside [0, %lld)", (long long)rank,
                         (long long)tp);
        return NULL;
    }
    if (full < 0) {
        PyErr_Format(PyExc_ValueError, "%U=%lld: a length cannot be negative", what, (long long)full);
        return NULL;
    }
    int64_t expected;
    if (spec_expected(spec, &expected) < 0)
        return NULL;
    if (expected >= 0 && expected != full) {
        PyErr_Format(PyExc_ValueError, "%U=%lld does not match %S = %lld", what, (long long)full,
                     PyTuple_GET_ITEM(spec, 1), (long long)expected);
        return NULL;
    }
    PyObject *all_ranges = PyTuple_New((Py_ssize_t)tp);
    PyObject *all_lengths = PyTuple_New((Py_ssize_t)tp);
    PyObject *result = NULL;
    int64_t covered = 0, mine = 0;
    if (all_ranges == NULL || all_lengths == NULL)
        goto done;
    for (int64_t r = 0; r < tp; r++) {
        range_list l = {0};
        int64_t length = 0;
        int rc = spec_rank(spec, full, 0, tp, r, &l, &length);
        PyObject *rt = rc == 0 ? ranges_tuple(&l) : NULL;
        /* Only "covered > full" matters: stop adding once it holds (no overflow). */
        for (Py_ssize_t i = 0; i < l.n && covered <= full; i++)
            if (__builtin_add_overflow(covered, l.v[i].length, &covered))
                covered = INT64_MAX;
        PyMem_Free(l.v);
        PyObject *len = rt ? PyLong_FromLongLong(length) : NULL;
        if (len == NULL) {
            Py_XDECREF(rt);
            goto done;
        }
        PyTuple_SET_ITEM(all_ranges, (Py_ssize_t)r, rt);
        PyTuple_SET_ITEM(all_lengths, (Py_ssize_t)r, len);
        if (r == rank)
            mine = length;
    }
    result = Py_BuildValue("(LLOOOLLO)", (long long)full, (long long)mine,
                           PyTuple_GET_ITEM(all_ranges, (Py_ssize_t)rank), all_ranges, all_lengths,
                           (long long)rank, (long long)tp, covered > full ? Py_True : Py_False);
done:
    Py_XDECREF(all_ranges);
    Py_XDECREF(all_lengths);
    return result;
}

/* resolve_split(spec_data, full, tp_size, rank, what="dimension") -> DimShard fields */
PyObject *sf_resolve_split(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    static char *kwlist[] = {"spec", "full", "tp_size", "rank", "what", NULL};
    PyObject *spec, *what = NULL;
    long long full, tp, rank;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OLLL|U:resolve_split", kwlist, &spec, &full,
                                     &tp, &rank, &what))
        return NULL;
    PyObject *dflt = what ? NULL : PyUnicode_FromString("dimension");
    if (what == NULL && dflt == NULL)
        return NULL;
    PyObject *r = resolve_split(spec, full, tp, rank, what ? what : dflt);
    Py_XDECREF(dflt);
    return r;
}

/* Resolve a ShardPlan request in place: plan.requests {name: (spec_data,
 * full, what, no_replicate)} -> plan.resolved {name: DimShard fields}.
 * `no_replicate`, when not None, is the message of the ValueError raised
 * if the layout would hold some indices on several ranks. */
int sf_resolve_plan_into(PyObject *plan)
{
    PyObject *tp_obj = PyObject_GetAttrString(plan, "tp_size");
    PyObject *rank_obj = tp_obj ? PyObject_GetAttrString(plan, "rank") : NULL;
    PyObject *requests = rank_obj ? PyObject_GetAttrString(plan, "requests") : NULL;
    PyObject *resolved = NULL, *items = NULL;
    int rc = -1;
    if (requests == NULL)
        goto done;
    long long tp = PyLong_AsLongLong(tp_obj), rank = PyLong_AsLongLong(rank_obj);
    if (PyErr_Occurred())
        goto done;
    if (!PyDict_Check(requests)) {
        PyErr_Format(PyExc_TypeError, "ShardPlan.requests must be a dict, got %.100s",
                     Py_TYPE(requests)->tp_name);
        goto done;
    }
    resolved = PyDict_New();
    items = resolved ? PyDict_Items(requests) : NULL; /* a snapshot */
    if (items == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *name = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 0);
        PyObject *req = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 1);
        PyObject *spec, *what, *no_replicate;
        long long full;
        if (!PyTuple_Check(req) ||
            !PyArg_ParseTuple(req, "OLUO;ShardPlan request (spec_data, full, what, no_replicate)",
                              &spec, &full, &what, &no_replicate)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError,
                                "ShardPlan request must be (spec_data, full, what, no_replicate)");
            goto done;
        }
        PyObject *fields = resolve_split(spec, full, tp, rank, what);
        if (fields == NULL)
            goto done;
        if (no_replicate != Py_None && PyTuple_GET_ITEM(fields, 7) == Py_True) {
            Py_DECREF(fields);
            PyErr_Format(PyExc_ValueError, "%S", no_replicate);
            goto done;
        }
        int set = PyDict_SetItem(resolved, name, fields);
        Py_DECREF(fields);
        if (set < 0)
            goto done;
    }
    rc = PyObject_SetAttrString(plan, "resolved", resolved);
done:
    Py_XDECREF(items);
    Py_XDECREF(resolved);
    Py_XDECREF(requests);
    Py_XDECREF(rank_obj);
    Py_XDECREF(tp_obj);
    return rc;
}

/* resolve_plan(plan) -> plan, with plan.resolved set */
PyObject *sf_resolve_plan(PyObject *self, PyObject *plan)
{
    (void)self;
    if (sf_resolve_plan_into(plan) < 0)
        return NULL;
    return Py_NewRef(plan);
}
