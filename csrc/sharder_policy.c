/*
 * sharder_policy.c -- reading the policy: Python objects in, checked tuples
 * out.  The one place the shape of a policy is checked; planning
 * (sharder_walk.c) reads the result without checking again.
 *
 * The policy is {key: ModulePolicyDescription} (read by attribute), or the
 * same in plain tuples (the engine's own form, used by tests):
 *   entries: {key: (attrs, params, subs, methods)}
 *     attrs   ((dotted_name, value), ...)
 *     params  (callable(module), ...)
 *     subs    ((suffix, target, kwargs_dict, ignore_if_not_exist), ...)
 *     methods ((name, function), ...)
 * A key is a module class, its __qualname__, or "module.qualname".
 */
#include "sharder_internal.h"

/* getattr(obj, name), with None for a missing attribute or a None value
 * replaced by `dflt` (new reference). */
static PyObject *attr_or(PyObject *obj, const char *name, PyObject *dflt)
{
    PyObject *v = PyObject_GetAttrString(obj, name);
    if (v == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return NULL;
        PyErr_Clear();
    }
    if (v == NULL || v == Py_None) {
        Py_XDECREF(v);
        return Py_NewRef(dflt);
    }
    return v;
}

/* A {name: value} mapping as ((str(name), value), ...). */
static PyObject *pairs_of(PyObject *mapping, const char *what, PyObject *model, PyObject *key)
{
    if (!PyDict_Check(mapping)) {
        PyErr_Format(PyExc_TypeError, "%U: policy[%R].%s must be a dict, got %.100s", model, key,
                     what, Py_TYPE(mapping)->tp_name);
        return NULL;
    }
    PyObject *out = PyTuple_New(PyDict_GET_SIZE(mapping));
    Py_ssize_t pos = 0, i = 0;
    PyObject *k, *v;
    while (out && PyDict_Next(mapping, &pos, &k, &v)) {
        PyObject *name = PyObject_Str(k);
        PyObject *pair = name ? PyTuple_Pack(2, name, v) : NULL;
        Py_XDECREF(name);
        if (pair == NULL)
            Py_CLEAR(out);
        else
            PyTuple_SET_ITEM(out, i++, pair);
    }
    return out;
}

/* One sub_module_replacement item as (suffix, target, kwargs, ignore). */
static PyObject *sub_item(PyObject *item, PyObject *model, PyObject *key)
{
    if (PyTuple_Check(item)) { /* the engine's tuple form: shape only */
        PyObject *suffix, *target, *kwargs;
        int ignore;
        if (!PyArg_ParseTuple(item, "UOO!p;sub_module_replacement item", &suffix, &target,
                              &PyDict_Type, &kwargs, &ignore))
            return NULL;
        return Py_NewRef(item);
    }
    PyObject *target = PyObject_GetAttrString(item, "target_module");
    if (target == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return NULL;
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "%U: policy[%R].sub_module_replacement items must be "
                     "SubModuleReplacementDescription, got %.100s",
                     model, key, Py_TYPE(item)->tp_name);
        return NULL;
    }
    PyObject *empty = PyDict_New();
    PyObject *suffix = PyObject_GetAttrString(item, "suffix");
    PyObject *kwargs = suffix && empty ? attr_or(item, "kwargs", empty) : NULL;
    PyObject *ignore = kwargs ? attr_or(item, "ignore_if_not_exist", Py_False) : NULL;
    PyObject *result = NULL, *copy = NULL;
    int has, flag;
    if (ignore == NULL)
        goto done;
    if (!PyUnicode_Check(suffix)) {
        PyErr_Format(PyExc_TypeError, "%U: policy[%R]: sub_module_replacement suffix must be a str, "
                     "got %.100s", model, key, Py_TYPE(suffix)->tp_name);
        goto done;
    }
    if ((has = sf_has_attr_str(target, "from_native_module")) <= 0) {
        if (has == 0)
            PyErr_Format(PyExc_TypeError, "%U: policy[%R]: target_module %R for '%U' has no "
                         "from_native_module", model, key, target, suffix);
        goto done;
    }
    if (!PyDict_Check(kwargs)) {
        PyErr_Format(PyExc_TypeError, "%U: policy[%R]: kwargs for '%U' must be a dict, got %.100s",
                     model, key, suffix, Py_TYPE(kwargs)->tp_name);
        goto done;
    }
    if ((flag = PyObject_IsTrue(ignore)) < 0 || (copy = PyDict_Copy(kwargs)) == NULL)
        goto done;
    result = Py_BuildValue("(OOOO)", suffix, target, copy, flag ? Py_True : Py_False);
done:
    Py_XDECREF(copy);
    Py_XDECREF(ignore);
    Py_XDECREF(kwargs);
    Py_XDECREF(suffix);
    Py_XDECREF(empty);
    Py_DECREF(target);
    return result;
}

/* A ModulePolicyDescription (or a tuple entry) as a checked
 * (attrs, params, subs, methods) tuple. */
