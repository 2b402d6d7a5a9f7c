/*
 * kernels_module.c -- the CPython glue of csrc/kernels/.
 *
 * Every function takes its inputs and preallocated outputs as tensors through
 * the one DLPack gate (sf_take: device, dtype, contiguity, writability), checks
 * the sizes that relate them before touching anything, refuses an output that
 * shares memory with any other tensor of the call (RUN; the one in-place use,
 * xent_backward's grad = logits, is declared with same_ok), releases the GIL
 * around the kernel and turns the sf_status it returns into an exception with
 * the one mapper (sf_set_pyerr).  Scalar arguments (vocab_real, p, window,
 * ...) are checked by the kernels themselves, whose messages name the kernel,
 * the argument and the numbers.  Outputs are allocated by the caller
 * (shardformer.ops), so nothing here creates tensors.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>

#include "cpu_features.h"
#include "glue.h"
#include "kernels/attention.h"
#include "kernels/cross_entropy.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/linear.h"
#include "kernels/norm.h"
#include "kernel_args.h"
#include "kernel_calls.h"
#include "tensor_view.h"

/* ---- cross-entropy ------------------------------------------------------ */

static PyObject *py_xent_forward(PyObject *self, PyObject *args)
{
    (void)self;
    views vs = {.fn = "xent_forward"};
    kcall k = {0};
    sf_view **t = k.t;
    if (take_xent_forward(&vs, args, &k)) return fail(&vs);
    RUN(sfk_xent_forward(kdtype(t[0]), t[0]->data, k.rows, k.n, k.i[1], I64P(t[1]), k.i[0], k.i[2], k.i[3],
                         FLOATP(t[2]), FLOATP(t[3]), FLOATP(t[4]), FLOATP(t[5]), &err));
}

static PyObject *py_xent_backward(PyObject *self, PyObject *args)
{
    (void)self;
    views vs = {.fn = "xent_backward"};
    kcall k = {0};
    sf_view **t = k.t;
    if (take_xent_backward(&vs, args, &k)) return fail(&vs);
    RUN(sfk_xent_backward(kdtype(t[0]), t[0]->data, t[4]->data, k.rows, k.n, k.i[1], I64P(t[1]), k.i[0],
                          k.i[2], FLOATP(t[2]), FLOATP(t[3]), k.f, k.i[3], &err));
}

/* ---- norms -------------------------------------------------------------- */

static PyObject *py_norm_forward(PyObject *self, PyObject *args)
{
    (void)self;
    views vs = {.fn = "norm_forward"};
    kcall k = {0};
    sf_view **t = k.t;
    if (take_norm_forward(&vs, args, &k)) return fail(&vs);
    RUN(sfk_norm_forward(k.flag, kdtype(t[0]), t[0]->data, k.rows, k.n, FLOATP(t[1]), FLOATP(t[2]), k.f,
                         t[3]->data, FLOATP(t[4]), FLOATP(t[5]), &err));
}

static PyObject *py_norm_backward(PyObject *self, PyObject *args)
{
    (void)self;
    views vs = {.fn = "norm_backward"};
    kcall k = {0};
    sf_view **t = k.t;
    if (take_norm_backward(&vs, args, &k)) return fail(&vs);
    RUN(sfk_norm_backward(k.flag, kdtype(t[1]), t[0]->data, t[1]->data, k.rows, k.n, FLOATP(t[2]),
                          FLOATP(t[3]), FLOATP(t[4]), t[5]->data, FLOATP(t[6]), FLOATP(t[7]), &err));
}

/* ---- linear on few rows -------------------------------------------------- */

/* skinny_linear(x [..., k], weight [n, k], bias [n] fp32 or None, y [..., n], path=0):
 * y = x weight^T + bias over the m rows of x (the leading dimensions).  The
 * weight's rows may lie any distance >= k apart (unit stride within a row):
 * a column slice of a wider tensor is read in place.  path: sfk_linear_path
 * (0 auto, 1 portable, 2 avx2, 3 avx512_bf16). */
