/*
 * sharder_record.c -- the plan record (sf_plan_op in C, shardformer._C.PlanOp
 * in Python) and what every file of the sharder shares: errors named in
 * context, attribute probes, dotted paths.  See sharder_internal.h.
 */
#include "sharder.h"
#include "sharder_internal.h"

#include <string.h>

PyTypeObject *sf_plan_op_type = NULL;

static const char *const KIND_NAMES[] = {"attr", "param", "sub", "method"};
enum { N_KINDS = 4 };

/* The fields, in order; the index of each is its slot in the struct sequence. */
enum { F_KIND, F_PATH, F_OWNER, F_NAME, F_VALUE, F_TARGET, F_NATIVE, F_KWARGS, F_PLAN, F_CHANGE,
       N_FIELDS };

static PyStructSequence_Field plan_op_fields[] = {
    {"kind", "'attr', 'param', 'sub' or 'method'"},
    {"path", "the dotted path the change lands on (for messages)"},
    {"owner", "the object changed: the attribute's owner, the module, or a sub-module's parent"},
    {"name", "the attribute or sub-module name (None for param)"},
    {"value", "attr: the value; param/method: the function; sub: the replacement once built"},
    {"target", "sub: the replacement class"},
    {"native", "sub: the module it replaces"},
    {"kwargs", "sub: keyword arguments for the target (a dict)"},
    {"plan", "sub: the target's resolved ShardPlan, or None"},
    {"change", "sub built in place: the prepared change (commit/rollback), else None"},
    {NULL, NULL},
};

static PyStructSequence_Desc plan_op_desc = {
    "shardformer._C.PlanOp",
    "One change of a shard plan (see csrc/sharder_internal.h): sharder_plan returns a list\n"
    "of them; sharder_apply builds them (filling in value or change) and makes them.",
    plan_op_fields,
    N_FIELDS,
};

const char *sf_op_kind_name(sf_op_kind kind)
{
    return KIND_NAMES[kind];
}

PyObject *sf_plan_op_new(const sf_plan_op *op)
{
    PyObject *rec = PyStructSequence_New(sf_plan_op_type);
    PyObject *kind = rec ? PyUnicode_InternFromString(KIND_NAMES[op->kind]) : NULL;
    if (kind == NULL) {
        Py_XDECREF(rec);
        return NULL;
    }
    PyObject *const values[N_FIELDS] = {kind,         op->path,   op->owner,  op->name,
                                        op->value,    op->target, op->native, op->kwargs,
                                        op->plan,     op->change};
    PyStructSequence_SET_ITEM(rec, F_KIND, kind);
    for (int i = F_PATH; i < N_FIELDS; i++)
        PyStructSequence_SET_ITEM(rec, i, Py_NewRef(values[i] ? values[i] : Py_None));
    return rec;
}

static PyObject *field_or_null(PyObject *rec, int i)
{
    PyObject *v = PyStructSequence_GET_ITEM(rec, i);
    return v == Py_None ? NULL : v;
}

