/*
 * sharder_internal.h -- what the files of the sharder engine share (not part
 * of the module's interface; see sharder.h for the entry points and the map
 * of the files).
 *
 *   the plan record   sf_plan_op, one change the plan makes, and its Python
 *                     face, the PlanOp struct sequence (sharder_record.c);
 *   error context     passes_through / raise_in_context: how an error of
 *                     planning is named "<model>: <path>: <what>";
 *   small helpers     attribute probes, dotted paths, a module's children.
 */
#ifndef SHARDFORMER_SHARDER_INTERNAL_H
#define SHARDFORMER_SHARDER_INTERNAL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* ------------------------------------------------------------------------
 * The plan record
 *
 * A plan is a list of records, one change each, made in plan order:
 *
 *   kind    fields used                           the change
 *   attr    owner, name, value                    setattr(owner, name, value)
 *   param   owner (the module), value (a fn)      value(owner)
 *   sub     owner (the parent), name, target,     setattr(parent, name,
 *           native, kwargs, plan                    target.from_native_module(
 *                                                   native, group, plan=plan, **kwargs))
 *   method  owner (the module), name, value (fn)  setattr(owner, name, bound value)
 *
 * `path` names the change in messages.  Applying fills in what it built:
 * `value` becomes the replacement of a sub (or the bound method of a
 * method), or `change` the prepared in-place change of a target with
 * prepare_native_module.  Unused fields are None.  In Python the record is
 * shardformer._C.PlanOp, a struct sequence with these field names.
 * ---------------------------------------------------------------------- */

typedef enum { SF_OP_ATTR, SF_OP_PARAM, SF_OP_SUB, SF_OP_METHOD } sf_op_kind;

typedef struct {
    sf_op_kind kind;
    PyObject *path;   /* str */
    PyObject *owner;  /* the object changed: owner, module or parent */
    PyObject *name;   /* str attribute name (attr, sub, method), else None */
    PyObject *value;  /* attr value, param/method function; a sub's replacement once built */
    PyObject *target; /* sub: the replacement class */
    PyObject *native; /* sub: the module replaced */
    PyObject *kwargs; /* sub: dict of keyword arguments for the target */
    PyObject *plan;   /* sub: the target's resolved ShardPlan, or None */
    PyObject *change; /* sub built in place: the prepared change (commit/rollback) */
} sf_plan_op;         /* borrowed references; NULL means None */

/* The PlanOp type, created once by sf_register_sharder (sharder.h). */
extern PyTypeObject *sf_plan_op_type;

/* A new PlanOp holding op's fields (new reference), or NULL with an exception. */
PyObject *sf_plan_op_new(const sf_plan_op *op);

/* Read a PlanOp into *op (borrowed references, valid while obj lives);
 * -1 with TypeError naming what is malformed. */
int sf_plan_op_read(PyObject *obj, sf_plan_op *op);

/* The name of a kind ("attr", "param", "sub", "method"). */
const char *sf_op_kind_name(sf_op_kind kind);

/* ------------------------------------------------------------------------
 * Errors in context
 * ---------------------------------------------------------------------- */

/* 1 when an exception of this type reaches the caller exactly as raised:
 * the interrupts (not Exception subclasses), MemoryError, RecursionError. */
int sf_passes_through(PyObject *type);

/* sf_passes_through of the pending exception. */
int sf_pending_passes_through(void);

/* Re-raise the pending exception as "<model>: <path>: <message>" (keeping
 * TypeError, else ValueError), the original chained as __cause__; those of
 * sf_passes_through are left pending unchanged. */
void sf_raise_in_context(PyObject *model_name, PyObject *path);

/* ------------------------------------------------------------------------
 * Helpers
 * ---------------------------------------------------------------------- */

/* 1 if obj has the attribute, 0 if not, -1 with an exception on other errors. */
int sf_has_attr(PyObject *obj, PyObject *name);
int sf_has_attr_str(PyObject *obj, const char *name);

/* "prefix.name", or name for an empty prefix (new reference). */
PyObject *sf_join_path(PyObject *prefix, PyObject *name);

/* The child modules dict of a torch.nn.Module (new reference), or NULL with
 * TypeError if `module` is not a module. */
PyObject *sf_children_of(PyObject *module);

/* 0 for a tuple, else -1 with TypeError "<what>: expected a tuple". */
int sf_check_tuple(PyObject *obj, const char *what);

/* The policy as {key: (attrs, params, subs, methods)}, every entry checked
 * (sharder_policy.c). */
PyObject *sf_read_policy(PyObject *model, PyObject *policy);

/* Resolve a ShardPlan request in place (layout_spec.c). */
int sf_resolve_plan_into(PyObject *plan);

#endif
