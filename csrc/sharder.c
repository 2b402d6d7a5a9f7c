/*
 * sharder.c -- the ModelSharder engine: read a policy, walk a torch module
 * tree, match it against the policy, resolve every substitution and its
 * shard layouts, and apply them.
 *
 * Two passes, so that a bad policy, a model that cannot be split or a
 * replacement that fails to build never leaves the model half-sharded:
 *
 *   plan   reads and validates the policy (the one place that checks its
 *          shape), walks the tree (iteratively, each module once), matches
 *          modules to policy keys (class object, class __qualname__, or
 *          "module.qualname" for remote-code classes), resolves attribute
 *          paths and sub-module suffixes (dotted, with '*' over the children
 *          of a container) and per-rank attribute values, and asks each
 *          replacement class what it splits (`plan_shard`, plain Python
 *          checks that return a ShardPlan request: split specs as data and
 *          the lengths they cut).  The layout arithmetic of every request
 *          runs here, in C, straight from the spec data (resolve_plan):
 *          planning never calls back from Python into C.  Nothing is
 *          modified.  Any error is re-raised as "<Model>: <path>: <what>".
 *
 *   apply  first builds what every op needs without touching the model
 *          (`from_native_module(native, group, plan=...)` for each sub-module
 *          swap, or `prepare_native_module` for a change made in place; bound
 *          methods), then makes the changes in plan order -- attributes,
 *          parameter callables, swaps (setattr on the parent), methods --
 *          journaled, and undoes them all if one fails.  The journal lets go
 *          of the replaced modules (and their full weights) at the end.
 *
 * KeyboardInterrupt, SystemExit, GeneratorExit, MemoryError and
 * RecursionError are never re-raised with context: they come out as raised
 * (see passes_through).
 *
 * The policy is {key: ModulePolicyDescription} (read here by attribute), or
 * the same in plain tuples (the engine's own form, used by tests):
 *   entries: {key: (attrs, params, subs, methods)}
 *     attrs   ((dotted_name, value), ...)
 *     params  (callable(module), ...)
 *     subs    ((suffix, target, kwargs_dict, ignore_if_not_exist), ...)
 *     methods ((name, function), ...)
 * A plan is a list of op tuples, see the OP_* tags below.
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

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "glue.h"
#include "layout.h"

static const char OP_ATTR[] = "attr";     /* (tag, path, owner, name, value) */
static const char OP_PARAM[] = "param";   /* (tag, path, module, fn) */
static const char OP_SUB[] = "sub";       /* (tag, path, parent, name, target, native, kwargs, plan) */
static const char OP_METHOD[] = "method"; /* (tag, path, module, name, fn) */

typedef struct {
    PyObject *model_name; /* str */
    PyObject *entries;    /* dict of validated tuple entries */
    PyObject *tp_size;    /* int */
    PyObject *rank;       /* int */
    PyObject *ops;        /* list being built */
    PyObject *replaced;   /* {(id(parent), name): (target, kwargs, path)} already planned */
    Py_ssize_t matched;
} plan_ctx;

/* ------------------------------------------------------------------------
 * Layout arithmetic of split specs (the data of shardformer.layout)
 * ---------------------------------------------------------------------- */

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
static int resolve_plan(PyObject *plan)
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
    if (resolve_plan(plan) < 0)
        return NULL;
    return Py_NewRef(plan);
}

/* Exceptions that reach the caller exactly as raised (same type, same
 * object), never wrapped with context: the interrupts (KeyboardInterrupt,
 * SystemExit, GeneratorExit: BaseException but not Exception), which a
 * caller must be able to catch as such, and the interpreter's resource
 * errors (MemoryError, RecursionError), whose type is what a caller acts on
 * and whose handling should not allocate a new message. */
static int passes_through(PyObject *type)
{
    if (type == NULL)
        return 0;
    return !PyErr_GivenExceptionMatches(type, PyExc_Exception) ||
           PyErr_GivenExceptionMatches(type, PyExc_MemoryError) ||
           PyErr_GivenExceptionMatches(type, PyExc_RecursionError);
}

/* 1 when the pending exception is one of those (see passes_through). */
static int pending_passes_through(void)
{
    return passes_through(PyErr_Occurred());
}

/* Re-raise the current exception as "<model>: <path>: <message>", keeping
 * ValueError / TypeError, and chaining the original as __cause__.  The
 * exceptions of passes_through are left pending unchanged. */
static void raise_in_context(const plan_ctx *ctx, PyObject *path)
{
    if (pending_passes_through())
        return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *new_type = PyExc_ValueError;
    if (type && PyType_IsSubtype((PyTypeObject *)type, (PyTypeObject *)PyExc_TypeError))
        new_type = PyExc_TypeError;
    PyObject *msg = value ? PyObject_Str(value) : NULL;
    if (msg == NULL) {
        if (pending_passes_through()) { /* str() itself was interrupted: that wins */
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            return;
        }
        PyErr_Clear();
        msg = PyUnicode_FromString("unknown error");
    }
    PyErr_Format(new_type, "%U: %U: %U", ctx->model_name, path, msg);
    Py_XDECREF(msg);
    PyObject *t2, *v2, *tb2;
    PyErr_Fetch(&t2, &v2, &tb2);
    PyErr_NormalizeException(&t2, &v2, &tb2);
    if (value && v2) {
        if (tb)
            PyException_SetTraceback(value, tb);
        PyException_SetCause(v2, value); /* steals value */
        value = NULL;
    }
    PyErr_Restore(t2, v2, tb2);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

/* 1 if obj has the attribute, 0 if not, -1 with an exception on other errors. */
static int has_attr(PyObject *obj, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v != NULL) {
        Py_DECREF(v);
        return 1;
    }
    if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

static int has_attr_str(PyObject *obj, const char *name)
{
    PyObject *n = PyUnicode_FromString(name);
    if (n == NULL)
        return -1;
    int rc = has_attr(obj, n);
    Py_DECREF(n);
    return rc;
}

static PyObject *join_path(PyObject *prefix, PyObject *name)
{
    if (PyUnicode_GetLength(prefix) == 0) {
        Py_INCREF(name);
        return name;
    }
    return PyUnicode_FromFormat("%U.%U", prefix, name);
}

/* The child modules dict of a torch.nn.Module (new reference), or NULL with
 * TypeError if `module` is not a module. */
static PyObject *children_of(PyObject *module)
{
    PyObject *children = PyObject_GetAttrString(module, "_modules");
    if (children == NULL && !PyErr_ExceptionMatches(PyExc_AttributeError))
        return NULL; /* an error of the object's own __getattr__: not ours to rename */
    if (children == NULL || !PyDict_Check(children)) {
        Py_XDECREF(children);
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "expected a torch.nn.Module, got %.100s",
                     Py_TYPE(module)->tp_name);
        return NULL;
    }
    return children;
}

