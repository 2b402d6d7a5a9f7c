/*
 * module.c -- shardformer._C: the CPython glue.
 *
 * Each function here parses its arguments, takes its tensors through the one
 * DLPack gate (sf_take, glue.h), releases the GIL around work that touches
 * tensor memory, calls a plain C function from layout.c (or the sharder
 * engine), and turns the sf_status it returns into a Python exception with
 * the one mapper (sf_set_pyerr).  No computation lives here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define PY_ARRAY_UNIQUE_SYMBOL shardformer_ARRAY_API
#include <numpy/arrayobject.h>

#include "fingerprint.h"
#include "glue.h"
#include "layout.h"
#include "sharder.h"
#include "tensor_view.h"

int sf_register_comm(PyObject *m);
int sf_register_nccl(PyObject *m);
int sf_register_kernels(PyObject *m);
int sf_register_decode(PyObject *m);

PyDoc_STRVAR(split_units_doc,
"split_units(units, parts, rank) -> (start, count)\n\n"
"Units [start, start+count) of `units` belong to `rank` of `parts`; the first\n"
"units % parts ranks hold one unit more.");

static PyObject *py_split_units(PyObject *self, PyObject *args)
{
    (void)self;
    long long units, parts, rank;
    if (!PyArg_ParseTuple(args, "LLL:split_units", &units, &parts, &rank))
        return NULL;
    int64_t start = 0, count = 0;
    sf_error err = {0};
    if (sf_set_pyerr(sf_split_units(units, parts, rank, &start, &count, &err), &err))
        return NULL;
    return Py_BuildValue("(LL)", (long long)start, (long long)count);
}

PyDoc_STRVAR(heads_layout_doc,
"heads_layout(num_heads, num_kv_heads, parts, rank) -> (q_start, q_count, kv_start, kv_count)\n\n"
"The attention heads held by `rank`.  KV heads are split over the ranks (the\n"
"query heads of a KV head stay with it); with fewer KV heads than ranks each\n"
"KV head is replicated on parts / num_kv_heads ranks that split its queries.");

static PyObject *py_heads_layout(PyObject *self, PyObject *args)
{
    (void)self;
    long long heads, kv, parts, rank;
    if (!PyArg_ParseTuple(args, "LLLL:heads_layout", &heads, &kv, &parts, &rank))
        return NULL;
    int64_t qs = 0, qc = 0, ks = 0, kc = 0;
    sf_error err = {0};
    if (sf_set_pyerr(sf_heads_layout(heads, kv, parts, rank, &qs, &qc, &ks, &kc, &err), &err))
        return NULL;
    return Py_BuildValue("(LLLL)", (long long)qs, (long long)qc, (long long)ks, (long long)kc);
}

PyDoc_STRVAR(vocab_layout_doc,
"vocab_layout(vocab, parts, rank, multiple) -> (padded, start, per_rank, real)\n\n"
"The vocabulary padded to a multiple of parts*multiple and split evenly: rows\n"
"[start, start+per_rank) of the padded table, the first `real` of them real.");

static PyObject *py_vocab_layout(PyObject *self, PyObject *args)
{
    (void)self;
    long long vocab, parts, rank, multiple;
    if (!PyArg_ParseTuple(args, "LLLL:vocab_layout", &vocab, &parts, &rank, &multiple))
        return NULL;
    int64_t padded = 0, start = 0, per = 0, real = 0;
    sf_error err = {0};
    if (sf_set_pyerr(sf_vocab_layout(vocab, parts, rank, multiple, &padded, &start, &per, &real,
                                     &err), &err))
        return NULL;
    return Py_BuildValue("(LLLL)", (long long)padded, (long long)start, (long long)per,
                         (long long)real);
}

/* Parse a sequence of (offset, length) pairs (tuples, lists or any other
 * sequences of two integers); returns a PyMem buffer, or NULL with TypeError
 * (or OverflowError) set.  Both levels are snapshotted into tuples first, so
 * that an __index__ that mutates the caller's lists cannot pull items out
 * from under us. */
