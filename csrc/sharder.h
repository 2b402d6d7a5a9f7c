/*
 * sharder.h -- the ModelSharder engine's entry points (plan, then apply) and
 * the resolution of split specs it plans with.
 *
 * Two passes, so that a bad policy, a model that cannot be split or a
 * replacement that fails to build never leaves the model half-sharded:
 * sharder_plan reads and checks the policy, walks the tree and returns the
 * plan -- a list of plan records (shardformer._C.PlanOp) -- changing nothing;
 * sharder_apply builds every replacement, then makes the changes journaled,
 * undoing them all if one fails.
 *
 * C core layout: one job per file; to follow a job, open its file (and
 * sharder_internal.h for the plan record and the shared helpers).
 *   sharder_policy.c   reading the policy: Python objects -> checked tuples
 *   sharder_walk.c     planning: tree walk, key matching, suffixes, per-rank
 *                      values, plan_shard requests -> plan records
 *   layout_spec.c      split specs (tuples) -> per-rank ranges, DimShard fields
 *   layout.c           the integer layout arithmetic and the shard copy kernel
 *   sharder_apply.c    building and swapping in, with the undo journal
 *   sharder_record.c   the plan record (sf_plan_op <-> PlanOp), errors in
 *                      context ("<Model>: <path>: <what>"), small helpers
 *   module.c           the _C module: layout/copy entry points, method table
 *   comm_module.c, comm/       collectives: shared memory, reductions, CPU probe;
 *   comm_nccl_module.c         the NCCL glue
 *   kernels_module.c, kernels/ fused kernels; cpu_features.c the CPU probes
 *   glue.c, tensor_view.c      DLPack in, sf_status -> Python exceptions out
 *
 * KeyboardInterrupt, SystemExit, GeneratorExit, MemoryError and
 * RecursionError are never re-raised with context: they come out as raised
 * (see sf_passes_through).
 */
#ifndef SHARDFORMER_SHARDER_H
#define SHARDFORMER_SHARDER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *sf_sharder_plan(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *sf_sharder_apply(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *sf_resolve_split(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *sf_resolve_plan(PyObject *self, PyObject *plan);

/* Add the PlanOp type to the module; -1 with an exception. */
int sf_register_sharder(PyObject *module);

#endif