/* Look up the policy entry of `module` by class, qualname, then module.qualname. */
static PyObject *entry_for(PyObject *entries, PyObject *module)
{
    PyObject *cls = (PyObject *)Py_TYPE(module);
    PyObject *entry = PyDict_GetItemWithError(entries, cls);
    if (entry || PyErr_Occurred())
        return entry;
    PyObject *qualname = PyObject_GetAttrString(cls, "__qualname__");
    if (qualname == NULL)
        return NULL;
    entry = PyDict_GetItemWithError(entries, qualname);
    if (entry == NULL && !PyErr_Occurred()) {
        PyObject *modname = PyObject_GetAttrString(cls, "__module__");
        if (modname == NULL) {
            Py_DECREF(qualname);
            return NULL;
        }
        PyObject *full = PyUnicode_FromFormat("%S.%U", modname, qualname);
        Py_DECREF(modname);
        if (full == NULL) {
            Py_DECREF(qualname);
            return NULL;
        }
        entry = PyDict_GetItemWithError(entries, full);
        Py_DECREF(full);
    }
    Py_DECREF(qualname);
    return entry; /* borrowed */
}

/* PyArg_ParseTuple raises SystemError on a non-tuple; policy data comes from
 * Python, so say TypeError instead. */
static int check_tuple(PyObject *obj, const char *what)
{
    if (PyTuple_Check(obj))
        return 0;
    PyErr_Format(PyExc_TypeError, "%s: expected a tuple, got %.100s", what,
                 Py_TYPE(obj)->tp_name);
    return -1;
}

static int add_op(plan_ctx *ctx, PyObject *op)
{
    if (op == NULL)
        return -1;
    int rc = PyList_Append(ctx->ops, op);
    Py_DECREF(op);
    return rc;
}

/* ------------------------------------------------------------------------
 * Reading the policy: the one place its shape is checked
 * ---------------------------------------------------------------------- */

/* getattr(obj, name), with None for a missing attribute or a None value
 * replaced by `dflt` (new reference). */
static PyObject *attr_or(PyObject *obj, const char *name, PyObject *dflt)
{
    PyObject *v = PyObject_GetAttrString(obj, name);
    if (v == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return NULL;
        PyErr_Clear();
    }
    if (v == NULL || v == Py_None) {
        Py_XDECREF(v);
        return Py_NewRef(dflt);
    }
    return v;
}

/* A {name: value} mapping as ((str(name), value), ...). */
static PyObject *pairs_of(PyObject *mapping, const char *what, PyObject *model, PyObject *key)
{
    if (!PyDict_Check(mapping)) {
        PyErr_Format(PyExc_TypeError, "%U: policy[%R].%s must be a dict, got %.100s", model, key,
                     what, Py_TYPE(mapping)->tp_name);
        return NULL;
    }
    PyObject *out = PyTuple_New(PyDict_GET_SIZE(mapping));
    Py_ssize_t pos = 0, i = 0;
    PyObject *k, *v;
    while (out && PyDict_Next(mapping, &pos, &k, &v)) {
        PyObject *name = PyObject_Str(k);
        PyObject *pair = name ? PyTuple_Pack(2, name, v) : NULL;
        Py_XDECREF(name);
        if (pair == NULL)
            Py_CLEAR(out);
        else
            PyTuple_SET_ITEM(out, i++, pair);
    }
    return out;
}

/* One sub_module_replacement item as (suffix, target, kwargs, ignore). */
static PyObject *sub_item(PyObject *item, PyObject *model, PyObject *key)
{
    if (PyTuple_Check(item)) { /* the engine's tuple form: shape only */
        PyObject *suffix, *target, *kwargs;
        int ignore;
        if (!PyArg_ParseTuple(item, "UOO!p;sub_module_replacement item", &suffix, &target,
                              &PyDict_Type, &kwargs, &ignore))
            return NULL;
        return Py_NewRef(item);
    }
    PyObject *target = PyObject_GetAttrString(item, "target_module");
    if (target == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return NULL;
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "%U: policy[%R].sub_module_replacement items must be "
                     "SubModuleReplacementDescription, got %.100s",
                     model, key, Py_TYPE(item)->tp_name);
        return NULL;
    }
    PyObject *empty = PyDict_New();
    PyObject *suffix = PyObject_GetAttrString(item, "suffix");
    PyObject *kwargs = suffix && empty ? attr_or(item, "kwargs", empty) : NULL;
    PyObject *ignore = kwargs ? attr_or(item, "ignore_if_not_exist", Py_False) : NULL;
    PyObject *result = NULL, *copy = NULL;
    int has, flag;
    if (ignore == NULL)
        goto done;
    if (!PyUnicode_Check(suffix)) {
        PyErr_Format(PyExc_TypeError, "%U: policy[%R]: sub_module_replacement suffix must be a str, "
                     "got %.100s", model, key, Py_TYPE(suffix)->tp_name);
        goto done;
    }
    if ((has = has_attr_str(target, "from_native_module")) <= 0) {
        if (has == 0)
            PyErr_Format(PyExc_TypeError, "%U: policy[%R]: target_module %R for '%U' has no "
                         "from_native_module", model, key, target, suffix);
        goto done;
    }
    if (!PyDict_Check(kwargs)) {
        PyErr_Format(PyExc_TypeError, "%U: policy[%R]: kwargs for '%U' must be a dict, got %.100s",
                     model, key, suffix, Py_TYPE(kwargs)->tp_name);
        goto done;
    }
    if ((flag = PyObject_IsTrue(ignore)) < 0 || (copy = PyDict_Copy(kwargs)) == NULL)
        goto done;
    result = Py_BuildValue("(OOOO)", suffix, target, copy, flag ? Py_True : Py_False);
done:
    Py_XDECREF(copy);
    Py_XDECREF(ignore);
    Py_XDECREF(kwargs);
    Py_XDECREF(suffix);
    Py_XDECREF(empty);
    Py_DECREF(target);
    return result;
}

/* A ModulePolicyDescription (or a tuple entry) as a checked
 * (attrs, params, subs, methods) tuple. */
