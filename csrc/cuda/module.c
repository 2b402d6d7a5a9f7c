/*
 * cuda/module.c -- shardformer._cuda, the CPython glue of the CUDA kernels
 * (cuda/kernels.h).  Plain C; it links the launchers nvcc compiled.
 *
 * Each function takes the arguments of its _C namesake (kernels_module.c),
 * in the same order, plus the CUDA stream to enqueue on as an integer (the
 * caller passes torch.cuda.current_stream(device).cuda_stream).  Tensors come
 * in through the same DLPack gate as _C's (kernel_args.h), here requiring
 * CUDA tensors, all on one device, which is made current for the launch and
 * restored after.  Sizes that relate the tensors are checked before any work;
 * launcher failures become exceptions through the one mapper (sf_set_pyerr).
 * The kernels run asynchronously on the stream, as torch's own ops do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "cuda/kernels.h"
#include "kernel_args.h"

/* Every tensor of the call on one CUDA device: *dev.  -1 with ValueError
 * naming the two arguments and their devices. */
static int one_device(views *vs, int *dev)
{
    *dev = vs->v[0].device.device_id;
    for (int i = 1; i < vs->n; i++)
        if (vs->v[i].device.device_id != *dev) {
            PyErr_Format(PyExc_ValueError, "%s: %s is on cuda:%d but %s is on cuda:%d (every tensor "
                         "of a call must be on one device)", vs->fn, vs->label[0], *dev, vs->label[i],
                         (int)vs->v[i].device.device_id);
            return -1;
        }
    return 0;
}

#define STREAM(s) ((cudaStream_t)(uintptr_t)(s))

/* The checks of RUN (kernel_args.h), then the launch on the tensors' device,
 * without the GIL: `rc = call;` */
#define RUN_CUDA(call)                                                        \
    int dev = 0;                                                              \
    if (no_overlap(&vs) || one_device(&vs, &dev)) return fail(&vs);           \
    sf_error err = {0};                                                       \
    sf_status rc;                                                             \
    Py_BEGIN_ALLOW_THREADS                                                    \
    int prev = 0;                                                             \
    rc = sfc_device_enter(dev, &prev, &err);                                  \
    if (rc == SF_OK) {                                                        \
        rc = (call);                                                          \
        sfc_device_leave(prev);                                               \
    }                                                                         \
    Py_END_ALLOW_THREADS                                                      \
    return finish(&vs, rc, &err)

#define VIEWS(name) views vs = {.fn = name " (CUDA)", .device = SF_TAKE_CUDA}

/* ---- cross-entropy ------------------------------------------------------ */

static PyObject *py_xent_forward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[6];
    long long vstart, real, ignore, vocab;
    unsigned long long s;
    if (!PyArg_ParseTuple(args, "OOLLLOOOOLK:xent_forward", &o[0], &o[1], &vstart, &real, &ignore,
                          &o[2], &o[3], &o[4], &o[5], &vocab, &s))
        return NULL;
    VIEWS("xent_forward");
    sf_view *z, *y, *mx, *se, *tg, *sz;
    if (arg(&vs, o[0], "logits", IN, &z) || arg(&vs, o[1], "labels", I64, &y) ||
        arg(&vs, o[2], "max", F32_OUT, &mx) || arg(&vs, o[3], "sumexp", F32_OUT, &se) ||
        arg(&vs, o[4], "target", F32_OUT, &tg) || arg(&vs, o[5], "sumz", F32_OUT_OPT, &sz))
        return fail(&vs);
    int64_t n = last_dim(z), rows = 0;
    if (lead_rows(&vs, z, &rows)) return fail(&vs);
    if (want_numel(&vs, y, "labels", rows) || want_numel(&vs, mx, "max", rows) ||
        want_numel(&vs, se, "sumexp", rows) || want_numel(&vs, tg, "target", rows) ||
        want_numel(&vs, sz, "sumz", rows))
        return fail(&vs);
    RUN_CUDA(sfc_xent_forward(kdtype(z), z->data, rows, n, real, (const int64_t *)y->data, vstart,
                              ignore, vocab, FLOATP(mx), FLOATP(se), FLOATP(tg), FLOATP(sz),
                              STREAM(s), &err));
}

