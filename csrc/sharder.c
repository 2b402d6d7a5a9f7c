/*
 * sharder.c -- the ModelSharder engine: walk a torch module tree, match it
 * against a policy, resolve every substitution, and apply them.
 *
 * Two passes, so that a bad policy or a model that cannot be split never
 * leaves the model half-sharded:
 *
 *   plan   walks the tree (iteratively, each module once), matches modules to
 *          policy keys (class object, class __qualname__, or
 *          "module.qualname" for remote-code classes), resolves attribute
 *          paths and sub-module suffixes (dotted, with '*' over the children
 *          of a container), resolves per-rank attribute values, and asks each
 *          replacement class to plan its shard (`plan_shard`), which runs the
 *          layout arithmetic and its checks.  Nothing is modified.  Any error
 *          is re-raised as "<Model>: <module path>: <what>".
 *
 *   apply  executes the plan in order: attributes, parameter callables,
 *          sub-module swaps (`from_native_module`, then setattr on the
 *          parent, which drops the last reference to the full weight), and
 *          method replacements bound to their module.
 *
 * The policy reaches us already normalized by sharder.py into plain tuples:
 *   entries: {key: (attrs, params, subs, methods)}
 *     attrs   ((dotted_name, value), ...)
 *     params  (callable(module), ...)
 *     subs    ((suffix, target, kwargs_dict, ignore_if_not_exist), ...)
 *     methods ((name, function), ...)
 * A plan is a list of op tuples, see the OP_* tags below.
 */
#include "sharder.h"

#include <string.h>

static const char OP_ATTR[] = "attr";     /* (tag, path, owner, name, value) */
static const char OP_PARAM[] = "param";   /* (tag, path, module, fn) */
static const char OP_SUB[] = "sub";       /* (tag, path, parent, name, target, native, kwargs, plan) */
static const char OP_METHOD[] = "method"; /* (tag, path, module, name, fn) */

typedef struct {
    PyObject *model_name; /* str */
    PyObject *entries;    /* dict */
    PyObject *tp_size;    /* int */
    PyObject *rank;       /* int */
    PyObject *ops;        /* list being built */
    PyObject *replaced;   /* set of (id(parent), name) already planned */
    Py_ssize_t matched;
} plan_ctx;

/* Re-raise the current exception as "<model>: <path>: <message>", keeping
 * ValueError / TypeError, and chaining the original as __cause__. */
static void raise_in_context(const plan_ctx *ctx, PyObject *path)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *new_type = PyExc_ValueError;
    if (type && PyType_IsSubtype((PyTypeObject *)type, (PyTypeObject *)PyExc_TypeError))
        new_type = PyExc_TypeError;
    PyObject *msg = value ? PyObject_Str(value) : NULL;
    if (msg == NULL) {
        PyErr_Clear();
        msg = PyUnicode_FromString("unknown error");
    }
    PyErr_Format(new_type, "%U: %U: %U", ctx->model_name, path, msg);
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
static int has_attr(PyObject *obj, PyObject *name)
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

static int has_attr_str(PyObject *obj, const char *name)
{
    PyObject *n = PyUnicode_FromString(name);
    if (n == NULL)
        return -1;
    int rc = has_attr(obj, n);
    Py_DECREF(n);
    return rc;
}

static PyObject *join_path(PyObject *prefix, PyObject *name)
{
    if (PyUnicode_GetLength(prefix) == 0) {
        Py_INCREF(name);
        return name;
    }
    return PyUnicode_FromFormat("%U.%U", prefix, name);
}

/* The child modules dict of a torch.nn.Module (new reference), or NULL with
 * TypeError if `module` is not a module. */
static PyObject *children_of(PyObject *module)
{
    PyObject *children = PyObject_GetAttrString(module, "_modules");
    if (children == NULL || !PyDict_Check(children)) {
        Py_XDECREF(children);
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "expected a torch.nn.Module, got %.100s",
                     Py_TYPE(module)->tp_name);
        return NULL;
    }
    return children;
}