static PyObject *py_skinny_linear(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[4];
    int path = SFK_LIN_AUTO;
    if (!PyArg_ParseTuple(args, "OOOO|i:skinny_linear", &o[0], &o[1], &o[2], &o[3], &path))
        return NULL;
    views vs = {.fn = "skinny_linear"};
    sf_view *x, *w, *b, *y;
    if (arg(&vs, o[0], "x", IN, &x) || arg(&vs, o[1], "weight", SF_DT_FLOAT, ARG_STRIDED, &w) ||
        arg(&vs, o[2], "bias", F32_OPT, &b) || arg(&vs, o[3], "y", OUT, &y))
        return fail(&vs);
    if (w->ndim != 2) {
        PyErr_Format(PyExc_ValueError, "skinny_linear: weight must be 2-D [out, in], got %d dimensions",
                     w->ndim);
        return fail(&vs);
    }
    const int64_t n = w->shape[0], k = w->shape[1];
    /* rows ldw elements apart; a dimension of size <= 1 has no stride to read */
    const int64_t ldw = n > 1 && k > 0 ? w->strides[0] : k;
    if (w->numel > 0 && ((k > 1 && w->strides[1] != 1) || ldw < k)) {
        PyErr_Format(PyExc_ValueError, "skinny_linear: weight [%lld, %lld] has strides (%lld, %lld): the kernel "
                     "reads rows of unit stride at least %lld elements apart; pass weight.contiguous()",
                     (long long)n, (long long)k, (long long)w->strides[0], (long long)w->strides[1],
                     (long long)k);
        return fail(&vs);
    }
    int64_t m = 0, mn = 0;
    if (lead_rows(&vs, x, &m)) return fail(&vs);
    if (last_dim(x) != k) {
        PyErr_Format(PyExc_ValueError, "skinny_linear: x has %lld features in its last dimension but weight "
                     "[%lld, %lld] takes %lld", (long long)last_dim(x), (long long)n, (long long)k,
                     (long long)k);
        return fail(&vs);
    }
    if (mul(&vs, "rows x outputs", m, n, &mn) || want_numel(&vs, y, "y", mn) ||
        want_numel(&vs, b, "bias", n) || same_dtype(&vs, x, "x", w, "weight") ||
        same_dtype(&vs, x, "x", y, "y"))
        return fail(&vs);
    RUN(sfk_skinny_linear(kdtype(x), x->data, w->data, ldw, FLOATP(b), m, n, k, y->data,
                          (sfk_linear_path)path, &err));
}

/* skinny_linear_path(dtype) -> the sfk_linear_path AUTO runs for it here:
 * dtype 0 float32, 1 float16, 2 bfloat16. */
static PyObject *py_skinny_linear_path(PyObject *self, PyObject *arg_)
{
    (void)self;
    const long d = PyLong_AsLong(arg_);
    if (d == -1 && PyErr_Occurred()) return NULL;
    if (d < 0 || d > 2) {
        PyErr_Format(PyExc_ValueError, "skinny_linear_path: dtype code %ld is not 0 (float32), 1 (float16) or "
                     "2 (bfloat16)", d);
        return NULL;
    }
    const sfk_dtype t = d == 0 ? SFK_F32 : d == 1 ? SFK_F16 : SFK_BF16;
    return PyLong_FromLong((long)sfk_skinny_linear_auto(t));
}

/* ---- elementwise -------------------------------------------------------- */

static PyObject *py_bias_gelu_forward(PyObject *self, PyObject *args)
{
    (void)self;
    views vs = {.fn = "bias_gelu_forward"};
    kcall k = {0};
    sf_view **t = k.t;
    if (take_bias_gelu_forward(&vs, args, &k)) return fail(&vs);
    RUN(sfk_bias_gelu_forward(kdtype(t[0]), t[0]->data, FLOATP(t[1]), k.rows, k.n, k.flag, t[2]->data, &err));
}

