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
#include "kernel_calls.h"

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

/* take(vs, args, k) (kernel_calls.h) on the call's arguments less the last,
 * the stream, which goes to *stream.  -1 with an exception. */
static int take_cuda(int (*take)(views *, PyObject *, kcall *), views *vs, PyObject *args, kcall *k,
                     unsigned long long *stream)
{
    const Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (n < 1) {
        PyErr_Format(PyExc_TypeError, "%s: expected the kernel's arguments and a CUDA stream", vs->fn);
        return -1;
    }
    *stream = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(args, n - 1));
    if (*stream == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    PyObject *rest = PyTuple_GetSlice(args, 0, n - 1);
    if (!rest) return -1;
    const int rc = take(vs, rest, k);
    Py_DECREF(rest);
    return rc;
}

#define VIEWS(name) views vs = {.fn = name " (CUDA)", .device = SF_TAKE_CUDA}

/* ---- cross-entropy ------------------------------------------------------ */

static PyObject *py_xent_forward(PyObject *self, PyObject *args)
{
    (void)self;
    VIEWS("xent_forward");
    kcall k = {0};
    sf_view **t = k.t;
    unsigned long long s;
    if (take_cuda(take_xent_forward, &vs, args, &k, &s)) return fail(&vs);
    RUN_CUDA(sfc_xent_forward(kdtype(t[0]), t[0]->data, k.rows, k.n, k.i[1], I64P(t[1]), k.i[0], k.i[2], k.i[3],
                         FLOATP(t[2]), FLOATP(t[3]), FLOATP(t[4]), FLOATP(t[5]),
                              STREAM(s), &err));
}

static PyObject *py_xent_backward(PyObject *self, PyObject *args)
{
    (void)self;
    VIEWS("xent_backward");
    kcall k = {0};
    sf_view **t = k.t;
    unsigned long long s;
    if (take_cuda(take_xent_backward, &vs, args, &k, &s)) return fail(&vs);
    RUN_CUDA(sfc_xent_backward(kdtype(t[0]), t[0]->data, t[4]->data, k.rows, k.n, k.i[1], I64P(t[1]), k.i[0],
                          k.i[2], FLOATP(t[2]), FLOATP(t[3]), k.f, k.i[3],
                              STREAM(s), &err));
}

/* ---- norms -------------------------------------------------------------- */

static PyObject *py_norm_forward(PyObject *self, PyObject *args)
{
    (void)self;
    VIEWS("norm_forward");
    kcall k = {0};
    sf_view **t = k.t;
    unsigned long long s;
    if (take_cuda(take_norm_forward, &vs, args, &k, &s)) return fail(&vs);
    RUN_CUDA(sfc_norm_forward(k.flag, kdtype(t[0]), t[0]->data, k.rows, k.n, FLOATP(t[1]), FLOATP(t[2]), k.f,
                         t[3]->data, FLOATP(t[4]), FLOATP(t[5]),
                              STREAM(s), &err));
}

static PyObject *py_norm_backward(PyObject *self, PyObject *args)
{
    (void)self;
    VIEWS("norm_backward");
    kcall k = {0};
    sf_view **t = k.t;
    unsigned long long s;
    if (take_cuda(take_norm_backward, &vs, args, &k, &s)) return fail(&vs);
    RUN_CUDA(sfc_norm_backward(k.flag, kdtype(t[1]), t[0]->data, t[1]->data, k.rows, k.n, FLOATP(t[2]),
                          FLOATP(t[3]), FLOATP(t[4]), t[5]->data, FLOATP(t[6]), FLOATP(t[7]),
                              STREAM(s), &err));
}

/* ---- elementwise -------------------------------------------------------- */

static PyObject *py_bias_gelu_forward(PyObject *self, PyObject *args)
{
    (void)self;
    VIEWS("bias_gelu_forward");
    kcall k = {0};
    sf_view **t = k.t;
    unsigned long long s;
    if (take_cuda(take_bias_gelu_forward, &vs, args, &k, &s)) return fail(&vs);
    RUN_CUDA(sfc_bias_gelu_forward(kdtype(t[0]), t[0]->data, FLOATP(t[1]), k.rows, k.n, k.flag, t[2]->data,
                              STREAM(s), &err));
}

