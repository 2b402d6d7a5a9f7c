/*
 * decode_module.c -- the CPython glue of the decode step (kernels/decode.h).
 *
 *   decode_plan(sizes, layers, keep) -> plan
 *       sizes = (batch, hidden, heads, kv_heads, head_dim, ffn, cap); layers:
 *       one tuple per layer (ln1, eps1, ln2, eps2, wq, wk, wv, bq|None,
 *       bk|None, bv|None, q_norm|None, k_norm|None, qk_eps, wo, bo|None, wg,
 *       wu, bg|None, bu|None, wd, bd|None, k_cache, v_cache, scale).  The
 *       step's type is layer 0's wq's (fp32, bf16 or fp16): the weights,
 *       norms and caches must all have it, the biases are fp32.  Every
 *       tensor goes through the one DLPack gate (CPU, contiguous; the
 *       caches writable) and its size is checked against `sizes` here, once; the plan keeps their
 *       data pointers and holds a reference to `keep` (the caller's list of
 *       those tensors), so their memory outlives the plan.
 *       ends (optional; None: the caller runs both ends) = (embed|None,
 *       embed_start, embed_real, vocab, norm|None, norm_eps, head|None,
 *       head_bias|None, chunk, nranks, ranges): decode.h's sfk_decode_ends,
 *       `ranges` a sequence of (rank, offset, count), rank-major; the
 *       embedding / norm / head of the step's type (the bias fp32); every
 *       size checked here (the ranges cover [0, vocab) once, no rank's
 *       exceed chunk), the gather's workspace allocated with the plan.
 *   decode_step(comm, plan, x, cos, sin, mask|None, past, ids|None,
 *               logits|None) -> (seconds in all-reduces, seconds in the all-gather)
 *       ids [batch] int64 given: x = their embedding (the plan's), else x
 *       [batch, hidden] is the input; x in place through every layer
 *       (decode.h), the two all-reduces of each layer on the shm
 *       communicator `comm` from C; logits [batch, vocab] of the step's type
 *       given: filled by the plan's final norm, head and gather.  The whole
 *       step with the GIL released (comm_glue.h's sf_shm_run_native).  Ids
 *       outside [0, vocab) raise IndexError before anything runs.
 *
 * The caller (shardformer.decode) owns the tensors of a plan and never
 * resizes them; it builds a new plan when it packs the weights again or
 * grows the caches.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <time.h>

#include "comm/shm.h"
#include "comm_glue.h"
#include "glue.h"
#include "kernels/decode.h"
#include "tensor_view.h"

#define PLAN_CAPSULE "shardformer.decode_plan"
#define LAYER_ITEMS 24

typedef struct {
    sfk_decode_step sizes;       /* batch .. cap; the per-step fields are filled per call */
    sfk_decode_ends ends;        /* embed / head NULL where the caller runs them; ranges, work owned */
    int64_t nlayers;
    PyObject *keep;
    sfk_decode_layer layers[];
} plan;

static void plan_dealloc(plan *p)
{
    PyMem_Free((void *)p->ends.ranges);
    PyMem_Free(p->ends.work);
    Py_XDECREF(p->keep);
    PyMem_Free(p);
}

static void plan_free(PyObject *cap)
{
    plan *p = PyCapsule_GetPointer(cap, PLAN_CAPSULE);
    if (!p) {
        PyErr_Clear();
        return;
    }
    plan_dealloc(p);
}

/* The data pointer of `obj` (a tensor through the DLPack gate with
 * `flags`, of a dtype in `dtypes`), named `label` in errors: *out its data
 * (NULL for None when optional), *numel its elements; with expect >= 0
 * exactly that many.  0, or -1 with an exception.  The memory outlives the
 * view: the plan's `keep` holds the tensor. */
static int take_checked(PyObject *obj, const char *label, unsigned dtypes, unsigned flags, int64_t expect,
                        void **out, int64_t *numel)
{
    sf_view v;
    *out = NULL, *numel = 0;
    int rc = sf_take("decode_plan", obj, label, dtypes, flags, &v);
    if (rc != 0) return rc < 0 ? -1 : 0;
    if (expect >= 0 && v.numel != expect) {
        PyErr_Format(PyExc_ValueError, "decode_plan: %s has %lld elements, expected %lld", label,
                     (long long)v.numel, (long long)expect);
        sf_view_release(&v);
        return -1;
    }
    *out = v.data, *numel = v.numel;
    sf_view_release(&v);
    return 0;
}