static PyObject *py_bias_gelu_backward(PyObject *self, PyObject *args)
{
    (void)self;
    views vs = {.fn = "bias_gelu_backward"};
    kcall k = {0};
    sf_view **t = k.t;
    if (take_bias_gelu_backward(&vs, args, &k)) return fail(&vs);
    RUN(sfk_bias_gelu_backward(kdtype(t[1]), t[0]->data, t[1]->data, FLOATP(t[2]), k.rows, k.n, k.flag,
                               t[3]->data, FLOATP(t[4]), &err));
}

static PyObject *py_swiglu_forward(PyObject *self, PyObject *args)
{
    (void)self;
    views vs = {.fn = "swiglu_forward"};
    kcall k = {0};
    sf_view **t = k.t;
    if (take_swiglu_forward(&vs, args, &k)) return fail(&vs);
    RUN(sfk_swiglu_forward(kdtype(t[0]), t[0]->data, t[1]->data, t[0]->numel, t[2]->data, &err));
}

static PyObject *py_swiglu_backward(PyObject *self, PyObject *args)
{
    (void)self;
    views vs = {.fn = "swiglu_backward"};
    kcall k = {0};
    sf_view **t = k.t;
    if (take_swiglu_backward(&vs, args, &k)) return fail(&vs);
    RUN(sfk_swiglu_backward(kdtype(t[1]), t[0]->data, t[1]->data, t[2]->data, t[1]->numel, t[3]->data,
                            t[4]->data, &err));
}

static PyObject *py_bda_forward(PyObject *self, PyObject *args)
{
    (void)self;
    views vs = {.fn = "bias_dropout_add_forward"};
    kcall k = {0};
    sf_view **t = k.t;
    if (take_bda_forward(&vs, args, &k)) return fail(&vs);
    RUN(sfk_bias_dropout_add_forward(kdtype(t[0]), t[0]->data, FLOATP(t[1]), t[2]->data, k.rows, k.n, k.f,
                                     k.seed, t[3]->data, &err));
}

static PyObject *py_bda_backward(PyObject *self, PyObject *args)
{
    (void)self;
    views vs = {.fn = "bias_dropout_add_backward"};
    kcall k = {0};
    sf_view **t = k.t;
    if (take_bda_backward(&vs, args, &k)) return fail(&vs);
    RUN(sfk_bias_dropout_add_backward(kdtype(t[0]), t[0]->data, k.rows, k.n, k.f, k.seed, t[1]->data,
                                      FLOATP(t[2]), &err));
}

/* ---- embedding ---------------------------------------------------------- */

static PyObject *py_embedding_forward(PyObject *self, PyObject *args)
{
    (void)self;
    views vs = {.fn = "embedding_forward"};
    kcall k = {0};
    sf_view **t = k.t;
    if (take_embedding_forward(&vs, args, &k)) return fail(&vs);
    RUN(sfk_embedding_forward(kdtype(t[0]), t[0]->data, k.n, k.i[1], I64P(t[1]), t[1]->numel, k.i[0],
                              k.i[2], t[2]->data, &err));
}

static PyObject *py_embedding_backward(PyObject *self, PyObject *args)
{
    (void)self;
    views vs = {.fn = "embedding_backward"};
    kcall k = {0};
    sf_view **t = k.t;
    if (take_embedding_backward(&vs, args, &k)) return fail(&vs);
    RUN(sfk_embedding_backward(kdtype(t[0]), t[0]->data, I64P(t[1]), t[1]->numel, k.n, k.i[1], k.i[0],
                               k.i[2], FLOATP(t[2]), &err));
}

