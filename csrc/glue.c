/*
 * glue.c -- the status-to-exception mapper and the DLPack gate (see glue.h).
 */
#include "glue.h"

#include <stdio.h>
#include <string.h>

static const char CAPSULE_V1[] = "dltensor_versioned";
static const char CAPSULE_V0[] = "dltensor";

int sf_set_pyerr(sf_status rc, const sf_error *err)
{
    if (rc == SF_OK)
        return 0;
    const char *msg = err && err->msg[0] ? err->msg : sf_status_name(rc);
    PyObject *type;
    switch (rc) {
    case SF_EINVAL: type = PyExc_ValueError; break;
    case SF_ETYPE: type = PyExc_TypeError; break;
    case SF_ERANGE: type = PyExc_IndexError; break;
    case SF_EOVERFLOW: type = PyExc_OverflowError; break;
    case SF_ENOMEM: type = PyExc_MemoryError; break;
    case SF_ETIMEOUT: type = PyExc_TimeoutError; break;
    case SF_EINTR:
        /* The exception a signal handler raised while the call polled
         * (KeyboardInterrupt, or whatever the handler raises) goes out
         * unchanged; failing that, a handler may have something to raise now. */
        if (PyErr_Occurred() || PyErr_CheckSignals() < 0)
            return -1;
        type = PyExc_KeyboardInterrupt;
        break;
    case SF_EIO: type = PyExc_OSError; break;
    case SF_EPEER:
    case SF_EMISMATCH: /* as gloo: RuntimeError for sizes that do not match */
    case SF_EUNSUPPORTED:
    case SF_EEXTERNAL:
    default: type = PyExc_RuntimeError; break;
    }
    PyErr_SetString(type, msg);
    return -1;
}

static PyObject *call_dlpack(PyObject *obj, const char *argname, int cuda)
{
    PyObject *method = PyObject_GetAttrString(obj, "__dlpack__");
    if (method == NULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "%s: expected a tensor supporting __dlpack__, got %.100s",
                     argname, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    /* Ask for the versioned capsule (it carries the read-only flag); fall
     * back to the legacy call for producers that predate DLPack 1.0.  For a
     * CUDA tensor ask first for stream=-1 (no synchronization: the NCCL glue
     * enqueues on the stream it is given, and an event between streams would
     * break CUDA graph capture); producers that refuse a stream (NumPy) are
     * asked again without one. */
    PyObject *empty = PyTuple_New(0);
    PyObject *capsule = NULL;
    if (empty == NULL) {
        Py_DECREF(method);
        return NULL;
    }
    if (cuda) {
        PyObject *kwargs = Py_BuildValue("{s:(ii),s:i}", "max_version", 1, 0, "stream", -1);
        if (kwargs != NULL)
            capsule = PyObject_Call(method, empty, kwargs);
        Py_XDECREF(kwargs);
        if (capsule == NULL)
            PyErr_Clear();
    }
    if (capsule == NULL) {
        PyObject *kwargs = Py_BuildValue("{s:(ii)}", "max_version", 1, 0);
        if (kwargs != NULL)
            capsule = PyObject_Call(method, empty, kwargs);
        Py_XDECREF(kwargs);
        if (capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            capsule = PyObject_CallNoArgs(method);
        }
    }
    Py_DECREF(empty);
    Py_DECREF(method);
    if (capsule == NULL) {
        /* Producer refused (e.g. a tensor that requires grad): say which arg. */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *msg = value ? PyObject_Str(value) : NULL;
        PyErr_Format(PyExc_TypeError, "%s: cannot export through DLPack: %S",
                     argname, msg ? msg : Py_None);
        Py_XDECREF(msg);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return NULL;
    }
    return capsule;
}

/* The capsule of `obj` as a validated view (no requirement checks yet). */
static int acquire(PyObject *obj, const char *argname, int cuda, sf_view *v)
{
    memset(v, 0, sizeof(*v));
    PyObject *capsule = call_dlpack(obj, argname, cuda);
    if (capsule == NULL)
        return -1;

    SFDLTensor *t = NULL;
    int readonly = 0;
    if (PyCapsule_IsValid(capsule, CAPSULE_V1)) {
        SFDLManagedTensorVersioned *m = PyCapsule_GetPointer(capsule, CAPSULE_V1);
        if (m->version.major != 1) {
            PyErr_Format(PyExc_TypeError, "%s: unsupported DLPack major version %u",
                         argname, (unsigned)m->version.major);
            Py_DECREF(capsule);
            return -1;
        }
        t = &m->dl_tensor;
        readonly = (m->flags & SF_DLPACK_FLAG_READ_ONLY) != 0;
    } else if (PyCapsule_IsValid(capsule, CAPSULE_V0)) {
        SFDLManagedTensor *m = PyCapsule_GetPointer(capsule, CAPSULE_V0);
        t = &m->dl_tensor;
    } else {
        PyErr_Format(PyExc_TypeError, "%s: __dlpack__ did not return a DLPack capsule",
                     argname);
        Py_DECREF(capsule);
        return -1;
    }
    sf_error err = {0};
    sf_status rc = sf_view_init(v, t, readonly, argname, &err);
    if (rc != SF_OK) {
        Py_DECREF(capsule);
        memset(v, 0, sizeof(*v));
        return sf_set_pyerr(rc, &err);
    }
    v->owner = capsule;
    return 0;
}

void sf_view_release(sf_view *v)
{
    PyObject *owner = (PyObject *)v->owner;
    v->owner = NULL;
    v->data = NULL;
    Py_XDECREF(owner);
}

int sf_take(const char *fn, PyObject *obj, const char *name, unsigned dtypes, unsigned flags,
            sf_view *v)
{
    char label[160];
    if (fn)
        snprintf(label, sizeof(label), "%s: %s", fn, name);
    else
        snprintf(label, sizeof(label), "%s", name);
    if (obj == Py_None && (flags & SF_TAKE_OPTIONAL)) {
        memset(v, 0, sizeof(*v));
        return 1;
    }
    if (acquire(obj, label, (flags & SF_TAKE_CUDA) != 0, v) < 0)
        return -1;
    sf_error err = {0};
    sf_status rc = SF_OK;
    if (!(flags & SF_TAKE_ANY_DEVICE))
        rc = flags & SF_TAKE_CUDA ? sf_check_cuda(v, label, &err) : sf_check_cpu(v, label, &err);
    if (rc == SF_OK)
        rc = sf_check_dtype(v, label, dtypes, &err);
    /* an empty tensor has nothing to lay out (torch gives them odd strides) */
    if (rc == SF_OK && (flags & SF_TAKE_CONTIGUOUS) && v->numel > 0)
        rc = sf_check_contiguous(v, label, &err);
    if (rc == SF_OK && (flags & SF_TAKE_WRITE))
        rc = sf_check_writable(v, label, &err);
    if (rc != SF_OK) {
        sf_view_release(v);
        return sf_set_pyerr(rc, &err);
    }
    return 0;
}
