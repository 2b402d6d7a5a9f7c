/*
 * comm_module.c -- the CPython glue of the collectives in csrc/comm/: the
 * shared-memory communicator, the reduction kernels and the CPU probe (the
 * NCCL glue is comm_nccl_module.c, which follows the same rules).
 *
 * Parses arguments, takes tensors through the one DLPack gate (sf_take:
 * CPU tensors for shm, CUDA tensors for NCCL), releases the GIL around every
 * wait and copy, and turns the sf_status of csrc/comm/ into exceptions with
 * the one mapper (sf_set_pyerr): TimeoutError for a peer that never arrived,
 * ValueError for bad arguments (and a closed communicator), OSError for the
 * system, RuntimeError for NCCL, ranks whose calls do not match and broken
 * communicators.  While a shm call waits, the Python signal handlers run
 * every ~15 ms (poll_signals): an exception one raises (KeyboardInterrupt)
 * ends the call and comes out unchanged.  No collective logic lives here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "comm/shm.h"
#include "comm_glue.h"
#include "cpu_features.h"
#include "glue.h"
#include "tensor_view.h"

#define SHM_CAPSULE "shardformer.shm_comm"

/* The capsule owns a box: the communicator, and the calls now inside the C
 * core with the GIL released (one at most: calls on one communicator must
 * not overlap, and a second is refused).  The box is read and written with
 * the GIL held only.  shm_close during a call marks the box closing, so new
 * calls are refused, and the call unmaps the segment when it leaves; a call
 * holds a reference to the capsule while it runs, so the capsule's
 * destructor never runs under it either. */
typedef struct {
    sf_shm *comm;
    int inflight;
    int closing;
} shm_box;

static void shm_capsule_free(PyObject *cap)
{
    shm_box *b = PyCapsule_GetPointer(cap, SHM_CAPSULE);
    if (!b) {
        PyErr_Clear();
        return;
    }
    /* b->inflight is 0: a running call holds a reference to the capsule. */
    sf_shm_close(b->comm);
    PyMem_Free(b);
}

/* The box of an open shm capsule; NULL with TypeError (not a shm capsule) or
 * ValueError (closed, or closing). */
static shm_box *shm_box_of(PyObject *cap)
{
    if (!PyCapsule_IsValid(cap, SHM_CAPSULE)) {
        PyErr_Format(PyExc_TypeError, "expected a shm communicator (from shm_create or "
                     "shm_attach), got %.100s", Py_TYPE(cap)->tp_name);
        return NULL;
    }
    shm_box *b = PyCapsule_GetPointer(cap, SHM_CAPSULE);
    if (!b)
        return NULL;
    if (!b->comm || b->closing) {
        PyErr_SetString(PyExc_ValueError, "shm communicator is closed");
        return NULL;
    }
    return b;
}

static PyObject *wrap_shm(sf_shm *c)
{
    shm_box *b = PyMem_Malloc(sizeof(*b));
    if (!b) {
        sf_shm_close(c);
        return PyErr_NoMemory();
    }
    b->comm = c;
    b->inflight = 0;
    b->closing = 0;
    PyObject *cap = PyCapsule_New(b, SHM_CAPSULE, shm_capsule_free);
    if (!cap) {
        sf_shm_close(c);
        PyMem_Free(b);
    }
    return cap;
}

/* The dtypes the reductions know (sf_take checks against this set first). */
#define RED_DTYPES (SF_DT_F32 | SF_DT_F16 | SF_DT_BF16 | SF_DT_F64 | SF_DT_I32 | SF_DT_I64)

static sf_red_dtype red_dtype(const sf_view *v)
{
    switch (sf_dtype_bit(v->dtype)) {
    case SF_DT_F16: return SF_RED_F16;
    case SF_DT_BF16: return SF_RED_BF16;
    case SF_DT_F64: return SF_RED_F64;
    case SF_DT_I32: return SF_RED_I32;
    case SF_DT_I64: return SF_RED_I64;
    default: return SF_RED_F32;
    }
}