/* Layer n's tensor `name` (contiguous; writable when `write`; None allowed
 * when `optional`) with exactly `numel` elements (take_checked). */
static int take_tensor(PyObject *obj, int64_t n, const char *name, unsigned dtypes, int64_t numel, int write,
                       int optional, void **out)
{
    char label[96];
    int64_t got;
    snprintf(label, sizeof(label), "layer %lld %s", (long long)n, name);
    unsigned flags = SF_TAKE_CONTIGUOUS | (write ? SF_TAKE_WRITE : 0) | (optional ? SF_TAKE_OPTIONAL : 0);
    return take_checked(obj, label, dtypes, flags, numel, out, &got);
}

static int take_float(PyObject *obj, int64_t n, const char *name, float *out)
{
    double v = PyFloat_AsDouble(obj);
    if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "decode_plan: layer %lld %s must be a number", (long long)n, name);
        return -1;
    }
    *out = (float)v;
    return 0;
}

/* Layer n's tuple into *l, every size checked against s; the weights, the
 * norms and the caches of s->dtype (`dt`, an SF_DT_* bit), the biases fp32. */
static int take_layer(PyObject *t, int64_t n, const sfk_decode_step *s, unsigned dt, sfk_decode_layer *l)
{
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != LAYER_ITEMS) {
        PyErr_Format(PyExc_TypeError, "decode_plan: layer %lld must be a tuple of %d items", (long long)n,
                     LAYER_ITEMS);
        return -1;
    }
    const int64_t h = s->hidden, d = s->head_dim, hq = s->heads * d, hk = s->kv_heads * d, F = s->ffn;
    const int64_t cache = s->batch * s->kv_heads * s->cap * d;
    const unsigned f = SF_DT_F32;
    PyObject **it = &PyTuple_GET_ITEM(t, 0);
    /* the tensors in tuple order (None at the floats) */
    static const char *const names[LAYER_ITEMS] = {
        "ln1", NULL, "ln2", NULL, "wq", "wk", "wv", "bq", "bk", "bv", "q_norm", "k_norm", NULL,
        "wo", "bo", "wg", "wu", "bg", "bu", "wd", "bd", "k_cache", "v_cache", NULL};
    const int64_t numel[LAYER_ITEMS] = {h, 0, h, 0, hq * h, hk * h, hk * h, hq, hk, hk, d, d, 0,
                                        h * hq, h, F * h, F * h, F, F, h * F, h, cache, cache, 0};
    const unsigned types[LAYER_ITEMS] = {dt, 0, dt, 0, dt, dt, dt, f, f, f, dt, dt, 0,
                                         dt, f, dt, dt, f, f, dt, f, dt, dt, 0};
    /* optional: biases and the q / k norms; written: the caches */
    const char optional[LAYER_ITEMS] = {0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 0, 0, 1, 1, 0, 1, 0, 0, 0};
    void *p[LAYER_ITEMS] = {0};
    for (int i = 0; i < LAYER_ITEMS; i++)
        if (names[i] && take_tensor(it[i], n, names[i], types[i], numel[i], i == 21 || i == 22, optional[i],
                                    &p[i]))
            return -1;
    if (take_float(it[1], n, "eps1", &l->eps1) || take_float(it[3], n, "eps2", &l->eps2) ||
        take_float(it[12], n, "qk_eps", &l->qk_eps) || take_float(it[23], n, "scale", &l->scale))
        return -1;
    if ((p[10] == NULL) != (p[11] == NULL)) {
        PyErr_Format(PyExc_ValueError, "decode_plan: layer %lld has a q_norm without a k_norm or the reverse",
                     (long long)n);
        return -1;
    }
    l->ln1 = p[0], l->ln2 = p[2], l->wq = p[4], l->wk = p[5], l->wv = p[6];
    l->bq = p[7], l->bk = p[8], l->bv = p[9], l->q_norm = p[10], l->k_norm = p[11];
    l->wo = p[13], l->bo = p[14], l->wg = p[15], l->wu = p[16], l->bg = p[17], l->bu = p[18];
    l->wd = p[19], l->bd = p[20], l->k_cache = p[21], l->v_cache = p[22];
    return 0;
}

