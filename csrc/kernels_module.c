/*
 * kernels_module.c -- the CPython glue of csrc/kernels/.
 *
 * Every function takes its inputs and preallocated outputs as tensors
 * (through DLPack), checks device, dtype, contiguity, writability and sizes
 * before touching anything, releases the GIL around the kernel and turns its
 * return code into an exception.  Outputs are allocated by the caller
 * (shardformer.ops), so nothing here creates tensors.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kernels/attention.h"
#include "kernels/cross_entropy.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/norm.h"
#include "tensor_view.h"

#define MAXV 14

enum { K_DATA = 0, K_F32 = 1, K_I64 = 2 };

typedef struct {
    sf_view v[MAXV];
    int n;
    const char *fn;
} views;

static void drop(views *vs)
{
    for (int i = 0; i < vs->n; i++) sf_view_release(&vs->v[i]);
    vs->n = 0;
}

/* Acquire `obj` as argument `name` of kind K_*, or NULL for None when
 * `optional`.  Sets *out (NULL for None).  -1 with an exception. */
static int take(views *vs, PyObject *obj, const char *name, int kind, int writable, int optional,
                sf_view **out)
{
    *out = NULL;
    if (obj == Py_None) {
        if (optional) return 0;
        PyErr_Format(PyExc_TypeError, "%s: %s must be a tensor, not None", vs->fn, name);
        return -1;
    }
    sf_view *v = &vs->v[vs->n];
    if (sf_view_acquire(obj, name, v) < 0) return -1;
    vs->n++;
    /* an empty tensor has nothing to lay out (torch gives them odd strides) */
    if (sf_check_cpu(v, name) < 0 || (v->numel > 0 && sf_check_contiguous(v, name) < 0)) return -1;
    if (writable && sf_check_writable(v, name) < 0) return -1;
    int code = v->dtype.code, bits = v->dtype.bits;
    if (kind == K_DATA && sf_check_float(v, name) < 0) return -1;
    if (kind == K_F32 && !(code == SF_DL_FLOAT && bits == 32)) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be float32, got %s", vs->fn, name,
                     sf_dtype_name(v->dtype));
        return -1;
    }
    if (kind == K_I64 && !(code == SF_DL_INT && bits == 64)) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be int64, got %s", vs->fn, name,
                     sf_dtype_name(v->dtype));
        return -1;
    }
    *out = v;
    return 0;
}

static sfk_dtype kdtype(const sf_view *v)
{
    if (v->dtype.code == SF_DL_BFLOAT) return SFK_BF16;
    return v->dtype.bits == 16 ? SFK_F16 : SFK_F32;
}

static int64_t last_dim(const sf_view *v) { return v->ndim ? v->shape[v->ndim - 1] : 1; }

static int64_t lead_rows(const sf_view *v)
{
    int64_t r = 1;
    for (int d = 0; d + 1 < v->ndim; d++) r *= v->shape[d];
    return r;
}

static int want_numel(views *vs, const sf_view *v, const char *name, int64_t n)
{
    if (v && v->numel != n) {
        PyErr_Format(PyExc_ValueError, "%s: %s has %lld elements, expected %lld", vs->fn, name,
                     (long long)v->numel, (long long)n);
        return -1;
    }
    return 0;
}

static int same_dtype(views *vs, const sf_view *a, const char *an, const sf_view *b,
                      const char *bn)
{
    (void)vs;
    return (a && b) ? sf_check_same_dtype(a, an, b, bn) : 0;
}

