/*
 * sharder_apply.c -- applying a plan: build every replacement, then swap
 * them all in, journaled, undoing everything if one step fails.
 */
#include "sharder.h"
#include "sharder_internal.h"

/* ------------------------------------------------------------------------
 * Applying: build every replacement, then swap them all in
 *
 * Phase 1 (build) runs the code that can fail -- from_native_module, the
 * adopt callback, prepare_native_module -- and changes nothing in the model.
 * Phase 2 (swap) sets attributes, sub-modules and bound methods and commits
 * prepared in-place changes, recording how to undo each in the journal.  A
 * failure anywhere undoes the journal in reverse, so the model is as it was.
 *
 * Journal entries (tuples):
 *   ("attr",   path, owner, name, old, delete)  undo: setattr(owner, name, old),
 *                                              or delattr when `delete`
 *   ("change", path, change)                   undo: change.rollback()
 *   ("param",  path)                           a param_replacement callable
 *                                              ran: cannot be undone
 *   ("inplace", path)                          from_native_module returned the
 *                                              native module itself, changed
 *                                              in place: cannot be undone
 * ---------------------------------------------------------------------- */

static const char J_ATTR[] = "attr";
static const char J_CHANGE[] = "change";
static const char J_PARAM[] = "param";
static const char J_INPLACE[] = "inplace";

static int journal_add(PyObject *journal, PyObject *entry)
{
    if (entry == NULL)
        return -1;
    int rc = PyList_Append(journal, entry);
    Py_DECREF(entry);
    return rc;
}

/* 1 if `name` is in obj.__dict__ (an instance attribute), 0 if not or if obj
 * has no __dict__, -1 with an exception. */
static int in_own_dict(PyObject *obj, PyObject *name)
{
    PyObject *d = PyObject_GetAttrString(obj, "__dict__");
    if (d == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    int rc = PySequence_Contains(d, name);
    Py_DECREF(d);
    return rc;
}

/* setattr(owner, name, value), journaled: afterwards an undo restores the old
 * value, or deletes the attribute when it did not exist or the set created an
 * instance attribute over a class one (a bound method over the class's). */
static int journaled_setattr(PyObject *journal, PyObject *path, PyObject *owner, PyObject *name,
                             PyObject *value)
{
    if (!PyUnicode_Check(name)) {
        PyErr_Format(PyExc_TypeError, "attribute name must be a str, not %.100s",
                     Py_TYPE(name)->tp_name);
        return -1;
    }
    int had_own = in_own_dict(owner, name);
    if (had_own < 0)
        return -1;
    PyObject *old = PyObject_GetAttr(owner, name);
    if (old == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
    }
    if (PyObject_SetAttr(owner, name, value) < 0) {
        Py_XDECREF(old);
        return -1;
    }
    int own_now = in_own_dict(owner, name);
    int delete = old == NULL || (!had_own && own_now > 0);
    PyObject *entry = own_now < 0 ? NULL
                                  : Py_BuildValue("(sOOOOO)", J_ATTR, path, owner, name,
                                                  old ? old : Py_None,
                                                  delete ? Py_True : Py_False);
    int rc = entry ? journal_add(journal, entry) : -1; /* journal_add releases entry */
    if (rc < 0) { /* not recorded: undo it now, so that the rollback leaves nothing behind */
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        if ((delete ? PyObject_DelAttr(owner, name) : PyObject_SetAttr(owner, name, old)) < 0)
            PyErr_Clear();
        PyErr_Restore(t, v, tb);
    }
    Py_XDECREF(old);
    return rc;
}

/* Undo one reversible journal entry: 0, 1 when it cannot be undone
 * (irreversible kinds), -1 with an exception. */
static int undo_entry(PyObject *entry)
{
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) < 2 ||
        !PyUnicode_Check(PyTuple_GET_ITEM(entry, 0)))
        return 1;
    PyObject *kind = PyTuple_GET_ITEM(entry, 0);
    if (PyUnicode_CompareWithASCIIString(kind, J_ATTR) == 0 && PyTuple_GET_SIZE(entry) == 6) {
        PyObject *owner = PyTuple_GET_ITEM(entry, 2), *name = PyTuple_GET_ITEM(entry, 3);
        if (PyTuple_GET_ITEM(entry, 5) == Py_True)
            return PyObject_DelAttr(owner, name);
        return PyObject_SetAttr(owner, name, PyTuple_GET_ITEM(entry, 4));
    }
    if (PyUnicode_CompareWithASCIIString(kind, J_CHANGE) == 0 && PyTuple_GET_SIZE(entry) == 3) {
        PyObject *r = PyObject_CallMethod(PyTuple_GET_ITEM(entry, 2), "rollback", NULL);
        Py_XDECREF(r);
        return r ? 0 : -1;
    }
    return 1;
}

