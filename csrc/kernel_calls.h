/*
 * kernel_calls.h -- the argument parsing and checks of each kernel call
 * that the CPU glue (kernels_module.c, shardformer._C) and the CUDA glue
 * (cuda/module.c, shardformer._cuda) share: the same Python arguments, the
 * same checks, the same messages; each glue then calls its own kernel.
 *
 * take_<op>(vs, args, k) parses `args` (the _C call's arguments; the CUDA
 * glue strips its trailing stream first), takes every tensor into vs on
 * vs->device (kernel_args.h) and checks the sizes that relate them, filling
 * k: k->t[] the tensors in the order of the call (NULL for a None),
 * k->rows / k->n the leading rows and the last dimension of the first, and
 * the scalars.  0 on success; -1 with an exception (the caller releases vs).
 */
#ifndef SHARDFORMER_KERNEL_CALLS_H
#define SHARDFORMER_KERNEL_CALLS_H

#include "kernel_args.h"

typedef struct {
    sf_view *t[8];          /* tensors, in the order of the call */
    int64_t rows, n;        /* leading rows and last dimension of t[0] (embedding: see there) */
    long long i[4];         /* integer arguments, in the order of the call */
    float f;                /* eps, or dropout p */
    int flag;               /* rms, or the tanh form */
    unsigned long long seed;
} kcall;

/* t[0] [..., n]: k->n and k->rows from it */
static inline int rows_of(views *vs, kcall *k, const sf_view *v)
{
    k->n = last_dim(v);
    return lead_rows(vs, v, &k->rows);
}

/* xent_forward(logits, labels, vocab_start, vocab_real, ignore_index, max, sumexp, target,
 * sumz, vocab=-1): t = logits, labels, max, sumexp, target, sumz; i = vstart, real, ignore, vocab */
static inline int take_xent_forward(views *vs, PyObject *args, kcall *k)
{
    PyObject *o[6];
    k->i[3] = -1;
    if (!PyArg_ParseTuple(args, "OOLLLOOOO|L:xent_forward", &o[0], &o[1], &k->i[0], &k->i[1],
                          &k->i[2], &o[2], &o[3], &o[4], &o[5], &k->i[3]))
        return -1;
    sf_view **t = k->t;
    if (arg(vs, o[0], "logits", IN, &t[0]) || arg(vs, o[1], "labels", I64, &t[1]) ||
        arg(vs, o[2], "max", F32_OUT, &t[2]) || arg(vs, o[3], "sumexp", F32_OUT, &t[3]) ||
        arg(vs, o[4], "target", F32_OUT, &t[4]) || arg(vs, o[5], "sumz", F32_OUT_OPT, &t[5]) ||
        rows_of(vs, k, t[0]))
        return -1;
    return want_numel(vs, t[1], "labels", k->rows) || want_numel(vs, t[2], "max", k->rows) ||
           want_numel(vs, t[3], "sumexp", k->rows) || want_numel(vs, t[4], "target", k->rows) ||
           want_numel(vs, t[5], "sumz", k->rows) ? -1 : 0;
}

/* xent_backward(logits, labels, vocab_start, vocab_real, ignore_index, lse, scale, eps, vocab,
 * grad): t = logits, labels, lse, scale, grad (may be the logits); i = vstart, real, ignore, vocab */
static inline int take_xent_backward(views *vs, PyObject *args, kcall *k)
{
    PyObject *o[5];
    if (!PyArg_ParseTuple(args, "OOLLLOOfLO:xent_backward", &o[0], &o[1], &k->i[0], &k->i[1],
                          &k->i[2], &o[2], &o[3], &k->f, &k->i[3], &o[4]))
        return -1;
    sf_view **t = k->t;
    if (arg(vs, o[0], "logits", IN, &t[0]) || arg(vs, o[1], "labels", I64, &t[1]) ||
        arg(vs, o[2], "lse", F32, &t[2]) || arg(vs, o[3], "scale", F32, &t[3]) ||
        arg(vs, o[4], "grad", OUT, &t[4]) || rows_of(vs, k, t[0]))
        return -1;
    if (want_numel(vs, t[1], "labels", k->rows) || want_numel(vs, t[2], "lse", k->rows) ||
        want_numel(vs, t[3], "scale", k->rows) || want_numel(vs, t[4], "grad", t[0]->numel) ||
        same_dtype(vs, t[0], "logits", t[4], "grad"))
        return -1;
    vs->same_ok[0] = t[0];                   /* the gradient may overwrite the logits */
    vs->same_ok[1] = t[4];
    return 0;
}