/* Look up the policy entry of `module` by class, qualname, then module.qualname. */
static PyObject *entry_for(PyObject *entries, PyObject *module)
{
    PyObject *cls = (PyObject *)Py_TYPE(module);
    PyObject *entry = PyDict_GetItemWithError(entries, cls);
    if (entry || PyErr_Occurred())
        return entry;
    PyObject *qualname = PyObject_GetAttrString(cls, "__qualname__");
    if (qualname == NULL)
        return NULL;
    entry = PyDict_GetItemWithError(entries, qualname);
    if (entry == NULL && !PyErr_Occurred()) {
        PyObject *modname = PyObject_GetAttrString(cls, "__module__");
        if (modname == NULL) {
            Py_DECREF(qualname);
            return NULL;
        }
        PyObject *full = PyUnicode_FromFormat("%S.%U", modname, qualname);
        Py_DECREF(modname);
        if (full == NULL) {
            Py_DECREF(qualname);
            return NULL;
        }
        entry = PyDict_GetItemWithError(entries, full);
        Py_DECREF(full);
    }
    Py_DECREF(qualname);
    return entry; /* borrowed */
}

/* PyArg_ParseTuple raises SystemError on a non-tuple; policy data comes from
 * Python, so say TypeError instead. */
static int check_tuple(PyObject *obj, const char *what)
{
    if (PyTuple_Check(obj))
        return 0;
    PyErr_Format(PyExc_TypeError, "%s: expected a tuple, got %.100s", what,
                 Py_TYPE(obj)->tp_name);
    return -1;
}

static int add_op(plan_ctx *ctx, PyObject *op)
{
    if (op == NULL)
        return -1;
    int rc = PyList_Append(ctx->ops, op);
    Py_DECREF(op);
    return rc;
}

/* Resolve a dotted attribute path relative to `module`: the owner of the last
 * component (new reference) and that component (borrowed from `parts`). */
static int plan_attribute(plan_ctx *ctx, PyObject *module, PyObject *mpath,
                          PyObject *dotted, PyObject *value)
{
    PyObject *path = join_path(mpath, dotted);
    if (path == NULL)
        return -1;
    PyObject *dot = PyUnicode_FromString(".");
    PyObject *parts = dot ? PyUnicode_Split(dotted, dot, -1) : NULL;
    Py_XDECREF(dot);
    int rc = -1;
    PyObject *owner = module, *resolved = NULL;
    Py_INCREF(owner);
    if (parts == NULL)
        goto done;
    Py_ssize_t n = PyList_GET_SIZE(parts);
    for (Py_ssize_t i = 0; i < n - 1; i++) {
        PyObject *next = PyObject_GetAttr(owner, PyList_GET_ITEM(parts, i));
        if (next == NULL)
            goto fail_ctx;
        Py_SETREF(owner, next);
    }
    PyObject *name = PyList_GET_ITEM(parts, n - 1);
    int exists = has_attr(owner, name);
    if (exists <= 0) {
        if (exists == 0)
            PyErr_Format(PyExc_ValueError,
                         "attribute_replacement names attribute '%U', which %.100s does not have",
                         name, Py_TYPE(owner)->tp_name);
        goto fail_ctx;
    }
    /* Per-rank values (shardformer.layout.PerRank and friends) resolve now,
     * so that their checks run before anything changes. */
    int per_rank = has_attr_str(value, "__shardformer_per_rank__");
    if (per_rank < 0)
        goto fail_ctx;
    if (per_rank) {
        resolved = PyObject_CallMethod(value, "resolve", "OO", ctx->tp_size, ctx->rank);
        if (resolved == NULL)
            goto fail_ctx;
    } else {
        resolved = value;
        Py_INCREF(resolved);
    }
    rc = add_op(ctx, Py_BuildValue("(sOOOO)", OP_ATTR, path, owner, name, resolved));
    goto done;
fail_ctx:
    raise_in_context(ctx, path);
done:
    Py_XDECREF(resolved);
    Py_XDECREF(parts);
    Py_DECREF(owner);
    Py_DECREF(path);
    return rc;
}