static PyObject *finish(views *vs, int rc)
{
    drop(vs);
    if (rc == SFK_ENOMEM) return PyErr_NoMemory();
    if (rc != SFK_OK) {
        PyErr_Format(PyExc_ValueError, "%s: invalid arguments (kernel returned %d)", vs->fn, rc);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *fail(views *vs)
{
    drop(vs);
    return NULL;
}

#define VOIDP(v) ((v) ? (void *)(v)->data : NULL)
#define FLOATP(v) ((v) ? (float *)(v)->data : NULL)

/* ---- cross-entropy ------------------------------------------------------ */

static PyObject *py_xent_forward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[7];
    long long vstart, real, ignore;
    if (!PyArg_ParseTuple(args, "OOLLLOOOO:xent_forward", &o[0], &o[1], &vstart, &real, &ignore,
                          &o[2], &o[3], &o[4], &o[5]))
        return NULL;
    views vs = {.fn = "xent_forward"};
    sf_view *z, *y, *mx, *se, *tg, *sz;
    if (take(&vs, o[0], "logits", K_DATA, 0, 0, &z) || take(&vs, o[1], "labels", K_I64, 0, 0, &y) ||
        take(&vs, o[2], "max", K_F32, 1, 0, &mx) || take(&vs, o[3], "sumexp", K_F32, 1, 0, &se) ||
        take(&vs, o[4], "target", K_F32, 1, 0, &tg) || take(&vs, o[5], "sumz", K_F32, 1, 1, &sz))
        return fail(&vs);
    int64_t n = last_dim(z), rows = lead_rows(z);
    if (want_numel(&vs, y, "labels", rows) || want_numel(&vs, mx, "max", rows) ||
        want_numel(&vs, se, "sumexp", rows) || want_numel(&vs, tg, "target", rows) ||
        want_numel(&vs, sz, "sumz", rows))
        return fail(&vs);
    if (real < 0 || real > n) {
        PyErr_Format(PyExc_ValueError, "xent_forward: vocab_real=%lld outside [0, %lld] (logits "
                     "have %lld columns)", real, (long long)n, (long long)n);
        return fail(&vs);
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sfk_xent_forward(kdtype(z), z->data, rows, n, real, (const int64_t *)y->data, vstart,
                          ignore, FLOATP(mx), FLOATP(se), FLOATP(tg), FLOATP(sz));
    Py_END_ALLOW_THREADS
    return finish(&vs, rc);
}

static PyObject *py_xent_backward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[5];
    long long vstart, real, ignore, vocab;
    float eps;
    if (!PyArg_ParseTuple(args, "OOLLLOOfLO:xent_backward", &o[0], &o[1], &vstart, &real, &ignore,
                          &o[2], &o[3], &eps, &vocab, &o[4]))
        return NULL;
    views vs = {.fn = "xent_backward"};
    sf_view *z, *y, *lse, *sc, *g;
    if (take(&vs, o[0], "logits", K_DATA, 0, 0, &z) || take(&vs, o[1], "labels", K_I64, 0, 0, &y) ||
        take(&vs, o[2], "lse", K_F32, 0, 0, &lse) || take(&vs, o[3], "scale", K_F32, 0, 0, &sc) ||
        take(&vs, o[4], "grad", K_DATA, 1, 0, &g))
        return fail(&vs);
    int64_t n = last_dim(z), rows = lead_rows(z);
    if (want_numel(&vs, y, "labels", rows) || want_numel(&vs, lse, "lse", rows) ||
        want_numel(&vs, sc, "scale", rows) || want_numel(&vs, g, "grad", z->numel) ||
        same_dtype(&vs, z, "logits", g, "grad"))
        return fail(&vs);
    if (real < 0 || real > n || vocab < 0) {
        PyErr_Format(PyExc_ValueError, "xent_backward: vocab_real=%lld outside [0, %lld] or "
                     "vocab=%lld < 0", real, (long long)n, vocab);
        return fail(&vs);
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sfk_xent_backward(kdtype(z), z->data, g->data, rows, n, real, (const int64_t *)y->data,
                           vstart, ignore, FLOATP(lse), FLOATP(sc), eps, vocab);
    Py_END_ALLOW_THREADS
    return finish(&vs, rc);
}

/* ---- norms -------------------------------------------------------------- */

static PyObject *py_norm_forward(PyObject *self, PyObject *args)
{
    (void)self;
    int rms;
    float eps;
    PyObject *o[6];
    if (!PyArg_ParseTuple(args, "pOOOfOOO:norm_forward", &rms, &o[0], &o[1], &o[2], &eps, &o[3],
                          &o[4], &o[5]))
        return NULL;
    views vs = {.fn = "norm_forward"};
    sf_view *x, *w, *b, *y, *mu, *rs;
    if (take(&vs, o[0], "x", K_DATA, 0, 0, &x) || take(&vs, o[1], "weight", K_F32, 0, 1, &w) ||
        take(&vs, o[2], "bias", K_F32, 0, 1, &b) || take(&vs, o[3], "y", K_DATA, 1, 0, &y) ||
        take(&vs, o[4], "mean", K_F32, 1, 1, &mu) || take(&vs, o[5], "rstd", K_F32, 1, 0, &rs))
        return fail(&vs);
    int64_t n = last_dim(x), rows = lead_rows(x);
    if (want_numel(&vs, w, "weight", n) || want_numel(&vs, b, "bias", n) ||
        want_numel(&vs, y, "y", x->numel) || same_dtype(&vs, x, "x", y, "y") ||
        want_numel(&vs, mu, "mean", rows) || want_numel(&vs, rs, "rstd", rows))
        return fail(&vs);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sfk_norm_forward(rms, kdtype(x), x->data, rows, n, FLOATP(w), FLOATP(b), eps, y->data,
                          FLOATP(mu), FLOATP(rs));
    Py_END_ALLOW_THREADS
    return finish(&vs, rc);
}

static PyObject *py_norm_backward(PyObject *self, PyObject *args)
{
    (void)self;
    int rms;
    PyObject *o[9];
    if (!PyArg_ParseTuple(args, "pOOOOOOOO:norm_backward", &rms, &o[0], &o[1], &o[2], &o[3], &o[4],
                          &o[5], &o[6], &o[7]))
        return NULL;
    views vs = {.fn = "norm_backward"};
    sf_view *dy, *x, *w, *mu, *rs, *dx, *dw, *db;
    if (take(&vs, o[0], "dy", K_DATA, 0, 0, &dy) || take(&vs, o[1], "x", K_DATA, 0, 0, &x) ||
        take(&vs, o[2], "weight", K_F32, 0, 1, &w) || take(&vs, o[3], "mean", K_F32, 0, rms, &mu) ||
        take(&vs, o[4], "rstd", K_F32, 0, 0, &rs) || take(&vs, o[5], "dx", K_DATA, 1, 0, &dx) ||
        take(&vs, o[6], "dweight", K_F32, 1, 1, &dw) || take(&vs, o[7], "dbias", K_F32, 1, 1, &db))
        return fail(&vs);
    int64_t n = last_dim(x), rows = lead_rows(x);
    if (want_numel(&vs, dy, "dy", x->numel) || want_numel(&vs, dx, "dx", x->numel) ||
        same_dtype(&vs, x, "x", dy, "dy") || same_dtype(&vs, x, "x", dx, "dx") ||
        want_numel(&vs, w, "weight", n) || want_numel(&vs, dw, "dweight", n) ||
        want_numel(&vs, db, "dbias", n) || want_numel(&vs, mu, "mean", rows) ||
        want_numel(&vs, rs, "rstd", rows))
        return fail(&vs);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sfk_norm_backward(rms, kdtype(x), dy->data, x->data, rows, n, FLOATP(w), FLOATP(mu),
                           FLOATP(rs), dx->data, FLOATP(dw), FLOATP(db));
    Py_END_ALLOW_THREADS
    return finish(&vs, rc);
}

/* ---- elementwise -------------------------------------------------------- */

static PyObject *py_bias_gelu_forward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[3];
    int approx;
    if (!PyArg_ParseTuple(args, "OOpO:bias_gelu_forward", &o[0], &o[1], &approx, &o[2]))
        return NULL;
    views vs = {.fn = "bias_gelu_forward"};
    sf_view *x, *b, *y;
    if (take(&vs, o[0], "x", K_DATA, 0, 0, &x) || take(&vs, o[1], "bias", K_F32, 0, 1, &b) ||
        take(&vs, o[2], "y", K_DATA, 1, 0, &y))
        return fail(&vs);
    int64_t n = last_dim(x), rows = lead_rows(x);
    if (want_numel(&vs, b, "bias", n) || want_numel(&vs, y, "y", x->numel) ||
        same_dtype(&vs, x, "x", y, "y"))
        return fail(&vs);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sfk_bias_gelu_forward(kdtype(x), x->data, FLOATP(b), rows, n, approx, y->data);
    Py_END_ALLOW_THREADS
    return finish(&vs, rc);
}

static PyObject *py_bias_gelu_backward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[5];
    int approx;
    if (!PyArg_ParseTuple(args, "OOOpOO:bias_gelu_backward", &o[0], &o[1], &o[2], &approx, &o[3],
                          &o[4]))
        return NULL;
    views vs = {.fn = "bias_gelu_backward"};
    sf_view *dy, *x, *b, *dx, *db;
    if (take(&vs, o[0], "dy", K_DATA, 0, 0, &dy) || take(&vs, o[1], "x", K_DATA, 0, 0, &x) ||
        take(&vs, o[2], "bias", K_F32, 0, 1, &b) || take(&vs, o[3], "dx", K_DATA, 1, 0, &dx) ||
        take(&vs, o[4], "dbias", K_F32, 1, 1, &db))
        return fail(&vs);
    int64_t n = last_dim(x), rows = lead_rows(x);
    if (want_numel(&vs, b, "bias", n) || want_numel(&vs, db, "dbias", n) ||
        want_numel(&vs, dy, "dy", x->numel) || want_numel(&vs, dx, "dx", x->numel) ||
        same_dtype(&vs, x, "x", dy, "dy") || same_dtype(&vs, x, "x", dx, "dx"))
        return fail(&vs);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sfk_bias_gelu_backward(kdtype(x), dy->data, x->data, FLOATP(b), rows, n, approx,
                                dx->data, FLOATP(db));
    Py_END_ALLOW_THREADS
    return finish(&vs, rc);
}

