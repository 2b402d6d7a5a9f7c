/*
 * layout_spec.c -- the split specs of shardformer.layout, resolved: the spec
 * data (tuples, below) read into sf_spec (layout.h) and cut into per-rank
 * index ranges by layout.c's sf_spec_rank; the results as DimShard fields.  Used by the planner (plan_shard requests, see
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

/* A spec read from its tuple: the sf_spec tree, and the describe() strings
 * (`keep`, a list) its nodes point into. */
typedef struct {
    sf_spec root;
    PyObject *keep;
} spec_data;

static void spec_nodes_free(sf_spec *s)
{
    if (s->segments != NULL) {
        sf_spec *segs = (sf_spec *)s->segments;
        for (int64_t i = 0; i < s->nsegments; i++)
            spec_nodes_free(&segs[i]);
        PyMem_Free(segs);
        s->segments = NULL;
    }
}

static void spec_data_free(spec_data *d)
{
    spec_nodes_free(&d->root);
    Py_CLEAR(d->keep);
}

static int spec_int(PyObject *spec, Py_ssize_t i, int64_t *out)
{
    long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(spec, i));
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = (int64_t)v;
    return 0;
}

static const struct {
    const char *name;
    sf_spec_kind kind;
    Py_ssize_t nfields;
} KINDS[] = {
    {"split", SF_SPEC_SPLIT, 3},     {"vocab", SF_SPEC_VOCAB, 3},
    {"heads", SF_SPEC_HEADS, 6},     {"grouped", SF_SPEC_GROUPED, 5},
    {"fused", SF_SPEC_FUSED, 3},
};

/* Read the spec tuple `spec` into *s (its describe() string kept alive in
 * `keep`); -1 with TypeError for a malformed tuple. */
static int spec_read(PyObject *spec, sf_spec *s, PyObject *keep)
{
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) < 2 ||
        !PyUnicode_Check(PyTuple_GET_ITEM(spec, 0))) {
        PyErr_Format(PyExc_TypeError, "split spec data: expected (kind, describe, ...), got %.100s",
                     Py_TYPE(spec)->tp_name);
        return -1;
    }
    const char *kind = PyUnicode_AsUTF8(PyTuple_GET_ITEM(spec, 0));
    if (kind == NULL)
        return -1;
    size_t k = 0;
    while (k < sizeof(KINDS) / sizeof(KINDS[0]) && strcmp(kind, KINDS[k].name) != 0)
        k++;
    if (k == sizeof(KINDS) / sizeof(KINDS[0])) {
        PyErr_Format(PyExc_TypeError, "split spec data: unknown kind '%s'", kind);
        return -1;
    }
    if (PyTuple_GET_SIZE(spec) != KINDS[k].nfields) {
        PyErr_Format(PyExc_TypeError, "split spec data '%s': expected %zd fields, got %zd", kind,
                     KINDS[k].nfields, PyTuple_GET_SIZE(spec));
        return -1;
    }
    PyObject *describe = PyObject_Str(PyTuple_GET_ITEM(spec, 1));
    int kept = describe ? PyList_Append(keep, describe) : -1;
    Py_XDECREF(describe); /* `keep` holds it */
    if (kept < 0 || (s->describe = PyUnicode_AsUTF8(describe)) == NULL)
        return -1;
    s->kind = KINDS[k].kind;
    switch (s->kind) {
    case SF_SPEC_SPLIT:
    case SF_SPEC_VOCAB:
        return spec_int(spec, 2, &s->unit);
    case SF_SPEC_HEADS:
        if (spec_int(spec, 5, &s->part) < 0)
            return -1;
        /* fall through */
    case SF_SPEC_GROUPED:
        return spec_int(spec, 2, &s->num_heads) < 0 || spec_int(spec, 3, &s->num_kv_heads) < 0 ||
                       spec_int(spec, 4, &s->head_dim) < 0
                   ? -1
                   : 0;
    case SF_SPEC_FUSED:
        break;
    }
    PyObject *segs = PyTuple_GET_ITEM(spec, 2);
    if (!PyTuple_Check(segs) || PyTuple_GET_SIZE(segs) == 0) {
        PyErr_SetString(PyExc_TypeError, "split spec data 'fused': segments must be a non-empty tuple");
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(segs);
    sf_spec *nodes = PyMem_Calloc((size_t)n, sizeof(sf_spec));
    if (nodes == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    s->segments = nodes;
    s->nsegments = n;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (Py_EnterRecursiveCall(" reading a fused split spec"))
            return -1;
        int rc = spec_read(PyTuple_GET_ITEM(segs, i), &nodes[i], keep);
        Py_LeaveRecursiveCall();
        if (rc < 0)
            return -1;
    }
    return 0;
}

/* Read a spec tuple into *d (spec_data_free it, also after a failure). */
static int spec_data_read(PyObject *spec, spec_data *d)
{
    memset(d, 0, sizeof(*d));
    d->keep = PyList_New(0);
    return d->keep ? spec_read(spec, &d->root, d->keep) : -1;
}

static PyObject *ranges_tuple(const sf_range_list *l)
{
    PyObject *t = PyTuple_New((Py_ssize_t)l->n);
    if (t == NULL)
        return NULL;
    for (int64_t i = 0; i < l->n; i++) {
        PyObject *pair = Py_BuildValue("(LL)", (long long)l->v[i].offset,
                                       (long long)l->v[i].length);
        if (pair == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, pair);
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
        sf_set_pyerr(sf_split_units(1, tp, rank, &s, &c, &err), &err);
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "rank=%lld outside [0, %lld)", (long long)rank,
                         (long long)tp);
        return NULL;
    }
    if (full < 0) {
        PyErr_Format(PyExc_ValueError, "%U=%lld: a length cannot be negative", what, (long long)full);
        return NULL;
    }
    spec_data d;
    PyObject *all_ranges = NULL, *all_lengths = NULL, *result = NULL;
    int64_t expected, covered = 0, mine = 0;
    if (spec_data_read(spec, &d) < 0 || sf_set_pyerr(sf_spec_expected(&d.root, &expected, &err), &err))
        goto done;
    if (expected >= 0 && expected != full) {
        PyErr_Format(PyExc_ValueError, "%U=%lld does not match %s = %lld", what, (long long)full,
                     d.root.describe, (long long)expected);
        goto done;
    }
    all_ranges = PyTuple_New((Py_ssize_t)tp);
    all_lengths = PyTuple_New((Py_ssize_t)tp);
    if (all_ranges == NULL || all_lengths == NULL)
        goto done;
    for (int64_t r = 0; r < tp; r++) {
        sf_range_list l = {0};
        int64_t length = 0;
        sf_status rc = sf_spec_rank(&d.root, full, 0, tp, r, &l, &length, &err);
        PyObject *rt = sf_set_pyerr(rc, &err) ? NULL : ranges_tuple(&l);
        /* Only "covered > full" matters: stop adding once it holds (no overflow). */
        for (int64_t i = 0; i < l.n && covered <= full; i++)
            if (__builtin_add_overflow(covered, l.v[i].length, &covered))
                covered = INT64_MAX;
        sf_range_list_free(&l);
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
    spec_data_free(&d);
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