/* The step's type: layer 0's wq dtype (fp32, bf16 or fp16). */
static int plan_dtype(PyObject *layers, sfk_dtype *t, unsigned *bit)
{
    PyObject *row = PyList_GET_SIZE(layers) ? PyList_GET_ITEM(layers, 0) : NULL;
    *t = SFK_F32, *bit = SF_DT_F32;
    if (!row || !PyTuple_Check(row) || PyTuple_GET_SIZE(row) != LAYER_ITEMS) return 0;  /* take_layer says */
    sf_view v;
    if (sf_take("decode_plan", PyTuple_GET_ITEM(row, 4), "layer 0 wq", SF_DT_F32 | SF_DT_BF16 | SF_DT_F16, 0,
                &v) < 0)
        return -1;
    *bit = sf_dtype_bit(v.dtype);
    *t = *bit == SF_DT_BF16 ? SFK_BF16 : *bit == SF_DT_F16 ? SFK_F16 : SFK_F32;
    sf_view_release(&v);
    return 0;
}

/* A tensor of the ends, None allowed (take_checked, labelled "ends <name>"). */
static int take_end(PyObject *obj, const char *name, unsigned dtypes, int64_t expect, void **out, int64_t *numel)
{
    char label[64];
    snprintf(label, sizeof(label), "ends %s", name);
    return take_checked(obj, label, dtypes, SF_TAKE_CONTIGUOUS | SF_TAKE_OPTIONAL, expect, out, numel);
}

/* The ranges of the head's gather into e: (rank, offset, count) triples,
 * rank-major, covering [0, vocab) exactly once, no rank above chunk rows,
 * this rank's own rows (head_rows) not checked here (each rank knows only
 * its own; the gather's block size is the same everywhere). */
static int take_ranges(PyObject *obj, sfk_decode_ends *e)
{
    PyObject *seq = PySequence_Fast(obj, "decode_plan: ends ranges must be a sequence of (rank, offset, count)");
    if (!seq) return -1;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int64_t *r = PyMem_Malloc((size_t)(n ? n : 1) * 3 * sizeof(int64_t));
    unsigned char *seen = PyMem_Calloc((size_t)e->vocab, 1);
    int64_t *rows = PyMem_Calloc((size_t)e->nranks, sizeof(int64_t));
    int ok = r && seen && rows;
    if (!ok) PyErr_NoMemory();
    int64_t covered = 0;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        long long a, b, c;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "LLL", &a, &b, &c)) {
            ok = 0;
            break;
        }
        if (a < 0 || a >= e->nranks || (i && a < r[3 * (i - 1)]) || b < 0 || c < 0 || b > e->vocab - c) {
            PyErr_Format(PyExc_ValueError, "decode_plan: range %zd (rank %lld, offset %lld, count %lld) is "
                         "outside %d ranks in order and a vocabulary of %lld", i, a, b, c, e->nranks,
                         (long long)e->vocab);
            ok = 0;
            break;
        }
        rows[a] += c;
        for (long long j = b; ok && j < b + c; j++) {
            if (seen[j]) {
                PyErr_Format(PyExc_ValueError, "decode_plan: vocabulary index %lld in two ranges", j);
                ok = 0;
            }
            seen[j] = 1;
        }
        covered += c;
        if (ok && rows[a] > e->chunk) {
            PyErr_Format(PyExc_ValueError, "decode_plan: rank %lld holds %lld real rows, above the gather's "
                         "block of %lld", a, (long long)rows[a], (long long)e->chunk);
            ok = 0;
        }
        r[3 * i] = a, r[3 * i + 1] = b, r[3 * i + 2] = c;
    }
    if (ok && covered != e->vocab) {
        PyErr_Format(PyExc_ValueError, "decode_plan: the ranges cover %lld of %lld vocabulary indices",
                     (long long)covered, (long long)e->vocab);
        ok = 0;
    }
    Py_DECREF(seq);
    PyMem_Free(seen);
    PyMem_Free(rows);
    if (!ok) {
        PyMem_Free(r);
        return -1;
    }
    e->ranges = r, e->nranges = n;
    return 0;
}