static PyObject *py_swiglu_forward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[3];
    if (!PyArg_ParseTuple(args, "OOO:swiglu_forward", &o[0], &o[1], &o[2]))
        return NULL;
    views vs = {.fn = "swiglu_forward"};
    sf_view *g, *u, *y;
    if (take(&vs, o[0], "gate", K_DATA, 0, 0, &g) || take(&vs, o[1], "up", K_DATA, 0, 0, &u) ||
        take(&vs, o[2], "y", K_DATA, 1, 0, &y))
        return fail(&vs);
    if (want_numel(&vs, u, "up", g->numel) || want_numel(&vs, y, "y", g->numel) ||
        same_dtype(&vs, g, "gate", u, "up") || same_dtype(&vs, g, "gate", y, "y"))
        return fail(&vs);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sfk_swiglu_forward(kdtype(g), g->data, u->data, g->numel, y->data);
    Py_END_ALLOW_THREADS
    return finish(&vs, rc);
}

static PyObject *py_swiglu_backward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[5];
    if (!PyArg_ParseTuple(args, "OOOOO:swiglu_backward", &o[0], &o[1], &o[2], &o[3], &o[4]))
        return NULL;
    views vs = {.fn = "swiglu_backward"};
    sf_view *dy, *g, *u, *dg, *du;
    if (take(&vs, o[0], "dy", K_DATA, 0, 0, &dy) || take(&vs, o[1], "gate", K_DATA, 0, 0, &g) ||
        take(&vs, o[2], "up", K_DATA, 0, 0, &u) || take(&vs, o[3], "dgate", K_DATA, 1, 0, &dg) ||
        take(&vs, o[4], "dup", K_DATA, 1, 0, &du))
        return fail(&vs);
    if (want_numel(&vs, dy, "dy", g->numel) || want_numel(&vs, u, "up", g->numel) ||
        want_numel(&vs, dg, "dgate", g->numel) || want_numel(&vs, du, "dup", g->numel) ||
        same_dtype(&vs, g, "gate", dy, "dy") || same_dtype(&vs, g, "gate", u, "up") ||
        same_dtype(&vs, g, "gate", dg, "dgate") || same_dtype(&vs, g, "gate", du, "dup"))
        return fail(&vs);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sfk_swiglu_backward(kdtype(g), dy->data, g->data, u->data, g->numel, dg->data, du->data);
    Py_END_ALLOW_THREADS
    return finish(&vs, rc);
}