static PyObject *py_xent_backward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[5];
    long long vstart, real, ignore, vocab;
    float eps;
    unsigned long long s;
    if (!PyArg_ParseTuple(args, "OOLLLOOfLOK:xent_backward", &o[0], &o[1], &vstart, &real, &ignore,
                          &o[2], &o[3], &eps, &vocab, &o[4], &s))
        return NULL;
    VIEWS("xent_backward");
    sf_view *z, *y, *lse, *sc, *g;
    if (arg(&vs, o[0], "logits", IN, &z) || arg(&vs, o[1], "labels", I64, &y) ||
        arg(&vs, o[2], "lse", F32, &lse) || arg(&vs, o[3], "scale", F32, &sc) ||
        arg(&vs, o[4], "grad", OUT, &g))
        return fail(&vs);
    int64_t n = last_dim(z), rows = 0;
    if (lead_rows(&vs, z, &rows)) return fail(&vs);
    if (want_numel(&vs, y, "labels", rows) || want_numel(&vs, lse, "lse", rows) ||
        want_numel(&vs, sc, "scale", rows) || want_numel(&vs, g, "grad", z->numel) ||
        same_dtype(&vs, z, "logits", g, "grad"))
        return fail(&vs);
    vs.same_ok[0] = z;                       /* the gradient may overwrite the logits */
    vs.same_ok[1] = g;
    RUN_CUDA(sfc_xent_backward(kdtype(z), z->data, g->data, rows, n, real, (const int64_t *)y->data,
                               vstart, ignore, FLOATP(lse), FLOATP(sc), eps, vocab, STREAM(s),
                               &err));
}

/* ---- norms -------------------------------------------------------------- */

static PyObject *py_norm_forward(PyObject *self, PyObject *args)
{
    (void)self;
    int rms;
    float eps;
    PyObject *o[6];
    unsigned long long s;
    if (!PyArg_ParseTuple(args, "pOOOfOOOK:norm_forward", &rms, &o[0], &o[1], &o[2], &eps, &o[3],
                          &o[4], &o[5], &s))
        return NULL;
    VIEWS("norm_forward");
    sf_view *x, *w, *b, *y, *mu, *rs;
    if (arg(&vs, o[0], "x", IN, &x) || arg(&vs, o[1], "weight", F32_OPT, &w) ||
        arg(&vs, o[2], "bias", F32_OPT, &b) || arg(&vs, o[3], "y", OUT, &y) ||
        arg(&vs, o[4], "mean", F32_OUT_OPT, &mu) || arg(&vs, o[5], "rstd", F32_OUT, &rs))
        return fail(&vs);
    int64_t n = last_dim(x), rows = 0;
    if (lead_rows(&vs, x, &rows)) return fail(&vs);
    if (want_numel(&vs, w, "weight", n) || want_numel(&vs, b, "bias", n) ||
        want_numel(&vs, y, "y", x->numel) || same_dtype(&vs, x, "x", y, "y") ||
        want_numel(&vs, mu, "mean", rows) || want_numel(&vs, rs, "rstd", rows))
        return fail(&vs);
    RUN_CUDA(sfc_norm_forward(rms, kdtype(x), x->data, rows, n, FLOATP(w), FLOATP(b), eps, y->data,
                              FLOATP(mu), FLOATP(rs), STREAM(s), &err));
}

static PyObject *py_norm_backward(PyObject *self, PyObject *args)
{
    (void)self;
    int rms;
    PyObject *o[8];
    unsigned long long s;
    if (!PyArg_ParseTuple(args, "pOOOOOOOOK:norm_backward", &rms, &o[0], &o[1], &o[2], &o[3], &o[4],
                          &o[5], &o[6], &o[7], &s))
        return NULL;
    VIEWS("norm_backward");
    sf_view *dy, *x, *w, *mu, *rs, *dx, *dw, *db;
    if (arg(&vs, o[0], "dy", IN, &dy) || arg(&vs, o[1], "x", IN, &x) ||
        arg(&vs, o[2], "weight", F32_OPT, &w) ||
        arg(&vs, o[3], "mean", SF_DT_F32, rms ? SF_TAKE_OPTIONAL : 0, &mu) ||
        arg(&vs, o[4], "rstd", F32, &rs) || arg(&vs, o[5], "dx", OUT, &dx) ||
        arg(&vs, o[6], "dweight", F32_OUT_OPT, &dw) || arg(&vs, o[7], "dbias", F32_OUT_OPT, &db))
        return fail(&vs);
    int64_t n = last_dim(x), rows = 0;
    if (lead_rows(&vs, x, &rows)) return fail(&vs);
    if (want_numel(&vs, dy, "dy", x->numel) || want_numel(&vs, dx, "dx", x->numel) ||
        same_dtype(&vs, x, "x", dy, "dy") || same_dtype(&vs, x, "x", dx, "dx") ||
        want_numel(&vs, w, "weight", n) || want_numel(&vs, dw, "dweight", n) ||
        want_numel(&vs, db, "dbias", n) || want_numel(&vs, mu, "mean", rows) ||
        want_numel(&vs, rs, "rstd", rows))
        return fail(&vs);
    RUN_CUDA(sfc_norm_backward(rms, kdtype(x), dy->data, x->data, rows, n, FLOATP(w), FLOATP(mu),
                               FLOATP(rs), dx->data, FLOATP(dw), FLOATP(db), STREAM(s), &err));
}