/* norm_forward(rms, x, w, b, eps, y, mean, rstd): t = x, w, b, y, mean, rstd */
static inline int take_norm_forward(views *vs, PyObject *args, kcall *k)
{
    PyObject *o[6];
    if (!PyArg_ParseTuple(args, "pOOOfOOO:norm_forward", &k->flag, &o[0], &o[1], &o[2], &k->f,
                          &o[3], &o[4], &o[5]))
        return -1;
    sf_view **t = k->t;
    if (arg(vs, o[0], "x", IN, &t[0]) || arg(vs, o[1], "weight", F32_OPT, &t[1]) ||
        arg(vs, o[2], "bias", F32_OPT, &t[2]) || arg(vs, o[3], "y", OUT, &t[3]) ||
        arg(vs, o[4], "mean", F32_OUT_OPT, &t[4]) || arg(vs, o[5], "rstd", F32_OUT, &t[5]) ||
        rows_of(vs, k, t[0]))
        return -1;
    return want_numel(vs, t[1], "weight", k->n) || want_numel(vs, t[2], "bias", k->n) ||
           want_numel(vs, t[3], "y", t[0]->numel) || same_dtype(vs, t[0], "x", t[3], "y") ||
           want_numel(vs, t[4], "mean", k->rows) || want_numel(vs, t[5], "rstd", k->rows) ? -1 : 0;
}

/* norm_backward(rms, dy, x, w, mean, rstd, dx, dw, db): t = dy, x, w, mean, rstd, dx, dw, db;
 * rows / n from x */
static inline int take_norm_backward(views *vs, PyObject *args, kcall *k)
{
    PyObject *o[8];
    if (!PyArg_ParseTuple(args, "pOOOOOOOO:norm_backward", &k->flag, &o[0], &o[1], &o[2], &o[3],
                          &o[4], &o[5], &o[6], &o[7]))
        return -1;
    sf_view **t = k->t;
    if (arg(vs, o[0], "dy", IN, &t[0]) || arg(vs, o[1], "x", IN, &t[1]) ||
        arg(vs, o[2], "weight", F32_OPT, &t[2]) ||
        arg(vs, o[3], "mean", SF_DT_F32, k->flag ? SF_TAKE_OPTIONAL : 0, &t[3]) ||
        arg(vs, o[4], "rstd", F32, &t[4]) || arg(vs, o[5], "dx", OUT, &t[5]) ||
        arg(vs, o[6], "dweight", F32_OUT_OPT, &t[6]) || arg(vs, o[7], "dbias", F32_OUT_OPT, &t[7]) ||
        rows_of(vs, k, t[1]))
        return -1;
    const int64_t numel = t[1]->numel;
    return want_numel(vs, t[0], "dy", numel) || want_numel(vs, t[5], "dx", numel) ||
           same_dtype(vs, t[1], "x", t[0], "dy") || same_dtype(vs, t[1], "x", t[5], "dx") ||
           want_numel(vs, t[2], "weight", k->n) || want_numel(vs, t[6], "dweight", k->n) ||
           want_numel(vs, t[7], "dbias", k->n) || want_numel(vs, t[3], "mean", k->rows) ||
           want_numel(vs, t[4], "rstd", k->rows) ? -1 : 0;
}

/* bias_gelu_forward(x, b, tanh, y): t = x, b, y */
static inline int take_bias_gelu_forward(views *vs, PyObject *args, kcall *k)
{
    PyObject *o[3];
    if (!PyArg_ParseTuple(args, "OOpO:bias_gelu_forward", &o[0], &o[1], &k->flag, &o[2]))
        return -1;
    sf_view **t = k->t;
    if (arg(vs, o[0], "x", IN, &t[0]) || arg(vs, o[1], "bias", F32_OPT, &t[1]) ||
        arg(vs, o[2], "y", OUT, &t[2]) || rows_of(vs, k, t[0]))
        return -1;
    return want_numel(vs, t[1], "bias", k->n) || want_numel(vs, t[2], "y", t[0]->numel) ||
           same_dtype(vs, t[0], "x", t[2], "y") ? -1 : 0;
}