static PyObject *py_bda_forward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[4];
    float p;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OOOfKO:bias_dropout_add_forward", &o[0], &o[1], &o[2], &p, &seed,
                          &o[3]))
        return NULL;
    views vs = {.fn = "bias_dropout_add_forward"};
    sf_view *x, *b, *r, *y;
    if (take(&vs, o[0], "x", K_DATA, 0, 0, &x) || take(&vs, o[1], "bias", K_F32, 0, 1, &b) ||
        take(&vs, o[2], "residual", K_DATA, 0, 0, &r) || take(&vs, o[3], "y", K_DATA, 1, 0, &y))
        return fail(&vs);
    int64_t n = last_dim(x), rows = lead_rows(x);
    if (want_numel(&vs, b, "bias", n) || want_numel(&vs, r, "residual", x->numel) ||
        want_numel(&vs, y, "y", x->numel) || same_dtype(&vs, x, "x", r, "residual") ||
        same_dtype(&vs, x, "x", y, "y"))
        return fail(&vs);
    if (!(p >= 0.0f && p <= 1.0f)) {
        PyErr_Format(PyExc_ValueError, "bias_dropout_add_forward: p=%g outside [0, 1]", (double)p);
        return fail(&vs);
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sfk_bias_dropout_add_forward(kdtype(x), x->data, FLOATP(b), r->data, rows, n, p, seed,
                                      y->data);
    Py_END_ALLOW_THREADS
    return finish(&vs, rc);
}

