/*
 * comm_module.c -- the CPython glue of the collectives in csrc/comm/.
 *
 * Parses and checks arguments (tensors arrive through DLPack as sf_views),
 * releases the GIL around every wait and copy, and turns error codes into
 * exceptions: TimeoutError for a peer that never arrived, ValueError for bad
 * arguments, OSError for the system, RuntimeError for NCCL and broken
 * communicators.  No collective logic lives here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "comm/nccl.h"
#include "comm/shm.h"
#include "tensor_view.h"

#define ERRLEN 768
#define SHM_CAPSULE "shardformer.shm_comm"
#define NCCL_CAPSULE "shardformer.nccl_comm"

/* The capsule owns a box so shm_close can empty it before the capsule dies. */
typedef struct { sf_shm *comm; } shm_box;

static void shm_capsule_free(PyObject *cap)
{
    shm_box *b = PyCapsule_GetPointer(cap, SHM_CAPSULE);
    if (b) {
        sf_shm_close(b->comm);
        PyMem_Free(b);
    }
}

static sf_shm *shm_from(PyObject *cap)
{
    if (!PyCapsule_IsValid(cap, SHM_CAPSULE)) {
        PyErr_Format(PyExc_TypeError, "expected a shm communicator (from shm_create or "
                     "shm_attach), got %.100s", Py_TYPE(cap)->tp_name);
        return NULL;
    }
    shm_box *b = PyCapsule_GetPointer(cap, SHM_CAPSULE);
    if (!b)
        return NULL;
    if (!b->comm) {
        PyErr_SetString(PyExc_ValueError, "shm communicator is closed");
        return NULL;
    }
    return b->comm;
}

static PyObject *raise_comm(int rc, const char *err)
{
    PyObject *type = rc == SF_COMM_ETIMEOUT ? PyExc_TimeoutError
                   : rc == SF_COMM_EINVAL   ? PyExc_ValueError
                   : rc == SF_COMM_ESYS     ? PyExc_OSError
                                            : PyExc_RuntimeError;
    PyErr_SetString(type, err);
    return NULL;
}

static PyObject *wrap_shm(sf_shm *c)
{
    shm_box *b = PyMem_Malloc(sizeof(*b));
    if (!b) {
        sf_shm_close(c);
        return PyErr_NoMemory();
    }
    b->comm = c;
    PyObject *cap = PyCapsule_New(b, SHM_CAPSULE, shm_capsule_free);
    if (!cap) {
        sf_shm_close(c);
        PyMem_Free(b);
    }
    return cap;
}

static int red_dtype(const sf_view *v, const char *argname, sf_red_dtype *t)
{
    int code = v->dtype.code, bits = v->dtype.bits;
    if (code == SF_DL_FLOAT && bits == 32) *t = SF_RED_F32;
    else if (code == SF_DL_FLOAT && bits == 16) *t = SF_RED_F16;
    else if (code == SF_DL_BFLOAT && bits == 16) *t = SF_RED_BF16;
    else if (code == SF_DL_FLOAT && bits == 64) *t = SF_RED_F64;
    else if (code == SF_DL_INT && bits == 32) *t = SF_RED_I32;
    else if (code == SF_DL_INT && bits == 64) *t = SF_RED_I64;
    else {
        PyErr_Format(PyExc_TypeError, "%s: dtype %s cannot be reduced (float32, float16, "
                     "bfloat16, float64, int32 or int64)", argname, sf_dtype_name(v->dtype));
        return -1;
    }
    return 0;
}

static int red_op(const char *op, sf_red_op *out)
{
    if (!strcmp(op, "sum")) *out = SF_RED_SUM;
    else if (!strcmp(op, "max")) *out = SF_RED_MAX;
    else {
        PyErr_Format(PyExc_ValueError, "reduction op '%s': expected 'sum' or 'max'", op);
        return -1;
    }
    return 0;
}

/* A CPU, contiguous view; writable when `write`. */
static int take(PyObject *obj, const char *name, int write, sf_view *v)
{
    if (sf_view_acquire(obj, name, v))
        return -1;
    if (sf_check_cpu(v, name) || sf_check_contiguous(v, name) ||
        (write && sf_check_writable(v, name))) {
        sf_view_release(v);
        return -1;
    }
    return 0;
}