static PyObject *read_entry(PyObject *desc, PyObject *model, PyObject *key)
{
    PyObject *attrs = NULL, *params = NULL, *subs_in = NULL, *methods = NULL;
    PyObject *subs = NULL, *result = NULL;
    if (PyTuple_Check(desc)) {
        if (!PyArg_ParseTuple(desc, "O!O!O!O!;policy entry", &PyTuple_Type, &attrs, &PyTuple_Type,
                              &params, &PyTuple_Type, &subs_in, &PyTuple_Type, &methods))
            return NULL;
        Py_INCREF(attrs);
        Py_INCREF(params);
        Py_INCREF(subs_in);
        Py_INCREF(methods);
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(attrs); i++) {
            PyObject *dotted, *value, *item = PyTuple_GET_ITEM(attrs, i);
            if (check_tuple(item, "attribute_replacement item") < 0 ||
                !PyArg_ParseTuple(item, "UO;attribute_replacement item", &dotted, &value))
                goto done;
        }
    } else {
        PyObject *none = Py_None;
        subs_in = PyObject_GetAttrString(desc, "sub_module_replacement");
        if (subs_in == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                return NULL;
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%U: policy entry for %R must be a "
                         "ModulePolicyDescription, got %.100s", model, key, Py_TYPE(desc)->tp_name);
            return NULL;
        }
        PyObject *empty_t = PyTuple_New(0), *empty_d = PyDict_New(), *raw;
        if (empty_t == NULL || empty_d == NULL) {
            Py_XDECREF(empty_t);
            Py_XDECREF(empty_d);
            goto done;
        }
        if (subs_in == none)
            Py_SETREF(subs_in, Py_NewRef(empty_t));
        if ((raw = attr_or(desc, "attribute_replacement", empty_d)) != NULL) {
            attrs = pairs_of(raw, "attribute_replacement", model, key);
            Py_DECREF(raw);
        }
        if (attrs && (raw = attr_or(desc, "param_replacement", empty_t)) != NULL) {
            params = PySequence_Tuple(raw);
            Py_DECREF(raw);
        }
        if (params && (raw = attr_or(desc, "method_replacement", empty_d)) != NULL) {
            methods = pairs_of(raw, "method_replacement", model, key);
            Py_DECREF(raw);
        }
        Py_DECREF(empty_t);
        Py_DECREF(empty_d);
        if (methods == NULL)
            goto done;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(methods); i++) {
        PyObject *name, *fn, *item = PyTuple_GET_ITEM(methods, i);
        if (check_tuple(item, "method_replacement item") < 0 ||
            !PyArg_ParseTuple(item, "UO;method_replacement item", &name, &fn))
            goto done;
        if (!PyCallable_Check(fn)) {
            PyErr_Format(PyExc_TypeError, "%U: policy[%R]: method_replacement '%U' is not callable",
                         model, key, name);
            goto done;
        }
    }
    PyObject *seq = PySequence_Tuple(subs_in);
    subs = seq ? PyTuple_New(PyTuple_GET_SIZE(seq)) : NULL;
    for (Py_ssize_t i = 0; subs && i < PyTuple_GET_SIZE(seq); i++) {
        PyObject *item = sub_item(PyTuple_GET_ITEM(seq, i), model, key);
        if (item == NULL)
            Py_CLEAR(subs);
        else
            PyTuple_SET_ITEM(subs, i, item);
    }
    Py_XDECREF(seq);
    if (subs == NULL)
        goto done;
    result = PyTuple_Pack(4, attrs, params, subs, methods);
done:
    Py_XDECREF(attrs);
    Py_XDECREF(params);
    Py_XDECREF(subs_in);
    Py_XDECREF(subs);
    Py_XDECREF(methods);
    return result;
}

/* The policy as {key: checked tuple entry}: a new dict, so that planning
 * (which runs Python code) cannot change it under us. */
static PyObject *read_policy(PyObject *model, PyObject *policy)
{
    if (!PyDict_Check(policy)) {
        PyErr_Format(PyExc_TypeError, "%U: module_policy() must return a dict, got %.100s", model,
                     Py_TYPE(policy)->tp_name);
        return NULL;
    }
    PyObject *items = PyDict_Items(policy);
    PyObject *out = items ? PyDict_New() : NULL;
    for (Py_ssize_t i = 0; out && i < PyList_GET_SIZE(items); i++) {
        PyObject *key = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 0);
        PyObject *desc = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 1);
        if (!PyType_Check(key) && !PyUnicode_Check(key)) {
            PyErr_Format(PyExc_TypeError, "%U: policy key %R must be a module class or a class name",
                         model, key);
            Py_CLEAR(out);
            break;
        }
        PyObject *entry = read_entry(desc, model, key);
        if (entry == NULL || PyDict_SetItem(out, key, entry) < 0)
            Py_CLEAR(out);
        Py_XDECREF(entry);
    }
    Py_XDECREF(items);
    return out;
}

/* ------------------------------------------------------------------------
 * Planning
 * ---------------------------------------------------------------------- */

/* A per-rank attribute value.  Head counts (shardformer.layout.Heads.local_*,
 * which carry `__shardformer_heads__` = (num_heads, num_kv_heads, which,
 * factor), which 0 = query heads, 1 = KV heads, 2 = query heads per KV head)
 * are computed here by the layout arithmetic; any other PerRank is the
 * policy's own function, called with (tp_size, rank). */
static PyObject *per_rank_value(plan_ctx *ctx, PyObject *value)
{
    PyObject *data = PyObject_GetAttrString(value, "__shardformer_heads__");
    if (data == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return NULL;
        PyErr_Clear();
        return PyObject_CallMethod(value, "resolve", "OO", ctx->tp_size, ctx->rank);
    }
    long long n, kv, which, factor;
    int ok = PyTuple_Check(data) &&
             PyArg_ParseTuple(data, "LLLL;__shardformer_heads__", &n, &kv, &which, &factor);
    Py_DECREF(data);
    if (!ok) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "__shardformer_heads__ must be a tuple of 4 ints");
        return NULL;
    }
    long long tp = PyLong_AsLongLong(ctx->tp_size), rank = PyLong_AsLongLong(ctx->rank);
    if (PyErr_Occurred())
        return NULL;
    int64_t qs, qc, ks, kc;
    sf_error err = {0};
    if (sf_set_pyerr(sf_heads_layout(n, kv, tp, rank, &qs, &qc, &ks, &kc, &err), &err))
        return NULL;
    int64_t count = which == 0 ? qc : which == 1 ? kc : kc > 0 ? qc / kc : 0, local;
    if (sf_mul_overflows(count, factor, &local)) {
        PyErr_Format(PyExc_OverflowError, "__shardformer_heads__: %lld heads * factor %lld "
                     "overflows int64", (long long)count, factor);
        return NULL;
    }
    return PyLong_FromLongLong((long long)local);
}

/* Resolve a dotted attribute path relative to `module`: the owner of the last
 * component (new reference) and that component (borrowed from `parts`). */
