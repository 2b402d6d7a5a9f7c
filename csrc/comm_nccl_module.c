/*
 * comm_nccl_module.c -- the CPython glue of the NCCL collectives
 * (csrc/comm/nccl.c): the library loaded at run time, communicators in
 * capsules, CUDA tensors through the one DLPack gate (sf_take), the
 * collectives enqueued on the caller's stream with the GIL released.  The
 * argument rules and the error mapping are comm_module.c's (see there).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "comm/nccl.h"
#include "comm_glue.h"
#include "glue.h"
#include "tensor_view.h"

#define NCCL_CAPSULE "shardformer.nccl_comm"

/* ---- NCCL ----------------------------------------------------------------- */

static PyObject *py_nccl_load(PyObject *self, PyObject *args)
{
    (void)self;
    const char *path = NULL;
    if (!PyArg_ParseTuple(args, "|z:nccl_load", &path))
        return NULL;
    sf_error err = {0};
    sf_status rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sf_nccl_load(path, &err);
    Py_END_ALLOW_THREADS
    if (sf_set_pyerr(rc, &err))
        return NULL;
    return Py_BuildValue("(is)", sf_nccl_version(), sf_nccl_path());
}

static PyObject *py_nccl_unique_id(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    unsigned char id[SF_NCCL_UNIQUE_ID_BYTES];
    sf_error err = {0};
    if (sf_set_pyerr(sf_nccl_unique_id(id, &err), &err))
        return NULL;
    return PyBytes_FromStringAndSize((const char *)id, SF_NCCL_UNIQUE_ID_BYTES);
}

/* The capsule owns a box with the communicator and its size.  Its destructor
 * frees the box only: NCCL communicators are destroyed explicitly
 * (nccl_comm_destroy, which empties the box), never by garbage collection. */
typedef struct {
    void *comm;
    int nranks, rank;
} nccl_box;

static void nccl_capsule_free(PyObject *cap)
{
    nccl_box *b = PyCapsule_GetPointer(cap, NCCL_CAPSULE);
    if (b)
        PyMem_Free(b);
    else
        PyErr_Clear();
}

static nccl_box *nccl_from(const char *fn, PyObject *cap)
{
    if (!PyCapsule_IsValid(cap, NCCL_CAPSULE)) {
        PyErr_Format(PyExc_TypeError, "%s: expected an NCCL communicator (from nccl_comm_init), "
                     "got %.100s", fn, Py_TYPE(cap)->tp_name);
        return NULL;
    }
    nccl_box *b = PyCapsule_GetPointer(cap, NCCL_CAPSULE);
    if (b && !b->comm) {
        PyErr_Format(PyExc_ValueError, "%s: the NCCL communicator is destroyed", fn);
        return NULL;
    }
    return b;
}

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
    nccl_box *b = PyMem_Malloc(sizeof(*b));
    if (!b)
        return PyErr_NoMemory();
    void *comm = NULL;
    sf_error err = {0};
    sf_status rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sf_nccl_comm_init(&comm, nranks, (const unsigned char *)id, rank, &err);
    Py_END_ALLOW_THREADS
    if (sf_set_pyerr(rc, &err)) {
        PyMem_Free(b);
        return NULL;
    }
    b->comm = comm;
    b->nranks = nranks;
    b->rank = rank;
    PyObject *cap = PyCapsule_New(b, NCCL_CAPSULE, nccl_capsule_free);
    if (!cap) {
        Py_BEGIN_ALLOW_THREADS
        sf_nccl_comm_destroy(comm, 1, &err);
        Py_END_ALLOW_THREADS
        PyMem_Free(b);
    }
    return cap;
}

static PyObject *py_nccl_comm_destroy(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap;
    int abort_it = 0;
    if (!PyArg_ParseTuple(args, "O|p:nccl_comm_destroy", &cap, &abort_it))
        return NULL;
    if (!PyCapsule_IsValid(cap, NCCL_CAPSULE))
        return PyErr_Format(PyExc_TypeError, "nccl_comm_destroy: expected an NCCL communicator, "
                            "got %.100s", Py_TYPE(cap)->tp_name);
    nccl_box *b = PyCapsule_GetPointer(cap, NCCL_CAPSULE);
    if (!b)
        return NULL;
    void *comm = b->comm;
    b->comm = NULL;  /* destroyed once, whatever NCCL says */
    sf_error err = {0};
    sf_status rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sf_nccl_comm_destroy(comm, abort_it, &err);
    Py_END_ALLOW_THREADS
    if (sf_set_pyerr(rc, &err))
        return NULL;
    Py_RETURN_NONE;
}