/* ---- elementwise -------------------------------------------------------- */

static PyObject *py_bias_gelu_forward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[3];
    int approx;
    unsigned long long s;
    if (!PyArg_ParseTuple(args, "OOpOK:bias_gelu_forward", &o[0], &o[1], &approx, &o[2], &s))
        return NULL;
    VIEWS("bias_gelu_forward");
    sf_view *x, *b, *y;
    if (arg(&vs, o[0], "x", IN, &x) || arg(&vs, o[1], "bias", F32_OPT, &b) ||
        arg(&vs, o[2], "y", OUT, &y))
        return fail(&vs);
    int64_t n = last_dim(x), rows = 0;
    if (lead_rows(&vs, x, &rows)) return fail(&vs);
    if (want_numel(&vs, b, "bias", n) || want_numel(&vs, y, "y", x->numel) ||
        same_dtype(&vs, x, "x", y, "y"))
        return fail(&vs);
    RUN_CUDA(sfc_bias_gelu_forward(kdtype(x), x->data, FLOATP(b), rows, n, approx, y->data,
                                   STREAM(s), &err));
}

static PyObject *py_bias_gelu_backward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[5];
    int approx;
    unsigned long long s;
    if (!PyArg_ParseTuple(args, "OOOpOOK:bias_gelu_backward", &o[0], &o[1], &o[2], &approx, &o[3],
                          &o[4], &s))
        return NULL;
    VIEWS("bias_gelu_backward");
    sf_view *dy, *x, *b, *dx, *db;
    if (arg(&vs, o[0], "dy", IN, &dy) || arg(&vs, o[1], "x", IN, &x) ||
        arg(&vs, o[2], "bias", F32_OPT, &b) || arg(&vs, o[3], "dx", OUT, &dx) ||
        arg(&vs, o[4], "dbias", F32_OUT_OPT, &db))
        return fail(&vs);
    int64_t n = last_dim(x), rows = 0;
    if (lead_rows(&vs, x, &rows)) return fail(&vs);
    if (want_numel(&vs, b, "bias", n) || want_numel(&vs, db, "dbias", n) ||
        want_numel(&vs, dy, "dy", x->numel) || want_numel(&vs, dx, "dx", x->numel) ||
        same_dtype(&vs, x, "x", dy, "dy") || same_dtype(&vs, x, "x", dx, "dx"))
        return fail(&vs);
    RUN_CUDA(sfc_bias_gelu_backward(kdtype(x), dy->data, x->data, FLOATP(b), rows, n, approx,
                                    dx->data, FLOATP(db), STREAM(s), &err));
}

static PyObject *py_swiglu_forward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[3];
    unsigned long long s;
    if (!PyArg_ParseTuple(args, "OOOK:swiglu_forward", &o[0], &o[1], &o[2], &s))
        return NULL;
    VIEWS("swiglu_forward");
    sf_view *g, *u, *y;
    if (arg(&vs, o[0], "gate", IN, &g) || arg(&vs, o[1], "up", IN, &u) ||
        arg(&vs, o[2], "y", OUT, &y))
        return fail(&vs);
    if (want_numel(&vs, u, "up", g->numel) || want_numel(&vs, y, "y", g->numel) ||
        same_dtype(&vs, g, "gate", u, "up") || same_dtype(&vs, g, "gate", y, "y"))
        return fail(&vs);
    RUN_CUDA(sfc_swiglu_forward(kdtype(g), g->data, u->data, g->numel, y->data, STREAM(s), &err));
}