static int plan_attribute(plan_ctx *ctx, PyObject *module, PyObject *mpath,
                          PyObject *dotted, PyObject *value)
{
    PyObject *path = join_path(mpath, dotted);
    if (path == NULL)
        return -1;
    PyObject *dot = PyUnicode_FromString(".");
    PyObject *parts = dot ? PyUnicode_Split(dotted, dot, -1) : NULL;
    Py_XDECREF(dot);
    int rc = -1;
    PyObject *owner = module, *resolved = NULL;
    Py_INCREF(owner);
    if (parts == NULL)
        goto done;
    Py_ssize_t n = PyList_GET_SIZE(parts);
    for (Py_ssize_t i = 0; i < n - 1; i++) {
        PyObject *next = PyObject_GetAttr(owner, PyList_GET_ITEM(parts, i));
        if (next == NULL)
            goto fail_ctx;
        Py_SETREF(owner, next);
    }
    PyObject *name = PyList_GET_ITEM(parts, n - 1);
    int exists = has_attr(owner, name);
    if (exists <= 0) {
        if (exists == 0)
            PyErr_Format(PyExc_ValueError,
                         "attribute_replacement names attribute '%U', which %.100s does not have",
                         name, Py_TYPE(owner)->tp_name);
        goto fail_ctx;
    }
    /* Per-rank values resolve now, so that their checks run before anything
     * changes. */
    int per_rank = has_attr_str(value, "__shardformer_per_rank__");
    if (per_rank < 0)
        goto fail_ctx;
    resolved = per_rank ? per_rank_value(ctx, value) : Py_NewRef(value);
    if (resolved == NULL)
        goto fail_ctx;
    rc = add_op(ctx, Py_BuildValue("(sOOOO)", OP_ATTR, path, owner, name, resolved));
    goto done;
fail_ctx:
    raise_in_context(ctx, path);
done:
    Py_XDECREF(resolved);
    Py_XDECREF(parts);
    Py_DECREF(owner);
    Py_DECREF(path);
    return rc;
}

/* Plan one sub-module swap: the target's plan_shard (Python checks that
 * return what to split, as data), then, for a ShardPlan request, its layout
 * arithmetic here. */
static int plan_submodule(plan_ctx *ctx, PyObject *parent, PyObject *name, PyObject *child,
                          PyObject *path, PyObject *target, PyObject *kwargs)
{
    /* The same slot reached again: by the same policy entry through a
     * parent shared by several paths (another path, same target and kwargs:
     * one module, planned once, its one replacement serves every path), or
     * by two entries that overlap. */
    PyObject *slot = Py_BuildValue("(nO)", (Py_ssize_t)(uintptr_t)parent, name);
    if (slot == NULL)
        return -1;
    PyObject *earlier = PyDict_GetItemWithError(ctx->replaced, slot); /* borrowed */
    if (earlier != NULL || PyErr_Occurred()) {
        Py_DECREF(slot);
        if (earlier == NULL)
            return -1;
        int other_path = PyUnicode_Compare(PyTuple_GET_ITEM(earlier, 2), path);
        if (other_path == -1 && PyErr_Occurred())
            return -1;
        if (other_path != 0 && PyTuple_GET_ITEM(earlier, 0) == target &&
            PyTuple_GET_ITEM(earlier, 1) == kwargs)
            return 0;
        PyErr_Format(PyExc_ValueError, "%U: %U: replaced by two policy entries",
                     ctx->model_name, path);
        return -1;
    }
    PyObject *what = PyTuple_Pack(3, target, kwargs, path);
    int added = what ? PyDict_SetItem(ctx->replaced, slot, what) : -1;
    Py_XDECREF(what);
    Py_DECREF(slot);
    if (added < 0)
        return -1;

    PyObject *plan = Py_NewRef(Py_None);
    int has_plan = has_attr_str(target, "plan_shard");
    if (has_plan < 0)
        goto fail;
    if (has_plan) {
        PyObject *method = PyObject_GetAttrString(target, "plan_shard");
        PyObject *args = method ? Py_BuildValue("(OOO)", child, ctx->tp_size, ctx->rank) : NULL;
        PyObject *result = args ? PyObject_Call(method, args, kwargs) : NULL;
        Py_XDECREF(method);
        Py_XDECREF(args);
        if (result == NULL)
            goto fail;
        Py_SETREF(plan, result);
        int request = has_attr_str(plan, "__shardformer_plan__");
        if (request < 0 || (request && resolve_plan(plan) < 0))
            goto fail;
    }
    int rc = add_op(ctx, Py_BuildValue("(sOOOOOOO)", OP_SUB, path, parent, name, target,
                                       child, kwargs, plan));
    Py_DECREF(plan);
    return rc;
fail:
    Py_DECREF(plan);
    raise_in_context(ctx, path);
    return -1;
}

/* Resolve suffix components parts[i:] below `module` (reached by `mpath`). */
static int resolve_suffix(plan_ctx *ctx, PyObject *module, PyObject *mpath, PyObject *parts,
                          Py_ssize_t i, PyObject *target, PyObject *kwargs, int ignore_missing,
                          PyObject *suffix)
{
    Py_ssize_t n = PyList_GET_SIZE(parts);
    PyObject *comp = PyList_GET_ITEM(parts, i);
    PyObject *children = children_of(module);
    if (children == NULL) {
        raise_in_context(ctx, mpath);
        return -1;
    }
    int rc = 0;
    int star = PyUnicode_CompareWithASCIIString(comp, "*") == 0;
    if (star) {
        /* Snapshot the items: the dict must not change under us. */
        PyObject *items = PyDict_Items(children);
        if (items == NULL) {
            Py_DECREF(children);
            return -1;
        }
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(items) && rc == 0; k++) {
            PyObject *kv = PyList_GET_ITEM(items, k);
            PyObject *cname = PyTuple_GET_ITEM(kv, 0), *child = PyTuple_GET_ITEM(kv, 1);
            if (child == Py_None)
                continue;
            PyObject *cpath = join_path(mpath, cname);
            if (cpath == NULL) {
                rc = -1;
                break;
            }
            if (i == n - 1)
                rc = plan_submodule(ctx, module, cname, child, cpath, target, kwargs);
            else
                rc = resolve_suffix(ctx, child, cpath, parts, i + 1, target, kwargs,
                                    ignore_missing, suffix);
            Py_DECREF(cpath);
        }
        Py_DECREF(items);
        Py_DECREF(children);
        return rc;
    }

    PyObject *child = PyDict_GetItemWithError(children, comp);
    if (child == NULL || child == Py_None) {
        Py_DECREF(children);
        if (PyErr_Occurred())
            return -1;
        if (ignore_missing)
            return 0;
        PyObject *cpath = join_path(mpath, comp);
        if (cpath == NULL)
            return -1;
        PyErr_Format(PyExc_ValueError,
                     "%U: %U: no sub-module '%U' (policy suffix '%U'); set "
                     "ignore_if_not_exist=True if it is optional",
                     ctx->model_name, cpath, comp, suffix);
        Py_DECREF(cpath);
        return -1;
    }
    Py_INCREF(child);
    Py_DECREF(children);
    PyObject *cpath = join_path(mpath, comp);
    if (cpath == NULL) {
        Py_DECREF(child);
        return -1;
    }
    if (i == n - 1)
        rc = plan_submodule(ctx, module, comp, child, cpath, target, kwargs);
    else
        rc = resolve_suffix(ctx, child, cpath, parts, i + 1, target, kwargs, ignore_missing,
                            suffix);
    Py_DECREF(cpath);
    Py_DECREF(child);
    return rc;
}