/* The plan's ends from `obj` (the module doc), sizes checked against s. */
static int take_ends(PyObject *obj, const sfk_decode_step *s, unsigned dt, sfk_decode_ends *e)
{
    PyObject *embed, *norm, *head, *bias, *ranges;
    long long start, real, vocab, chunk;
    int nranks;
    double eps;
    if (!PyArg_ParseTuple(obj, "OLLLOdOOLiO:decode_plan ends", &embed, &start, &real, &vocab, &norm, &eps, &head,
                          &bias, &chunk, &nranks, &ranges))
        return -1;
    const int64_t h = s->hidden;
    if (vocab <= 0 || vocab > (1LL << 31) || nranks <= 0 || nranks > 4096 || chunk < 0 || chunk > (1LL << 31)) {
        PyErr_Format(PyExc_ValueError, "decode_plan: ends vocab %lld, %d ranks, chunk %lld out of range", vocab,
                     nranks, chunk);
        return -1;
    }
    e->vocab = vocab, e->nranks = nranks, e->chunk = chunk, e->norm_eps = (float)eps;
    void *ptr;
    int64_t numel;
    if (take_end(embed, "embed", dt, -1, &ptr, &numel)) return -1;
    if (ptr) {
        if (numel % h || start < 0 || real < 0 || real > numel / h || (real > 0 && start > vocab - real)) {
            PyErr_Format(PyExc_ValueError, "decode_plan: ends embed of %lld elements (hidden %lld) cannot hold "
                         "ids [%lld, %lld) of a vocabulary of %lld", (long long)numel, (long long)h, start,
                         start + real, vocab);
            return -1;
        }
        e->embed = ptr, e->embed_start = start, e->embed_real = real;
    }
    if (take_end(head, "head", dt, -1, &ptr, &numel)) return -1;
    if (ptr) {
        if (numel % h || numel / h > chunk) {
            PyErr_Format(PyExc_ValueError, "decode_plan: ends head of %lld elements is not rows of hidden %lld "
                         "within the gather's block of %lld", (long long)numel, (long long)h, chunk);
            return -1;
        }
        e->head = ptr, e->head_rows = numel / h;
        void *b, *g;
        if (take_end(bias, "head_bias", SF_DT_F32, e->head_rows, &b, &numel) ||
            take_end(norm, "norm", dt, h, &g, &numel))
            return -1;
        if (!g) {
            PyErr_Format(PyExc_ValueError, "decode_plan: ends head without a norm");
            return -1;
        }
        e->head_bias = b, e->norm = g;
        if (take_ranges(ranges, e)) return -1;
        const int64_t work = (int64_t)(nranks + 1) * s->batch * chunk;
        e->work = PyMem_Malloc((size_t)(work ? work : 1) * (size_t)sfk_size(s->dtype));
        if (!e->work) {
            PyErr_NoMemory();
            return -1;
        }
    }
    return 0;
}

static PyObject *py_decode_plan(PyObject *self, PyObject *args)
{
    (void)self;
    long long z[7];
    PyObject *layers, *keep, *ends = Py_None;
    if (!PyArg_ParseTuple(args, "(LLLLLLL)OO|O:decode_plan", &z[0], &z[1], &z[2], &z[3], &z[4], &z[5], &z[6],
                          &layers, &keep, &ends))
        return NULL;
    if (!PyList_Check(layers))
        return PyErr_Format(PyExc_TypeError, "decode_plan: layers must be a list of tuples");
    for (int i = 0; i < 7; i++)
        if (z[i] <= 0 || z[i] > (1LL << 31))
            return PyErr_Format(PyExc_ValueError, "decode_plan: size %d is %lld, outside [1, 2^31] (sizes: "
                                "batch, hidden, heads, kv_heads, head_dim, ffn, cap)", i, z[i]);
    sfk_dtype t;
    unsigned bit;
    if (plan_dtype(layers, &t, &bit)) return NULL;
    const Py_ssize_t nl = PyList_GET_SIZE(layers);
    plan *p = PyMem_Malloc(sizeof(plan) + (size_t)nl * sizeof(sfk_decode_layer));
    if (!p) return PyErr_NoMemory();
    memset(p, 0, sizeof(plan));
    p->keep = Py_NewRef(keep);
    p->sizes = (sfk_decode_step){.dtype = t, .batch = z[0], .hidden = z[1], .heads = z[2], .kv_heads = z[3],
                                 .head_dim = z[4], .ffn = z[5], .cap = z[6]};
    int64_t elems;
    if (sf_mul_overflows(z[0] * z[3], z[4] * z[6], &elems)) {
        plan_dealloc(p);
        return PyErr_Format(PyExc_OverflowError, "decode_plan: the cache's size overflows int64");
    }
    p->nlayers = nl;
    for (Py_ssize_t n = 0; n < nl; n++)
        if (take_layer(PyList_GET_ITEM(layers, n), n, &p->sizes, bit, &p->layers[n])) {
            plan_dealloc(p);
            return NULL;
        }
    if (ends != Py_None && take_ends(ends, &p->sizes, bit, &p->ends)) {
        plan_dealloc(p);
        return NULL;
    }
    PyObject *cap = PyCapsule_New(p, PLAN_CAPSULE, plan_free);
    if (!cap) plan_dealloc(p);
    return cap;
}