static PyObject *py_bda_backward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[3];
    float p;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OfKOO:bias_dropout_add_backward", &o[0], &p, &seed, &o[1], &o[2]))
        return NULL;
    views vs = {.fn = "bias_dropout_add_backward"};
    sf_view *dy, *dx, *db;
    if (take(&vs, o[0], "dy", K_DATA, 0, 0, &dy) || take(&vs, o[1], "dx", K_DATA, 1, 0, &dx) ||
        take(&vs, o[2], "dbias", K_F32, 1, 1, &db))
        return fail(&vs);
    int64_t n = last_dim(dy), rows = lead_rows(dy);
    if (want_numel(&vs, dx, "dx", dy->numel) || want_numel(&vs, db, "dbias", n) ||
        same_dtype(&vs, dy, "dy", dx, "dx"))
        return fail(&vs);
    if (!(p >= 0.0f && p <= 1.0f)) {
        PyErr_Format(PyExc_ValueError, "bias_dropout_add_backward: p=%g outside [0, 1]", (double)p);
        return fail(&vs);
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sfk_bias_dropout_add_backward(kdtype(dy), dy->data, rows, n, p, seed, dx->data, FLOATP(db));
    Py_END_ALLOW_THREADS
    return finish(&vs, rc);
}

/* ---- embedding ---------------------------------------------------------- */

static PyObject *py_embedding_forward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[3];
    long long vstart, real;
    if (!PyArg_ParseTuple(args, "OOLLO:embedding_forward", &o[0], &o[1], &vstart, &real, &o[2]))
        return NULL;
    views vs = {.fn = "embedding_forward"};
    sf_view *w, *ids, *out;
    if (take(&vs, o[0], "weight", K_DATA, 0, 0, &w) || take(&vs, o[1], "ids", K_I64, 0, 0, &ids) ||
        take(&vs, o[2], "out", K_DATA, 1, 0, &out))
        return fail(&vs);
    if (w->ndim != 2 || real < 0 || real > w->shape[0]) {
        PyErr_Format(PyExc_ValueError, "embedding_forward: weight must be 2-D with at least "
                     "vocab_real=%lld rows, got %d-D", real, w->ndim);
        return fail(&vs);
    }
    int64_t d = w->shape[1];
    if (want_numel(&vs, out, "out", ids->numel * d) || same_dtype(&vs, w, "weight", out, "out"))
        return fail(&vs);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sfk_embedding_forward(kdtype(w), w->data, d, real, (const int64_t *)ids->data,
                               ids->numel, vstart, out->data);
    Py_END_ALLOW_THREADS
    return finish(&vs, rc);
}

static PyObject *py_embedding_backward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[3];
    long long vstart, real, pad;
    if (!PyArg_ParseTuple(args, "OOLLLO:embedding_backward", &o[0], &o[1], &vstart, &real, &pad,
                          &o[2]))
        return NULL;
    views vs = {.fn = "embedding_backward"};
    sf_view *dout, *ids, *dw;
    if (take(&vs, o[0], "dout", K_DATA, 0, 0, &dout) || take(&vs, o[1], "ids", K_I64, 0, 0, &ids) ||
        take(&vs, o[2], "dweight", K_F32, 1, 0, &dw))
        return fail(&vs);
    if (dw->ndim != 2 || real < 0 || real > dw->shape[0]) {
        PyErr_Format(PyExc_ValueError, "embedding_backward: dweight must be 2-D with at least "
                     "vocab_real=%lld rows, got %d-D", real, dw->ndim);
        return fail(&vs);
    }
    int64_t d = dw->shape[1];
    if (want_numel(&vs, dout, "dout", ids->numel * d))
        return fail(&vs);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sfk_embedding_backward(kdtype(dout), dout->data, (const int64_t *)ids->data, ids->numel,
                                d, real, vstart, pad, FLOATP(dw));
    Py_END_ALLOW_THREADS
    return finish(&vs, rc);
}

/* ---- attention ---------------------------------------------------------- */

/* `v` (optional) as a bias / mask read at (b, h, i, j) of [B, H, Sq, Sk]:
 * 4-D, each dimension 1 (broadcast, stride 0) or the full size. */
static int broadcast_strides(views *vs, const sf_view *v, const char *name, const int64_t full[4],
                             int64_t st[4])
{
    for (int d = 0; d < 4; d++) st[d] = 0;
    if (!v) return 0;
    int ok = v->ndim == 4;
    for (int d = 0; ok && d < 4; d++) ok = v->shape[d] == full[d] || v->shape[d] == 1;
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be 4-D and broadcast to [B, H, Sq, Sk] = "
                     "[%lld, %lld, %lld, %lld] (each dimension 1 or that size), got %d-D", vs->fn,
                     name, (long long)full[0], (long long)full[1], (long long)full[2],
                     (long long)full[3], v->ndim);
        return -1;
    }
    for (int d = 0; d < 4; d++) st[d] = v->shape[d] == 1 ? 0 : v->strides[d];
    return 0;
}