/* Plan the (checked, see read_entry) policy entry of one matched module. */
static int plan_module(plan_ctx *ctx, PyObject *module, PyObject *mpath, PyObject *entry)
{
    PyObject *attrs = PyTuple_GET_ITEM(entry, 0), *params = PyTuple_GET_ITEM(entry, 1);
    PyObject *subs = PyTuple_GET_ITEM(entry, 2), *methods = PyTuple_GET_ITEM(entry, 3);
    PyObject *shown = PyUnicode_GetLength(mpath) ? mpath : NULL;
    PyObject *root_name = NULL;
    if (shown == NULL) {
        root_name = PyUnicode_FromString("<root>");
        if (root_name == NULL)
            return -1;
        shown = root_name;
    }
    int rc = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(attrs) && rc == 0; i++) {
        PyObject *item = PyTuple_GET_ITEM(attrs, i);
        rc = plan_attribute(ctx, module, mpath, PyTuple_GET_ITEM(item, 0), PyTuple_GET_ITEM(item, 1));
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(params) && rc == 0; i++)
        rc = add_op(ctx, Py_BuildValue("(sOOO)", OP_PARAM, shown, module,
                                       PyTuple_GET_ITEM(params, i)));
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(subs) && rc == 0; i++) {
        PyObject *item = PyTuple_GET_ITEM(subs, i);
        PyObject *suffix = PyTuple_GET_ITEM(item, 0);
        int ignore_missing = PyObject_IsTrue(PyTuple_GET_ITEM(item, 3));
        PyObject *dot = PyUnicode_FromString(".");
        PyObject *parts = dot ? PyUnicode_Split(suffix, dot, -1) : NULL;
        Py_XDECREF(dot);
        if (parts == NULL || ignore_missing < 0) {
            Py_XDECREF(parts);
            rc = -1;
            break;
        }
        rc = resolve_suffix(ctx, module, mpath, parts, 0, PyTuple_GET_ITEM(item, 1),
                            PyTuple_GET_ITEM(item, 2), ignore_missing, suffix);
        Py_DECREF(parts);
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(methods) && rc == 0; i++) {
        PyObject *item = PyTuple_GET_ITEM(methods, i);
        rc = add_op(ctx, Py_BuildValue("(sOOOO)", OP_METHOD, shown, module,
                                       PyTuple_GET_ITEM(item, 0), PyTuple_GET_ITEM(item, 1)));
    }
    Py_XDECREF(root_name);
    return rc;
}

/* sharder_plan(root, model_name, policy, tp_size, rank) -> (ops, matched) */
PyObject *sf_sharder_plan(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    static char *kwlist[] = {"root", "model_name", "policy", "tp_size", "rank", NULL};
    PyObject *root, *policy;
    plan_ctx ctx = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OUOO!O!:sharder_plan", kwlist, &root,
                                     &ctx.model_name, &policy, &PyLong_Type, &ctx.tp_size,
                                     &PyLong_Type, &ctx.rank))
        return NULL;
    ctx.entries = read_policy(ctx.model_name, policy);
    if (ctx.entries == NULL)
        return NULL;
    ctx.ops = PyList_New(0);
    ctx.replaced = PyDict_New();
    PyObject *visited = PySet_New(NULL);
    PyObject *stack = PyList_New(0);
    PyObject *empty = PyUnicode_FromString("");
    PyObject *result = NULL;
    if (!ctx.ops || !ctx.replaced || !visited || !stack || !empty)
        goto done;

    /* Iterative pre-order walk; a module reachable by several paths (shared
     * layers) is planned once, under the first path. */
    PyObject *first = PyTuple_Pack(2, root, empty);
    if (first == NULL || PyList_Append(stack, first) < 0) {
        Py_XDECREF(first);
        goto done;
    }
    Py_DECREF(first);
    while (PyList_GET_SIZE(stack) > 0) {
        Py_ssize_t top = PyList_GET_SIZE(stack) - 1;
        PyObject *item = PyList_GET_ITEM(stack, top);
        Py_INCREF(item);
        if (PyList_SetSlice(stack, top, top + 1, NULL) < 0) {
            Py_DECREF(item);
            goto done;
        }
        PyObject *module = PyTuple_GET_ITEM(item, 0), *mpath = PyTuple_GET_ITEM(item, 1);
        PyObject *key = PyLong_FromVoidPtr(module);
        int seen = key ? PySet_Contains(visited, key) : -1;
        if (seen == 0)
            seen = PySet_Add(visited, key) < 0 ? -1 : 0;
        Py_XDECREF(key);
        if (seen != 0) {
            Py_DECREF(item);
            if (seen < 0)
                goto done;
            continue;
        }
        PyObject *entry = entry_for(ctx.entries, module);
        if (entry == NULL && PyErr_Occurred()) {
            Py_DECREF(item);
            goto done;
        }
        if (entry != NULL) {
            /* ctx.entries is our own dict, but keep the entry alive anyway
             * while planning runs Python code (plan_shard, PerRank). */
            Py_INCREF(entry);
            ctx.matched++;
            int rc = plan_module(&ctx, module, mpath, entry);
            Py_DECREF(entry);
            if (rc < 0) {
                Py_DECREF(item);
                goto done;
            }
        }
        PyObject *children = children_of(module);
        if (children == NULL) {
            raise_in_context(&ctx, mpath);
            Py_DECREF(item);
            goto done;
        }
        /* Push in reverse so that children are visited in definition order. */
        PyObject *items = PyDict_Items(children);
        Py_DECREF(children);
        if (items == NULL) {
            Py_DECREF(item);
            goto done;
        }
        for (Py_ssize_t k = PyList_GET_SIZE(items) - 1; k >= 0; k--) {
            PyObject *kv = PyList_GET_ITEM(items, k);
            PyObject *child = PyTuple_GET_ITEM(kv, 1);
            if (child == Py_None)
                continue;
            PyObject *cpath = join_path(mpath, PyTuple_GET_ITEM(kv, 0));
            PyObject *pair = cpath ? PyTuple_Pack(2, child, cpath) : NULL;
            Py_XDECREF(cpath);
            if (pair == NULL || PyList_Append(stack, pair) < 0) {
                Py_XDECREF(pair);
                Py_DECREF(items);
                Py_DECREF(item);
                goto done;
            }
            Py_DECREF(pair);
        }
        Py_DECREF(items);
        Py_DECREF(item);
    }
    result = Py_BuildValue("(On)", ctx.ops, ctx.matched);
done:
    Py_XDECREF(ctx.entries);
    Py_XDECREF(ctx.ops);
    Py_XDECREF(ctx.replaced);
    Py_XDECREF(visited);
    Py_XDECREF(stack);
    Py_XDECREF(empty);
    return result;
}

/* ------------------------------------------------------------------------
 * Applying: build every replacement, then swap them all in
 *
 * Phase 1 (build) runs the code that can fail -- from_native_module, the
 * adopt callback, prepare_native_module -- and changes nothing in the model.
 * Phase 2 (swap) sets attributes, sub-modules and bound methods and commits
 * prepared in-place changes, recording how to undo each in the journal.  A
 * failure anywhere undoes the journal in reverse, so the model is as it was.
 *
 * Journal entries (tuples):
 *   ("attr",   path, owner, name, old, delete)  undo: setattr(owner, name, old),
 *                                              or delattr when `delete`
 *   ("change", path, change)                   undo: change.rollback()
 *   ("param",  path)                           a param_replacement callable
 *                                              ran: cannot be undone
 *   ("inplace", path)                          from_native_module returned the
 *                                              native module itself, changed
 *                                              in place: cannot be undone
 * ---------------------------------------------------------------------- */