/* The dtype of a bytes-moving call, as the ranks compare it. */
static sf_shm_dtype shm_dtype(const sf_view *v)
{
    return SF_SHM_DTYPE(v->dtype.code, v->dtype.bits, v->dtype.lanes);
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

/* A CPU, contiguous view of a reducible dtype (or any dtype when `bytes`);
 * writable when `write`.  0 or -1 with an exception (sf_take). */
static int take_cpu(const char *fn, PyObject *obj, const char *name, int write, int bytes,
                    sf_view *v)
{
    return sf_take(fn, obj, name, bytes ? SF_DT_ANY : RED_DTYPES,
                   SF_TAKE_CONTIGUOUS | (write ? SF_TAKE_WRITE : 0), v) < 0 ? -1 : 0;
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
    sf_error err = {0};
    sf_status rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sf_shm_create(name, nranks, (size_t)workspace, (size_t)p2p, nonce, &c, &err);
    Py_END_ALLOW_THREADS
    if (sf_set_pyerr(rc, &err))
        return NULL;
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
    sf_error err = {0};
    sf_status rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sf_shm_attach(name, nranks, rank, nonce, &c, &err);
    Py_END_ALLOW_THREADS
    if (sf_set_pyerr(rc, &err))
        return NULL;
    return wrap_shm(c);
}

static PyObject *py_shm_unlink(PyObject *self, PyObject *arg)
{
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name)
        return NULL;
    sf_error err = {0};
    sf_status rc = sf_shm_unlink(name, &err);
    if (sf_set_pyerr(rc, &err))
        return NULL;
    Py_RETURN_NONE;
}

/* Idempotent.  During a call (another thread) it only marks the box closing:
 * the call unmaps when it returns. */
static PyObject *py_shm_close(PyObject *self, PyObject *cap)
{
    (void)self;
    if (!PyCapsule_IsValid(cap, SHM_CAPSULE))
        return PyErr_Format(PyExc_TypeError, "shm_close: expected a shm communicator, got %.100s",
                            Py_TYPE(cap)->tp_name);
    shm_box *b = PyCapsule_GetPointer(cap, SHM_CAPSULE);
    if (!b)
        return NULL;
    if (b->inflight) {
        b->closing = 1;
    } else {
        sf_shm_close(b->comm);
        b->comm = NULL;
    }
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
    shm_box *b = shm_box_of(cap);
    if (!b)
        return NULL;
    if (!(timeout > 0) || oneshot_max < 0) {
        char num[64]; /* PyErr_Format has no %g */
        snprintf(num, sizeof(num), "%g", timeout);
        return PyErr_Format(PyExc_ValueError, "shm_configure: timeout=%s s must be > 0 and "
                            "oneshot_max=%zd >= 0", num, oneshot_max);
    }
    if (b->inflight)
        return PyErr_Format(PyExc_RuntimeError, "shm_configure: a call is running on this "
                            "communicator in another thread");
    sf_shm_configure(b->comm, label, timeout, (size_t)oneshot_max);
    Py_RETURN_NONE;
}

static PyObject *py_shm_info(PyObject *self, PyObject *cap)
{
    (void)self;
    shm_box *b = shm_box_of(cap);
    if (!b)
        return NULL;
    sf_shm *c = b->comm;
    return Py_BuildValue("{s:i,s:i,s:n,s:n,s:n,s:d,s:K,s:K}", "rank", sf_shm_rank(c), "nranks",
                         sf_shm_nranks(c), "workspace", (Py_ssize_t)sf_shm_workspace(c),
                         "segment_bytes", (Py_ssize_t)sf_shm_segment_bytes(c), "oneshot_max",
                         (Py_ssize_t)sf_shm_oneshot_max(c), "timeout", sf_shm_timeout(c),
                         "futex_sleeps", (unsigned long long)sf_shm_sleeps(c),
                         "futex_wakes", (unsigned long long)sf_shm_wakes(c));
}

static PyObject *py_shm_abort(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap;
    unsigned long long token;
    if (!PyArg_ParseTuple(args, "OK:shm_abort", &cap, &token))
        return NULL;
    shm_box *b = shm_box_of(cap);
    if (!b)
        return NULL;
    if (token == 0)
        return PyErr_Format(PyExc_ValueError, "shm_abort: the token must be nonzero");
    sf_shm_abort(b->comm, (uint64_t)token);
    Py_RETURN_NONE;
}

static PyObject *py_shm_abort_record(PyObject *self, PyObject *cap)
{
    (void)self;
    shm_box *b = shm_box_of(cap);
    if (!b)
        return NULL;
    int rank, why;
    uint64_t token;
    if (!sf_shm_abort_record(b->comm, &rank, &why, &token))
        Py_RETURN_NONE;
    return Py_BuildValue("(iiK)", rank, why, (unsigned long long)token);
}