static PyObject *py_embedding_grad(PyObject *self, PyObject *args)
{
    (void)self;
    views vs = {.fn = "embedding_grad"};
    kcall k = {0};
    sf_view **t = k.t;
    if (take_embedding_grad(&vs, args, &k)) return fail(&vs);
    RUN(sfk_embedding_grad(kdtype(t[0]), t[0]->data, I64P(t[1]), t[1]->numel, k.n, k.rows, k.i[1], k.i[0],
                           k.i[2], t[2]->data, &err));
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

/* q, k, v shapes, the optional alibi / bias / mask, and the scalar options
 * into *a, with the element counts of lse and dbias.  -1 with an exception. */
static int attn_params(views *vs, const sf_view *q, const sf_view *k, const sf_view *v,
                       const sf_view *alibi, const sf_view *bias, const sf_view *mask, float scale,
                       int causal, long long window, float p, unsigned long long seed, sfk_attn *a,
                       int64_t sz[2])
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
    if (same_dtype(vs, q, "q", k, "k") || same_dtype(vs, q, "q", v, "v")) return -1;
    /* window, dropout and the GQA ratio are the kernel's to check (sfk_attention_*) */
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
    return mul(vs, "B x Hq", a->B, a->Hq, &sz[0]) || mul(vs, "B x Hq x Sq", sz[0], a->Sq, &sz[0]) ||
           mul(vs, "B x Hq x Sq x Sk", sz[0], a->Sk, &sz[1]) ? -1 : 0;
}

/* The optional trailing `softcap` of attention_forward / _backward: None (or
 * absent) and 0 mean none, else a finite float > 0 (as a float32: a value
 * that rounds to 0 or to infinity is refused too).  -1 with an exception. */
static int softcap_arg(const char *fn, PyObject *obj, float *cap)
{
    *cap = 0.0f;
    if (!obj || obj == Py_None) return 0;
    if (!PyFloat_Check(obj) && !PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: softcap must be a float or None, got %s", fn,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    const double d = PyFloat_AsDouble(obj);
    if (d == -1.0 && PyErr_Occurred()) return -1;
    const float f = (float)d;
    if (d == 0.0) return 0;
    if (!(d > 0.0) || !isfinite(d) || !isfinite(f) || f == 0.0f) {
        PyErr_Format(PyExc_ValueError, "%s: softcap=%R must be finite and > 0 as a float32 "
                     "(0 or None: no soft-capping)", fn, obj);
        return -1;
    }
    *cap = f;
    return 0;
}

/* The optional dropout coordinates (attention.h): qpos [Sq] and kpos [Sk]
 * int64 (or None) and drop_seq >= 0 into *a; the kernel checks the values.
 * -1 with an exception. */
static int drop_positions(views *vs, const sf_view *qpos, const sf_view *kpos, long long drop_seq,
                          sfk_attn *a)
{
    if (want_numel(vs, qpos, "qpos", a->Sq) || want_numel(vs, kpos, "kpos", a->Sk)) return -1;
    if (drop_seq < 0) {
        PyErr_Format(PyExc_ValueError, "%s: drop_seq=%lld must be >= 0 (0: the query count)",
                     vs->fn, drop_seq);
        return -1;
    }
    a->qpos = qpos ? (const int64_t *)qpos->data : NULL;
    a->kpos = kpos ? (const int64_t *)kpos->data : NULL;
    a->drop_seq = (int64_t)drop_seq;
    return 0;
}

/* A boolean / uint8 mask, optional. */
#define MASK SF_DT_BOOL | SF_DT_U8, SF_TAKE_OPTIONAL

static PyObject *py_attention_forward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[10] = {0}, *capobj = NULL;
    float scale, p, cap;
    int causal;
    long long window, drop_seq = 0;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OOOOOfpLOOOfK|OOOL:attention_forward", &o[0], &o[1], &o[2], &o[3],
                          &o[4], &scale, &causal, &window, &o[5], &o[6], &o[7], &p, &seed, &capobj,
                          &o[8], &o[9], &drop_seq) ||
        softcap_arg("attention_forward", capobj, &cap))
        return NULL;
    views vs = {.fn = "attention_forward"};
    sf_view *q, *k, *v, *out, *lse, *al, *bi, *mk, *qp = NULL, *kp = NULL;
    if (arg(&vs, o[0], "q", IN, &q) || arg(&vs, o[1], "k", IN, &k) ||
        arg(&vs, o[2], "v", IN, &v) || arg(&vs, o[3], "out", OUT, &out) ||
        arg(&vs, o[4], "lse", F32_OUT, &lse) || arg(&vs, o[5], "alibi_slopes", F32_OPT, &al) ||
        arg(&vs, o[6], "bias", F32_OPT, &bi) || arg(&vs, o[7], "mask", MASK, &mk) ||
        (o[8] && arg(&vs, o[8], "qpos", I64_OPT, &qp)) ||
        (o[9] && arg(&vs, o[9], "kpos", I64_OPT, &kp)))
        return fail(&vs);
    sfk_attn a;
    int64_t sz[2];
    if (attn_params(&vs, q, k, v, al, bi, mk, scale, causal, window, p, seed, &a, sz) ||
        want_numel(&vs, out, "out", q->numel) || same_dtype(&vs, q, "q", out, "out") ||
        want_numel(&vs, lse, "lse", sz[0]) || drop_positions(&vs, qp, kp, drop_seq, &a))
        return fail(&vs);
    a.softcap = cap;
    RUN(sfk_attention_forward(&a, q->data, k->data, v->data, out->data, FLOATP(lse), &err));
}