static sf_range *parse_ranges(PyObject *seq, Py_ssize_t *n)
{
    if (!PySequence_Check(seq) || PyUnicode_Check(seq) || PyBytes_Check(seq)) {
        PyErr_Format(PyExc_TypeError,
                     "ranges: expected a sequence of (offset, length) pairs, got %.100s",
                     Py_TYPE(seq)->tp_name);
        return NULL;
    }
    PyObject *items = PySequence_Tuple(seq);
    if (items == NULL)
        return NULL;
    *n = PyTuple_GET_SIZE(items);
    sf_range *ranges = PyMem_Calloc((size_t)(*n > 0 ? *n : 1), sizeof(sf_range));
    if (ranges == NULL) {
        Py_DECREF(items);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        PyObject *item = PyTuple_GET_ITEM(items, i);
        PyObject *pair = NULL;
        if (PySequence_Check(item) && !PyUnicode_Check(item) && !PyBytes_Check(item))
            pair = PySequence_Tuple(item);
        else
            PyErr_Format(PyExc_TypeError, "ranges item %zd: expected an (offset, length) "
                         "pair, got %.100s", i, Py_TYPE(item)->tp_name);
        if (pair != NULL && PyTuple_GET_SIZE(pair) != 2) {
            PyErr_Format(PyExc_TypeError, "ranges item %zd: expected an (offset, length) "
                         "pair, got %zd values", i, PyTuple_GET_SIZE(pair));
            Py_CLEAR(pair);
        }
        long long off = -1, len = -1;
        if (pair != NULL) {
            off = PyLong_AsLongLong(PyTuple_GET_ITEM(pair, 0));
            if (!(off == -1 && PyErr_Occurred()))
                len = PyLong_AsLongLong(PyTuple_GET_ITEM(pair, 1));
            Py_DECREF(pair);
        }
        if (PyErr_Occurred()) {
            PyMem_Free(ranges);
            Py_DECREF(items);
            return NULL;
        }
        ranges[i].offset = off;
        ranges[i].length = len;
    }
    Py_DECREF(items);
    return ranges;
}

static PyObject *copy_ranges_impl(PyObject *args, PyObject *kwargs, int to_full)
{
    static char *kwlist[] = {"full", "shard", "dim", "ranges", NULL};
    PyObject *full_obj, *shard_obj, *ranges_obj;
    int dim;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOiO", kwlist, &full_obj, &shard_obj, &dim,
                                     &ranges_obj))
        return NULL;
    sf_view full, shard;
    if (sf_take(NULL, full_obj, "full", SF_DT_ANY, to_full ? SF_TAKE_WRITE : 0, &full) < 0)
        return NULL;
    if (sf_take(NULL, shard_obj, "shard", SF_DT_ANY, to_full ? 0 : SF_TAKE_WRITE, &shard) < 0) {
        sf_view_release(&full);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = 0;
    sf_range *ranges = NULL;
    sf_error err = {0};
    if (sf_set_pyerr(sf_check_same_dtype(&full, "full", &shard, "shard", &err), &err))
        goto done;
    if (full.ndim != shard.ndim) {
        PyErr_Format(PyExc_ValueError, "full has %d dimensions but shard has %d", full.ndim,
                     shard.ndim);
        goto done;
    }
    if (dim < 0)
        dim += full.ndim;
    if (dim < 0 || dim >= full.ndim) {
        PyErr_Format(PyExc_IndexError, "dim out of range for a %d-dimensional tensor", full.ndim);
        goto done;
    }
    ranges = parse_ranges(ranges_obj, &n);
    if (ranges == NULL)
        goto done;
    if (n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "ranges: too many ranges");
        goto done;
    }
    sf_strided f = {full.data, full.ndim, full.shape, full.strides};
    sf_strided s = {shard.data, shard.ndim, shard.shape, shard.strides};
    sf_status rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sf_copy_ranges(&f, &s, dim, ranges, (int)n, full.itemsize, to_full, &err);
    Py_END_ALLOW_THREADS
    if (sf_set_pyerr(rc, &err) == 0)
        result = Py_NewRef(Py_None);