/* bias_gelu_backward(dy, x, b, tanh, dx, db): t = dy, x, b, dx, db; rows / n from x */
static inline int take_bias_gelu_backward(views *vs, PyObject *args, kcall *k)
{
    PyObject *o[5];
    if (!PyArg_ParseTuple(args, "OOOpOO:bias_gelu_backward", &o[0], &o[1], &o[2], &k->flag, &o[3],
                          &o[4]))
        return -1;
    sf_view **t = k->t;
    if (arg(vs, o[0], "dy", IN, &t[0]) || arg(vs, o[1], "x", IN, &t[1]) ||
        arg(vs, o[2], "bias", F32_OPT, &t[2]) || arg(vs, o[3], "dx", OUT, &t[3]) ||
        arg(vs, o[4], "dbias", F32_OUT_OPT, &t[4]) || rows_of(vs, k, t[1]))
        return -1;
    const int64_t numel = t[1]->numel;
    return want_numel(vs, t[2], "bias", k->n) || want_numel(vs, t[4], "dbias", k->n) ||
           want_numel(vs, t[0], "dy", numel) || want_numel(vs, t[3], "dx", numel) ||
           same_dtype(vs, t[1], "x", t[0], "dy") || same_dtype(vs, t[1], "x", t[3], "dx") ? -1 : 0;
}

/* swiglu_forward(gate, up, y): t = gate, up, y */
static inline int take_swiglu_forward(views *vs, PyObject *args, kcall *k)
{
    PyObject *o[3];
    if (!PyArg_ParseTuple(args, "OOO:swiglu_forward", &o[0], &o[1], &o[2]))
        return -1;
    sf_view **t = k->t;
    if (arg(vs, o[0], "gate", IN, &t[0]) || arg(vs, o[1], "up", IN, &t[1]) ||
        arg(vs, o[2], "y", OUT, &t[2]))
        return -1;
    return want_numel(vs, t[1], "up", t[0]->numel) || want_numel(vs, t[2], "y", t[0]->numel) ||
           same_dtype(vs, t[0], "gate", t[1], "up") || same_dtype(vs, t[0], "gate", t[2], "y") ? -1 : 0;
}

/* swiglu_backward(dy, gate, up, dgate, dup): t = dy, gate, up, dgate, dup */
static inline int take_swiglu_backward(views *vs, PyObject *args, kcall *k)
{
    PyObject *o[5];
    if (!PyArg_ParseTuple(args, "OOOOO:swiglu_backward", &o[0], &o[1], &o[2], &o[3], &o[4]))
        return -1;
    sf_view **t = k->t;
    if (arg(vs, o[0], "dy", IN, &t[0]) || arg(vs, o[1], "gate", IN, &t[1]) ||
        arg(vs, o[2], "up", IN, &t[2]) || arg(vs, o[3], "dgate", OUT, &t[3]) ||
        arg(vs, o[4], "dup", OUT, &t[4]))
        return -1;
    const int64_t numel = t[1]->numel;
    return want_numel(vs, t[0], "dy", numel) || want_numel(vs, t[2], "up", numel) ||
           want_numel(vs, t[3], "dgate", numel) || want_numel(vs, t[4], "dup", numel) ||
           same_dtype(vs, t[1], "gate", t[0], "dy") || same_dtype(vs, t[1], "gate", t[2], "up") ||
           same_dtype(vs, t[1], "gate", t[3], "dgate") || same_dtype(vs, t[1], "gate", t[4], "dup") ? -1 : 0;
}

/* bias_dropout_add_forward(x, b, residual, p, seed, y): t = x, b, residual, y */
static inline int take_bda_forward(views *vs, PyObject *args, kcall *k)
{
    PyObject *o[4];
    if (!PyArg_ParseTuple(args, "OOOfKO:bias_dropout_add_forward", &o[0], &o[1], &o[2], &k->f,
                          &k->seed, &o[3]))
        return -1;
    sf_view **t = k->t;
    if (arg(vs, o[0], "x", IN, &t[0]) || arg(vs, o[1], "bias", F32_OPT, &t[1]) ||
        arg(vs, o[2], "residual", IN, &t[2]) || arg(vs, o[3], "y", OUT, &t[3]) ||
        rows_of(vs, k, t[0]))
        return -1;
    return want_numel(vs, t[1], "bias", k->n) || want_numel(vs, t[2], "residual", t[0]->numel) ||
           want_numel(vs, t[3], "y", t[0]->numel) || same_dtype(vs, t[0], "x", t[2], "residual") ||
           same_dtype(vs, t[0], "x", t[3], "y") ? -1 : 0;
}