/* q, k, v shapes, GQA, the optional alibi / bias / mask, and the scalar
 * options into *a.  -1 with an exception. */
static int attn_params(views *vs, const sf_view *q, const sf_view *k, const sf_view *v,
                       const sf_view *alibi, const sf_view *bias, const sf_view *mask, float scale,
                       int causal, long long window, float p, unsigned long long seed, sfk_attn *a)
{
    if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4) {
        PyErr_Format(PyExc_ValueError, "%s: q, k, v must be 4-D [B, H, S, D], got %d-D, %d-D, %d-D",
                     vs->fn, q->ndim, k->ndim, v->ndim);
        return -1;
    }
    for (int d = 0; d < 4; d++)
        if (k->shape[d] != v->shape[d]) {
            PyErr_Format(PyExc_ValueError, "%s: k and v shapes differ in dimension %d (%lld vs %lld)",
                         vs->fn, d, (long long)k->shape[d], (long long)v->shape[d]);
            return -1;
        }
    if (q->shape[0] != k->shape[0] || q->shape[3] != k->shape[3]) {
        PyErr_Format(PyExc_ValueError, "%s: q [%lld, ., ., %lld] and k [%lld, ., ., %lld] differ in "
                     "batch or head size", vs->fn, (long long)q->shape[0], (long long)q->shape[3],
                     (long long)k->shape[0], (long long)k->shape[3]);
        return -1;
    }
    if (q->shape[1] > 0 && (k->shape[1] == 0 || q->shape[1] % k->shape[1] != 0)) {
        PyErr_Format(PyExc_ValueError, "%s: %lld query heads are not a multiple of %lld key-value "
                     "heads", vs->fn, (long long)q->shape[1], (long long)k->shape[1]);
        return -1;
    }
    if (same_dtype(vs, q, "q", k, "k") || same_dtype(vs, q, "q", v, "v")) return -1;
    if (window < 0 || !(p >= 0.0f && p <= 1.0f)) {
        PyErr_Format(PyExc_ValueError, "%s: window=%lld must be >= 0 and dropout=%g in [0, 1]",
                     vs->fn, window, (double)p);
        return -1;
    }
    *a = (sfk_attn){.t = kdtype(q), .B = q->shape[0], .Hq = q->shape[1], .Hkv = k->shape[1],
                    .Sq = q->shape[2], .Sk = k->shape[2], .D = q->shape[3], .scale = scale,
                    .causal = causal, .window = window, .dropout = p, .seed = seed};
    const int64_t full[4] = {a->B, a->Hq, a->Sq, a->Sk};
    if (want_numel(vs, alibi, "alibi_slopes", a->Hq) ||
        broadcast_strides(vs, bias, "bias", full, a->bias_st) ||
        broadcast_strides(vs, mask, "mask", full, a->mask_st))
        return -1;
    a->alibi = FLOATP(alibi);
    a->bias = FLOATP(bias);
    a->mask = mask ? (const uint8_t *)mask->data : NULL;
    return 0;
}

/* A boolean / uint8 mask (K_DATA-like check for bytes). */
static int take_mask(views *vs, PyObject *obj, sf_view **out)
{
    if (take(vs, obj, "mask", -1, 0, 1, out) < 0) return -1;
    if (*out && !(((*out)->dtype.code == SF_DL_BOOL || (*out)->dtype.code == SF_DL_UINT) &&
                  (*out)->dtype.bits == 8)) {
        PyErr_Format(PyExc_TypeError, "%s: mask must be bool or uint8, got %s", vs->fn,
                     sf_dtype_name((*out)->dtype));
        return -1;
    }
    return 0;
}

static PyObject *py_attention_forward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[8];
    float scale, p;
    int causal;
    long long window;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OOOOOfpLOOOfK:attention_forward", &o[0], &o[1], &o[2], &o[3],
                          &o[4], &scale, &causal, &window, &o[5], &o[6], &o[7], &p, &seed))
        return NULL;
    views vs = {.fn = "attention_forward"};
    sf_view *q, *k, *v, *out, *lse, *al, *bi, *mk;
    if (take(&vs, o[0], "q", K_DATA, 0, 0, &q) || take(&vs, o[1], "k", K_DATA, 0, 0, &k) ||
        take(&vs, o[2], "v", K_DATA, 0, 0, &v) || take(&vs, o[3], "out", K_DATA, 1, 0, &out) ||
        take(&vs, o[4], "lse", K_F32, 1, 0, &lse) || take(&vs, o[5], "alibi_slopes", K_F32, 0, 1, &al) ||
        take(&vs, o[6], "bias", K_F32, 0, 1, &bi) || take_mask(&vs, o[7], &mk))
        return fail(&vs);
    sfk_attn a;
    if (attn_params(&vs, q, k, v, al, bi, mk, scale, causal, window, p, seed, &a) ||
        want_numel(&vs, out, "out", q->numel) || same_dtype(&vs, q, "q", out, "out") ||
        want_numel(&vs, lse, "lse", a.B * a.Hq * a.Sq))
        return fail(&vs);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sfk_attention_forward(&a, q->data, k->data, v->data, out->data, FLOATP(lse));
    Py_END_ALLOW_THREADS
    return finish(&vs, rc);
}