done:
    PyMem_Free(ranges);
    sf_view_release(&full);
    sf_view_release(&shard);
    return result;
}

PyDoc_STRVAR(copy_shard_doc,
"copy_shard(full, shard, dim, ranges)\n\n"
"Copy the (offset, length) ranges of `full` along `dim` into `shard`, back to\n"
"back, and zero the rest of `shard` along `dim` (vocabulary padding).  CPU\n"
"tensors of one dtype; both may be strided; `shard` must be writable and must\n"
"not overlap itself (no expand()ed or as_strided destination: ValueError).  A\n"
"`full` sharing memory with `shard` is read from a copy taken first.");

static PyObject *py_copy_shard(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    return copy_ranges_impl(args, kwargs, 0);
}

PyDoc_STRVAR(place_shard_doc,
"place_shard(full, shard, dim, ranges)\n\n"
"The inverse of copy_shard: write the back-to-back pieces of `shard` into the\n"
"(offset, length) ranges of `full` along `dim` (the destination `full` must not\n"
"overlap itself; a `shard` sharing memory with it is read from a copy first).");

static PyObject *py_place_shard(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    return copy_ranges_impl(args, kwargs, 1);
}

PyDoc_STRVAR(fingerprint_doc,
"fingerprint(tensor, seed=0) -> int\n\n"
"64-bit fingerprint (not cryptographic) of a contiguous CPU tensor's bytes,\n"
"continuing from `seed`: equal tensors of equal dtype and shape give equal\n"
"values on every rank.  Runs without the GIL.");

static PyObject *py_fingerprint(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    static char *kwlist[] = {"tensor", "seed", NULL};
    PyObject *obj, *seed_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O!:fingerprint", kwlist, &obj, &PyLong_Type,
                                     &seed_obj))
        return NULL;
    /* "K" would wrap negative and oversized seeds silently: convert checked. */
    unsigned long long seed = seed_obj ? PyLong_AsUnsignedLongLong(seed_obj) : 0;
    if (seed_obj && PyErr_Occurred())
        return NULL;
    sf_view v;
    if (sf_take(NULL, obj, "tensor", SF_DT_ANY, SF_TAKE_CONTIGUOUS, &v) < 0)
        return NULL;
    PyObject *result = NULL;
    sf_error err = {0};
    size_t nbytes = 0;
    if (sf_set_pyerr(sf_view_nbytes(&v, "tensor", &nbytes, &err), &err))
        goto done;
    uint64_t h = 0;
    sf_status rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sf_fingerprint(v.data, nbytes, (uint64_t)seed, &h, &err);
    Py_END_ALLOW_THREADS
    if (sf_set_pyerr(rc, &err) == 0)
        result = PyLong_FromUnsignedLongLong((unsigned long long)h);
done:
    sf_view_release(&v);
    return result;
}

PyDoc_STRVAR(gather_index_doc,
"gather_index(rank_ranges, full_length, chunk) -> numpy.ndarray[int64]\n\n"
"Index plan to reassemble a dimension gathered from all ranks.  Rank r's\n"
"shard (the pieces of its ranges, back to back) sits at [r*chunk, (r+1)*chunk)\n"
"of the gathered buffer; element i of the result is where full index i is\n"
"found.  Every full index must be covered by some rank.");