/* The dtypes NCCL has codes for, and the codes (ncclDataType_t). */
#define NCCL_DTYPES (SF_DT_I8 | SF_DT_U8 | SF_DT_I32 | SF_DT_I64 | SF_DT_F16 | SF_DT_F32 | \
                     SF_DT_F64 | SF_DT_BF16)

static int nccl_dtype(const sf_view *v)
{
    switch (sf_dtype_bit(v->dtype)) {
    case SF_DT_I8: return SF_NCCL_INT8;
    case SF_DT_U8: return SF_NCCL_UINT8;
    case SF_DT_I32: return SF_NCCL_INT32;
    case SF_DT_I64: return SF_NCCL_INT64;
    case SF_DT_F16: return SF_NCCL_FLOAT16;
    case SF_DT_F64: return SF_NCCL_FLOAT64;
    case SF_DT_BF16: return SF_NCCL_BFLOAT16;
    default: return SF_NCCL_FLOAT32;
    }
}

static int nccl_op(const char *fn, const char *op, int *out)
{
    if (!strcmp(op, "sum")) *out = SF_NCCL_SUM;
    else if (!strcmp(op, "prod")) *out = SF_NCCL_PROD;
    else if (!strcmp(op, "max")) *out = SF_NCCL_MAX;
    else if (!strcmp(op, "min")) *out = SF_NCCL_MIN;
    else {
        PyErr_Format(PyExc_ValueError, "%s: reduction op '%s': expected 'sum', 'prod', 'max' or "
                     "'min'", fn, op);
        return -1;
    }
    return 0;
}

/* One NCCL collective: its tensors (a CUDA, contiguous view each, taken and
 * checked before the communicator is even looked at, so a CPU tensor or a
 * bad dtype is refused whether or not NCCL is there), the communicator, the
 * op or peer, and the stream (a cudaStream_t as an integer). */
typedef enum { NC_ALL_REDUCE, NC_ALL_GATHER, NC_REDUCE_SCATTER, NC_BROADCAST, NC_SEND,
               NC_RECV, NC_ALL_TO_ALL } nccl_kind;

/* The grouped ncclSend / ncclRecv of an all_to_all run concurrently: a recv
 * into block r may land before the send of block r has read it, so out and
 * tensor must not share a byte (in place included, unlike shm).  0, or -1
 * with ValueError. */
static int nccl_all_to_all_overlap(const char *fn, const sf_view *out, const sf_view *in)
{
    sf_error err = {0};
    size_t ob = 0, ib = 0;
    if (sf_set_pyerr(sf_view_nbytes(out, "out", &ob, &err), &err) ||
        sf_set_pyerr(sf_view_nbytes(in, "tensor", &ib, &err), &err))
        return -1;
    if (!ob || !ib)
        return 0;
    uintptr_t o = (uintptr_t)out->data, i = (uintptr_t)in->data;
    if (o - i < ib || i - o < ob) { /* unsigned: one starts inside the other */
        PyErr_Format(PyExc_ValueError, "%s: out overlaps tensor in memory; NCCL's all_to_all "
                     "cannot run in place", fn);
        return -1;
    }
    return 0;
}

