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
 *   decode_step(comm, plan, x, cos, sin, mask|None, past) -> seconds
 *       x [batch, hidden] in place through every layer (decode.h), the two
 *       all-reduces of each layer on the shm communicator `comm` from C,
 *       the whole loop with the GIL released (comm_glue.h's
 *       sf_shm_run_native); returns the seconds spent in the all-reduces.
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
    int64_t nlayers;
    PyObject *keep;
    sfk_decode_layer layers[];
} plan;

static void plan_free(PyObject *cap)
{
    plan *p = PyCapsule_GetPointer(cap, PLAN_CAPSULE);
    if (!p) {
        PyErr_Clear();
        return;
    }
    Py_XDECREF(p->keep);
    PyMem_Free(p);
}

/* The data pointer of `obj` (CPU, contiguous, of a dtype in `dtypes`;
 * writable when `write`) with exactly `numel` elements; *out = NULL for
 * None when `optional`.  0, or -1 with an exception naming layer n's
 * argument. */
static int take_tensor(PyObject *obj, int64_t n, const char *name, unsigned dtypes, int64_t numel, int write,
                       int optional, void **out)
{
    char label[96];
    snprintf(label, sizeof(label), "layer %lld %s", (long long)n, name);
    sf_view v;
    unsigned flags = SF_TAKE_CONTIGUOUS | (write ? SF_TAKE_WRITE : 0) | (optional ? SF_TAKE_OPTIONAL : 0);
    int rc = sf_take("decode_plan", obj, label, dtypes, flags, &v);
    *out = NULL;
    if (rc < 0) return -1;
    if (rc == 1) return 0;
    if (v.numel != numel) {
        PyErr_Format(PyExc_ValueError, "decode_plan: %s has %lld elements, expected %lld", label,
                     (long long)v.numel, (long long)numel);
        sf_view_release(&v);
        return -1;
    }
    *out = v.data;
    sf_view_release(&v);            /* the memory stays: `keep` holds the tensor */
    return 0;
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

static PyObject *py_decode_plan(PyObject *self, PyObject *args)
{
    (void)self;
    long long z[7];
    PyObject *layers, *keep;
    if (!PyArg_ParseTuple(args, "(LLLLLLL)OO:decode_plan", &z[0], &z[1], &z[2], &z[3], &z[4], &z[5], &z[6],
                          &layers, &keep))
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
    p->sizes = (sfk_decode_step){.dtype = t, .batch = z[0], .hidden = z[1], .heads = z[2], .kv_heads = z[3],
                                 .head_dim = z[4], .ffn = z[5], .cap = z[6]};
    int64_t elems;
    if (sf_mul_overflows(z[0] * z[3], z[4] * z[6], &elems)) {
        PyMem_Free(p);
        return PyErr_Format(PyExc_OverflowError, "decode_plan: the cache's size overflows int64");
    }
    p->nlayers = nl;
    for (Py_ssize_t n = 0; n < nl; n++)
        if (take_layer(PyList_GET_ITEM(layers, n), n, &p->sizes, bit, &p->layers[n])) {
            PyMem_Free(p);
            return NULL;
        }
    p->keep = Py_NewRef(keep);
    PyObject *cap = PyCapsule_New(p, PLAN_CAPSULE, plan_free);
    if (!cap) {
        Py_DECREF(p->keep);
        PyMem_Free(p);
    }
    return cap;
}

typedef struct {
    sfk_decode_step step;
    const plan *p;
    float *x;
    double reduce_s;
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

static sf_status run_step(sf_shm *comm, void *arg, sf_error *err)
{
    step_ctx *c = arg;
    c->comm = comm;
    return sfk_decode_layers(&c->step, c->p->layers, c->p->nlayers, c->x, err);
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
    PyObject *cap, *comm, *xo, *co, *so, *mo;
    long long past;
    if (!PyArg_ParseTuple(args, "OOOOOOL:decode_step", &comm, &cap, &xo, &co, &so, &mo, &past))
        return NULL;
    const plan *p = PyCapsule_GetPointer(cap, PLAN_CAPSULE);
    if (!p) return NULL;
    const int64_t B = p->sizes.batch, d = p->sizes.head_dim;
    if (past < 0 || past >= p->sizes.cap)
        return PyErr_Format(PyExc_ValueError, "decode_step: position %lld outside the plan's cache of %lld "
                            "positions", past, (long long)p->sizes.cap);
    sf_view v[4];
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
    step_ctx ctx = {.p = p, .x = (float *)v[0].data};
    ctx.step = p->sizes;
    ctx.step.past = past;
    ctx.step.cos = (const float *)v[1].data;
    ctx.step.sin = (const float *)v[2].data;
    ctx.step.rope_rows = rows;
    ctx.step.mask = mask;
    ctx.step.reduce = shm_sum;
    ctx.step.reduce_ctx = &ctx;
    if (sf_shm_run_native(comm, run_step, &ctx) == 0)
        res = PyFloat_FromDouble(ctx.reduce_s);
done:
    for (int i = 0; i < held; i++) sf_view_release(&v[i]);
    return res;
}

static PyMethodDef decode_methods[] = {
    {"decode_plan", py_decode_plan, METH_VARARGS,
     "decode_plan((batch, hidden, heads, kv_heads, head_dim, ffn, cap), layers, keep) -> plan: the "
     "layers' tensors (fp32, bf16 or fp16) checked and held (csrc/decode_module.c)."},
    {"decode_step", py_decode_step, METH_VARARGS,
     "decode_step(shm_comm, plan, x, cos, sin, mask|None, past) -> seconds in all-reduces: x [batch, "
     "hidden] in place through every layer of the plan, GIL released."},
    {NULL, NULL, 0, NULL},
};

int sf_register_decode(PyObject *m)
{
    return PyModule_AddFunctions(m, decode_methods);
}