static const char J_ATTR[] = "attr";
static const char J_CHANGE[] = "change";
static const char J_PARAM[] = "param";
static const char J_INPLACE[] = "inplace";

static int journal_add(PyObject *journal, PyObject *entry)
{
    if (entry == NULL)
        return -1;
    int rc = PyList_Append(journal, entry);
    Py_DECREF(entry);
    return rc;
}

/* 1 if `name` is in obj.__dict__ (an instance attribute), 0 if not or if obj
 * has no __dict__, -1 with an exception. */
static int in_own_dict(PyObject *obj, PyObject *name)
{
    PyObject *d = PyObject_GetAttrString(obj, "__dict__");
    if (d == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    int rc = PySequence_Contains(d, name);
    Py_DECREF(d);
    return rc;
}

/* setattr(owner, name, value), journaled: afterwards an undo restores the old
 * value, or deletes the attribute when it did not exist or the set created an
 * instance attribute over a class one (a bound method over the class's). */
static int journaled_setattr(PyObject *journal, PyObject *path, PyObject *owner, PyObject *name,
                             PyObject *value)
{
    if (!PyUnicode_Check(name)) {
        PyErr_Format(PyExc_TypeError, "attribute name must be a str, not %.100s",
                     Py_TYPE(name)->tp_name);
        return -1;
    }
    int had_own = in_own_dict(owner, name);
    if (had_own < 0)
        return -1;
    PyObject *old = PyObject_GetAttr(owner, name);
    if (old == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
    }
    if (PyObject_SetAttr(owner, name, value) < 0) {
        Py_XDECREF(old);
        return -1;
    }
    int own_now = in_own_dict(owner, name);
    int delete = old == NULL || (!had_own && own_now > 0);
    PyObject *entry = own_now < 0 ? NULL
                                  : Py_BuildValue("(sOOOOO)", J_ATTR, path, owner, name,
                                                  old ? old : Py_None,
                                                  delete ? Py_True : Py_False);
    int rc = entry ? journal_add(journal, entry) : -1; /* journal_add releases entry */
    if (rc < 0) { /* not recorded: undo it now, so that the rollback leaves nothing behind */
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        if ((delete ? PyObject_DelAttr(owner, name) : PyObject_SetAttr(owner, name, old)) < 0)
            PyErr_Clear();
        PyErr_Restore(t, v, tb);
    }
    Py_XDECREF(old);
    return rc;
}

/* Undo one reversible journal entry: 0, 1 when it cannot be undone
 * (irreversible kinds), -1 with an exception. */
static int undo_entry(PyObject *entry)
{
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) < 2 ||
        !PyUnicode_Check(PyTuple_GET_ITEM(entry, 0)))
        return 1;
    PyObject *kind = PyTuple_GET_ITEM(entry, 0);
    if (PyUnicode_CompareWithASCIIString(kind, J_ATTR) == 0 && PyTuple_GET_SIZE(entry) == 6) {
        PyObject *owner = PyTuple_GET_ITEM(entry, 2), *name = PyTuple_GET_ITEM(entry, 3);
        if (PyTuple_GET_ITEM(entry, 5) == Py_True)
            return PyObject_DelAttr(owner, name);
        return PyObject_SetAttr(owner, name, PyTuple_GET_ITEM(entry, 4));
    }
    if (PyUnicode_CompareWithASCIIString(kind, J_CHANGE) == 0 && PyTuple_GET_SIZE(entry) == 3) {
        PyObject *r = PyObject_CallMethod(PyTuple_GET_ITEM(entry, 2), "rollback", NULL);
        Py_XDECREF(r);
        return r ? 0 : -1;
    }
    return 1;
}

/* Undo the journal in reverse order, removing every entry undone; what is
 * left could not be undone.  The pending exception (the failure that called
 * for the rollback) is kept, unless an undo step is interrupted
 * (passes_through): that exception is raised instead, after the rollback. */
static void rollback(PyObject *journal)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *it = NULL, *iv = NULL, *itb = NULL; /* an interrupt during the rollback */
    for (Py_ssize_t k = PyList_GET_SIZE(journal) - 1; k >= 0; k--) {
        if (k >= PyList_GET_SIZE(journal)) /* an undo step shrank the list */
            continue;
        PyObject *entry = Py_NewRef(PyList_GET_ITEM(journal, k));
        int rc = undo_entry(entry);
        Py_DECREF(entry);
        if (rc == 0) {
            if (PyList_SetSlice(journal, k, k + 1, NULL) < 0)
                rc = -1;
            else
                continue;
        }
        if (rc < 0) {
            if (it == NULL && pending_passes_through())
                PyErr_Fetch(&it, &iv, &itb);
            else
                PyErr_Clear(); /* the entry stays: the caller sees it was not undone */
        }
    }
    if (it != NULL) {
        PyErr_NormalizeException(&it, &iv, &itb);
        if (iv != NULL && value != NULL) {
            PyErr_NormalizeException(&type, &value, &tb);
            PyException_SetContext(iv, Py_NewRef(value)); /* steals the new reference */
        }
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        PyErr_Restore(it, iv, itb);
        return;
    }
    PyErr_Restore(type, value, tb);
}

/* The op tuple's tag, checked against its length; NULL with TypeError for a
 * malformed op. */