static int plan_submodule(plan_ctx *ctx, PyObject *parent, PyObject *name, PyObject *child,
                          PyObject *path, PyObject *target, PyObject *kwargs)
{
    /* The same slot replaced twice means two policy entries overlap. */
    PyObject *slot = Py_BuildValue("(nO)", (Py_ssize_t)(uintptr_t)parent, name);
    if (slot == NULL)
        return -1;
    int seen = PySet_Contains(ctx->replaced, slot);
    if (seen != 0) {
        Py_DECREF(slot);
        if (seen > 0) {
            PyErr_Format(PyExc_ValueError, "%U: %U: replaced by two policy entries",
                         ctx->model_name, path);
        }
        return -1;
    }
    if (PySet_Add(ctx->replaced, slot) < 0) {
        Py_DECREF(slot);
        return -1;
    }
    Py_DECREF(slot);

    PyObject *plan = Py_None;
    Py_INCREF(plan);
    int has_plan = has_attr_str(target, "plan_shard");
    if (has_plan < 0)
        goto fail;
    if (has_plan) {
        PyObject *method = PyObject_GetAttrString(target, "plan_shard");
        PyObject *args = method ? Py_BuildValue("(OOO)", child, ctx->tp_size, ctx->rank) : NULL;
        PyObject *result = args ? PyObject_Call(method, args, kwargs) : NULL;
        Py_XDECREF(method);
        Py_XDECREF(args);
        if (result == NULL)
            goto fail;
        Py_SETREF(plan, result);
    }
    int rc = add_op(ctx, Py_BuildValue("(sOOOOOOO)", OP_SUB, path, parent, name, target,
                                       child, kwargs, plan));
    Py_DECREF(plan);
    return rc;
fail:
    Py_DECREF(plan);
    raise_in_context(ctx, path);
    return -1;
}

/* Resolve suffix components parts[i:] below `module` (reached by `mpath`). */
static int resolve_suffix(plan_ctx *ctx, PyObject *module, PyObject *mpath, PyObject *parts,
                          Py_ssize_t i, PyObject *target, PyObject *kwargs, int ignore_missing,
                          PyObject *suffix)
{
    Py_ssize_t n = PyList_GET_SIZE(parts);
    PyObject *comp = PyList_GET_ITEM(parts, i);
    PyObject *children = children_of(module);
    if (children == NULL) {
        raise_in_context(ctx, mpath);
        return -1;
    }
    int rc = 0;
    int star = PyUnicode_CompareWithASCIIString(comp, "*") == 0;
    if (star) {
        /* Snapshot the items: the dict must not change under us. */
        PyObject *items = PyDict_Items(children);
        if (items == NULL) {
            Py_DECREF(children);
            return -1;
        }
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(items) && rc == 0; k++) {
            PyObject *kv = PyList_GET_ITEM(items, k);
            PyObject *cname = PyTuple_GET_ITEM(kv, 0), *child = PyTuple_GET_ITEM(kv, 1);
            if (child == Py_None)
                continue;
            PyObject *cpath = join_path(mpath, cname);
            if (cpath == NULL) {
                rc = -1;
                break;
            }
            if (i == n - 1)
                rc = plan_submodule(ctx, module, cname, child, cpath, target, kwargs);
            else
                rc = resolve_suffix(ctx, child, cpath, parts, i + 1, target, kwargs,
                                    ignore_missing, suffix);
            Py_DECREF(cpath);
        }
        Py_DECREF(items);
        Py_DECREF(children);
        return rc;
    }

    PyObject *child = PyDict_GetItemWithError(children, comp);
    if (child == NULL || child == Py_None) {
        Py_DECREF(children);
        if (PyErr_Occurred())
            return -1;
        if (ignore_missing)
            return 0;
        PyObject *cpath = join_path(mpath, comp);
        if (cpath == NULL)
            return -1;
        PyErr_Format(PyExc_ValueError,
                     "%U: %U: no sub-module '%U' (policy suffix '%U'); set "
                     "ignore_if_not_exist=True if it is optional",
                     ctx->model_name, cpath, comp, suffix);
        Py_DECREF(cpath);
        return -1;
    }
    Py_INCREF(child);
    Py_DECREF(children);
    PyObject *cpath = join_path(mpath, comp);
    if (cpath == NULL) {
        Py_DECREF(child);
        return -1;
    }
    if (i == n - 1)
        rc = plan_submodule(ctx, module, comp, child, cpath, target, kwargs);
    else
        rc = resolve_suffix(ctx, child, cpath, parts, i + 1, target, kwargs, ignore_missing,
                            suffix);
    Py_DECREF(cpath);
    Py_DECREF(child);
    return rc;
}