static PyObject *read_entry(PyObject *desc, PyObject *model, PyObject *key)
{
    PyObject *attrs = NULL, *params = NULL, *subs_in = NULL, *methods = NULL;
    PyObject *subs = NULL, *result = NULL;
    if (PyTuple_Check(desc)) {
        if (!PyArg_ParseTuple(desc, "O!O!O!O!;policy entry", &PyTuple_Type, &attrs, &PyTuple_Type,
                              &params, &PyTuple_Type, &subs_in, &PyTuple_Type, &methods))
            return NULL;
        Py_INCREF(attrs);
        Py_INCREF(params);
        Py_INCREF(subs_in);
        Py_INCREF(methods);
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(attrs); i++) {
            PyObject *dotted, *value, *item = PyTuple_GET_ITEM(attrs, i);
            if (sf_check_tuple(item, "attribute_replacement item") < 0 ||
                !PyArg_ParseTuple(item, "UO;attribute_replacement item", &dotted, &value))
                goto done;
        }
    } else {
        PyObject *none = Py_None;
        subs_in = PyObject_GetAttrString(desc, "sub_module_replacement");
        if (subs_in == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                return NULL;
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%U: policy entry for %R must be a "
                         "ModulePolicyDescription, got %.100s", model, key, Py_TYPE(desc)->tp_name);
            return NULL;
        }
        PyObject *empty_t = PyTuple_New(0), *empty_d = PyDict_New(), *raw;
        if (empty_t == NULL || empty_d == NULL) {
            Py_XDECREF(empty_t);
            Py_XDECREF(empty_d);
            goto done;
        }
        if (subs_in == none)
            Py_SETREF(subs_in, Py_NewRef(empty_t));
        if ((raw = attr_or(desc, "attribute_replacement", empty_d)) != NULL) {
            attrs = pairs_of(raw, "attribute_replacement", model, key);
            Py_DECREF(raw);
        }
        if (attrs && (raw = attr_or(desc, "param_replacement", empty_t)) != NULL) {
            params = PySequence_Tuple(raw);
            Py_DECREF(raw);
        }
        if (params && (raw = attr_or(desc, "method_replacement", empty_d)) != NULL) {
            methods = pairs_of(raw, "method_replacement", model, key);
            Py_DECREF(raw);
        }
        Py_DECREF(empty_t);
        Py_DECREF(empty_d);
        if (methods == NULL)
            goto done;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(methods); i++) {
        PyObject *name, *fn, *item = PyTuple_GET_ITEM(methods, i);
        if (sf_check_tuple(item, "method_replacement item") < 0 ||
            !PyArg_ParseTuple(item, "UO;method_replacement item", &name, &fn))
            goto done;
        if (!PyCallable_Check(fn)) {
            PyErr_Format(PyExc_TypeError, "%U: policy[%R]: method_replacement '%U' is not callable",
                         model, key, name);
            goto done;
        }
    }
    PyObject *seq = PySequence_Tuple(subs_in);
    subs = seq ? PyTuple_New(PyTuple_GET_SIZE(seq)) : NULL;
    for (Py_ssize_t i = 0; subs && i < PyTuple_GET_SIZE(seq); i++) {
        PyObject *item = sub_item(PyTuple_GET_ITEM(seq, i), model, key);
        if (item == NULL)
            Py_CLEAR(subs);
        else
            PyTuple_SET_ITEM(subs, i, item);
    }
    Py_XDECREF(seq);
    if (subs == NULL)
        goto done;
    result = PyTuple_Pack(4, attrs, params, subs, methods);
done:
    Py_XDECREF(attrs);
    Py_XDECREF(params);
    Py_XDECREF(subs_in);
    Py_XDECREF(subs);
    Py_XDECREF(methods);
    return result;
}

/* The policy as {key: checked tuple entry}: a new dict, so that planning
 * (which runs Python code) cannot change it under us. */
PyObject *sf_read_policy(PyObject *model, PyObject *policy)
{
    if (!PyDict_Check(policy)) {
        PyErr_Format(PyExc_TypeError, "%U: module_policy() must return a dict, got %.100s", model,
                     Py_TYPE(policy)->tp_name);
        return NULL;
    }
    PyObject *items = PyDict_Items(policy);
    PyObject *out = items ? PyDict_New() : NULL;
    for (Py_ssize_t i = 0; out && i < PyList_GET_SIZE(items); i++) {
        PyObject *key = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 0);
        PyObject *desc = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 1);
        if (!PyType_Check(key) && !PyUnicode_Check(key)) {
            PyErr_Format(PyExc_TypeError, "%U: policy key %R must be a module class or a class name",
                         model, key);
            Py_CLEAR(out);
            break;
        }
        PyObject *entry = read_entry(desc, model, key);
        if (entry == NULL || PyDict_SetItem(out, key, entry) < 0)
            Py_CLEAR(out);
        Py_XDECREF(entry);
    }
    Py_XDECREF(items);
    return out;
}