static PyObject *py_attention_backward(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[15] = {0}, *capobj = NULL;
    float scale, p, cap;
    int causal;
    long long window, drop_seq = 0;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOfpLOOOfK|OOOL:attention_backward", &o[0], &o[1], &o[2],
                          &o[3], &o[4], &o[5], &o[6], &o[7], &o[8], &o[9], &scale, &causal,
                          &window, &o[10], &o[11], &o[12], &p, &seed, &capobj, &o[13], &o[14],
                          &drop_seq) ||
        softcap_arg("attention_backward", capobj, &cap))
        return NULL;
    views vs = {.fn = "attention_backward"};
    sf_view *q, *k, *v, *out, *dout, *lse, *dq, *dk, *dv, *db, *al, *bi, *mk;
    sf_view *qp = NULL, *kp = NULL;
    /* MAXV views at most: q k v out dout lse dq dk dv dbias + alibi bias mask + qpos kpos = 15 */
    if (arg(&vs, o[0], "q", IN, &q) || arg(&vs, o[1], "k", IN, &k) ||
        arg(&vs, o[2], "v", IN, &v) || arg(&vs, o[3], "out", IN, &out) ||
        arg(&vs, o[4], "dout", IN, &dout) || arg(&vs, o[5], "lse", F32, &lse) ||
        arg(&vs, o[6], "dq", OUT, &dq) || arg(&vs, o[7], "dk", OUT, &dk) ||
        arg(&vs, o[8], "dv", OUT, &dv) || arg(&vs, o[9], "dbias", F32_OUT_OPT, &db) ||
        arg(&vs, o[10], "alibi_slopes", F32_OPT, &al) ||
        arg(&vs, o[11], "bias", F32_OPT, &bi) || arg(&vs, o[12], "mask", MASK, &mk) ||
        (o[13] && arg(&vs, o[13], "qpos", I64_OPT, &qp)) ||
        (o[14] && arg(&vs, o[14], "kpos", I64_OPT, &kp)))
        return fail(&vs);
    sfk_attn a;
    int64_t sz[2];
    if (attn_params(&vs, q, k, v, al, bi, mk, scale, causal, window, p, seed, &a, sz) ||
        want_numel(&vs, out, "out", q->numel) || want_numel(&vs, dout, "dout", q->numel) ||
        want_numel(&vs, dq, "dq", q->numel) || want_numel(&vs, dk, "dk", k->numel) ||
        want_numel(&vs, dv, "dv", k->numel) || same_dtype(&vs, q, "q", out, "out") ||
        same_dtype(&vs, q, "q", dout, "dout") || same_dtype(&vs, q, "q", dq, "dq") ||
        same_dtype(&vs, q, "q", dk, "dk") || same_dtype(&vs, q, "q", dv, "dv") ||
        want_numel(&vs, lse, "lse", sz[0]) || want_numel(&vs, db, "dbias", sz[1]) ||
        drop_positions(&vs, qp, kp, drop_seq, &a))
        return fail(&vs);
    a.softcap = cap;
    RUN(sfk_attention_backward(&a, q->data, k->data, v->data, out->data, dout->data, FLOATP(lse),
                                dq->data, dk->data, dv->data, FLOATP(db), &err));
}