typedef struct {
    sfk_decode_step step;
    sfk_decode_ends ends;
    const plan *p;
    float *x;
    const int64_t *ids;          /* NULL: x is the input */
    void *logits;                /* NULL: the caller's head */
    double reduce_s, gather_s;
    sf_shm *comm;
} step_ctx;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static sf_status shm_sum(void *arg, float *buf, int64_t n, sf_error *err)
{
    step_ctx *c = arg;
    const double t0 = now();
    sf_status rc = sf_shm_all_reduce(c->comm, buf, (size_t)n, SF_RED_F32, SF_RED_SUM, SF_AR_AUTO, err);
    c->reduce_s += now() - t0;
    return rc;
}

/* The shm dtype of the logits (DLPack's codes, as comm_module.c sends them). */
static sf_shm_dtype shm_dtype(sfk_dtype t)
{
    return t == SFK_F32 ? SF_SHM_DTYPE(2, 32, 1) : t == SFK_BF16 ? SF_SHM_DTYPE(4, 16, 1) : SF_SHM_DTYPE(2, 16, 1);
}

static sf_status shm_gather(void *arg, void *out, const void *in, int64_t bytes, sf_error *err)
{
    step_ctx *c = arg;
    const double t0 = now();
    sf_status rc = sf_shm_all_gather(c->comm, out, in, (size_t)bytes, shm_dtype(c->step.dtype), err);
    c->gather_s += now() - t0;
    return rc;
}

static sf_status run_step(sf_shm *comm, void *arg, sf_error *err)
{
    step_ctx *c = arg;
    c->comm = comm;
    if (c->logits && sf_shm_nranks(comm) != c->ends.nranks)
        return sf_fail(err, SF_EINVAL, "decode_step: the plan's head gathers over %d ranks, the communicator "
                       "has %d", c->ends.nranks, sf_shm_nranks(comm));
    sf_status rc = SF_OK;
    if (c->ids) rc = sfk_decode_embed(&c->step, &c->ends, c->ids, c->x, err);
    if (rc == SF_OK) rc = sfk_decode_layers(&c->step, c->p->layers, c->p->nlayers, c->x, err);
    if (rc == SF_OK && c->logits) rc = sfk_decode_logits(&c->step, &c->ends, c->x, c->logits, err);
    return rc;
}

/* Tensor `obj` as argument `name` of decode_step: fp32 (int64 for the mask),
 * CPU, contiguous, `numel` elements.  0, 1 (None, optional), -1. */
static int take_step_arg(PyObject *obj, const char *name, unsigned dtype, unsigned flags, int64_t numel,
                         sf_view *v)
{
    int rc = sf_take("decode_step", obj, name, dtype, flags | SF_TAKE_CONTIGUOUS, v);
    if (rc != 0) return rc;
    if (v->numel != numel) {
        PyErr_Format(PyExc_ValueError, "decode_step: %s has %lld elements, expected %lld", name,
                     (long long)v->numel, (long long)numel);
        sf_view_release(v);
        return -1;
    }
    return 0;
}