static int plan_module(plan_ctx *ctx, PyObject *module, PyObject *mpath, PyObject *entry)
{
    PyObject *attrs, *params, *subs, *methods;
    if (check_tuple(entry, "policy entry") < 0)
        return -1;
    if (!PyArg_ParseTuple(entry, "O!O!O!O!;policy entry", &PyTuple_Type, &attrs, &PyTuple_Type,
                          &params, &PyTuple_Type, &subs, &PyTuple_Type, &methods))
        return -1;
    PyObject *shown = PyUnicode_GetLength(mpath) ? mpath : NULL;
    PyObject *root_name = NULL;
    if (shown == NULL) {
        root_name = PyUnicode_FromString("<root>");
        if (root_name == NULL)
            return -1;
        shown = root_name;
    }
    int rc = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(attrs) && rc == 0; i++) {
        PyObject *dotted, *value;
        if (check_tuple(PyTuple_GET_ITEM(attrs, i), "attribute_replacement item") < 0 ||
            !PyArg_ParseTuple(PyTuple_GET_ITEM(attrs, i), "UO;attribute_replacement item",
                              &dotted, &value))
            rc = -1;
        else
            rc = plan_attribute(ctx, module, mpath, dotted, value);
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(params) && rc == 0; i++)
        rc = add_op(ctx, Py_BuildValue("(sOOO)", OP_PARAM, shown, module,
                                       PyTuple_GET_ITEM(params, i)));
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(subs) && rc == 0; i++) {
        PyObject *suffix, *target, *kwargs;
        int ignore_missing;
        if (check_tuple(PyTuple_GET_ITEM(subs, i), "sub_module_replacement item") < 0 ||
            !PyArg_ParseTuple(PyTuple_GET_ITEM(subs, i), "UOO!p;sub_module_replacement item",
                              &suffix, &target, &PyDict_Type, &kwargs, &ignore_missing)) {
            rc = -1;
            break;
        }
        PyObject *dot = PyUnicode_FromString(".");
        PyObject *parts = dot ? PyUnicode_Split(suffix, dot, -1) : NULL;
        Py_XDECREF(dot);
        if (parts == NULL) {
            rc = -1;
            break;
        }
        rc = resolve_suffix(ctx, module, mpath, parts, 0, target, kwargs, ignore_missing, suffix);
        Py_DECREF(parts);
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(methods) && rc == 0; i++) {
        PyObject *name, *fn;
        if (check_tuple(PyTuple_GET_ITEM(methods, i), "method_replacement item") < 0 ||
            !PyArg_ParseTuple(PyTuple_GET_ITEM(methods, i), "UO;method_replacement item", &name,
                              &fn)) {
            rc = -1;
            break;
        }
        if (!PyCallable_Check(fn)) {
            PyErr_Format(PyExc_TypeError, "%U: %U: method_replacement '%U' is not callable",
                         ctx->model_name, shown, name);
            rc = -1;
            break;
        }
        rc = add_op(ctx, Py_BuildValue("(sOOOO)", OP_METHOD, shown, module, name, fn));
    }
    Py_XDECREF(root_name);
    return rc;
}