/* bias_dropout_add_backward(dy, p, seed, dx, db): t = dy, dx, db */
static inline int take_bda_backward(views *vs, PyObject *args, kcall *k)
{
    PyObject *o[3];
    if (!PyArg_ParseTuple(args, "OfKOO:bias_dropout_add_backward", &o[0], &k->f, &k->seed, &o[1],
                          &o[2]))
        return -1;
    sf_view **t = k->t;
    if (arg(vs, o[0], "dy", IN, &t[0]) || arg(vs, o[1], "dx", OUT, &t[1]) ||
        arg(vs, o[2], "dbias", F32_OUT_OPT, &t[2]) || rows_of(vs, k, t[0]))
        return -1;
    return want_numel(vs, t[1], "dx", t[0]->numel) || want_numel(vs, t[2], "dbias", k->n) ||
           same_dtype(vs, t[0], "dy", t[1], "dx") ? -1 : 0;
}

/* embedding_forward(weight, ids, vocab_start, vocab_real, out, vocab=-1): t = weight, ids, out;
 * i = vstart, real, vocab; k->n = d (weight's columns) */
static inline int take_embedding_forward(views *vs, PyObject *args, kcall *k)
{
    PyObject *o[3];
    k->i[2] = -1;
    if (!PyArg_ParseTuple(args, "OOLLO|L:embedding_forward", &o[0], &o[1], &k->i[0], &k->i[1], &o[2],
                          &k->i[2]))
        return -1;
    sf_view **t = k->t;
    if (arg(vs, o[0], "weight", IN, &t[0]) || arg(vs, o[1], "ids", I64, &t[1]) ||
        arg(vs, o[2], "out", OUT, &t[2]))
        return -1;
    if (t[0]->ndim != 2 || k->i[1] < 0 || k->i[1] > t[0]->shape[0]) {
        PyErr_Format(PyExc_ValueError, "%s: weight must be 2-D with at least vocab_real=%lld rows, "
                     "got %d-D", vs->fn, k->i[1], t[0]->ndim);
        return -1;
    }
    int64_t nout;
    k->n = t[0]->shape[1];
    return mul(vs, "ids x embedding size", t[1]->numel, k->n, &nout) ||
           want_numel(vs, t[2], "out", nout) || same_dtype(vs, t[0], "weight", t[2], "out") ? -1 : 0;
}

/* embedding_backward / embedding_grad(dout, ids, vocab_start, vocab_real, padding_local, dweight):
 * t = dout, ids, dweight; i = vstart, real, pad; k->n = d (dweight's columns), k->rows = its rows.
 * backward's dweight is float32 (summed into), grad's has dout's dtype (every row written). */
static inline int take_embedding_dweight(views *vs, PyObject *args, kcall *k, const char *format,
                                         int dout_dtype)
{
    PyObject *o[3];
    if (!PyArg_ParseTuple(args, format, &o[0], &o[1], &k->i[0], &k->i[1], &k->i[2], &o[2]))
        return -1;
    sf_view **t = k->t;
    if (arg(vs, o[0], "dout", IN, &t[0]) || arg(vs, o[1], "ids", I64, &t[1]) ||
        arg(vs, o[2], "dweight", dout_dtype ? SF_DT_FLOAT : SF_DT_F32, SF_TAKE_WRITE, &t[2]))
        return -1;
    if (t[2]->ndim != 2 || k->i[1] < 0 || k->i[1] > t[2]->shape[0]) {
        PyErr_Format(PyExc_ValueError, "%s: dweight must be 2-D with at least vocab_real=%lld rows, "
                     "got %d-D", vs->fn, k->i[1], t[2]->ndim);
        return -1;
    }
    int64_t nout;
    k->n = t[2]->shape[1];
    k->rows = t[2]->shape[0];
    return mul(vs, "ids x embedding size", t[1]->numel, k->n, &nout) ||
           want_numel(vs, t[0], "dout", nout) ||
           (dout_dtype && same_dtype(vs, t[0], "dout", t[2], "dweight")) ? -1 : 0;
}

static inline int take_embedding_backward(views *vs, PyObject *args, kcall *k)
{
    return take_embedding_dweight(vs, args, k, "OOLLLO:embedding_backward", 0);
}

static inline int take_embedding_grad(views *vs, PyObject *args, kcall *k)
{
    return take_embedding_dweight(vs, args, k, "OOLLLO:embedding_grad", 1);
}

#define I64P(v) ((const int64_t *)(v)->data)

#endif /* SHARDFORMER_KERNEL_CALLS_H */