static PyObject *nccl_collective(nccl_kind kind, const char *fn, PyObject *cap, PyObject *out_obj,
                                 PyObject *in_obj, const char *op_name, int peer,
                                 unsigned long long stream)
{
    /* out: written (all_gather, reduce_scatter, all_to_all: the result;
     * all_reduce, broadcast, recv: the tensor itself); in: read (all_gather,
     * reduce_scatter, all_to_all, send). */
    sf_view out = {0}, in = {0};
    int have_out = out_obj != NULL, have_in = in_obj != NULL;
    PyObject *res = NULL;
    int op = SF_NCCL_SUM;
    if (have_out && sf_take(fn, out_obj, kind == NC_ALL_GATHER || kind == NC_REDUCE_SCATTER ||
                            kind == NC_ALL_TO_ALL ? "out" : "tensor", NCCL_DTYPES,
                            SF_TAKE_CUDA | SF_TAKE_CONTIGUOUS | SF_TAKE_WRITE, &out) < 0)
        return NULL;
    if (have_in && sf_take(fn, in_obj, "tensor", NCCL_DTYPES, SF_TAKE_CUDA | SF_TAKE_CONTIGUOUS,
                           &in) < 0)
        goto done;
    if (have_out && have_in) {
        sf_error err = {0};
        if (sf_set_pyerr(sf_check_same_dtype(&out, "out", &in, "tensor", &err), &err))
            goto done;
        if (out.device.device_id != in.device.device_id) {
            PyErr_Format(PyExc_ValueError, "%s: out is on CUDA device %d but tensor on device %d",
                         fn, (int)out.device.device_id, (int)in.device.device_id);
            goto done;
        }
        if (kind == NC_ALL_TO_ALL && nccl_all_to_all_overlap(fn, &out, &in))
            goto done;
    }
    if (op_name && nccl_op(fn, op_name, &op))
        goto done;
    nccl_box *b = nccl_from(fn, cap);
    if (!b)
        goto done;
    if (kind == NC_ALL_GATHER && sf_check_blocks(fn, "out", &out, &in, b->nranks))
        goto done;
    if (kind == NC_REDUCE_SCATTER && sf_check_blocks(fn, "tensor", &in, &out, b->nranks))
        goto done;
    if (kind == NC_ALL_TO_ALL && sf_check_all_to_all(fn, &out, &in, b->nranks))
        goto done;
    if ((kind == NC_BROADCAST || kind == NC_SEND || kind == NC_RECV) &&
        (peer < 0 || peer >= b->nranks)) {
        PyErr_Format(PyExc_ValueError, "%s: %s rank %d not in [0, %d)", fn,
                     kind == NC_BROADCAST ? "root" : "peer", peer, b->nranks);
        goto done;
    }
    const int dtype = nccl_dtype(have_out ? &out : &in);
    const uintptr_t st = (uintptr_t)stream;
    const int nranks = b->nranks;
    void *comm = b->comm;
    sf_error err = {0};
    sf_status rc = SF_OK;
    Py_BEGIN_ALLOW_THREADS
    switch (kind) {
    case NC_ALL_REDUCE:
        rc = sf_nccl_all_reduce(comm, out.data, out.data, (size_t)out.numel, dtype, op, st, &err);
        break;
    case NC_ALL_GATHER:
        rc = sf_nccl_all_gather(comm, in.data, out.data, (size_t)in.numel, dtype, st, &err);
        break;
    case NC_REDUCE_SCATTER:
        rc = sf_nccl_reduce_scatter(comm, in.data, out.data, (size_t)out.numel, dtype, op, st,
                                    &err);
        break;
    case NC_BROADCAST:
        rc = sf_nccl_broadcast(comm, out.data, out.data, (size_t)out.numel, dtype, peer, st, &err);
        break;
    case NC_SEND:
        rc = sf_nccl_send(comm, in.data, (size_t)in.numel, dtype, peer, st, &err);
        break;
    case NC_RECV:
        rc = sf_nccl_recv(comm, out.data, (size_t)out.numel, dtype, peer, st, &err);
        break;
    case NC_ALL_TO_ALL:
        rc = sf_nccl_all_to_all(comm, in.data, out.data, (size_t)(in.numel / nranks), dtype,
                                nranks, st, &err);
        break;
    }
    Py_END_ALLOW_THREADS
    if (!sf_set_pyerr(rc, &err))
        res = Py_NewRef(Py_None);
done:
    sf_view_release(&in);
    sf_view_release(&out);
    return res;
}

static PyObject *py_nccl_all_reduce(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap, *t;
    const char *op = "sum";
    unsigned long long stream = 0;
    if (!PyArg_ParseTuple(args, "OO|sK:nccl_all_reduce", &cap, &t, &op, &stream))
        return NULL;
    return nccl_collective(NC_ALL_REDUCE, "nccl_all_reduce", cap, t, NULL, op, 0, stream);
}