static PyObject *py_decode_step(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap, *comm, *xo, *co, *so, *mo, *io = Py_None, *lo = Py_None;
    long long past;
    if (!PyArg_ParseTuple(args, "OOOOOOL|OO:decode_step", &comm, &cap, &xo, &co, &so, &mo, &past, &io, &lo))
        return NULL;
    const plan *p = PyCapsule_GetPointer(cap, PLAN_CAPSULE);
    if (!p) return NULL;
    const int64_t B = p->sizes.batch, d = p->sizes.head_dim;
    if (past < 0 || past >= p->sizes.cap)
        return PyErr_Format(PyExc_ValueError, "decode_step: position %lld outside the plan's cache of %lld "
                            "positions", past, (long long)p->sizes.cap);
    sf_view v[6];
    int held = 0, rc;
    PyObject *res = NULL;
    if (take_step_arg(xo, "x", SF_DT_F32, SF_TAKE_WRITE, B * p->sizes.hidden, &v[held]) < 0) goto done;
    held++;
    sf_view *c0 = NULL;
    if (sf_take("decode_step", co, "cos", SF_DT_F32, SF_TAKE_CONTIGUOUS, &v[held]) < 0) goto done;
    c0 = &v[held++];
    const int64_t rows = c0->numel / d;
    if (c0->numel % d || (rows != 1 && rows != B)) {
        PyErr_Format(PyExc_ValueError, "decode_step: cos has %lld elements, expected %lld or %lld (1 or %lld "
                     "rows of head_dim %lld)", (long long)c0->numel, (long long)d, (long long)(B * d),
                     (long long)B, (long long)d);
        goto done;
    }
    if (take_step_arg(so, "sin", SF_DT_F32, 0, c0->numel, &v[held]) < 0) goto done;
    held++;
    rc = take_step_arg(mo, "mask", SF_DT_I64, SF_TAKE_OPTIONAL, B * (past + 1), &v[held]);
    if (rc < 0) goto done;
    const int64_t *mask = NULL;
    if (rc == 0) mask = (const int64_t *)v[held++].data;
    step_ctx ctx = {.p = p, .x = (float *)v[0].data, .ends = p->ends};
    if (io != Py_None) {
        if (!p->ends.embed) {
            PyErr_Format(PyExc_ValueError, "decode_step: ids given to a plan without an embedding");
            goto done;
        }
        if (take_step_arg(io, "ids", SF_DT_I64, 0, B, &v[held]) < 0) goto done;
        ctx.ids = (const int64_t *)v[held++].data;
        for (int64_t b = 0; b < B; b++)
            if (ctx.ids[b] < 0 || ctx.ids[b] >= p->ends.vocab) {
                PyErr_Format(PyExc_IndexError, "index %lld is out of range for the vocabulary of %lld (token ids "
                             "must be in [0, %lld))", (long long)ctx.ids[b], (long long)p->ends.vocab,
                             (long long)p->ends.vocab);
                goto done;
            }
    }
    if (lo != Py_None) {
        const unsigned bit = p->sizes.dtype == SFK_F32 ? SF_DT_F32 : p->sizes.dtype == SFK_BF16 ? SF_DT_BF16
                                                                                              : SF_DT_F16;
        if (!p->ends.head) {
            PyErr_Format(PyExc_ValueError, "decode_step: logits given to a plan without a head");
            goto done;
        }
        if (take_step_arg(lo, "logits", bit, SF_TAKE_WRITE, B * p->ends.vocab, &v[held]) < 0) goto done;
        ctx.logits = v[held++].data;
    }
    ctx.step = p->sizes;
    ctx.step.past = past;
    ctx.step.cos = (const float *)v[1].data;
    ctx.step.sin = (const float *)v[2].data;
    ctx.step.rope_rows = rows;
    ctx.step.mask = mask;
    ctx.step.reduce = shm_sum;
    ctx.step.reduce_ctx = &ctx;
    ctx.ends.gather = shm_gather;
    ctx.ends.gather_ctx = &ctx;
    if (sf_shm_run_native(comm, run_step, &ctx) == 0)
        res = Py_BuildValue("(dd)", ctx.reduce_s, ctx.gather_s);
done:
    for (int i = 0; i < held; i++) sf_view_release(&v[i]);
    return res;
}

static PyMethodDef decode_methods[] = {
    {"decode_plan", py_decode_plan, METH_VARARGS,
     "decode_plan((batch, hidden, heads, kv_heads, head_dim, ffn, cap), layers, keep, ends=None) -> plan: "
     "the layers' tensors (fp32, bf16 or fp16) and the embedding / final norm / LM head checked and held "
     "(csrc/decode_module.c)."},
    {"decode_step", py_decode_step, METH_VARARGS,
     "decode_step(shm_comm, plan, x, cos, sin, mask|None, past, ids=None, logits=None) -> (seconds in "
     "all-reduces, seconds in the all-gather): the embedding of ids into x (given), x [batch, hidden] in "
     "place through every layer of the plan, the logits (given) from the final norm, head and gather; GIL "
     "released."},
    {NULL, NULL, 0, NULL},
};

int sf_register_decode(PyObject *m)
{
    return PyModule_AddFunctions(m, decode_methods);
}
