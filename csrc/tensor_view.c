/*
 * tensor_view.c -- DLPack capsule -> sf_view, and the argument checks that
 * every tensor-taking entry point of _C runs before touching memory.
 */
#include "tensor_view.h"

#include <string.h>

static const char CAPSULE_V1[] = "dltensor_versioned";
static const char CAPSULE_V0[] = "dltensor";

const char *sf_dtype_name(SFDLDataType dt)
{
    if (dt.lanes != 1)
        return "vector";
    switch (dt.code) {
    case SF_DL_FLOAT:
        return dt.bits == 32 ? "float32" : dt.bits == 16 ? "float16"
             : dt.bits == 64 ? "float64" : "float?";
    case SF_DL_BFLOAT:
        return dt.bits == 16 ? "bfloat16" : "bfloat?";
    case SF_DL_INT:
        return dt.bits == 64 ? "int64" : dt.bits == 32 ? "int32"
             : dt.bits == 16 ? "int16" : dt.bits == 8 ? "int8" : "int?";
    case SF_DL_UINT:
        return dt.bits == 8 ? "uint8" : "uint?";
    case SF_DL_BOOL:
        return "bool";
    default:
        return "unknown";
    }
}

static PyObject *call_dlpack(PyObject *obj, const char *argname)
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
     * back to the legacy call for producers that predate DLPack 1.0. */
    PyObject *kwargs = Py_BuildValue("{s:(ii)}", "max_version", 1, 0);
    PyObject *empty = PyTuple_New(0);
    PyObject *capsule = NULL;
    if (kwargs != NULL && empty != NULL)
        capsule = PyObject_Call(method, empty, kwargs);
    Py_XDECREF(kwargs);
    Py_XDECREF(empty);
    if (capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        capsule = PyObject_CallNoArgs(method);
    }
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

int sf_view_acquire(PyObject *obj, const char *argname, sf_view *v)
{
    memset(v, 0, sizeof(*v));
    PyObject *capsule = call_dlpack(obj, argname);
    if (capsule == NULL)
        return -1;

    SFDLTensor *t = NULL;
    if (PyCapsule_IsValid(capsule, CAPSULE_V1)) {
        SFDLManagedTensorVersioned *m = PyCapsule_GetPointer(capsule, CAPSULE_V1);
        if (m->version.major != 1) {
            PyErr_Format(PyExc_TypeError, "%s: unsupported DLPack major version %u",
                         argname, (unsigned)m->version.major);
            Py_DECREF(capsule);
            return -1;
        }
        t = &m->dl_tensor;
        v->readonly = (m->flags & SF_DLPACK_FLAG_READ_ONLY) != 0;
    } else if (PyCapsule_IsValid(capsule, CAPSULE_V0)) {
        SFDLManagedTensor *m = PyCapsule_GetPointer(capsule, CAPSULE_V0);
        t = &m->dl_tensor;
    } else {
        PyErr_Format(PyExc_TypeError, "%s: __dlpack__ did not return a DLPack capsule",
                     argname);
        Py_DECREF(capsule);
        return -1;
    }

    if (t->ndim < 0 || t->ndim > SF_MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "%s: %d dimensions (at most %d supported)",
                     argname, (int)t->ndim, SF_MAX_DIMS);
        Py_DECREF(capsule);
        return -1;
    }
    if (t->dtype.lanes != 1 || t->dtype.bits == 0 || t->dtype.bits % 8 != 0) {
        PyErr_Format(PyExc_TypeError, "%s: unsupported DLPack dtype (code %u, %u bits, %u lanes)",
                     argname, (unsigned)t->dtype.code, (unsigned)t->dtype.bits,
                     (unsigned)t->dtype.lanes);
        Py_DECREF(capsule);
        return -1;
    }

    v->ndim = t->ndim;
    v->dtype = t->dtype;
    v->device = t->device;
    v->itemsize = t->dtype.bits / 8;
    v->data = (char *)t->data + t->byte_offset;
    v->numel = 1;
    for (int d = 0; d < v->ndim; d++) {
        if (t->shape[d] < 0) {
            PyErr_Format(PyExc_ValueError, "%s: negative size in dimension %d", argname, d);
            Py_DECREF(capsule);
            return -1;
        }
        v->shape[d] = t->shape[d];
        if (t->shape[d] != 0 && v->numel > INT64_MAX / t->shape[d]) {
            PyErr_Format(PyExc_OverflowError, "%s: the element count overflows int64 at "
                         "dimension %d", argname, d);
            Py_DECREF(capsule);
            return -1;
        }
        v->numel *= t->shape[d];
    }
    /* NULL strides mean compact row-major: spell them out. */
    int64_t stride = 1;
    for (int d = v->ndim - 1; d >= 0; d--) {
        v->strides[d] = t->strides ? t->strides[d] : stride;
        stride *= v->shape[d];
    }
    v->owner = capsule;
    return 0;
}

void sf_view_release(sf_view *v)
{
    Py_CLEAR(v->owner);
    v->data = NULL;
}

int sf_view_is_contiguous(const sf_view *v)
{
    int64_t expected = 1;
    for (int d = v->ndim - 1; d >= 0; d--) {
        if (v->shape[d] != 1 && v->strides[d] != expected)
            return 0;
        expected *= v->shape[d];
    }
    return 1;
}

int sf_check_cpu(const sf_view *v, const char *argname)
{
    if (v->device.device_type != SF_DL_CPU) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected a CPU tensor, got DLPack device type %d (device %d)",
                     argname, (int)v->device.device_type, (int)v->device.device_id);
        return -1;
    }
    return 0;
}

int sf_check_contiguous(const sf_view *v, const char *argname)
{
    if (!sf_view_is_contiguous(v)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected a contiguous tensor (call .contiguous() first)", argname);
        return -1;
    }
    return 0;
}

int sf_check_writable(const sf_view *v, const char *argname)
{
    if (v->readonly) {
        PyErr_Format(PyExc_ValueError, "%s: tensor is read-only", argname);
        return -1;
    }
    return 0;
}

int sf_check_same_dtype(const sf_view *a, const char *aname,
                        const sf_view *b, const char *bname)
{
    if (a->dtype.code != b->dtype.code || a->dtype.bits != b->dtype.bits) {
        PyErr_Format(PyExc_TypeError, "%s has dtype %s but %s has dtype %s",
                     aname, sf_dtype_name(a->dtype), bname, sf_dtype_name(b->dtype));
        return -1;
    }
    return 0;
}

int sf_check_float(const sf_view *v, const char *argname)
{
    int ok = (v->dtype.code == SF_DL_FLOAT && (v->dtype.bits == 32 || v->dtype.bits == 16)) ||
             (v->dtype.code == SF_DL_BFLOAT && v->dtype.bits == 16);
    if (!ok) {
        PyErr_Format(PyExc_TypeError,
                     "%s: expected float32, float16 or bfloat16, got %s",
                     argname, sf_dtype_name(v->dtype));
        return -1;
    }
    return 0;
}