static PyObject *py_attention_dropout_keep(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *obj, *qo = NULL, *ko = NULL;
    float p;
    unsigned long long seed;
    long long drop_seq = 0;
    if (!PyArg_ParseTuple(args, "OfK|OOL:attention_dropout_keep", &obj, &p, &seed, &qo, &ko,
                          &drop_seq))
        return NULL;
    views vs = {.fn = "attention_dropout_keep"};
    sf_view *keep, *qp = NULL, *kp = NULL;
    if (arg(&vs, obj, "keep", SF_DT_ANY, SF_TAKE_WRITE, &keep) ||
        (qo && arg(&vs, qo, "qpos", I64_OPT, &qp)) || (ko && arg(&vs, ko, "kpos", I64_OPT, &kp)))
        return fail(&vs);
    if (keep->ndim != 4 || sf_dtype_bit(keep->dtype) != SF_DT_U8) {
        PyErr_Format(PyExc_ValueError, "attention_dropout_keep: keep must be a 4-D uint8 "
                     "[B, H, Sq, Sk] tensor, got %d-D %s", keep->ndim, sf_dtype_name(keep->dtype));
        return fail(&vs);
    }
    sfk_attn a = {.t = SFK_F32, .B = keep->shape[0], .Hq = keep->shape[1], .Hkv = 1,
                  .Sq = keep->shape[2], .Sk = keep->shape[3], .D = 0, .dropout = p, .seed = seed};
    if (a.Hq == 0) a.Hkv = 0;
    if (drop_positions(&vs, qp, kp, drop_seq, &a))
        return fail(&vs);
    RUN(sfk_attention_dropout_keep(&a, (uint8_t *)keep->data, &err));
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

/* The worker pool of the kernels' row-parallel driver (csrc/kernels/common.c). */
static PyObject *py_pool_stats(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    int64_t created, workers, calls, busy;
    sfk_pool_stats(&created, &workers, &calls, &busy);
    return Py_BuildValue("{s:L,s:L,s:L,s:L}", "threads_created", (long long)created, "workers",
                         (long long)workers, "pool_calls", (long long)calls, "inline_busy",
                         (long long)busy);
}

static PyObject *py_pool_shutdown(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    Py_BEGIN_ALLOW_THREADS
    sfk_pool_shutdown();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---- dtype conversion, for tests ------------------------------------------ */

static PyObject *py_convert(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[2];
    if (!PyArg_ParseTuple(args, "OO:kernel_convert", &o[0], &o[1]))
        return NULL;
    views vs = {.fn = "kernel_convert"};
    sf_view *src, *dst;
    if (arg(&vs, o[0], "src", IN, &src) || arg(&vs, o[1], "dst", OUT, &dst) ||
        want_numel(&vs, dst, "dst", src->numel))
        return fail(&vs);
    RUN(sfk_convert(kdtype(src), src->data, kdtype(dst), dst->data, src->numel, &err));
}

static PyMethodDef kernel_methods[] = {
    {"xent_forward", py_xent_forward, METH_VARARGS,
     "xent_forward(logits, labels, vocab_start, vocab_real, ignore_index, max, sumexp, target, "
     "sumz|None, vocab=-1): per-row max, sum exp(z - max), target logit, sum z of a vocabulary "
     "shard; with vocab >= 0, a label outside [0, vocab) other than ignore_index is an "
     "IndexError."},
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
    {"skinny_linear", py_skinny_linear, METH_VARARGS,
     "skinny_linear(x, weight, bias, y, path=0): y = x weight^T + bias"},
    {"skinny_linear_path", py_skinny_linear_path, METH_O,
     "skinny_linear_path(dtype_code) -> the path the kernel takes by default"},
    {"swiglu_forward", py_swiglu_forward, METH_VARARGS, "swiglu_forward(gate, up, y)"},
    {"swiglu_backward", py_swiglu_backward, METH_VARARGS,
     "swiglu_backward(dy, gate, up, dgate, dup)"},
    {"bias_dropout_add_forward", py_bda_forward, METH_VARARGS,
     "bias_dropout_add_forward(x, bias|None, residual, p, seed, y)"},
    {"bias_dropout_add_backward", py_bda_backward, METH_VARARGS,
     "bias_dropout_add_backward(dy, p, seed, dx, dbias|None)"},
    {"embedding_forward", py_embedding_forward, METH_VARARGS,
     "embedding_forward(weight, ids, vocab_start, vocab_real, out, vocab=-1): with vocab >= 0, "
     "an id outside [0, vocab) is an IndexError."},
    {"embedding_backward", py_embedding_backward, METH_VARARGS,
     "embedding_backward(dout, ids, vocab_start, vocab_real, padding_local, dweight)"},
    {"embedding_grad", py_embedding_grad, METH_VARARGS,
     "embedding_grad(dout, ids, vocab_start, vocab_real, padding_local, dweight): every row of dweight "
     "(dout's dtype) written: the fp32 sum of its ids' dout rows, rounded once, or 0."},
    {"attention_forward", py_attention_forward, METH_VARARGS,
     "attention_forward(q, k, v, out, lse, scale, causal, window, alibi_slopes|None, bias|None, "
     "mask|None, dropout, seed[, softcap|None, qpos|None, kpos|None, drop_seq]): flash-style "
     "attention (csrc/kernels/attention.h)."},
    {"attention_backward", py_attention_backward, METH_VARARGS,
     "attention_backward(q, k, v, out, dout, lse, dq, dk, dv, dbias|None, scale, causal, window, "
     "alibi_slopes|None, bias|None, mask|None, dropout, seed[, softcap|None, qpos|None, kpos|None, "
     "drop_seq])"},
    {"attention_dropout_keep", py_attention_dropout_keep, METH_VARARGS,
     "attention_dropout_keep(keep, p, seed[, qpos|None, kpos|None, drop_seq]): the dropout draws of "
     "attention as uint8 [B, H, Sq, Sk]."},
    {"kernel_set_num_threads", py_set_threads, METH_VARARGS,
     "kernel_set_num_threads(n): threads the kernels split rows over (large inputs only)."},
    {"kernel_get_num_threads", py_get_threads, METH_NOARGS, "kernel_get_num_threads() -> int"},
    {"kernel_pool_stats", py_pool_stats, METH_NOARGS,
     "kernel_pool_stats() -> dict: threads_created (ever, this process), workers (now), "
     "pool_calls (parallel calls the pool ran), inline_busy (calls that found the pool busy "
     "and ran on the calling thread alone)."},
    {"kernel_pool_shutdown", py_pool_shutdown, METH_NOARGS,
     "kernel_pool_shutdown(): stop and join the kernels' worker threads (done at exit; the next "
     "parallel call makes new ones)."},
    {"kernel_convert", py_convert, METH_VARARGS,
     "kernel_convert(src, dst): dst = src converted between float32, float16 and bfloat16 the "
     "way the kernels do (csrc/half.h), for tests."},
    {NULL, NULL, 0, NULL},
};

int sf_register_kernels(PyObject *m)
{
    /* join the pool's workers at exit, so that leak checkers see none left */
    if (Py_AtExit(sfk_pool_shutdown) < 0) {
        PyErr_SetString(PyExc_RuntimeError, "shardformer._C: no room for an atexit function");
        return -1;
    }
    return PyModule_AddFunctions(m, kernel_methods);
}
