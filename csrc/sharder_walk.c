/*
 * sharder_walk.c -- planning: walk the module tree (iteratively, each module
 * once), match modules to the policy's keys, and turn each matched entry
 * into plan records (sharder_internal.h): attribute paths resolved,
 * sub-module suffixes expanded (dotted, '*' over a container's children),
 * per-rank values computed, and each replacement's plan_shard asked what it
 * splits (its layouts resolved in C by layout_spec.c).  Nothing is
 * modified; any error comes out as "<Model>: <path>: <what>".
 */
#include "sharder.h"
#include "sharder_internal.h"

#include <stdint.h>

#include "glue.h"
#include "layout.h"

typedef struct {
    PyObject *model_name; /* str */
    PyObject *entries;    /* dict of checked tuple entries (sharder_policy.c) */
    PyObject *tp_size;    /* int */
    PyObject *rank;       /* int */
    PyObject *ops;        /* list of PlanOp being built */
    PyObject *replaced;   /* {(id(parent), name): (target, kwargs, path)} already planned */
    Py_ssize_t matched;
} plan_ctx;

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


/* Append a plan record made of `op`. */
static int add_op(plan_ctx *ctx, const sf_plan_op *op)
{
    PyObject *rec = sf_plan_op_new(op);
    if (rec == NULL)
        return -1;
    int rc = PyList_Append(ctx->ops, rec);
    Py_DECREF(rec);
    return rc;
}

static void raise_in_context(const plan_ctx *ctx, PyObject *path)
{
    sf_raise_in_context(ctx->model_name, path);
}

/* A per-rank attribute value.  Head counts (shardformer.layout.Heads.local_*,
 * which carry `__shardformer_heads__` = (num_heads, num_kv_heads, which,
 * factor), which 0 = query heads, 1 = KV heads, 2 = query heads per KV head)
 * are computed here by the layout arithmetic; any other PerRank is the
 * policy's own function, called with (tp_size, rank). */
static PyObject *per_rank_value(plan_ctx *ctx, PyObject *value)
{
    PyObject *data = PyObject_GetAttrString(value, "__shardformer_heads__");
    if (data == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return NULL;
        PyErr_Clear();
        return PyObject_CallMethod(value, "resolve", "OO", ctx->tp_size, ctx->rank);
    }
    long long n, kv, which, factor;
    int ok = PyTuple_Check(data) &&
             PyArg_ParseTuple(data, "LLLL;__shardformer_heads__", &n, &kv, &which, &factor);
    Py_DECREF(data);
    if (!ok) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "__shardformer_heads__ must be a tuple of 4 ints");
        return NULL;
    }
    long long tp = PyLong_AsLongLong(ctx->tp_size), rank = PyLong_AsLongLong(ctx->rank);
    if (PyErr_Occurred())
        return NULL;
    int64_t qs, qc, ks, kc;
    sf_error err = {0};
    if (sf_set_pyerr(sf_heads_layout(n, kv, tp, rank, &qs, &qc, &ks, &kc, &err), &err))
        return NULL;
    int64_t count = which == 0 ? qc : which == 1 ? kc : kc > 0 ? qc / kc : 0, local;
    if (sf_mul_overflows(count, factor, &local)) {
        PyErr_Format(PyExc_OverflowError, "__shardformer_heads__: %lld heads * factor %lld "
                     "overflows int64", (long long)count, factor);
        return NULL;
    }
    return PyLong_FromLongLong((long long)local);
}

/* Resolve a dotted attribute path relative to `module`: the owner of the last
 * component (new reference) and that component (borrowed from `parts`). */