/* Undo the journal in reverse order, removing every entry undone; what is
 * left could not be undone.  The pending exception (the failure that called
 * for the rollback) is kept, unless an undo step is interrupted
 * (passes_through): that exception is raised instead, after the rollback. */
static void rollback(PyObject *journal)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *it = NULL, *iv = NULL, *itb = NULL; /* an interrupt during the rollback */
    for (Py_ssize_t k = PyList_GET_SIZE(journal) - 1; k >= 0; k--) {
        if (k >= PyList_GET_SIZE(journal)) /* an undo step shrank the list */
            continue;
        PyObject *entry = Py_NewRef(PyList_GET_ITEM(journal, k));
        int rc = undo_entry(entry);
        Py_DECREF(entry);
        if (rc == 0) {
            if (PyList_SetSlice(journal, k, k + 1, NULL) < 0)
                rc = -1;
            else
                continue;
        }
        if (rc < 0) {
            if (it == NULL && sf_pending_passes_through())
                PyErr_Fetch(&it, &iv, &itb);
            else
                PyErr_Clear(); /* the entry stays: the caller sees it was not undone */
        }
    }
    if (it != NULL) {
        PyErr_NormalizeException(&it, &iv, &itb);
        if (iv != NULL && value != NULL) {
            PyErr_NormalizeException(&type, &value, &tb);
            PyException_SetContext(iv, Py_NewRef(value)); /* steals the new reference */
        }
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        PyErr_Restore(it, iv, itb);
        return;
    }
    PyErr_Restore(type, value, tb);
}

/* Phase 1 for a sub-module op: the op with `change` set to the prepared
 * in-place change when the target has prepare_native_module, else with
 * `value` set to the built replacement. */