static PyObject *py_shm_set_phase(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap;
    int phase;
    if (!PyArg_ParseTuple(args, "Op:shm_set_phase", &cap, &phase))
        return NULL;
    shm_box *b = shm_box_of(cap);
    if (!b)
        return NULL;
    sf_shm_set_phase(b->comm, (unsigned)phase);
    Py_RETURN_NONE;
}

static PyObject *py_shm_rank_states(PyObject *self, PyObject *cap)
{
    (void)self;
    shm_box *b = shm_box_of(cap);
    if (!b)
        return NULL;
    int n = sf_shm_nranks(b->comm);
    PyObject *out = PyList_New(n);
    for (int r = 0; out && r < n; r++) {
        uint64_t seq;
        unsigned phase;
        sf_shm_rank_state(b->comm, r, &seq, &phase);
        PyObject *item = Py_BuildValue("(KO)", (unsigned long long)seq, phase ? Py_True : Py_False);
        if (!item) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, r, item);
    }
    return out;
}

/* ---- shm: running a call -------------------------------------------------- */

typedef enum { SHM_ALL_REDUCE, SHM_ALL_GATHER, SHM_REDUCE_SCATTER, SHM_BROADCAST, SHM_SEND,
               SHM_RECV, SHM_BARRIER, SHM_ALL_TO_ALL } shm_kind;

/* One call's arguments, taken and checked with the GIL held. */
typedef struct {
    shm_kind kind;
    void *out;        /* written: the in-place tensor, or the output */
    const void *in;   /* read: all_gather, reduce_scatter, all_to_all, send */
    size_t count;     /* elements (all_reduce, reduce_scatter: of out) or bytes
                         (all_to_all: of one rank's block) */
    sf_red_dtype red_t;
    sf_red_op op;
    sf_ar_algo algo;
    sf_shm_dtype dtype;
    int peer;         /* broadcast root, send/recv peer */
} shm_call;

static sf_status shm_dispatch(sf_shm *c, const shm_call *a, sf_error *err)
{
    switch (a->kind) {
    case SHM_ALL_REDUCE:
        return sf_shm_all_reduce(c, a->out, a->count, a->red_t, a->op, a->algo, err);
    case SHM_ALL_GATHER:
        return sf_shm_all_gather(c, a->out, a->in, a->count, a->dtype, err);
    case SHM_REDUCE_SCATTER:
        return sf_shm_reduce_scatter(c, a->out, a->in, a->count, a->red_t, a->op, err);
    case SHM_BROADCAST:
        return sf_shm_broadcast(c, a->out, a->count, a->dtype, a->peer, err);
    case SHM_SEND:
        return sf_shm_send(c, a->in, a->count, a->dtype, a->peer, err);
    case SHM_RECV:
        return sf_shm_recv(c, a->out, a->count, a->dtype, a->peer, err);
    case SHM_BARRIER:
        return sf_shm_barrier(c, err);
    case SHM_ALL_TO_ALL:
        return sf_shm_all_to_all(c, a->out, a->in, a->count, a->dtype, err);
    }
    return sf_fail(err, SF_EINVAL, "shm: unknown call %d", (int)a->kind);
}

/* The waits' poll callback (every ~15 ms of a slow wait): take the GIL back
 * for a moment and run the Python signal handlers (they run in the main
 * thread only; elsewhere this is a no-op).  Nonzero when a handler raised:
 * its exception stays set, and the call fails with SF_EINTR. */
static int poll_signals(void *ctx)
{
    PyThreadState **saved = ctx;
    PyEval_RestoreThread(*saved);
    int r = PyErr_CheckSignals();
    *saved = PyEval_SaveThread();
    return r < 0;
}

/* Run fn(comm, ctx, err) on the communicator of `cap` with the GIL released,
 * polling for signals: one call, or a C loop that makes many (the decode
 * step, decode_module.c).  0, or -1 with an exception: the call's
 * (sf_set_pyerr), or the one a signal handler raised (KeyboardInterrupt,
 * ...), unchanged. */
int sf_shm_run_native(PyObject *cap, sf_shm_native_fn fn, void *ctx)
{
    /* Looked up again: taking the tensors ran Python code (__dlpack__). */
    shm_box *b = shm_box_of(cap);
    if (!b)
        return -1;
    if (b->inflight) {
        PyErr_SetString(PyExc_RuntimeError, "shm communicator is running a call in another "
                        "thread (calls on one communicator must not overlap)");
        return -1;
    }
    sf_shm *c = b->comm;
    sf_error err = {0};
    Py_INCREF(cap);
    b->inflight++;
    PyThreadState *saved = PyEval_SaveThread();
    sf_shm_set_poll(c, poll_signals, &saved);
    sf_status rc = fn(c, ctx, &err);
    sf_shm_set_poll(c, NULL, NULL);
    PyEval_RestoreThread(saved);
    b->inflight--;
    if (b->closing && b->inflight == 0) { /* shm_close came during the call */
        sf_shm_close(c);
        b->comm = NULL;
        b->closing = 0;
    }
    int res = sf_set_pyerr(rc, &err);
    Py_DECREF(cap); /* last: b is not touched after this */
    return res;
}