static const char *op_tag(PyObject *op)
{
    if (!PyTuple_Check(op) || PyTuple_GET_SIZE(op) < 2) {
        PyErr_SetString(PyExc_TypeError, "sharder_apply: malformed plan op");
        return NULL;
    }
    if (!PyUnicode_Check(PyTuple_GET_ITEM(op, 0))) {
        PyErr_SetString(PyExc_TypeError, "sharder_apply: malformed plan op (tag is not a str)");
        return NULL;
    }
    const char *tag = PyUnicode_AsUTF8(PyTuple_GET_ITEM(op, 0));
    if (tag == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(op);
    if ((strcmp(tag, OP_ATTR) == 0 && n == 5) || (strcmp(tag, OP_PARAM) == 0 && n == 4) ||
        (strcmp(tag, OP_SUB) == 0 && n == 8) || (strcmp(tag, OP_METHOD) == 0 && n == 5))
        return tag;
    PyErr_Format(PyExc_TypeError, "sharder_apply: unknown plan op '%s'", tag);
    return NULL;
}

/* Phase 1 for a sub-module op: the prepared in-place change
 * ("change", path, change) when the target has prepare_native_module, else
 * the built replacement ("sub", path, parent, name, replacement). */
static PyObject *build_sub(PyObject *op, PyObject *process_group, PyObject *adopt,
                           PyObject *journal)
{
    PyObject *path = PyTuple_GET_ITEM(op, 1), *parent = PyTuple_GET_ITEM(op, 2);
    PyObject *name = PyTuple_GET_ITEM(op, 3), *target = PyTuple_GET_ITEM(op, 4);
    PyObject *native = PyTuple_GET_ITEM(op, 5), *plan = PyTuple_GET_ITEM(op, 7);
    if (!PyDict_Check(PyTuple_GET_ITEM(op, 6))) {
        PyErr_SetString(PyExc_TypeError, "sharder_apply: malformed plan op (kwargs is not "
                        "a dict)");
        return NULL;
    }
    PyObject *kwargs = PyDict_Copy(PyTuple_GET_ITEM(op, 6));
    if (kwargs == NULL)
        return NULL;
    if (plan != Py_None && PyDict_SetItemString(kwargs, "plan", plan) < 0) {
        Py_DECREF(kwargs);
        return NULL;
    }
    PyObject *result = NULL;
    int in_place = has_attr_str(target, "prepare_native_module");
    PyObject *factory = in_place < 0 ? NULL
                        : PyObject_GetAttrString(target, in_place ? "prepare_native_module"
                                                                  : "from_native_module");
    PyObject *args = factory ? PyTuple_Pack(2, native, process_group) : NULL;
    PyObject *built = args ? PyObject_Call(factory, args, kwargs) : NULL;
    Py_XDECREF(factory);
    Py_XDECREF(args);
    Py_DECREF(kwargs);
    if (built == NULL)
        return NULL;
    if (in_place) {
        int ok = has_attr_str(built, "commit");
        if (ok > 0)
            ok = has_attr_str(built, "rollback");
        if (ok == 0)
            PyErr_Format(PyExc_TypeError, "%.100s.prepare_native_module must return an object "
                         "with commit() and rollback(), got %.100s",
                         PyType_Check(target) ? ((PyTypeObject *)target)->tp_name : "target",
                         Py_TYPE(built)->tp_name);
        /* The module stays the same object: adopt sees it on both sides. */
        PyObject *r = ok > 0 && adopt != Py_None
                          ? PyObject_CallFunctionObjArgs(adopt, path, native, native, NULL)
                          : (ok > 0 ? Py_NewRef(Py_None) : NULL);
        if (r != NULL) {
            Py_DECREF(r);
            result = PyTuple_Pack(3, PyTuple_GET_ITEM(op, 0), path, built);
        }
        Py_DECREF(built);
        return result;
    }
    if (built == native &&
        journal_add(journal, Py_BuildValue("(sO)", J_INPLACE, path)) < 0) {
        Py_DECREF(built);
        return NULL;
    }
    /* adopt(path, native, replacement): the replacement takes over what the
     * native module carried at run time (training flag, hooks, frozen
     * parameters) before it enters the tree. */
    if (adopt != Py_None) {
        PyObject *r = PyObject_CallFunctionObjArgs(adopt, path, native, built, NULL);
        if (r == NULL) {
            Py_DECREF(built);
            return NULL;
        }
        Py_DECREF(r);
    }
    result = PyTuple_Pack(5, PyTuple_GET_ITEM(op, 0), path, parent, name, built);
    Py_DECREF(built);
    return result;
}

/* Phase 1 for one op: what phase 2 will do, built without touching the
 * model (new reference, or NULL with an exception). */
static PyObject *build_op(PyObject *op, PyObject *process_group, PyObject *adopt,
                          PyObject *journal)
{
    const char *tag = op_tag(op);
    if (tag == NULL)
        return NULL;
    if (strcmp(tag, OP_SUB) == 0)
        return build_sub(op, process_group, adopt, journal);
    if (strcmp(tag, OP_METHOD) == 0) {
        /* shardformer.pickling.bind: a bound method that pickles as (function, module) */
        PyObject *pickling = PyImport_ImportModule("shardformer.pickling");
        PyObject *bound = pickling ? PyObject_CallMethod(pickling, "bind", "OO", PyTuple_GET_ITEM(op, 4),
                                                         PyTuple_GET_ITEM(op, 2)) : NULL;
        Py_XDECREF(pickling);
        if (bound == NULL)
            return NULL;
        PyObject *r = PyTuple_Pack(5, PyTuple_GET_ITEM(op, 0), PyTuple_GET_ITEM(op, 1),
                                   PyTuple_GET_ITEM(op, 2), PyTuple_GET_ITEM(op, 3), bound);
        Py_DECREF(bound);
        return r;
    }
    if (strcmp(tag, OP_PARAM) == 0 && !PyCallable_Check(PyTuple_GET_ITEM(op, 3))) {
        PyErr_Format(PyExc_TypeError, "param_replacement %R is not callable",
                     PyTuple_GET_ITEM(op, 3));
        return NULL;
    }
    return Py_NewRef(op); /* attr (owner, name, value) and param (module, fn) as planned */
}

/* Phase 2 for one built op: make the change, journaled. */
static int commit_op(PyObject *built, PyObject *journal)
{
    const char *tag = PyUnicode_AsUTF8(PyTuple_GET_ITEM(built, 0));
    PyObject *path = PyTuple_GET_ITEM(built, 1);
    if (tag == NULL)
        return -1;
    if (strcmp(tag, OP_PARAM) == 0) {
        /* Recorded first: a callable that fails may have changed the module. */
        if (journal_add(journal, Py_BuildValue("(sO)", J_PARAM, path)) < 0)
            return -1;
        PyObject *r = PyObject_CallOneArg(PyTuple_GET_ITEM(built, 3), PyTuple_GET_ITEM(built, 2));
        Py_XDECREF(r);
        return r ? 0 : -1;
    }
    if (strcmp(tag, OP_SUB) == 0 && PyTuple_GET_SIZE(built) == 3) {
        /* Recorded first: rollback() undoes a commit that failed halfway too. */
        PyObject *change = PyTuple_GET_ITEM(built, 2);
        if (journal_add(journal, Py_BuildValue("(sOO)", J_CHANGE, path, change)) < 0)
            return -1;
        PyObject *r = PyObject_CallMethod(change, "commit", NULL);
        Py_XDECREF(r);
        return r ? 0 : -1;
    }
    /* attr (tag, path, owner, name, value), sub (tag, path, parent, name,
     * replacement), method (tag, path, module, name, bound): one setattr. */
    return journaled_setattr(journal, path, PyTuple_GET_ITEM(built, 2), PyTuple_GET_ITEM(built, 3),
                             PyTuple_GET_ITEM(built, 4));
}

/* The paths of the journal's entries (what stays changed), as "a, b, ...". */
static PyObject *journal_paths(PyObject *journal)
{
    PyObject *paths = PyList_New(0);
    for (Py_ssize_t k = 0; paths && k < PyList_GET_SIZE(journal); k++) {
        PyObject *e = PyList_GET_ITEM(journal, k);
        PyObject *p = PyTuple_Check(e) && PyTuple_GET_SIZE(e) > 1 ? PyTuple_GET_ITEM(e, 1) : e;
        PyObject *text = PyObject_Str(p);
        if (text == NULL || PyList_Append(paths, text) < 0)
            Py_CLEAR(paths);
        Py_XDECREF(text);
    }
    if (paths == NULL)
        return NULL;
    PyObject *sep = PyUnicode_FromString(", ");
    PyObject *joined = sep ? PyUnicode_Join(sep, paths) : NULL;
    Py_XDECREF(sep);
    Py_DECREF(paths);
    return joined;
}

/* The failure of op `i` (of n): roll the journal back; then, unless the
 * exception passes through unchanged, raise RuntimeError naming the op and
 * whether the model is as it was, chaining the original as __cause__. */
static void apply_failed(PyObject *op, Py_ssize_t i, Py_ssize_t n, PyObject *journal)
{
    rollback(journal);
    if (pending_passes_through())
        return;
    PyObject *path = PyTuple_Check(op) && PyTuple_GET_SIZE(op) > 1 ? PyTuple_GET_ITEM(op, 1)
                                                                   : Py_None;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *left = PyList_GET_SIZE(journal) ? journal_paths(journal) : NULL;
    if (PyList_GET_SIZE(journal) && left == NULL)
        PyErr_Clear();
    if (left != NULL || PyList_GET_SIZE(journal))
        PyErr_Format(PyExc_RuntimeError,
                     "applying the shard plan failed at %S (op %zd of %zd): %S; the model is "
                     "partially sharded (changes that cannot be undone: %S) and must be rebuilt",
                     path, i + 1, n, value ? value : Py_None, left ? left : Py_None);
    else
        PyErr_Format(PyExc_RuntimeError,
                     "applying the shard plan failed at %S (op %zd of %zd): %S; every change "
                     "was undone, the model is as it was",
                     path, i + 1, n, value ? value : Py_None);
    Py_XDECREF(left);
    if (value != NULL) {
        PyObject *t2, *v2, *tb2;
        PyErr_Fetch(&t2, &v2, &tb2);
        PyErr_NormalizeException(&t2, &v2, &tb2);
        if (v2 != NULL)
            PyException_SetCause(v2, Py_NewRef(value)); /* steals the new reference */
        PyErr_Restore(t2, v2, tb2);
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

/* sharder_apply(ops, process_group, adopt=None, journal=None, built=None) -> number of ops applied.
 *
 * Phase 1 builds every replacement (the model untouched); phase 2 swaps them
 * in, consuming the plan list (each op dropped as it is committed).  On any
 * failure every change is undone and the exception raised (RuntimeError
 * naming the op, or the original one when it passes through unchanged, see
 * passes_through).  `adopt`, when not None, is called as adopt(path,
 * native, replacement) for every sub-module replacement, in phase 1.
 * `built`, when not None, is called as built(ops, builds) once phase 1 is
 * done, before anything is swapped in: `builds` is the list of what phase 2
 * will commit, one entry per op (("sub", path, parent, name, replacement),
 * ("sub", path, change) for a change in place, or the op itself), which the
 * callback may edit in place (the sharder's tie binding); an exception it
 * raises comes out as raised, after the rollback.
 * `journal`, when a list, receives the record of the changes: after a
 * failure it holds those that could not be undone (empty: the model is as it
 * was); after success it is emptied (the replaced modules are let go). */
PyObject *sf_sharder_apply(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    static char *kwlist[] = {"ops", "process_group", "adopt", "journal", "built", NULL};
    PyObject *ops, *process_group, *adopt = Py_None, *journal = Py_None, *on_built = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O|OOO:sharder_apply", kwlist, &PyList_Type,
                                     &ops, &process_group, &adopt, &journal, &on_built))
        return NULL;
    if (adopt != Py_None && !PyCallable_Check(adopt)) {
        PyErr_Format(PyExc_TypeError, "sharder_apply: adopt must be callable or None, got %s",
                     Py_TYPE(adopt)->tp_name);
        return NULL;
    }
    if (on_built != Py_None && !PyCallable_Check(on_built)) {
        PyErr_Format(PyExc_TypeError, "sharder_apply: built must be callable or None, got %s",
                     Py_TYPE(on_built)->tp_name);
        return NULL;
    }
    if (journal != Py_None && !PyList_Check(journal)) {
        PyErr_Format(PyExc_TypeError, "sharder_apply: journal must be a list or None, got %s",
                     Py_TYPE(journal)->tp_name);
        return NULL;
    }
    journal = journal == Py_None ? PyList_New(0) : Py_NewRef(journal);
    PyObject *built = journal ? PyList_New(0) : NULL;
    PyObject *result = NULL;
    if (built == NULL)
        goto done;
    Py_ssize_t n = PyList_GET_SIZE(ops);
    /* Sizes are re-read every step: an op runs Python code that could
     * change the list (n only feeds the messages). */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ops); i++) {
        PyObject *op = Py_NewRef(PyList_GET_ITEM(ops, i));
        PyObject *b = build_op(op, process_group, adopt, journal);
        if (b == NULL || PyList_Append(built, b) < 0) {
            Py_XDECREF(b);
            apply_failed(op, i, n, journal);
            Py_DECREF(op);
            goto done;
        }
        Py_DECREF(b);
        Py_DECREF(op);
    }
    if (on_built != Py_None) {
        PyObject *r = PyObject_CallFunctionObjArgs(on_built, ops, built, NULL);
        if (r == NULL) {
            rollback(journal); /* the callback's exception comes out as raised */
            goto done;
        }
        Py_DECREF(r);
        if (PyList_GET_SIZE(built) != PyList_GET_SIZE(ops)) {
            PyErr_SetString(PyExc_RuntimeError, "sharder_apply: the built callback changed the "
                            "number of builds");
            rollback(journal);
            goto done;
        }
    }
    Py_ssize_t i;
    for (i = 0; i < PyList_GET_SIZE(ops) && i < PyList_GET_SIZE(built); i++) {
        PyObject *op = Py_NewRef(PyList_GET_ITEM(ops, i));
        PyObject *b = Py_NewRef(PyList_GET_ITEM(built, i));
        /* consume both: the op's and the build's references go with the commit */
        int rc = PyList_SetItem(ops, i, Py_NewRef(Py_None));
        if (rc == 0)
            rc = PyList_SetItem(built, i, Py_NewRef(Py_None));
        if (rc == 0)
            rc = commit_op(b, journal);
        Py_DECREF(b);
        if (rc < 0) {
            apply_failed(op, i, n, journal);
            Py_DECREF(op);
            goto done;
        }
        Py_DECREF(op);
    }
    if (PyList_SetSlice(journal, 0, PyList_GET_SIZE(journal), NULL) < 0)
        goto done;
    result = PyLong_FromSsize_t(i);
done:
    Py_XDECREF(built);
    Py_XDECREF(journal);
    return result;
}