static PyObject *py_nccl_all_gather(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap, *out, *t;
    unsigned long long stream = 0;
    if (!PyArg_ParseTuple(args, "OOO|K:nccl_all_gather", &cap, &out, &t, &stream))
        return NULL;
    return nccl_collective(NC_ALL_GATHER, "nccl_all_gather", cap, out, t, NULL, 0, stream);
}

static PyObject *py_nccl_reduce_scatter(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap, *out, *t;
    const char *op = "sum";
    unsigned long long stream = 0;
    if (!PyArg_ParseTuple(args, "OOO|sK:nccl_reduce_scatter", &cap, &out, &t, &op, &stream))
        return NULL;
    return nccl_collective(NC_REDUCE_SCATTER, "nccl_reduce_scatter", cap, out, t, op, 0, stream);
}

static PyObject *py_nccl_broadcast(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap, *t;
    int root;
    unsigned long long stream = 0;
    if (!PyArg_ParseTuple(args, "OOi|K:nccl_broadcast", &cap, &t, &root, &stream))
        return NULL;
    return nccl_collective(NC_BROADCAST, "nccl_broadcast", cap, t, NULL, NULL, root, stream);
}

static PyObject *py_nccl_send(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap, *t;
    int peer;
    unsigned long long stream = 0;
    if (!PyArg_ParseTuple(args, "OOi|K:nccl_send", &cap, &t, &peer, &stream))
        return NULL;
    return nccl_collective(NC_SEND, "nccl_send", cap, NULL, t, NULL, peer, stream);
}

static PyObject *py_nccl_recv(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap, *t;
    int peer;
    unsigned long long stream = 0;
    if (!PyArg_ParseTuple(args, "OOi|K:nccl_recv", &cap, &t, &peer, &stream))
        return NULL;
    return nccl_collective(NC_RECV, "nccl_recv", cap, t, NULL, NULL, peer, stream);
}

static PyObject *py_nccl_all_to_all(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap, *out, *t;
    unsigned long long stream = 0;
    if (!PyArg_ParseTuple(args, "OOO|K:nccl_all_to_all", &cap, &out, &t, &stream))
        return NULL;
    return nccl_collective(NC_ALL_TO_ALL, "nccl_all_to_all", cap, out, t, NULL, 0, stream);
}

static PyMethodDef nccl_methods[] = {
    {"nccl_load", py_nccl_load, METH_VARARGS,
     "nccl_load(path=None) -> (version, path); OSError with the reason when it cannot."},
    {"nccl_unique_id", py_nccl_unique_id, METH_NOARGS, "nccl_unique_id() -> 128 bytes"},
    {"nccl_comm_init", py_nccl_comm_init, METH_VARARGS,
     "nccl_comm_init(nranks, unique_id, rank) -> comm"},
    {"nccl_comm_destroy", py_nccl_comm_destroy, METH_VARARGS,
     "nccl_comm_destroy(comm, abort=False)"},
    {"nccl_all_reduce", py_nccl_all_reduce, METH_VARARGS,
     "nccl_all_reduce(comm, t, op='sum', stream=0): in place; t a contiguous CUDA tensor."},
    {"nccl_all_gather", py_nccl_all_gather, METH_VARARGS,
     "nccl_all_gather(comm, out, t, stream=0): out = concat over ranks of t."},
    {"nccl_reduce_scatter", py_nccl_reduce_scatter, METH_VARARGS,
     "nccl_reduce_scatter(comm, out, t, op='sum', stream=0): out = own block of the reduced t."},
    {"nccl_broadcast", py_nccl_broadcast, METH_VARARGS,
     "nccl_broadcast(comm, t, root, stream=0)"},
    {"nccl_all_to_all", py_nccl_all_to_all, METH_VARARGS,
     "nccl_all_to_all(comm, out, t, stream=0): block i of out = block rank of t on rank i."},
    {"nccl_send", py_nccl_send, METH_VARARGS, "nccl_send(comm, t, peer, stream=0)"},
    {"nccl_recv", py_nccl_recv, METH_VARARGS, "nccl_recv(comm, t, peer, stream=0)"},
    {NULL, NULL, 0, NULL},
};

int sf_register_nccl(PyObject *m)
{
    return PyModule_AddFunctions(m, nccl_methods);
}