int sf_plan_op_read(PyObject *obj, sf_plan_op *op)
{
    if (!Py_IS_TYPE(obj, sf_plan_op_type)) {
        PyErr_Format(PyExc_TypeError, "malformed plan op: expected a shardformer._C.PlanOp, got "
                     "%.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *kind = PyStructSequence_GET_ITEM(obj, F_KIND);
    int k = 0;
    while (k < N_KINDS && !(PyUnicode_Check(kind) &&
                            PyUnicode_CompareWithASCIIString(kind, KIND_NAMES[k]) == 0))
        k++;
    if (k == N_KINDS) {
        PyErr_Format(PyExc_TypeError, "unknown plan op kind %R", kind);
        return -1;
    }
    memset(op, 0, sizeof(*op));
    op->kind = (sf_op_kind)k;
    op->path = PyStructSequence_GET_ITEM(obj, F_PATH);
    op->owner = field_or_null(obj, F_OWNER);
    op->name = field_or_null(obj, F_NAME);
    op->value = field_or_null(obj, F_VALUE);
    op->target = field_or_null(obj, F_TARGET);
    op->native = field_or_null(obj, F_NATIVE);
    op->kwargs = field_or_null(obj, F_KWARGS);
    op->plan = field_or_null(obj, F_PLAN);
    op->change = field_or_null(obj, F_CHANGE);
    const char *missing = op->owner == NULL ? "owner" : NULL;
    if (missing == NULL && op->kind != SF_OP_PARAM && op->name == NULL)
        missing = "name";
    if (missing == NULL && op->kind != SF_OP_SUB && op->value == NULL && op->kind != SF_OP_ATTR)
        missing = "value";
    if (missing == NULL && op->kind == SF_OP_SUB && (op->target == NULL || op->native == NULL))
        missing = op->target == NULL ? "target" : "native";
    if (missing != NULL) {
        PyErr_Format(PyExc_TypeError, "malformed plan op: a '%s' op needs %s", KIND_NAMES[k],
                     missing);
        return -1;
    }
    if (op->name != NULL && !PyUnicode_Check(op->name)) {
        PyErr_Format(PyExc_TypeError, "malformed plan op: name must be a str, not %.100s",
                     Py_TYPE(op->name)->tp_name);
        return -1;
    }
    if (op->kind == SF_OP_SUB && op->kwargs != NULL && !PyDict_Check(op->kwargs)) {
        PyErr_SetString(PyExc_TypeError, "malformed plan op (kwargs is not a dict)");
        return -1;
    }
    return 0;
}

int sf_register_sharder(PyObject *module)
{
    if (sf_plan_op_type == NULL) {
        sf_plan_op_type = PyStructSequence_NewType(&plan_op_desc);
        if (sf_plan_op_type == NULL)
            return -1;
    }
    return PyModule_AddObjectRef(module, "PlanOp", (PyObject *)sf_plan_op_type);
}

/* ------------------------------------------------------------------------
 * Errors in context, helpers
 * ---------------------------------------------------------------------- */


/* Exceptions that reach the caller exactly as raised (same type, same
 * object), never wrapped with context: the interrupts (KeyboardInterrupt,
 * SystemExit, GeneratorExit: BaseException but not Exception), which a
 * caller must be able to catch as such, and the interpreter's resource
 * errors (MemoryError, RecursionError), whose type is what a caller acts on
 * and whose handling should not allocate a new message. */
int sf_passes_through(PyObject *type)
{
    if (type == NULL)
        return 0;
    return !PyErr_GivenExceptionMatches(type, PyExc_Exception) ||
           PyErr_GivenExceptionMatches(type, PyExc_MemoryError) ||
           PyErr_GivenExceptionMatches(type, PyExc_RecursionError);
}

/* 1 when the pending exception is one of those (see passes_through). */
int sf_pending_passes_through(void)
{
    return sf_passes_through(PyErr_Occurred());
}

/* Re-raise the current exception as "<model>: <path>: <message>", keeping
 * ValueError / TypeError, and chaining the original as __cause__.  The
 * exceptions of passes_through are left pending unchanged. */
void sf_raise_in_context(PyObject *model_name, PyObject *path)
{
    if (sf_pending_passes_through())
        return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *new_type = PyExc_ValueError;
    if (type && PyType_IsSubtype((PyTypeObject *)type, (PyTypeObject *)PyExc_TypeError))
        new_type = PyExc_TypeError;
    PyObject *msg = value ? PyObject_Str(value) : NULL;
    if (msg == NULL) {
        if (sf_pending_passes_through()) { /* str() itself was interrupted: that wins */
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            return;
        }
        PyErr_Clear();
        msg = PyUnicode_FromString("unknown error");
    }
    PyErr_Format(new_type, "%U: %U: %U", model_name, path, msg);
    Py_XDECREF(msg);
    PyObject *t2, *v2, *tb2;
    PyErr_Fetch(&t2, &v2, &tb2);
    PyErr_NormalizeException(&t2, &v2, &tb2);
    if (value && v2) {
        if (tb)
            PyException_SetTraceback(value, tb);
        PyException_SetCause(v2, value); /* steals value */
        value = NULL;
    }
    PyErr_Restore(t2, v2, tb2);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

/* 1 if obj has the attribute, 0 if not, -1 with an exception on other errors. */
int sf_has_attr(PyObject *obj, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v != NULL) {
        Py_DECREF(v);
        return 1;
    }
    if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

int sf_has_attr_str(PyObject *obj, const char *name)
{
    PyObject *n = PyUnicode_FromString(name);
    if (n == NULL)
        return -1;
    int rc = sf_has_attr(obj, n);
    Py_DECREF(n);
    return rc;
}

PyObject *sf_join_path(PyObject *prefix, PyObject *name)
{
    if (PyUnicode_GetLength(prefix) == 0) {
        Py_INCREF(name);
        return name;
    }
    return PyUnicode_FromFormat("%U.%U", prefix, name);
}

/* The child modules dict of a torch.nn.Module (new reference), or NULL with
 * TypeError if `module` is not a module. */
PyObject *sf_children_of(PyObject *module)
{
    PyObject *children = PyObject_GetAttrString(module, "_modules");
    if (children == NULL && !PyErr_ExceptionMatches(PyExc_AttributeError))
        return NULL; /* an error of the object's own __getattr__: not ours to rename */
    if (children == NULL || !PyDict_Check(children)) {
        Py_XDECREF(children);
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "expected a torch.nn.Module, got %.100s",
                     Py_TYPE(module)->tp_name);
        return NULL;
    }
    return children;
}

/* PyArg_ParseTuple raises SystemError on a non-tuple; policy data comes from
 * Python, so say TypeError instead. */
int sf_check_tuple(PyObject *obj, const char *what)
{
    if (PyTuple_Check(obj))
        return 0;
    PyErr_Format(PyExc_TypeError, "%s: expected a tuple, got %.100s", what,
                 Py_TYPE(obj)->tp_name);
    return -1;
}