static PyObject *build_sub(const sf_plan_op *op, PyObject *process_group, PyObject *adopt,
                           PyObject *journal)
{
    PyObject *kwargs = op->kwargs ? PyDict_Copy(op->kwargs) : PyDict_New();
    if (kwargs == NULL)
        return NULL;
    if (op->plan != NULL && PyDict_SetItemString(kwargs, "plan", op->plan) < 0) {
        Py_DECREF(kwargs);
        return NULL;
    }
    sf_plan_op out = *op;
    PyObject *result = NULL;
    int in_place = sf_has_attr_str(op->target, "prepare_native_module");
    PyObject *factory = in_place < 0 ? NULL
                        : PyObject_GetAttrString(op->target, in_place ? "prepare_native_module"
                                                                      : "from_native_module");
    PyObject *args = factory ? PyTuple_Pack(2, op->native, process_group) : NULL;
    PyObject *built = args ? PyObject_Call(factory, args, kwargs) : NULL;
    Py_XDECREF(factory);
    Py_XDECREF(args);
    Py_DECREF(kwargs);
    if (built == NULL)
        return NULL;
    if (in_place) {
        int ok = sf_has_attr_str(built, "commit");
        if (ok > 0)
            ok = sf_has_attr_str(built, "rollback");
        if (ok == 0)
            PyErr_Format(PyExc_TypeError, "%.100s.prepare_native_module must return an object "
                         "with commit() and rollback(), got %.100s",
                         PyType_Check(op->target) ? ((PyTypeObject *)op->target)->tp_name
                                                  : "target",
                         Py_TYPE(built)->tp_name);
        /* The module stays the same object: adopt sees it on both sides. */
        PyObject *r = ok > 0 && adopt != Py_None
                          ? PyObject_CallFunctionObjArgs(adopt, op->path, op->native, op->native,
                                                         NULL)
                          : (ok > 0 ? Py_NewRef(Py_None) : NULL);
        if (r != NULL) {
            Py_DECREF(r);
            out.change = built;
            result = sf_plan_op_new(&out);
        }
        Py_DECREF(built);
        return result;
    }
    if (built == op->native &&
        journal_add(journal, Py_BuildValue("(sO)", J_INPLACE, op->path)) < 0) {
        Py_DECREF(built);
        return NULL;
    }
    /* adopt(path, native, replacement): the replacement takes over what the
     * native module carried at run time (training flag, hooks, frozen
     * parameters) before it enters the tree. */
    if (adopt != Py_None) {
        PyObject *r = PyObject_CallFunctionObjArgs(adopt, op->path, op->native, built, NULL);
        if (r == NULL) {
            Py_DECREF(built);
            return NULL;
        }
        Py_DECREF(r);
    }
    out.value = built;
    result = sf_plan_op_new(&out);
    Py_DECREF(built);
    return result;
}

/* Phase 1 for one op: what phase 2 will do, built without touching the
 * model (new reference, or NULL with an exception). */
static PyObject *build_op(PyObject *rec, PyObject *process_group, PyObject *adopt,
                          PyObject *journal)
{
    sf_plan_op op;
    if (sf_plan_op_read(rec, &op) < 0)
        return NULL;
    if (op.kind == SF_OP_SUB)
        return build_sub(&op, process_group, adopt, journal);
    if (op.kind == SF_OP_METHOD) {
        /* shardformer.pickling.bind: a bound method that pickles as (function, module) */
        PyObject *pickling = PyImport_ImportModule("shardformer.pickling");
        PyObject *bound = pickling ? PyObject_CallMethod(pickling, "bind", "OO", op.value,
                                                         op.owner) : NULL;
        Py_XDECREF(pickling);
        if (bound == NULL)
            return NULL;
        op.value = bound;
        PyObject *r = sf_plan_op_new(&op);
        Py_DECREF(bound);
        return r;
    }
    if (op.kind == SF_OP_PARAM && !PyCallable_Check(op.value)) {
        PyErr_Format(PyExc_TypeError, "param_replacement %R is not callable", op.value);
        return NULL;
    }
    return Py_NewRef(rec); /* attr (owner, name, value) and param (module, fn) as planned */
}

/* Phase 2 for one built op: make the change, journaled. */
static int commit_op(PyObject *rec, PyObject *journal)
{
    sf_plan_op op;
    if (sf_plan_op_read(rec, &op) < 0)
        return -1;
    if (op.kind == SF_OP_PARAM) {
        /* Recorded first: a callable that fails may have changed the module. */
        if (journal_add(journal, Py_BuildValue("(sO)", J_PARAM, op.path)) < 0)
            return -1;
        PyObject *r = PyObject_CallOneArg(op.value, op.owner);
        Py_XDECREF(r);
        return r ? 0 : -1;
    }
    if (op.kind == SF_OP_SUB && op.change != NULL) {
        /* Recorded first: rollback() undoes a commit that failed halfway too. */
        if (journal_add(journal, Py_BuildValue("(sOO)", J_CHANGE, op.path, op.change)) < 0)
            return -1;
        PyObject *r = PyObject_CallMethod(op.change, "commit", NULL);
        Py_XDECREF(r);
        return r ? 0 : -1;
    }
    if (op.kind == SF_OP_SUB && op.value == NULL) {
        PyErr_SetString(PyExc_TypeError, "malformed build: a 'sub' op with neither a "
                        "replacement (value) nor a change");
        return -1;
    }
    /* attr: the value; sub: the replacement; method: the bound method. */
    return journaled_setattr(journal, op.path, op.owner, op.name, op.value ? op.value : Py_None);
}