static PyObject *py_swiglu_backward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[5];
    unsigned long long s;
    if (!PyArg_ParseTuple(args, "OOOOOK:swiglu_backward", &o[0], &o[1], &o[2], &o[3], &o[4], &s))
        return NULL;
    VIEWS("swiglu_backward");
    sf_view *dy, *g, *u, *dg, *du;
    if (arg(&vs, o[0], "dy", IN, &dy) || arg(&vs, o[1], "gate", IN, &g) ||
        arg(&vs, o[2], "up", IN, &u) || arg(&vs, o[3], "dgate", OUT, &dg) ||
        arg(&vs, o[4], "dup", OUT, &du))
        return fail(&vs);
    if (want_numel(&vs, dy, "dy", g->numel) || want_numel(&vs, u, "up", g->numel) ||
        want_numel(&vs, dg, "dgate", g->numel) || want_numel(&vs, du, "dup", g->numel) ||
        same_dtype(&vs, g, "gate", dy, "dy") || same_dtype(&vs, g, "gate", u, "up") ||
        same_dtype(&vs, g, "gate", dg, "dgate") || same_dtype(&vs, g, "gate", du, "dup"))
        return fail(&vs);
    RUN_CUDA(sfc_swiglu_backward(kdtype(g), dy->data, g->data, u->data, g->numel, dg->data,
                                 du->data, STREAM(s), &err));
}

static PyObject *py_bda_forward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[4];
    float p;
    unsigned long long seed, s;
    if (!PyArg_ParseTuple(args, "OOOfKOK:bias_dropout_add_forward", &o[0], &o[1], &o[2], &p, &seed,
                          &o[3], &s))
        return NULL;
    VIEWS("bias_dropout_add_forward");
    sf_view *x, *b, *r, *y;
    if (arg(&vs, o[0], "x", IN, &x) || arg(&vs, o[1], "bias", F32_OPT, &b) ||
        arg(&vs, o[2], "residual", IN, &r) || arg(&vs, o[3], "y", OUT, &y))
        return fail(&vs);
    int64_t n = last_dim(x), rows = 0;
    if (lead_rows(&vs, x, &rows)) return fail(&vs);
    if (want_numel(&vs, b, "bias", n) || want_numel(&vs, r, "residual", x->numel) ||
        want_numel(&vs, y, "y", x->numel) || same_dtype(&vs, x, "x", r, "residual") ||
        same_dtype(&vs, x, "x", y, "y"))
        return fail(&vs);
    RUN_CUDA(sfc_bias_dropout_add_forward(kdtype(x), x->data, FLOATP(b), r->data, rows, n, p, seed,
                                          y->data, STREAM(s), &err));
}

static PyObject *py_bda_backward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[3];
    float p;
    unsigned long long seed, s;
    if (!PyArg_ParseTuple(args, "OfKOOK:bias_dropout_add_backward", &o[0], &p, &seed, &o[1], &o[2],
                          &s))
        return NULL;
    VIEWS("bias_dropout_add_backward");
    sf_view *dy, *dx, *db;
    if (arg(&vs, o[0], "dy", IN, &dy) || arg(&vs, o[1], "dx", OUT, &dx) ||
        arg(&vs, o[2], "dbias", F32_OUT_OPT, &db))
        return fail(&vs);
    int64_t n = last_dim(dy), rows = 0;
    if (lead_rows(&vs, dy, &rows)) return fail(&vs);
    if (want_numel(&vs, dx, "dx", dy->numel) || want_numel(&vs, db, "dbias", n) ||
        same_dtype(&vs, dy, "dy", dx, "dx"))
        return fail(&vs);
    RUN_CUDA(sfc_bias_dropout_add_backward(kdtype(dy), dy->data, rows, n, p, seed, dx->data,
                                           FLOATP(db), STREAM(s), &err));
}

/* ---- embedding ---------------------------------------------------------- */

static PyObject *py_embedding_forward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[3];
    long long vstart, real, vocab;
    unsigned long long s;
    if (!PyArg_ParseTuple(args, "OOLLOLK:embedding_forward", &o[0], &o[1], &vstart, &real, &o[2],
                          &vocab, &s))
        return NULL;
    VIEWS("embedding_forward");
    sf_view *w, *ids, *out;
    if (arg(&vs, o[0], "weight", IN, &w) || arg(&vs, o[1], "ids", I64, &ids) ||
        arg(&vs, o[2], "out", OUT, &out))
        return fail(&vs);
    if (w->ndim != 2 || real < 0 || real > w->shape[0]) {
        PyErr_Format(PyExc_ValueError, "%s: weight must be 2-D with at least vocab_real=%lld rows, "
                     "got %d-D", vs.fn, real, w->ndim);
        return fail(&vs);
    }
    int64_t d = w->shape[1], nout;
    if (mul(&vs, "ids x embedding size", ids->numel, d, &nout) ||
        want_numel(&vs, out, "out", nout) || same_dtype(&vs, w, "weight", out, "out"))
        return fail(&vs);
    RUN_CUDA(sfc_embedding_forward(kdtype(w), w->data, d, real, (const int64_t *)ids->data,
                                   ids->numel, vstart, vocab, out->data, STREAM(s), &err));
}