static PyObject *py_bias_gelu_backward(PyObject *self, PyObject *args)
{
    (void)self;
    VIEWS("bias_gelu_backward");
    kcall k = {0};
    sf_view **t = k.t;
    unsigned long long s;
    if (take_cuda(take_bias_gelu_backward, &vs, args, &k, &s)) return fail(&vs);
    RUN_CUDA(sfc_bias_gelu_backward(kdtype(t[1]), t[0]->data, t[1]->data, FLOATP(t[2]), k.rows, k.n, k.flag,
                               t[3]->data, FLOATP(t[4]),
                              STREAM(s), &err));
}

static PyObject *py_swiglu_forward(PyObject *self, PyObject *args)
{
    (void)self;
    VIEWS("swiglu_forward");
    kcall k = {0};
    sf_view **t = k.t;
    unsigned long long s;
    if (take_cuda(take_swiglu_forward, &vs, args, &k, &s)) return fail(&vs);
    RUN_CUDA(sfc_swiglu_forward(kdtype(t[0]), t[0]->data, t[1]->data, t[0]->numel, t[2]->data,
                              STREAM(s), &err));
}

static PyObject *py_swiglu_backward(PyObject *self, PyObject *args)
{
    (void)self;
    VIEWS("swiglu_backward");
    kcall k = {0};
    sf_view **t = k.t;
    unsigned long long s;
    if (take_cuda(take_swiglu_backward, &vs, args, &k, &s)) return fail(&vs);
    RUN_CUDA(sfc_swiglu_backward(kdtype(t[1]), t[0]->data, t[1]->data, t[2]->data, t[1]->numel, t[3]->data,
                            t[4]->data,
                              STREAM(s), &err));
}

static PyObject *py_bda_forward(PyObject *self, PyObject *args)
{
    (void)self;
    VIEWS("bias_dropout_add_forward");
    kcall k = {0};
    sf_view **t = k.t;
    unsigned long long s;
    if (take_cuda(take_bda_forward, &vs, args, &k, &s)) return fail(&vs);
    RUN_CUDA(sfc_bias_dropout_add_forward(kdtype(t[0]), t[0]->data, FLOATP(t[1]), t[2]->data, k.rows, k.n, k.f,
                                     k.seed, t[3]->data,
                              STREAM(s), &err));
}

static PyObject *py_bda_backward(PyObject *self, PyObject *args)
{
    (void)self;
    VIEWS("bias_dropout_add_backward");
    kcall k = {0};
    sf_view **t = k.t;
    unsigned long long s;
    if (take_cuda(take_bda_backward, &vs, args, &k, &s)) return fail(&vs);
    RUN_CUDA(sfc_bias_dropout_add_backward(kdtype(t[0]), t[0]->data, k.rows, k.n, k.f, k.seed, t[1]->data,
                                      FLOATP(t[2]),
                              STREAM(s), &err));
}

/* ---- embedding ---------------------------------------------------------- */

static PyObject *py_embedding_forward(PyObject *self, PyObject *args)
{
    (void)self;
    VIEWS("embedding_forward");
    kcall k = {0};
    sf_view **t = k.t;
    unsigned long long s;
    if (take_cuda(take_embedding_forward, &vs, args, &k, &s)) return fail(&vs);
    RUN_CUDA(sfc_embedding_forward(kdtype(t[0]), t[0]->data, k.n, k.i[1], I64P(t[1]), t[1]->numel, k.i[0],
                              k.i[2], t[2]->data,
                              STREAM(s), &err));
}

static PyObject *py_embedding_backward(PyObject *self, PyObject *args)
{
    (void)self;
    VIEWS("embedding_backward");
    kcall k = {0};
    sf_view **t = k.t;
    unsigned long long s;
    if (take_cuda(take_embedding_backward, &vs, args, &k, &s)) return fail(&vs);
    RUN_CUDA(sfc_embedding_backward(kdtype(t[0]), t[0]->data, I64P(t[1]), t[1]->numel, k.n, k.i[1], k.i[0],
                               k.i[2], FLOATP(t[2]),
                              STREAM(s), &err));
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