static PyObject *py_attention_backward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[13];
    float scale, p;
    int causal;
    long long window;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOfpLOOOfK:attention_backward", &o[0], &o[1], &o[2],
                          &o[3], &o[4], &o[5], &o[6], &o[7], &o[8], &o[9], &scale, &causal,
                          &window, &o[10], &o[11], &o[12], &p, &seed))
        return NULL;
    views vs = {.fn = "attention_backward"};
    sf_view *q, *k, *v, *out, *dout, *lse, *dq, *dk, *dv, *db, *al, *bi, *mk;
    /* MAXV views at most: q k v out dout lse dq dk dv dbias + alibi bias mask = 13 */
    if (take(&vs, o[0], "q", K_DATA, 0, 0, &q) || take(&vs, o[1], "k", K_DATA, 0, 0, &k) ||
        take(&vs, o[2], "v", K_DATA, 0, 0, &v) || take(&vs, o[3], "out", K_DATA, 0, 0, &out) ||
        take(&vs, o[4], "dout", K_DATA, 0, 0, &dout) || take(&vs, o[5], "lse", K_F32, 0, 0, &lse) ||
        take(&vs, o[6], "dq", K_DATA, 1, 0, &dq) || take(&vs, o[7], "dk", K_DATA, 1, 0, &dk) ||
        take(&vs, o[8], "dv", K_DATA, 1, 0, &dv) || take(&vs, o[9], "dbias", K_F32, 1, 1, &db) ||
        take(&vs, o[10], "alibi_slopes", K_F32, 0, 1, &al) ||
        take(&vs, o[11], "bias", K_F32, 0, 1, &bi) || take_mask(&vs, o[12], &mk))
        return fail(&vs);
    sfk_attn a;
    if (attn_params(&vs, q, k, v, al, bi, mk, scale, causal, window, p, seed, &a) ||
        want_numel(&vs, out, "out", q->numel) || want_numel(&vs, dout, "dout", q->numel) ||
        want_numel(&vs, dq, "dq", q->numel) || want_numel(&vs, dk, "dk", k->numel) ||
        want_numel(&vs, dv, "dv", k->numel) || same_dtype(&vs, q, "q", out, "out") ||
        same_dtype(&vs, q, "q", dout, "dout") || same_dtype(&vs, q, "q", dq, "dq") ||
        same_dtype(&vs, q, "q", dk, "dk") || same_dtype(&vs, q, "q", dv, "dv") ||
        want_numel(&vs, lse, "lse", a.B * a.Hq * a.Sq) ||
        want_numel(&vs, db, "dbias", a.B * a.Hq * a.Sq * a.Sk))
        return fail(&vs);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sfk_attention_backward(&a, q->data, k->data, v->data, out->data, dout->data, FLOATP(lse),
                                dq->data, dk->data, dv->data, FLOATP(db));
    Py_END_ALLOW_THREADS
    return finish(&vs, rc);
}

static PyObject *py_attention_dropout_keep(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *obj;
    float p;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OfK:attention_dropout_keep", &obj, &p, &seed))
        return NULL;
    views vs = {.fn = "attention_dropout_keep"};
    sf_view *keep;
    if (take(&vs, obj, "keep", -1, 1, 0, &keep))
        return fail(&vs);
    if (keep->ndim != 4 || keep->dtype.code != SF_DL_UINT || keep->dtype.bits != 8 ||
        !(p >= 0.0f && p <= 1.0f)) {
        PyErr_Format(PyExc_ValueError, "attention_dropout_keep: keep must be a 4-D uint8 "
                     "[B, H, Sq, Sk] tensor and p=%g in [0, 1]", (double)p);
        return fail(&vs);
    }
    sfk_attn a = {.t = SFK_F32, .B = keep->shape[0], .Hq = keep->shape[1], .Hkv = 1,
                  .Sq = keep->shape[2], .Sk = keep->shape[3], .D = 0, .dropout = p, .seed = seed};
    if (a.Hq == 0) a.Hkv = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sfk_attention_dropout_keep(&a, (uint8_t *)keep->data);
    Py_END_ALLOW_THREADS
    return finish(&vs, rc);
}