static int plan_attribute(plan_ctx *ctx, PyObject *module, PyObject *mpath,
                          PyObject *dotted, PyObject *value)
{
    PyObject *path = sf_join_path(mpath, dotted);
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
    int exists = sf_has_attr(owner, name);
    if (exists <= 0) {
        if (exists == 0)
            PyErr_Format(PyExc_ValueError,
                         "attribute_replacement names attribute '%U', which %.100s does not have",
                         name, Py_TYPE(owner)->tp_name);
        goto fail_ctx;
    }
    /* Per-rank values resolve now, so that their checks run before anything
     * changes. */
    int per_rank = sf_has_attr_str(value, "__shardformer_per_rank__");
    if (per_rank < 0)
        goto fail_ctx;
    resolved = per_rank ? per_rank_value(ctx, value) : Py_NewRef(value);
    if (resolved == NULL)
        goto fail_ctx;
    rc = add_op(ctx, &(sf_plan_op){.kind = SF_OP_ATTR, .path = path, .owner = owner,
                                   .name = name, .value = resolved});
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

/* Plan one sub-module swap: the target's plan_shard (Python checks that
 * return what to split, as data), then, for a ShardPlan request, its layout
 * arithmetic here. */
static int plan_submodule(plan_ctx *ctx, PyObject *parent, PyObject *name, PyObject *child,
                          PyObject *path, PyObject *target, PyObject *kwargs)
{
    /* The same slot reached again: by the same policy entry through a
     * parent shared by several paths (another path, same target and kwargs:
     * one module, planned once, its one replacement serves every path), or
     * by two entries that overlap. */
    PyObject *slot = Py_BuildValue("(nO)", (Py_ssize_t)(uintptr_t)parent, name);
    if (slot == NULL)
        return -1;
    PyObject *earlier = PyDict_GetItemWithError(ctx->replaced, slot); /* borrowed */
    if (earlier != NULL || PyErr_Occurred()) {
        Py_DECREF(slot);
        if (earlier == NULL)
            return -1;
        int other_path = PyUnicode_Compare(PyTuple_GET_ITEM(earlier, 2), path);
        if (other_path == -1 && PyErr_Occurred())
            return -1;
        if (other_path != 0 && PyTuple_GET_ITEM(earlier, 0) == target &&
            PyTuple_GET_ITEM(earlier, 1) == kwargs)
            return 0;
        PyErr_Format(PyExc_ValueError, "%U: %U: replaced by two policy entries",
                     ctx->model_name, path);
        return -1;
    }
    PyObject *what = PyTuple_Pack(3, target, kwargs, path);
    int added = what ? PyDict_SetItem(ctx->replaced, slot, what) : -1;
    Py_XDECREF(what);
    Py_DECREF(slot);
    if (added < 0)
        return -1;

    PyObject *plan = Py_NewRef(Py_None);
    int has_plan = sf_has_attr_str(target, "plan_shard");
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
        int request = sf_has_attr_str(plan, "__shardformer_plan__");
        if (request < 0 || (request && sf_resolve_plan_into(plan) < 0))
            goto fail;
    }
    int rc = add_op(ctx, &(sf_plan_op){.kind = SF_OP_SUB, .path = path, .owner = parent,
                                       .name = name, .target = target, .native = child,
                                       .kwargs = kwargs, .plan = plan});
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
    PyObject *children = sf_children_of(module);
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
            PyObject *cpath = sf_join_path(mpath, cname);
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
        PyObject *cpath = sf_join_path(mpath, comp);
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
    PyObject *cpath = sf_join_path(mpath, comp);
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

/* Plan the (checked, see read_entry) policy entry of one matched module. */
static int plan_module(plan_ctx *ctx, PyObject *module, PyObject *mpath, PyObject *entry)
{
    PyObject *attrs = PyTuple_GET_ITEM(entry, 0), *params = PyTuple_GET_ITEM(entry, 1);
    PyObject *subs = PyTuple_GET_ITEM(entry, 2), *methods = PyTuple_GET_ITEM(entry, 3);
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
        PyObject *item = PyTuple_GET_ITEM(attrs, i);
        rc = plan_attribute(ctx, module, mpath, PyTuple_GET_ITEM(item, 0), PyTuple_GET_ITEM(item, 1));
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(params) && rc == 0; i++)
        rc = add_op(ctx, &(sf_plan_op){.kind = SF_OP_PARAM, .path = shown, .owner = module,
                                       .value = PyTuple_GET_ITEM(params, i)});
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(subs) && rc == 0; i++) {
        PyObject *item = PyTuple_GET_ITEM(subs, i);
        PyObject *suffix = PyTuple_GET_ITEM(item, 0);
        int ignore_missing = PyObject_IsTrue(PyTuple_GET_ITEM(item, 3));
        PyObject *dot = PyUnicode_FromString(".");
        PyObject *parts = dot ? PyUnicode_Split(suffix, dot, -1) : NULL;
        Py_XDECREF(dot);
        if (parts == NULL || ignore_missing < 0) {
            Py_XDECREF(parts);
            rc = -1;
            break;
        }
        rc = resolve_suffix(ctx, module, mpath, parts, 0, PyTuple_GET_ITEM(item, 1),
                            PyTuple_GET_ITEM(item, 2), ignore_missing, suffix);
        Py_DECREF(parts);
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(methods) && rc == 0; i++) {
        PyObject *item = PyTuple_GET_ITEM(methods, i);
        rc = add_op(ctx, &(sf_plan_op){.kind = SF_OP_METHOD, .path = shown, .owner = module,
                                       .name = PyTuple_GET_ITEM(item, 0),
                                       .value = PyTuple_GET_ITEM(item, 1)});
    }
    Py_XDECREF(root_name);
    return rc;
}

/* sharder_plan(root, model_name, policy, tp_size, rank) -> (ops, matched) */
PyObject *sf_sharder_plan(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    static char *kwlist[] = {"root", "model_name", "policy", "tp_size", "rank", NULL};
    PyObject *root, *policy;
    plan_ctx ctx = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OUOO!O!:sharder_plan", kwlist, &root,
                                     &ctx.model_name, &policy, &PyLong_Type, &ctx.tp_size,
                                     &PyLong_Type, &ctx.rank))
        return NULL;
    ctx.entries = sf_read_policy(ctx.model_name, policy);
    if (ctx.entries == NULL)
        return NULL;
    ctx.ops = PyList_New(0);
    ctx.replaced = PyDict_New();
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
            /* ctx.entries is our own dict, but keep the entry alive anyway
             * while planning runs Python code (plan_shard, PerRank). */
            Py_INCREF(entry);
            ctx.matched++;
            int rc = plan_module(&ctx, module, mpath, entry);
            Py_DECREF(entry);
            if (rc < 0) {
                Py_DECREF(item);
                goto done;
            }
        }
        PyObject *children = sf_children_of(module);
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
            PyObject *cpath = sf_join_path(mpath, PyTuple_GET_ITEM(kv, 0));
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
    Py_XDECREF(ctx.entries);
    Py_XDECREF(ctx.ops);
    Py_XDECREF(ctx.replaced);
    Py_XDECREF(visited);
    Py_XDECREF(stack);
    Py_XDECREF(empty);
    return result;
}