static PyObject *py_embedding_backward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[3];
    long long vstart, real, pad;
    unsigned long long s;
    if (!PyArg_ParseTuple(args, "OOLLLOK:embedding_backward", &o[0], &o[1], &vstart, &real, &pad,
                          &o[2], &s))
        return NULL;
    VIEWS("embedding_backward");
    sf_view *dout, *ids, *dw;
    if (arg(&vs, o[0], "dout", IN, &dout) || arg(&vs, o[1], "ids", I64, &ids) ||
        arg(&vs, o[2], "dweight", F32_OUT, &dw))
        return fail(&vs);
    if (dw->ndim != 2 || real < 0 || real > dw->shape[0]) {
        PyErr_Format(PyExc_ValueError, "%s: dweight must be 2-D with at least vocab_real=%lld "
                     "rows, got %d-D", vs.fn, real, dw->ndim);
        return fail(&vs);
    }
    int64_t d = dw->shape[1], nout;
    if (mul(&vs, "ids x embedding size", ids->numel, d, &nout) ||
        want_numel(&vs, dout, "dout", nout))
        return fail(&vs);
    RUN_CUDA(sfc_embedding_backward(kdtype(dout), dout->data, (const int64_t *)ids->data,
                                    ids->numel, d, real, vstart, pad, FLOATP(dw), STREAM(s), &err));
}

static PyObject *py_device_count(PyObject *self, PyObject *args)
{
    (void)self;
    (void)args;
    int n;
    Py_BEGIN_ALLOW_THREADS
    n = sfc_device_count();
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(n);
}

#define FN(name, f, doc) {name, (PyCFunction)(f), METH_VARARGS, doc}

static PyMethodDef methods[] = {
    FN("norm_forward", py_norm_forward, "norm_forward(rms, x, w, b, eps, y, mean, rstd, stream)"),
    FN("norm_backward", py_norm_backward,
       "norm_backward(rms, dy, x, w, mean, rstd, dx, dw, db, stream)"),
    FN("xent_forward", py_xent_forward,
       "xent_forward(logits, labels, vocab_start, vocab_real, ignore_index, max, sumexp, target, "
       "sumz, vocab, stream)"),
    FN("xent_backward", py_xent_backward,
       "xent_backward(logits, labels, vocab_start, vocab_real, ignore_index, lse, scale, eps, "
       "vocab, grad, stream)"),
    FN("embedding_forward", py_embedding_forward,
       "embedding_forward(weight, ids, vocab_start, vocab_real, out, vocab, stream)"),
    FN("embedding_backward", py_embedding_backward,
       "embedding_backward(dout, ids, vocab_start, vocab_real, padding_local, dweight, stream)"),
    FN("bias_gelu_forward", py_bias_gelu_forward, "bias_gelu_forward(x, b, tanh, y, stream)"),
    FN("bias_gelu_backward", py_bias_gelu_backward,
       "bias_gelu_backward(dy, x, b, tanh, dx, db, stream)"),
    FN("swiglu_forward", py_swiglu_forward, "swiglu_forward(gate, up, y, stream)"),
    FN("swiglu_backward", py_swiglu_backward, "swiglu_backward(dy, gate, up, dgate, dup, stream)"),
    FN("bias_dropout_add_forward", py_bda_forward,
       "bias_dropout_add_forward(x, b, residual, p, seed, y, stream)"),
    FN("bias_dropout_add_backward", py_bda_backward,
       "bias_dropout_add_backward(dy, p, seed, dx, db, stream)"),
    {"device_count", (PyCFunction)py_device_count, METH_NOARGS,
     "device_count() -> the CUDA devices the runtime sees (0: none, or no driver)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "shardformer._cuda",
    "The CUDA kernels of shardformer (csrc/cuda/): see shardformer.ops and docs/cuda.md.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cuda(void) { return PyModule_Create(&moddef); }