static PyObject *py_gather_index(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *per_rank;
    long long full_len, chunk;
    if (!PyArg_ParseTuple(args, "OLL:gather_index", &per_rank, &full_len, &chunk))
        return NULL;
    if (full_len < 0 || chunk < 0) {
        PyErr_SetString(PyExc_ValueError, "full_length and chunk must be >= 0");
        return NULL;
    }
    if (!PySequence_Check(per_rank) || PyUnicode_Check(per_rank) || PyBytes_Check(per_rank)) {
        PyErr_Format(PyExc_TypeError, "rank_ranges: expected a sequence per rank, got %.100s",
                     Py_TYPE(per_rank)->tp_name);
        return NULL;
    }
    /* A tuple snapshot: parsing may run Python code (__index__) that could
     * change a list we iterate over. */
    PyObject *fast = PySequence_Tuple(per_rank);
    if (fast == NULL)
        return NULL;
    /* Positions in the gathered buffer go up to nranks * chunk: keep it in int64. */
    Py_ssize_t nranks = PyTuple_GET_SIZE(fast);
    if (nranks > 0 && chunk > INT64_MAX / nranks) {
        PyErr_Format(PyExc_ValueError, "%zd ranks with chunk %lld overflow int64", nranks,
                     chunk);
        Py_DECREF(fast);
        return NULL;
    }
    npy_intp dims[1] = {(npy_intp)full_len};
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(1, dims, NPY_INT64);
    if (out == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    int64_t *idx = (int64_t *)PyArray_DATA(out);
    for (npy_intp i = 0; i < dims[0]; i++)
        idx[i] = -1;
    for (Py_ssize_t r = 0; r < nranks; r++) {
        Py_ssize_t n = 0;
        sf_range *ranges = parse_ranges(PyTuple_GET_ITEM(fast, r), &n);
        if (ranges == NULL)
            goto fail;
        int64_t pos = 0;
        for (Py_ssize_t k = 0; k < n; k++) {
            /* Overflow-safe form of offset + length > full_len, pos + length > chunk. */
            if (ranges[k].offset < 0 || ranges[k].length < 0 || ranges[k].offset > full_len ||
                ranges[k].length > full_len - ranges[k].offset ||
                ranges[k].length > chunk - pos) {
                PyErr_Format(PyExc_ValueError,
                             "rank %zd range (%lld, %lld) does not fit full length %lld "
                             "with chunk %lld", r, (long long)ranges[k].offset,
                             (long long)ranges[k].length, full_len, chunk);
                PyMem_Free(ranges);
                goto fail;
            }
            for (int64_t j = 0; j < ranges[k].length; j++)
                if (idx[ranges[k].offset + j] < 0)
                    idx[ranges[k].offset + j] = (int64_t)r * chunk + pos + j;
            pos += ranges[k].length;
        }
        PyMem_Free(ranges);
    }
    for (npy_intp i = 0; i < dims[0]; i++) {
        if (idx[i] < 0) {
            PyErr_Format(PyExc_ValueError, "full index %lld is held by no rank", (long long)i);
            goto fail;
        }
    }
    Py_DECREF(fast);
    return (PyObject *)out;
fail:
    Py_DECREF(fast);
    Py_DECREF(out);
    return NULL;
}

PyDoc_STRVAR(tensor_info_doc,
"tensor_info(t) -> dict\n\n"
"What _C sees of a tensor through DLPack: dtype, device, shape, strides,\n"
"contiguity.  For tests and debugging.");

static PyObject *py_tensor_info(PyObject *self, PyObject *arg)
{
    (void)self;
    sf_view v;
    if (sf_take(NULL, arg, "t", SF_DT_ANY, SF_TAKE_ANY_DEVICE, &v) < 0)
        return NULL;
    PyObject *shape = PyTuple_New(v.ndim), *strides = PyTuple_New(v.ndim);
    PyObject *result = NULL;
    if (shape && strides) {
        for (int d = 0; d < v.ndim; d++) {
            PyTuple_SET_ITEM(shape, d, PyLong_FromLongLong(v.shape[d]));
            PyTuple_SET_ITEM(strides, d, PyLong_FromLongLong(v.strides[d]));
        }
        result = Py_BuildValue("{s:s,s:i,s:i,s:O,s:O,s:O,s:O,s:i}", "dtype",
                               sf_dtype_name(v.dtype), "device_type", (int)v.device.device_type,
                               "device_id", (int)v.device.device_id, "shape", shape, "strides",
                               strides, "contiguous", sf_view_is_contiguous(&v) ? Py_True : Py_False,
                               "readonly", v.readonly ? Py_True : Py_False, "itemsize",
                               v.itemsize);
    }
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    sf_view_release(&v);
    return result;
}

PyDoc_STRVAR(sharder_plan_doc,
"sharder_plan(root, model_name, policy, tp_size, rank) -> (ops, matched)\n\n"
"Read and check the policy, walk the module tree, match policy entries,\n"
"resolve and validate every substitution and its shard layouts; change\n"
"nothing.  ops is a list of PlanOp records (kind, path, owner, name, value,\n"
"target, native, kwargs, plan, change).  See csrc/sharder.h.");

PyDoc_STRVAR(resolve_split_doc,
"resolve_split(spec, full, tp_size, rank, what='dimension') -> DimShard fields\n\n"
"The layout of a split spec (SplitSpec.data) over a dimension of length full:\n"
"(full, length, ranges, all_ranges, all_lengths, rank, tp_size, replicated).");

PyDoc_STRVAR(resolve_plan_doc,
"resolve_plan(plan) -> plan\n\n"
"Resolve a ShardPlan's requests {name: (spec, full, what, no_replicate)} into\n"
"plan.resolved {name: DimShard fields}, as sharder_plan does.");

PyDoc_STRVAR(sharder_apply_doc,
"sharder_apply(ops, process_group, adopt=None, journal=None, built=None) -> int\n\n"
"Apply a plan from sharder_plan, consuming the list, in two phases: build\n"
"every replacement (from_native_module, or prepare_native_module for an\n"
"in-place change) and bound method, calling adopt(path, native, replacement)\n"
"for each, without touching the model; then swap them in, journaled, undoing\n"
"the swaps in reverse if one fails.  `built(ops, builds)`, when given, sees\n"
"(and may edit) the list of builds -- PlanOp records with a sub's\n"
"replacement in value, or its prepared change in change -- between the two\n"
"phases; what it raises\n"
"comes out unchanged.  `journal`, when given, is left holding the changes\n"
"that could not be undone after a failure (empty on success).");

static PyMethodDef methods[] = {
    {"split_units", py_split_units, METH_VARARGS, split_units_doc},
    {"heads_layout", py_heads_layout, METH_VARARGS, heads_layout_doc},
    {"vocab_layout", py_vocab_layout, METH_VARARGS, vocab_layout_doc},
    {"copy_shard", (PyCFunction)(void (*)(void))py_copy_shard, METH_VARARGS | METH_KEYWORDS,
     copy_shard_doc},
    {"place_shard", (PyCFunction)(void (*)(void))py_place_shard, METH_VARARGS | METH_KEYWORDS,
     place_shard_doc},
    {"gather_index", py_gather_index, METH_VARARGS, gather_index_doc},
    {"fingerprint", (PyCFunction)(void (*)(void))py_fingerprint, METH_VARARGS | METH_KEYWORDS,
     fingerprint_doc},
    {"tensor_info", py_tensor_info, METH_O, tensor_info_doc},
    {"sharder_plan", (PyCFunction)(void (*)(void))sf_sharder_plan, METH_VARARGS | METH_KEYWORDS,
     sharder_plan_doc},
    {"sharder_apply", (PyCFunction)(void (*)(void))sf_sharder_apply,
     METH_VARARGS | METH_KEYWORDS, sharder_apply_doc},
    {"resolve_split", (PyCFunction)(void (*)(void))sf_resolve_split,
     METH_VARARGS | METH_KEYWORDS, resolve_split_doc},
    {"resolve_plan", sf_resolve_plan, METH_O, resolve_plan_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "shardformer._C",
    "shardformer's C core: shard layouts, shard copies and the sharder engine.",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__C(void)
{
    import_array();
    PyObject *m = PyModule_Create(&module_def);
    if (m && sf_register_comm(m) < 0)
        Py_CLEAR(m);
    if (m && sf_register_nccl(m) < 0)
        Py_CLEAR(m);
    if (m && sf_register_decode(m) < 0)
        Py_CLEAR(m);
    if (m && sf_register_kernels(m) < 0)
        Py_CLEAR(m);
    if (m && sf_register_sharder(m) < 0)
        Py_CLEAR(m);
    return m;
}