/* ---- shm: setup ---------------------------------------------------------- */

static PyObject *py_shm_create(PyObject *self, PyObject *args)
{
    (void)self;
    const char *name;
    int nranks;
    Py_ssize_t workspace, p2p;
    unsigned long long nonce;
    if (!PyArg_ParseTuple(args, "sinnK:shm_create", &name, &nranks, &workspace, &p2p, &nonce))
        return NULL;
    if (workspace <= 0 || p2p <= 0)
        return PyErr_Format(PyExc_ValueError, "shm_create: workspace=%zd and p2p=%zd must be "
                            "positive", workspace, p2p);
    sf_shm *c = NULL;
    char err[ERRLEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sf_shm_create(name, nranks, (size_t)workspace, (size_t)p2p, nonce, &c, err, ERRLEN);
    Py_END_ALLOW_THREADS
    if (rc)
        return raise_comm(rc, err);
    return wrap_shm(c);
}

static PyObject *py_shm_attach(PyObject *self, PyObject *args)
{
    (void)self;
    const char *name;
    int nranks, rank;
    unsigned long long nonce;
    if (!PyArg_ParseTuple(args, "siiK:shm_attach", &name, &nranks, &rank, &nonce))
        return NULL;
    sf_shm *c = NULL;
    char err[ERRLEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sf_shm_attach(name, nranks, rank, nonce, &c, err, ERRLEN);
    Py_END_ALLOW_THREADS
    if (rc)
        return raise_comm(rc, err);
    return wrap_shm(c);
}

static PyObject *py_shm_unlink(PyObject *self, PyObject *arg)
{
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name)
        return NULL;
    char err[ERRLEN] = "";
    int rc = sf_shm_unlink(name, err, ERRLEN);
    if (rc)
        return raise_comm(rc, err);
    Py_RETURN_NONE;
}

static PyObject *py_shm_close(PyObject *self, PyObject *cap)
{
    (void)self;
    shm_box *b = PyCapsule_GetPointer(cap, SHM_CAPSULE);
    if (!b)
        return NULL;
    sf_shm_close(b->comm);
    b->comm = NULL;
    Py_RETURN_NONE;
}

static PyObject *py_shm_configure(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap;
    const char *label;
    double timeout;
    Py_ssize_t oneshot_max;
    if (!PyArg_ParseTuple(args, "Osdn:shm_configure", &cap, &label, &timeout, &oneshot_max))
        return NULL;
    sf_shm *c = shm_from(cap);
    if (!c)
        return NULL;
    if (!(timeout > 0) || oneshot_max < 0)
        return PyErr_Format(PyExc_ValueError, "shm_configure: timeout=%g s must be > 0 and "
                            "oneshot_max=%zd >= 0", timeout, oneshot_max);
    sf_shm_configure(c, label, timeout, (size_t)oneshot_max);
    Py_RETURN_NONE;
}

static PyObject *py_shm_info(PyObject *self, PyObject *cap)
{
    (void)self;
    sf_shm *c = shm_from(cap);
    if (!c)
        return NULL;
    return Py_BuildValue("{s:i,s:i,s:n,s:n,s:n,s:d}", "rank", sf_shm_rank(c), "nranks",
                         sf_shm_nranks(c), "workspace", (Py_ssize_t)sf_shm_workspace(c),
                         "segment_bytes", (Py_ssize_t)sf_shm_segment_bytes(c), "oneshot_max",
                         (Py_ssize_t)sf_shm_oneshot_max(c), "timeout", sf_shm_timeout(c));
}

/* ---- shm: collectives ---------------------------------------------------- */

static PyObject *py_shm_all_reduce(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap, *obj;
    const char *op_name = "sum";
    int algo = 0;
    if (!PyArg_ParseTuple(args, "OO|si:shm_all_reduce", &cap, &obj, &op_name, &algo))
        return NULL;
    sf_shm *c = shm_from(cap);
    sf_red_op op;
    if (!c || red_op(op_name, &op))
        return NULL;
    if (algo < 0 || algo > 2)
        return PyErr_Format(PyExc_ValueError, "shm_all_reduce: algo=%d not in 0..2", algo);
    sf_view v;
    if (take(obj, "tensor", 1, &v))
        return NULL;
    sf_red_dtype t;
    if (red_dtype(&v, "tensor", &t)) {
        sf_view_release(&v);
        return NULL;
    }
    char err[ERRLEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sf_shm_all_reduce(c, v.data, (size_t)v.numel, t, op, (sf_ar_algo)algo, err, ERRLEN);
    Py_END_ALLOW_THREADS
    sf_view_release(&v);
    if (rc)
        return raise_comm(rc, err);
    Py_RETURN_NONE;
}

static PyObject *py_shm_all_gather(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap, *oo, *io;
    if (!PyArg_ParseTuple(args, "OOO:shm_all_gather", &cap, &oo, &io))
        return NULL;
    sf_shm *c = shm_from(cap);
    if (!c)
        return NULL;
    sf_view out, in;
    if (take(oo, "out", 1, &out))
        return NULL;
    if (take(io, "tensor", 0, &in)) {
        sf_view_release(&out);
        return NULL;
    }
    PyObject *res = NULL;
    if (sf_check_same_dtype(&out, "out", &in, "tensor") == 0) {
        if (out.numel != in.numel * sf_shm_nranks(c)) {
            PyErr_Format(PyExc_ValueError, "shm_all_gather: out has %lld elements, expected "
                         "%lld = %d ranks x %lld", (long long)out.numel,
                         (long long)in.numel * sf_shm_nranks(c), sf_shm_nranks(c),
                         (long long)in.numel);
        } else {
            char err[ERRLEN] = "";
            int rc;
            Py_BEGIN_ALLOW_THREADS
            rc = sf_shm_all_gather(c, out.data, in.data, (size_t)in.numel * (size_t)in.itemsize,
                                   err, ERRLEN);
            Py_END_ALLOW_THREADS
            if (rc)
                raise_comm(rc, err);
            else
                res = Py_NewRef(Py_None);
        }
    }
    sf_view_release(&in);
    sf_view_release(&out);
    return res;
}

static PyObject *py_shm_reduce_scatter(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap, *oo, *io;
    const char *op_name = "sum";
    if (!PyArg_ParseTuple(args, "OOO|s:shm_reduce_scatter", &cap, &oo, &io, &op_name))
        return NULL;
    sf_shm *c = shm_from(cap);
    sf_red_op op;
    if (!c || red_op(op_name, &op))
        return NULL;
    sf_view out, in;
    if (take(oo, "out", 1, &out))
        return NULL;
    if (take(io, "tensor", 0, &in)) {
        sf_view_release(&out);
        return NULL;
    }
    PyObject *res = NULL;
    sf_red_dtype t;
    if (sf_check_same_dtype(&out, "out", &in, "tensor") == 0 && red_dtype(&in, "tensor", &t) == 0) {
        if (in.numel != out.numel * sf_shm_nranks(c)) {
            PyErr_Format(PyExc_ValueError, "shm_reduce_scatter: input has %lld elements, "
                         "expected %lld = %d ranks x %lld", (long long)in.numel,
                         (long long)out.numel * sf_shm_nranks(c), sf_shm_nranks(c),
                         (long long)out.numel);
        } else {
            char err[ERRLEN] = "";
            int rc;
            Py_BEGIN_ALLOW_THREADS
            rc = sf_shm_reduce_scatter(c, out.data, in.data, (size_t)out.numel, t, op, err,
                                       ERRLEN);
            Py_END_ALLOW_THREADS
            if (rc)
                raise_comm(rc, err);
            else
                res = Py_NewRef(Py_None);
        }
    }
    sf_view_release(&in);
    sf_view_release(&out);
    return res;
}

/* broadcast, send and recv move bytes: one tensor, one rank argument. */
typedef int (*bytes_fn)(sf_shm *, void *, size_t, int, char *, size_t);

static int send_adapter(sf_shm *c, void *buf, size_t n, int peer, char *err, size_t len)
{
    return sf_shm_send(c, buf, n, peer, err, len);
}

static PyObject *bytes_call(PyObject *args, const char *fmt, bytes_fn fn, int write)
{
    PyObject *cap, *obj;
    int peer;
    if (!PyArg_ParseTuple(args, fmt, &cap, &obj, &peer))
        return NULL;
    sf_shm *c = shm_from(cap);
    if (!c)
        return NULL;
    sf_view v;
    if (take(obj, "tensor", write, &v))
        return NULL;
    char err[ERRLEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = fn(c, v.data, (size_t)v.numel * (size_t)v.itemsize, peer, err, ERRLEN);
    Py_END_ALLOW_THREADS
    sf_view_release(&v);
    if (rc)
        return raise_comm(rc, err);
    Py_RETURN_NONE;
}

static PyObject *py_shm_broadcast(PyObject *self, PyObject *args)
{
    (void)self;
    /* Only the root's tensor is read; others' are written. */
    return bytes_call(args, "OOi:shm_broadcast", sf_shm_broadcast, 1);
}

static PyObject *py_shm_send(PyObject *self, PyObject *args)
{
    (void)self;
    return bytes_call(args, "OOi:shm_send", send_adapter, 0);
}

static PyObject *py_shm_recv(PyObject *self, PyObject *args)
{
    (void)self;
    return bytes_call(args, "OOi:shm_recv", sf_shm_recv, 1);
}

static PyObject *py_shm_barrier(PyObject *self, PyObject *cap)
{
    (void)self;
    sf_shm *c = shm_from(cap);
    if (!c)
        return NULL;
    char err[ERRLEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sf_shm_barrier(c, err, ERRLEN);
    Py_END_ALLOW_THREADS
    if (rc)
        return raise_comm(rc, err);
    Py_RETURN_NONE;
}

/* ---- the reduction kernels, for tests and benchmarks ----------------------- */

static PyObject *py_reduce_buffers(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *oo, *seq;
    const char *op_name = "sum";
    int simd = 1;
    if (!PyArg_ParseTuple(args, "OO|sp:reduce_buffers", &oo, &seq, &op_name, &simd))
        return NULL;
    sf_red_op op;
    if (red_op(op_name, &op))
        return NULL;
    PyObject *items = PySequence_Fast(seq, "reduce_buffers: inputs must be a sequence");
    if (!items)
        return NULL;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(items);
    if (k < 1 || k > SF_SHM_MAX_RANKS) {
        Py_DECREF(items);
        return PyErr_Format(PyExc_ValueError, "reduce_buffers: %zd inputs, expected 1..%d", k,
                            SF_SHM_MAX_RANKS);
    }
    sf_view out, in[SF_SHM_MAX_RANKS];
    const void *src[SF_SHM_MAX_RANKS];
    Py_ssize_t got = 0;
    PyObject *res = NULL;
    sf_red_dtype t;
    if (take(oo, "out", 1, &out)) {
        Py_DECREF(items);
        return NULL;
    }
    if (red_dtype(&out, "out", &t))
        goto done;
    for (; got < k; got++) {
        if (take(PySequence_Fast_GET_ITEM(items, got), "inputs[i]", 0, &in[got]))
            goto done;
        src[got] = in[got].data;
        if (sf_check_same_dtype(&out, "out", &in[got], "inputs[i]") ||
            in[got].numel != out.numel) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "reduce_buffers: inputs[%zd] has %lld elements, "
                             "out has %lld", got, (long long)in[got].numel,
                             (long long)out.numel);
            got++;
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    sf_reduce(t, op, out.data, src, (int)k, (size_t)out.numel, simd);
    Py_END_ALLOW_THREADS
    res = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < got; i++)
        sf_view_release(&in[i]);
    sf_view_release(&out);
    Py_DECREF(items);
    return res;
}

static PyObject *py_cpu_has_avx2(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyBool_FromLong(sf_cpu_has_avx2());
}

/* ---- NCCL ----------------------------------------------------------------- */

static PyObject *py_nccl_load(PyObject *self, PyObject *args)
{
    (void)self;
    const char *path = NULL;
    if (!PyArg_ParseTuple(args, "|z:nccl_load", &path))
        return NULL;
    char err[ERRLEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sf_nccl_load(path, err, ERRLEN);
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_SetString(PyExc_OSError, err);
        return NULL;
    }
    return Py_BuildValue("(is)", sf_nccl_version(), sf_nccl_path());
}

static PyObject *py_nccl_unique_id(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    unsigned char id[SF_NCCL_UNIQUE_ID_BYTES];
    char err[ERRLEN] = "";
    if (sf_nccl_unique_id(id, err, ERRLEN)) {
        PyErr_SetString(PyExc_RuntimeError, err);
        return NULL;
    }
    return PyBytes_FromStringAndSize((const char *)id, SF_NCCL_UNIQUE_ID_BYTES);
}

/* The capsule has no destructor: NCCL communicators are destroyed explicitly
 * (nccl_comm_destroy), never from garbage collection. */
static PyObject *py_nccl_comm_init(PyObject *self, PyObject *args)
{
    (void)self;
    int nranks, rank;
    const char *id;
    Py_ssize_t idlen;
    if (!PyArg_ParseTuple(args, "iy#i:nccl_comm_init", &nranks, &id, &idlen, &rank))
        return NULL;
    if (idlen != SF_NCCL_UNIQUE_ID_BYTES)
        return PyErr_Format(PyExc_ValueError, "nccl_comm_init: unique id has %zd bytes, "
                            "expected %d", idlen, SF_NCCL_UNIQUE_ID_BYTES);
    void *comm = NULL;
    char err[ERRLEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sf_nccl_comm_init(&comm, nranks, (const unsigned char *)id, rank, err, ERRLEN);
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_SetString(PyExc_RuntimeError, err);
        return NULL;
    }
    return PyCapsule_New(comm, NCCL_CAPSULE, NULL);
}

static PyObject *py_nccl_comm_destroy(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap;
    int abort_it = 0;
    if (!PyArg_ParseTuple(args, "O|p:nccl_comm_destroy", &cap, &abort_it))
        return NULL;
    void *comm = PyCapsule_GetPointer(cap, NCCL_CAPSULE);
    if (!comm)
        return NULL;
    char err[ERRLEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sf_nccl_comm_destroy(comm, abort_it, err, ERRLEN);
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_SetString(PyExc_RuntimeError, err);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* nccl_call(kind, comm, send_ptr, recv_ptr, count, dtype, op_or_peer, stream)
 * kind: "all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv".
 * Pointers and the stream are integers (device memory never crosses DLPack
 * here, so no stream synchronization is implied). */
static PyObject *py_nccl_call(PyObject *self, PyObject *args)
{
    (void)self;
    const char *kind;
    PyObject *cap;
    unsigned long long sp, rp, stream;
    Py_ssize_t count;
    int dtype, arg;
    if (!PyArg_ParseTuple(args, "sOKKniiK:nccl_call", &kind, &cap, &sp, &rp, &count, &dtype,
                          &arg, &stream))
        return NULL;
    void *comm = PyCapsule_GetPointer(cap, NCCL_CAPSULE);
    if (!comm)
        return NULL;
    if (count < 0 || dtype < SF_NCCL_INT8 || dtype > SF_NCCL_BFLOAT16)
        return PyErr_Format(PyExc_ValueError, "nccl_call: count=%zd or dtype=%d out of range",
                            count, dtype);
    const void *s = (const void *)(uintptr_t)sp;
    void *r = (void *)(uintptr_t)rp;
    size_t n = (size_t)count;
    uintptr_t st = (uintptr_t)stream;
    char err[ERRLEN] = "";
    int rc = -1;
    Py_BEGIN_ALLOW_THREADS
    if (!strcmp(kind, "all_reduce"))
        rc = sf_nccl_all_reduce(comm, s, r, n, dtype, arg, st, err, ERRLEN);
    else if (!strcmp(kind, "all_gather"))
        rc = sf_nccl_all_gather(comm, s, r, n, dtype, st, err, ERRLEN);
    else if (!strcmp(kind, "reduce_scatter"))
        rc = sf_nccl_reduce_scatter(comm, s, r, n, dtype, arg, st, err, ERRLEN);
    else if (!strcmp(kind, "broadcast"))
        rc = sf_nccl_broadcast(comm, s, r, n, dtype, arg, st, err, ERRLEN);
    else if (!strcmp(kind, "send"))
        rc = sf_nccl_send(comm, s, n, dtype, arg, st, err, ERRLEN);
    else if (!strcmp(kind, "recv"))
        rc = sf_nccl_recv(comm, r, n, dtype, arg, st, err, ERRLEN);
    Py_END_ALLOW_THREADS
    if (rc == -1)
        return PyErr_Format(PyExc_ValueError, "nccl_call: unknown collective %s", kind);
    if (rc) {
        PyErr_SetString(PyExc_RuntimeError, err);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef comm_methods[] = {
    {"shm_create", py_shm_create, METH_VARARGS,
     "shm_create(name, nranks, workspace, p2p, nonce) -> comm: rank 0 makes the segment."},
    {"shm_attach", py_shm_attach, METH_VARARGS,
     "shm_attach(name, nranks, rank, nonce) -> comm: map rank 0's segment."},
    {"shm_unlink", py_shm_unlink, METH_O, "shm_unlink(name): remove the segment's name."},
    {"shm_close", py_shm_close, METH_O, "shm_close(comm): unmap the segment."},
    {"shm_configure", py_shm_configure, METH_VARARGS,
     "shm_configure(comm, label, timeout_s, oneshot_max_bytes)"},
    {"shm_info", py_shm_info, METH_O, "shm_info(comm) -> dict"},
    {"shm_all_reduce", py_shm_all_reduce, METH_VARARGS,
     "shm_all_reduce(comm, t, op='sum', algo=0): in place; algo 1 one-shot, 2 RS+AG."},
    {"shm_all_gather", py_shm_all_gather, METH_VARARGS,
     "shm_all_gather(comm, out, t): out = concat over ranks of t."},
    {"shm_reduce_scatter", py_shm_reduce_scatter, METH_VARARGS,
     "shm_reduce_scatter(comm, out, t, op='sum'): out = own block of the reduced t."},
    {"shm_broadcast", py_shm_broadcast, METH_VARARGS, "shm_broadcast(comm, t, root)"},
    {"shm_send", py_shm_send, METH_VARARGS, "shm_send(comm, t, dst)"},
    {"shm_recv", py_shm_recv, METH_VARARGS, "shm_recv(comm, t, src)"},
    {"shm_barrier", py_shm_barrier, METH_O, "shm_barrier(comm)"},
    {"reduce_buffers", py_reduce_buffers, METH_VARARGS,
     "reduce_buffers(out, inputs, op='sum', simd=True): out = op over inputs (the shm kernels)."},
    {"cpu_has_avx2", py_cpu_has_avx2, METH_NOARGS, "True when the AVX2 kernels run here."},
    {"nccl_load", py_nccl_load, METH_VARARGS,
     "nccl_load(path=None) -> (version, path); OSError with the reason when it cannot."},
    {"nccl_unique_id", py_nccl_unique_id, METH_NOARGS, "nccl_unique_id() -> 128 bytes"},
    {"nccl_comm_init", py_nccl_comm_init, METH_VARARGS,
     "nccl_comm_init(nranks, unique_id, rank) -> comm"},
    {"nccl_comm_destroy", py_nccl_comm_destroy, METH_VARARGS,
     "nccl_comm_destroy(comm, abort=False)"},
    {"nccl_call", py_nccl_call, METH_VARARGS,
     "nccl_call(kind, comm, send_ptr, recv_ptr, count, dtype, op_or_peer, stream)"},
    {NULL, NULL, 0, NULL},
};

int sf_register_comm(PyObject *m)
{
    return PyModule_AddFunctions(m, comm_methods);
}