/* ---- threads ------------------------------------------------------------ */

static PyObject *py_set_threads(PyObject *self, PyObject *args)
{
    (void)self;
    int n;
    if (!PyArg_ParseTuple(args, "i:kernel_set_num_threads", &n))
        return NULL;
    if (n < 1 || n > 64) {
        PyErr_Format(PyExc_ValueError, "kernel_set_num_threads: n=%d outside [1, 64]", n);
        return NULL;
    }
    sfk_set_num_threads(n);
    Py_RETURN_NONE;
}

static PyObject *py_get_threads(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyLong_FromLong(sfk_get_num_threads());
}

static PyObject *py_has_avx2(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyBool_FromLong(sfk_has_avx2());
}

static PyMethodDef kernel_methods[] = {
    {"xent_forward", py_xent_forward, METH_VARARGS,
     "xent_forward(logits, labels, vocab_start, vocab_real, ignore_index, max, sumexp, target, "
     "sumz|None): per-row max, sum exp(z - max), target logit, sum z of a vocabulary shard."},
    {"xent_backward", py_xent_backward, METH_VARARGS,
     "xent_backward(logits, labels, vocab_start, vocab_real, ignore_index, lse, scale, eps, vocab, "
     "grad): grad = scale * (softmax - (1-eps) onehot - eps/vocab), 0 on padding columns."},
    {"norm_forward", py_norm_forward, METH_VARARGS,
     "norm_forward(rms, x, weight|None, bias|None, eps, y, mean|None, rstd)"},
    {"norm_backward", py_norm_backward, METH_VARARGS,
     "norm_backward(rms, dy, x, weight|None, mean|None, rstd, dx, dweight|None, dbias|None)"},
    {"bias_gelu_forward", py_bias_gelu_forward, METH_VARARGS,
     "bias_gelu_forward(x, bias|None, tanh_approx, y)"},
    {"bias_gelu_backward", py_bias_gelu_backward, METH_VARARGS,
     "bias_gelu_backward(dy, x, bias|None, tanh_approx, dx, dbias|None)"},
    {"swiglu_forward", py_swiglu_forward, METH_VARARGS, "swiglu_forward(gate, up, y)"},
    {"swiglu_backward", py_swiglu_backward, METH_VARARGS,
     "swiglu_backward(dy, gate, up, dgate, dup)"},
    {"bias_dropout_add_forward", py_bda_forward, METH_VARARGS,
     "bias_dropout_add_forward(x, bias|None, residual, p, seed, y)"},
    {"bias_dropout_add_backward", py_bda_backward, METH_VARARGS,
     "bias_dropout_add_backward(dy, p, seed, dx, dbias|None)"},
    {"embedding_forward", py_embedding_forward, METH_VARARGS,
     "embedding_forward(weight, ids, vocab_start, vocab_real, out)"},
    {"embedding_backward", py_embedding_backward, METH_VARARGS,
     "embedding_backward(dout, ids, vocab_start, vocab_real, padding_local, dweight)"},
    {"attention_forward", py_attention_forward, METH_VARARGS,
     "attention_forward(q, k, v, out, lse, scale, causal, window, alibi_slopes|None, bias|None, "
     "mask|None, dropout, seed): flash-style attention (csrc/kernels/attention.h)."},
    {"attention_backward", py_attention_backward, METH_VARARGS,
     "attention_backward(q, k, v, out, dout, lse, dq, dk, dv, dbias|None, scale, causal, window, "
     "alibi_slopes|None, bias|None, mask|None, dropout, seed)"},
    {"attention_dropout_keep", py_attention_dropout_keep, METH_VARARGS,
     "attention_dropout_keep(keep, p, seed): the dropout draws of attention as uint8 [B, H, Sq, Sk]."},
    {"kernel_set_num_threads", py_set_threads, METH_VARARGS,
     "kernel_set_num_threads(n): threads the kernels split rows over (large inputs only)."},
    {"kernel_get_num_threads", py_get_threads, METH_NOARGS, "kernel_get_num_threads() -> int"},
    {"kernel_has_avx2", py_has_avx2, METH_NOARGS, "kernel_has_avx2() -> bool"},
    {NULL, NULL, 0, NULL},
};

int sf_register_kernels(PyObject *m)
{
    return PyModule_AddFunctions(m, kernel_methods);
}