/* The paths of the journal's entries (what stays changed), as "a, b, ...". */
static PyObject *journal_paths(PyObject *journal)
{
    PyObject *paths = PyList_New(0);
    for (Py_ssize_t k = 0; paths && k < PyList_GET_SIZE(journal); k++) {
        PyObject *e = PyList_GET_ITEM(journal, k);
        PyObject *p = PyTuple_Check(e) && PyTuple_GET_SIZE(e) > 1 ? PyTuple_GET_ITEM(e, 1) : e;
        PyObject *text = PyObject_Str(p);
        if (text == NULL || PyList_Append(paths, text) < 0)
            Py_CLEAR(paths);
        Py_XDECREF(text);
    }
    if (paths == NULL)
        return NULL;
    PyObject *sep = PyUnicode_FromString(", ");
    PyObject *joined = sep ? PyUnicode_Join(sep, paths) : NULL;
    Py_XDECREF(sep);
    Py_DECREF(paths);
    return joined;
}

/* The failure of op `i` (of n): roll the journal back; then, unless the
 * exception passes through unchanged, raise RuntimeError naming the op and
 * whether the model is as it was, chaining the original as __cause__. */
static void apply_failed(PyObject *op, Py_ssize_t i, Py_ssize_t n, PyObject *journal)
{
    rollback(journal);
    if (sf_pending_passes_through())
        return;
    PyObject *path = PyObject_TypeCheck(op, sf_plan_op_type) ? PyStructSequence_GET_ITEM(op, 1)
                                                             : Py_None;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *left = PyList_GET_SIZE(journal) ? journal_paths(journal) : NULL;
    if (PyList_GET_SIZE(journal) && left == NULL)
        PyErr_Clear();
    if (left != NULL || PyList_GET_SIZE(journal))
        PyErr_Format(PyExc_RuntimeError,
                     "applying the shard plan failed at %S (op %zd of %zd): %S; the model is "
                     "partially sharded (changes that cannot be undone: %S) and must be rebuilt",
                     path, i + 1, n, value ? value : Py_None, left ? left : Py_None);
    else
        PyErr_Format(PyExc_RuntimeError,
                     "applying the shard plan failed at %S (op %zd of %zd): %S; every change "
                     "was undone, the model is as it was",
                     path, i + 1, n, value ? value : Py_None);
    Py_XDECREF(left);
    if (value != NULL) {
        PyObject *t2, *v2, *tb2;
        PyErr_Fetch(&t2, &v2, &tb2);
        PyErr_NormalizeException(&t2, &v2, &tb2);
        if (v2 != NULL)
            PyException_SetCause(v2, Py_NewRef(value)); /* steals the new reference */
        PyErr_Restore(t2, v2, tb2);
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

/* sharder_apply(ops, process_group, adopt=None, journal=None, built=None) -> number of ops applied.
 *
 * Phase 1 builds every replacement (the model untouched); phase 2 swaps them
 * in, consuming the plan list (each op dropped as it is committed).  On any
 * failure every change is undone and the exception raised (RuntimeError
 * naming the op, or the original one when it passes through unchanged, see
 * passes_through).  `adopt`, when not None, is called as adopt(path,
 * native, replacement) for every sub-module replacement, in phase 1.
 * `built`, when not None, is called as built(ops, builds) once phase 1 is
 * done, before anything is swapped in: `builds` is the list of what phase 2
 * will commit, one PlanOp per op (a sub's with `value` = its replacement, or
 * `change` = its prepared in-place change; a method's with `value` bound),
 * which the callback may edit (the sharder's tie binding); an exception it
 * raises comes out as raised, after the rollback.
 * `journal`, when a list, receives the record of the changes: after a
 * failure it holds those that could not be undone (empty: the model is as it
 * was); after success it is emptied (the replaced modules are let go). */
PyObject *sf_sharder_apply(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    static char *kwlist[] = {"ops", "process_group", "adopt", "journal", "built", NULL};
    PyObject *ops, *process_group, *adopt = Py_None, *journal = Py_None, *on_built = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O|OOO:sharder_apply", kwlist, &PyList_Type,
                                     &ops, &process_group, &adopt, &journal, &on_built))
        return NULL;
    if (adopt != Py_None && !PyCallable_Check(adopt)) {
        PyErr_Format(PyExc_TypeError, "sharder_apply: adopt must be callable or None, got %s",
                     Py_TYPE(adopt)->tp_name);
        return NULL;
    }
    if (on_built != Py_None && !PyCallable_Check(on_built)) {
        PyErr_Format(PyExc_TypeError, "sharder_apply: built must be callable or None, got %s",
                     Py_TYPE(on_built)->tp_name);
        return NULL;
    }
    if (journal != Py_None && !PyList_Check(journal)) {
        PyErr_Format(PyExc_TypeError, "sharder_apply: journal must be a list or None, got %s",
                     Py_TYPE(journal)->tp_name);
        return NULL;
    }
    journal = journal == Py_None ? PyList_New(0) : Py_NewRef(journal);
    PyObject *built = journal ? PyList_New(0) : NULL;
    PyObject *result = NULL;
    if (built == NULL)
        goto done;
    Py_ssize_t n = PyList_GET_SIZE(ops);
    /* Sizes are re-read every step: an op runs Python code that could
     * change the list (n only feeds the messages). */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ops); i++) {
        PyObject *op = Py_NewRef(PyList_GET_ITEM(ops, i));
        PyObject *b = build_op(op, process_group, adopt, journal);
        if (b == NULL || PyList_Append(built, b) < 0) {
            Py_XDECREF(b);
            apply_failed(op, i, n, journal);
            Py_DECREF(op);
            goto done;
        }
        Py_DECREF(b);
        Py_DECREF(op);
    }
    if (on_built != Py_None) {
        PyObject *r = PyObject_CallFunctionObjArgs(on_built, ops, built, NULL);
        if (r == NULL) {
            rollback(journal); /* the callback's exception comes out as raised */
            goto done;
        }
        Py_DECREF(r);
        if (PyList_GET_SIZE(built) != PyList_GET_SIZE(ops)) {
            PyErr_SetString(PyExc_RuntimeError, "sharder_apply: the built callback changed the "
                            "number of builds");
            rollback(journal);
            goto done;
        }
    }
    Py_ssize_t i;
    for (i = 0; i < PyList_GET_SIZE(ops) && i < PyList_GET_SIZE(built); i++) {
        PyObject *op = Py_NewRef(PyList_GET_ITEM(ops, i));
        PyObject *b = Py_NewRef(PyList_GET_ITEM(built, i));
        /* consume both: the op's and the build's references go with the commit */
        int rc = PyList_SetItem(ops, i, Py_NewRef(Py_None));
        if (rc == 0)
            rc = PyList_SetItem(built, i, Py_NewRef(Py_None));
        if (rc == 0)
            rc = commit_op(b, journal);
        Py_DECREF(b);
        if (rc < 0) {
            apply_failed(op, i, n, journal);
            Py_DECREF(op);
            goto done;
        }
        Py_DECREF(op);
    }
    if (PyList_SetSlice(journal, 0, PyList_GET_SIZE(journal), NULL) < 0)
        goto done;
    result = PyLong_FromSsize_t(i);
done:
    Py_XDECREF(built);
    Py_XDECREF(journal);
    return result;
}
