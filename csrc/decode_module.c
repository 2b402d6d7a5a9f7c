/*
 * decode_module.c -- the CPython glue of the decode step (kernels/decode.h).
 *
 *   decode_plan(sizes, layers, keep) -> plan
 *       sizes = (batch, hidden, heads, kv_heads, head_dim, ffn, cap); layers:
 *       one tuple per layer (ln1, eps1, ln2, eps2, wqkv, bqkv|None,
 *       q_norm|None, k_norm|None, qk_eps, wo, bo|None, wgu, bgu|None, wd,
 *       bd|None, k_cache, v_cache, scale).  Every tensor goes through the
 *       one DLPack gate (fp32, CPU, contiguous; the caches writable) and its
 *       size is checked against `sizes` here, once; the plan keeps their
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
#define LAYER_ITEMS 18

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

/* The data pointer of `obj` (fp32, CPU, contiguous; writable when `write`)
 * with exactly `numel` elements; *out = NULL for None when `optional`.
 * 0, or -1 with an exception naming layer n's argument. */
static int take_f32(PyObject *obj, int64_t n, const char *name, int64_t numel, int write, int optional,
                    float **out)
{
    char label[96];
    snprintf(label, sizeof(label), "layer %lld %s", (long long)n, name);
    sf_view v;
    unsigned flags = SF_TAKE_CONTIGUOUS | (write ? SF_TAKE_WRITE : 0) | (optional ? SF_TAKE_OPTIONAL : 0);
    int rc = sf_take("decode_plan", obj, label, SF_DT_F32, flags, &v);
    *out = NULL;
    if (rc < 0) return -1;
    if (rc == 1) return 0;
    if (v.numel != numel) {
        PyErr_Format(PyExc_ValueError, "decode_plan: %s has %lld elements, expected %lld", label,
                     (long long)v.numel, (long long)numel);
        sf_view_release(&v);
        return -1;
    }
    *out = (float *)v.data;
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

/* Layer n's tuple into *l, every size checked against s. */
static int take_layer(PyObject *t, int64_t n, const sfk_decode_step *s, sfk_decode_layer *l)
{
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != LAYER_ITEMS) {
        PyErr_Format(PyExc_TypeError, "decode_plan: layer %lld must be a tuple of %d items", (long long)n,
                     LAYER_ITEMS);
        return -1;
    }
    const int64_t h = s->hidden, d = s->head_dim, hq = s->heads * d, hk = s->kv_heads * d, F = s->ffn;
    const int64_t nqkv = hq + 2 * hk, cache = s->batch * s->kv_heads * s->cap * d;
    PyObject **it = &PyTuple_GET_ITEM(t, 0);
    float *p[15];
    if (take_f32(it[0], n, "ln1", h, 0, 0, &p[0]) || take_float(it[1], n, "eps1", &l->eps1) ||
        take_f32(it[2], n, "ln2", h, 0, 0, &p[1]) || take_float(it[3], n, "eps2", &l->eps2) ||
        take_f32(it[4], n, "wqkv", nqkv * h, 0, 0, &p[2]) || take_f32(it[5], n, "bqkv", nqkv, 0, 1, &p[3]) ||
        take_f32(it[6], n, "q_norm", d, 0, 1, &p[4]) || take_f32(it[7], n, "k_norm", d, 0, 1, &p[5]) ||
        take_float(it[8], n, "qk_eps", &l->qk_eps) || take_f32(it[9], n, "wo", h * hq, 0, 0, &p[6]) ||
        take_f32(it[10], n, "bo", h, 0, 1, &p[7]) || take_f32(it[11], n, "wgu", 2 * F * h, 0, 0, &p[8]) ||
        take_f32(it[12], n, "bgu", 2 * F, 0, 1, &p[9]) || take_f32(it[13], n, "wd", h * F, 0, 0, &p[10]) ||
        take_f32(it[14], n, "bd", h, 0, 1, &p[11]) || take_f32(it[15], n, "k_cache", cache, 1, 0, &p[12]) ||
        take_f32(it[16], n, "v_cache", cache, 1, 0, &p[13]) || take_float(it[17], n, "scale", &l->scale))
        return -1;
    if ((p[4] == NULL) != (p[5] == NULL)) {
        PyErr_Format(PyExc_ValueError, "decode_plan: layer %lld has a q_norm without a k_norm or the reverse",
                     (long long)n);
        return -1;
    }
    l->ln1 = p[0], l->ln2 = p[1], l->wqkv = p[2], l->bqkv = p[3], l->q_norm = p[4], l->k_norm = p[5];
    l->wo = p[6], l->bo = p[7], l->wgu = p[8], l->bgu = p[9], l->wd = p[10], l->bd = p[11];
    l->k_cache = p[12], l->v_cache = p[13];
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
    const Py_ssize_t nl = PyList_GET_SIZE(layers);
    plan *p = PyMem_Malloc(sizeof(plan) + (size_t)nl * sizeof(sfk_decode_layer));
    if (!p) return PyErr_NoMemory();
    memset(p, 0, sizeof(plan));
    p->sizes = (sfk_decode_step){.batch = z[0], .hidden = z[1], .heads = z[2], .kv_heads = z[3],
                                 .head_dim = z[4], .ffn = z[5], .cap = z[6]};
    int64_t elems;
    if (sf_mul_overflows(z[0] * z[3], z[4] * z[6], &elems)) {
        PyMem_Free(p);
        return PyErr_Format(PyExc_OverflowError, "decode_plan: the cache's size overflows int64");
    }
    p->nlayers = nl;
    for (Py_ssize_t n = 0; n < nl; n++)
        if (take_layer(PyList_GET_ITEM(layers, n), n, &p->sizes, &p->layers[n])) {
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
     "layers' fp32 tensors checked and held (csrc/decode_module.c)."},
    {"decode_step", py_decode_step, METH_VARARGS,
     "decode_step(shm_comm, plan, x, cos, sin, mask|None, past) -> seconds in all-reduces: x [batch, "
     "hidden] in place through every layer of the plan, GIL released."},
    {NULL, NULL, 0, NULL},
};

int sf_register_decode(PyObject *m)
{
    return PyModule_AddFunctions(m, decode_methods);
}