static sf_status shm_dispatch_native(sf_shm *c, void *ctx, sf_error *err)
{
    return shm_dispatch(c, ctx, err);
}

/* One call of the collectives below (sf_shm_run_native). */
static int shm_run(PyObject *cap, const shm_call *a)
{
    return sf_shm_run_native(cap, shm_dispatch_native, (void *)a);
}

/* ---- shm: collectives ---------------------------------------------------- */

/* big.numel == nranks * small.numel (checked multiplication); 0 or -1 with
 * ValueError / OverflowError naming `bigname`. */
int sf_check_blocks(const char *fn, const char *bigname, const sf_view *big,
                        const sf_view *small, int nranks)
{
    int64_t want;
    if (sf_mul_overflows(small->numel, (int64_t)nranks, &want)) {
        PyErr_Format(PyExc_OverflowError, "%s: %d ranks x %lld elements overflow int64", fn,
                     nranks, (long long)small->numel);
        return -1;
    }
    if (big->numel != want) {
        PyErr_Format(PyExc_ValueError, "%s: %s has %lld elements, expected %lld = %d ranks x "
                     "%lld", fn, bigname, (long long)big->numel, (long long)want, nranks,
                     (long long)small->numel);
        return -1;
    }
    return 0;
}

static PyObject *py_shm_all_reduce(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap, *obj;
    const char *op_name = "sum";
    int algo = 0;
    if (!PyArg_ParseTuple(args, "OO|si:shm_all_reduce", &cap, &obj, &op_name, &algo))
        return NULL;
    sf_red_op op;
    if (!shm_box_of(cap) || red_op(op_name, &op))
        return NULL;
    if (algo < 0 || algo > 2)
        return PyErr_Format(PyExc_ValueError, "shm_all_reduce: algo=%d not in 0..2", algo);
    sf_view v;
    if (take_cpu(NULL, obj, "tensor", 1, 0, &v))
        return NULL;
    shm_call a = {.kind = SHM_ALL_REDUCE, .out = v.data, .count = (size_t)v.numel,
                  .red_t = red_dtype(&v), .op = op, .algo = (sf_ar_algo)algo};
    int failed = shm_run(cap, &a);
    sf_view_release(&v);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_shm_reduce_scatter(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap, *oo, *io;
    const char *op_name = "sum";
    if (!PyArg_ParseTuple(args, "OOO|s:shm_reduce_scatter", &cap, &oo, &io, &op_name))
        return NULL;
    shm_box *b = shm_box_of(cap);
    sf_red_op op;
    if (!b || red_op(op_name, &op))
        return NULL;
    int nranks = sf_shm_nranks(b->comm);
    sf_view out, in;
    if (take_cpu(NULL, oo, "out", 1, 0, &out))
        return NULL;
    if (take_cpu(NULL, io, "tensor", 0, 0, &in)) {
        sf_view_release(&out);
        return NULL;
    }
    PyObject *res = NULL;
    sf_error err = {0};
    if (!sf_set_pyerr(sf_check_same_dtype(&out, "out", &in, "tensor", &err), &err) &&
        !sf_check_blocks("shm_reduce_scatter", "input", &in, &out, nranks)) {
        shm_call a = {.kind = SHM_REDUCE_SCATTER, .out = out.data, .in = in.data,
                      .count = (size_t)out.numel, .red_t = red_dtype(&in), .op = op};
        if (!shm_run(cap, &a))
            res = Py_NewRef(Py_None);
    }
    sf_view_release(&in);
    sf_view_release(&out);
    return res;
}

/* out and tensor: the same number of elements, a multiple of nranks; 0 or
 * -1 with ValueError. */
int sf_check_all_to_all(const char *fn, const sf_view *out, const sf_view *in, int nranks)
{
    if (out->numel != in->numel) {
        PyErr_Format(PyExc_ValueError, "%s: out has %lld elements but tensor has %lld; "
                     "all_to_all needs the same number", fn, (long long)out->numel,
                     (long long)in->numel);
        return -1;
    }
    if (nranks < 1 || in->numel % nranks) {
        PyErr_Format(PyExc_ValueError, "%s: tensor has %lld elements, not divisible into %d "
                     "equal blocks (one per rank)", fn, (long long)in->numel, nranks);
        return -1;
    }
    return 0;
}

/* all_gather and all_to_all: an output and an input buffer of one dtype.
 * all_gather: out holds nranks blocks of the input's size, and `count` is the
 * input's bytes; all_to_all: out and tensor the same size, a multiple of
 * nranks, and `count` the bytes of one block. */
static PyObject *out_in_call(PyObject *args, const char *fmt, shm_kind kind)
{
    PyObject *cap, *oo, *io;
    if (!PyArg_ParseTuple(args, fmt, &cap, &oo, &io))
        return NULL;
    shm_box *b = shm_box_of(cap);
    if (!b)
        return NULL;
    const char *fn = kind == SHM_ALL_GATHER ? "shm_all_gather" : "shm_all_to_all";
    int nranks = sf_shm_nranks(b->comm);
    sf_view out, in;
    if (take_cpu(NULL, oo, "out", 1, 1, &out))
        return NULL;
    if (take_cpu(NULL, io, "tensor", 0, 1, &in)) {
        sf_view_release(&out);
        return NULL;
    }
    PyObject *res = NULL;
    sf_error err = {0};
    size_t bytes = 0;
    if (!sf_set_pyerr(sf_check_same_dtype(&out, "out", &in, "tensor", &err), &err) &&
        !(kind == SHM_ALL_GATHER ? sf_check_blocks(fn, "out", &out, &in, nranks)
                                 : sf_check_all_to_all(fn, &out, &in, nranks)) &&
        !sf_set_pyerr(sf_view_nbytes(&in, "tensor", &bytes, &err), &err)) {
        size_t count = kind == SHM_ALL_GATHER ? bytes : bytes / (size_t)nranks;
        shm_call a = {.kind = kind, .out = out.data, .in = in.data, .count = count, .dtype = shm_dtype(&in)};
        if (!shm_run(cap, &a))
            res = Py_NewRef(Py_None);
    }
    sf_view_release(&in);
    sf_view_release(&out);
    return res;
}

static PyObject *py_shm_all_gather(PyObject *self, PyObject *args)
{
    (void)self;
    return out_in_call(args, "OOO:shm_all_gather", SHM_ALL_GATHER);
}

static PyObject *py_shm_all_to_all(PyObject *self, PyObject *args)
{
    (void)self;
    return out_in_call(args, "OOO:shm_all_to_all", SHM_ALL_TO_ALL);
}

/* broadcast, send and recv move the bytes of one tensor, with one rank
 * argument (root or peer); `write`: the tensor is written. */
static PyObject *bytes_call(PyObject *args, const char *fmt, shm_kind kind, int write)
{
    PyObject *cap, *obj;
    int peer;
    if (!PyArg_ParseTuple(args, fmt, &cap, &obj, &peer))
        return NULL;
    if (!shm_box_of(cap))
        return NULL;
    sf_view v;
    if (take_cpu(NULL, obj, "tensor", write, 1, &v))
        return NULL;
    sf_error err = {0};
    size_t bytes = 0;
    int failed = sf_set_pyerr(sf_view_nbytes(&v, "tensor", &bytes, &err), &err);
    if (!failed) {
        shm_call a = {.kind = kind, .count = bytes, .dtype = shm_dtype(&v), .peer = peer};
        if (write)
            a.out = v.data;
        else
            a.in = v.data;
        failed = shm_run(cap, &a);
    }
    sf_view_release(&v);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_shm_broadcast(PyObject *self, PyObject *args)
{
    (void)self;
    /* Only the root's tensor is read; others' are written. */
    return bytes_call(args, "OOi:shm_broadcast", SHM_BROADCAST, 1);
}

static PyObject *py_shm_send(PyObject *self, PyObject *args)
{
    (void)self;
    return bytes_call(args, "OOi:shm_send", SHM_SEND, 0);
}

static PyObject *py_shm_recv(PyObject *self, PyObject *args)
{
    (void)self;
    return bytes_call(args, "OOi:shm_recv", SHM_RECV, 1);
}

static PyObject *py_shm_barrier(PyObject *self, PyObject *cap)
{
    (void)self;
    shm_call a = {.kind = SHM_BARRIER};
    if (shm_run(cap, &a))
        return NULL;
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
    sf_error err = {0};
    sf_status rc;
    if (take_cpu("reduce_buffers", oo, "out", 1, 0, &out)) {
        Py_DECREF(items);
        return NULL;
    }
    for (; got < k; got++) {
        if (take_cpu("reduce_buffers", PySequence_Fast_GET_ITEM(items, got), "inputs[i]", 0, 0,
                     &in[got]))
            goto done;
        src[got] = in[got].data;
        if (sf_set_pyerr(sf_check_same_dtype(&out, "out", &in[got], "inputs[i]", &err), &err) ||
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
    rc = sf_reduce(red_dtype(&out), op, out.data, src, (int)k, (size_t)out.numel, simd, &err);
    Py_END_ALLOW_THREADS
    if (!sf_set_pyerr(rc, &err))
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
    return PyBool_FromLong(sf_cpu_has_simd());
}

static PyObject *py_cpu_features(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    unsigned f = sf_cpu_features();
    return Py_BuildValue("{s:O,s:O,s:O,s:O,s:O,s:O,s:O,s:O,s:O}", "avx2", f & SF_CPU_AVX2 ? Py_True : Py_False,
                         "fma", f & SF_CPU_FMA ? Py_True : Py_False, "f16c",
                         f & SF_CPU_F16C ? Py_True : Py_False, "avx512f",
                         f & SF_CPU_AVX512F ? Py_True : Py_False, "avx512bw",
                         f & SF_CPU_AVX512BW ? Py_True : Py_False, "avx512bf16",
                         f & SF_CPU_AVX512BF16 ? Py_True : Py_False, "simd",
                         sf_cpu_has_simd() ? Py_True : Py_False, "avx512",
                         sf_cpu_has_avx512() ? Py_True : Py_False, "avx512_bf16",
                         sf_cpu_has_avx512_bf16() ? Py_True : Py_False);
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
    {"shm_abort", py_shm_abort, METH_VARARGS,
     "shm_abort(comm, token): this rank failed; every wait of every rank fails now (token: nonzero)."},
    {"shm_set_phase", py_shm_set_phase, METH_VARARGS,
     "shm_set_phase(comm, backward): the phase the next calls' descriptors carry (forward: False)."},
    {"shm_rank_states", py_shm_rank_states, METH_O,
     "shm_rank_states(comm) -> [(barriers entered, last call in backward)] per group rank."},
    {"shm_abort_record", py_shm_abort_record, METH_O,
     "shm_abort_record(comm) -> None or (rank, why, token): the group's first failure."},
    {"shm_all_reduce", py_shm_all_reduce, METH_VARARGS,
     "shm_all_reduce(comm, t, op='sum', algo=0): in place; algo 1 one-shot, 2 RS+AG."},
    {"shm_all_gather", py_shm_all_gather, METH_VARARGS,
     "shm_all_gather(comm, out, t): out = concat over ranks of t."},
    {"shm_reduce_scatter", py_shm_reduce_scatter, METH_VARARGS,
     "shm_reduce_scatter(comm, out, t, op='sum'): out = own block of the reduced t."},
    {"shm_all_to_all", py_shm_all_to_all, METH_VARARGS,
     "shm_all_to_all(comm, out, t): block i of out = block rank of t on rank i "
     "(t, out: nranks equal blocks)."},
    {"shm_broadcast", py_shm_broadcast, METH_VARARGS, "shm_broadcast(comm, t, root)"},
    {"shm_send", py_shm_send, METH_VARARGS, "shm_send(comm, t, dst)"},
    {"shm_recv", py_shm_recv, METH_VARARGS, "shm_recv(comm, t, src)"},
    {"shm_barrier", py_shm_barrier, METH_O, "shm_barrier(comm)"},
    {"reduce_buffers", py_reduce_buffers, METH_VARARGS,
     "reduce_buffers(out, inputs, op='sum', simd=True): out = op over inputs (the shm kernels)."},
    {"cpu_has_avx2", py_cpu_has_avx2, METH_NOARGS,
     "True when the SIMD kernels run here (AVX2, FMA and F16C: cpu_features()['simd'])."},
    {"cpu_features", py_cpu_features, METH_NOARGS,
     "cpu_features() -> dict: the one CPU probe of the C core (avx2, fma, f16c, avx512f, and "
     "simd / avx512: what the kernels use)."},
    {NULL, NULL, 0, NULL},
};

int sf_register_comm(PyObject *m)
{
    return PyModule_AddFunctions(m, comm_methods);
}