/* sharder_plan(root, model_name, entries, tp_size, rank) -> (ops, matched) */
PyObject *sf_sharder_plan(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    static char *kwlist[] = {"root", "model_name", "entries", "tp_size", "rank", NULL};
    PyObject *root;
    plan_ctx ctx = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OUO!O!O!:sharder_plan", kwlist, &root,
                                     &ctx.model_name, &PyDict_Type, &ctx.entries, &PyLong_Type,
                                     &ctx.tp_size, &PyLong_Type, &ctx.rank))
        return NULL;
    ctx.ops = PyList_New(0);
    ctx.replaced = PySet_New(NULL);
    PyObject *visited = PySet_New(NULL);
    PyObject *stack = PyList_New(0);
    PyObject *empty = PyUnicode_FromString("");
    PyObject *result = NULL;
    if (!ctx.ops || !ctx.replaced || !visited || !stack || !empty)
        goto done;

    /* Iterative pre-order walk; a module reachable by several paths (shared
     * layers) is planned once, under the first path. */
    PyObject *first = PyTuple_Pack(2, root, empty);
    if (first == NULL || PyList_Append(stack, first) < 0) {
        Py_XDECREF(first);
        goto done;
    }
    Py_DECREF(first);
    while (PyList_GET_SIZE(stack) > 0) {
        Py_ssize_t top = PyList_GET_SIZE(stack) - 1;
        PyObject *item = PyList_GET_ITEM(stack, top);
        Py_INCREF(item);
        if (PyList_SetSlice(stack, top, top + 1, NULL) < 0) {
            Py_DECREF(item);
            goto done;
        }
        PyObject *module = PyTuple_GET_ITEM(item, 0), *mpath = PyTuple_GET_ITEM(item, 1);
        PyObject *key = PyLong_FromVoidPtr(module);
        int seen = key ? PySet_Contains(visited, key) : -1;
        if (seen == 0)
            seen = PySet_Add(visited, key) < 0 ? -1 : 0;
        Py_XDECREF(key);
        if (seen != 0) {
            Py_DECREF(item);
            if (seen < 0)
                goto done;
            continue;
        }
        PyObject *entry = entry_for(ctx.entries, module);
        if (entry == NULL && PyErr_Occurred()) {
            Py_DECREF(item);
            goto done;
        }
        if (entry != NULL) {
            /* entry is borrowed from the dict, and planning runs Python code
             * (plan_shard, PerRank.resolve) that could drop it from there. */
            Py_INCREF(entry);
            ctx.matched++;
            int rc = plan_module(&ctx, module, mpath, entry);
            Py_DECREF(entry);
            if (rc < 0) {
                Py_DECREF(item);
                goto done;
            }
        }
        PyObject *children = children_of(module);
        if (children == NULL) {
            raise_in_context(&ctx, mpath);
            Py_DECREF(item);
            goto done;
        }
        /* Push in reverse so that children are visited in definition order. */
        PyObject *items = PyDict_Items(children);
        Py_DECREF(children);
        if (items == NULL) {
            Py_DECREF(item);
            goto done;
        }
        for (Py_ssize_t k = PyList_GET_SIZE(items) - 1; k >= 0; k--) {
            PyObject *kv = PyList_GET_ITEM(items, k);
            PyObject *child = PyTuple_GET_ITEM(kv, 1);
            if (child == Py_None)
                continue;
            PyObject *cpath = join_path(mpath, PyTuple_GET_ITEM(kv, 0));
            PyObject *pair = cpath ? PyTuple_Pack(2, child, cpath) : NULL;
            Py_XDECREF(cpath);
            if (pair == NULL || PyList_Append(stack, pair) < 0) {
                Py_XDECREF(pair);
                Py_DECREF(items);
                Py_DECREF(item);
                goto done;
            }
            Py_DECREF(pair);
        }
        Py_DECREF(items);
        Py_DECREF(item);
    }
    result = Py_BuildValue("(On)", ctx.ops, ctx.matched);
done:
    Py_XDECREF(ctx.ops);
    Py_XDECREF(ctx.replaced);
    Py_XDECREF(visited);
    Py_XDECREF(stack);
    Py_XDECREF(empty);
    return result;
}

