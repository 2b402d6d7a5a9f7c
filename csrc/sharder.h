/* sharder.h -- the ModelSharder engine (plan, then apply) and the layout
 * arithmetic of split specs it plans with; see sharder.c. */
#ifndef SHARDFORMER_SHARDER_H
#define SHARDFORMER_SHARDER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *sf_sharder_plan(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *sf_sharder_apply(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *sf_resolve_split(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *sf_resolve_plan(PyObject *self, PyObject *plan);

#endif