static int apply_op(PyObject *op, PyObject *process_group, PyObject *adopt)
{
    if (!PyTuple_Check(op) || PyTuple_GET_SIZE(op) < 2) {
        PyErr_SetString(PyExc_TypeError, "sharder_apply: malformed plan op");
        return -1;
    }
    if (!PyUnicode_Check(PyTuple_GET_ITEM(op, 0))) {
        PyErr_SetString(PyExc_TypeError, "sharder_apply: malformed plan op (tag is not a str)");
        return -1;
    }
    const char *tag = PyUnicode_AsUTF8(PyTuple_GET_ITEM(op, 0));
    if (tag == NULL)
        return -1;
    if (strcmp(tag, OP_ATTR) == 0 && PyTuple_GET_SIZE(op) == 5) {
        return PyObject_SetAttr(PyTuple_GET_ITEM(op, 2), PyTuple_GET_ITEM(op, 3),
                                PyTuple_GET_ITEM(op, 4));
    }
    if (strcmp(tag, OP_PARAM) == 0 && PyTuple_GET_SIZE(op) == 4) {
        PyObject *r = PyObject_CallOneArg(PyTuple_GET_ITEM(op, 3), PyTuple_GET_ITEM(op, 2));
        Py_XDECREF(r);
        return r ? 0 : -1;
    }
    if (strcmp(tag, OP_SUB) == 0 && PyTuple_GET_SIZE(op) == 8) {
        PyObject *parent = PyTuple_GET_ITEM(op, 2), *name = PyTuple_GET_ITEM(op, 3);
        PyObject *target = PyTuple_GET_ITEM(op, 4), *native = PyTuple_GET_ITEM(op, 5);
        if (!PyDict_Check(PyTuple_GET_ITEM(op, 6))) {
            PyErr_SetString(PyExc_TypeError, "sharder_apply: malformed plan op (kwargs is not "
                            "a dict)");
            return -1;
        }
        PyObject *kwargs = PyDict_Copy(PyTuple_GET_ITEM(op, 6));
        PyObject *plan = PyTuple_GET_ITEM(op, 7);
        if (kwargs == NULL)
            return -1;
        if (plan != Py_None && PyDict_SetItemString(kwargs, "plan", plan) < 0) {
            Py_DECREF(kwargs);
            return -1;
        }
        PyObject *factory = PyObject_GetAttrString(target, "from_native_module");
        PyObject *args = factory ? PyTuple_Pack(2, native, process_group) : NULL;
        PyObject *replacement = args ? PyObject_Call(factory, args, kwargs) : NULL;
        Py_XDECREF(factory);
        Py_XDECREF(args);
        Py_DECREF(kwargs);
        if (replacement == NULL)
            return -1;
        /* adopt(path, native, replacement): the replacement takes over what
         * the native module carried at run time (training flag, hooks,
         * frozen parameters) before it enters the tree. */
        if (adopt != Py_None) {
            PyObject *r = PyObject_CallFunctionObjArgs(adopt, PyTuple_GET_ITEM(op, 1), native,
                                                       replacement, NULL);
            if (r == NULL) {
                Py_DECREF(replacement);
                return -1;
            }
            Py_DECREF(r);
        }
        int rc = PyObject_SetAttr(parent, name, replacement);
        Py_DECREF(replacement);
        return rc;
    }
    if (strcmp(tag, OP_METHOD) == 0 && PyTuple_GET_SIZE(op) == 5) {
        PyObject *bound = PyMethod_New(PyTuple_GET_ITEM(op, 4), PyTuple_GET_ITEM(op, 2));
        if (bound == NULL)
            return -1;
        int rc = PyObject_SetAttr(PyTuple_GET_ITEM(op, 2), PyTuple_GET_ITEM(op, 3), bound);
        Py_DECREF(bound);
        return rc;
    }
    PyErr_Format(PyExc_TypeError, "sharder_apply: unknown plan op '%s'", tag);
    return -1;
}

/* sharder_apply(ops, process_group, adopt=None) -> number of ops applied.
 * The plan list is consumed: each op is dropped once applied, so the last
 * reference to a replaced module (and its full weights) goes as early as
 * possible.  `adopt`, when not None, is called as adopt(path, native,
 * replacement) for every sub-module swap, before the swap. */
PyObject *sf_sharder_apply(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    static char *kwlist[] = {"ops", "process_group", "adopt", NULL};
    PyObject *ops, *process_group, *adopt = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O|O:sharder_apply", kwlist, &PyList_Type,
                                     &ops, &process_group, &adopt))
        return NULL;
    if (adopt != Py_None && !PyCallable_Check(adopt)) {
        PyErr_Format(PyExc_TypeError, "sharder_apply: adopt must be callable or None, got %s",
                     Py_TYPE(adopt)->tp_name);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(ops);
    /* Re-read the size every step: an op runs Python code that could shrink
     * the list (n only feeds the messages). */
    Py_ssize_t i;
    for (i = 0; i < PyList_GET_SIZE(ops); i++) {
        PyObject *op = PyList_GET_ITEM(ops, i);
        Py_INCREF(op);
        if (PyList_SetItem(ops, i, Py_NewRef(Py_None)) < 0) {
            Py_DECREF(op);
            return NULL;
        }
        int rc = apply_op(op, process_group, adopt);
        if (rc < 0) {
            PyObject *path = PyTuple_Check(op) && PyTuple_GET_SIZE(op) > 1
                                 ? PyTuple_GET_ITEM(op, 1) : Py_None;
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            PyErr_Format(PyExc_RuntimeError,
                         "applying the shard plan failed at %S (op %zd of %zd): %S; "
                         "the model is partially sharded and must be rebuilt",
                         path, i + 1, n, value ? value : Py_None);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            Py_DECREF(op);
            return NULL;
        }
        Py_DECREF(op);
    }
    return PyLong_FromSsize_t(i);
}
