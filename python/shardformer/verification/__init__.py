"""shardformer.verify: where does a sharded model depart from the unsharded one?

    from shardformer import verify
    report = verify(build, inputs, plan={...})        # or policy=..., shard_config=...
    print(report)                                      # report.ok, report.first_mismatch

`build()` makes a fresh model; it is called under the same torch seed for the
reference and for the copy to shard, on every rank.  One copy is sharded at
the given layout, and the two run the same inputs: the model's outputs, the
loss (the model's own, else a fixed random projection of its outputs), every
parameter's gradient, and after `steps` SGD steps every parameter and the
outputs again are compared (each rank its shard, cut from the reference by
the layout the sharder recorded).  Forward hooks and full backward hooks on
both copies compare every sub-module's output and input gradient on the way,
so the report names the first module, in execution order, that departs
(its outputs in forward order, then input gradients in the order backward
reaches them, then parameter gradients), with the numbers.

Where it runs:
  * a plain process (torch.distributed not initialized): verify starts
    `world_size` local CPU ranks itself (gloo, shardformer.launch.spawn);
    `build`, `inputs` and a policy must then be picklable (module-level);
  * inside a distributed job (torch.distributed initialized, e.g. torchrun):
    it runs in place; every rank of the tensor-parallel group (the
    shard_config's, default the world) must call it with the same arguments,
    and `world_size` must equal that group's size.  Every rank gets the
    same report.
"""
from __future__ import annotations

import json
import math

from .report import CheckResult, Entry, Mismatch, Report, merge

__all__ = ["CheckResult", "Mismatch", "Report", "VerifyError", "verify"]

DOCS = "docs/verify.md"
_RAISED = "shardformer-verify-raised:"


class VerifyError(RuntimeError):
    """verify() could not compare: a rank failed outside the compared model
    (building, sharding), or the ranks disagree."""


def verify(build, inputs, *, shard_config=None, plan=None, policy=None, world_size: int = 2, steps: int = 1,
           rtol: float = 1e-5) -> Report:
    """Compare build() sharded (at `shard_config` / `plan` / `policy`, as
    ShardFormer.optimize takes them) with build() unsharded; returns a
    Report.  See the module doc and docs/verify.md."""
    _check_args(build, inputs, shard_config, plan, policy, world_size, steps, rtol)
    import torch.distributed as dist

    from ..config import ShardConfig

    shard_config = ShardConfig() if shard_config is None else shard_config
    if dist.is_available() and dist.is_initialized():
        return _in_place(build, inputs, shard_config, plan, policy, world_size, steps, rtol)
    groups = [f for f in ("tensor_parallel_process_group", "sequence_parallel_process_group",
                          "expert_parallel_process_group") if getattr(shard_config, f) is not None]
    if groups:
        raise ValueError(f"verify: shard_config sets {', '.join(groups)}, but torch.distributed is not initialized, "
                         f"so verify starts its own {world_size} ranks and the group cannot exist there; leave it "
                         f"None (the world of those ranks), or call verify on every rank of your job ({DOCS})")
    return _spawned(build, inputs, shard_config, plan, policy, world_size, steps, rtol)


def _check_args(build, inputs, shard_config, plan, policy, world_size, steps, rtol) -> None:
    from ..config import ShardConfig
    from ..policy import Policy

    if not callable(build):
        raise TypeError(f"verify: build must be a function returning a fresh model, got {type(build).__name__}")
    if not (callable(inputs) or isinstance(inputs, dict)):
        raise TypeError(f"verify: inputs must be a dict of tensors or a function returning one, got "
                        f"{type(inputs).__name__}")
    if shard_config is not None and not isinstance(shard_config, ShardConfig):
        raise TypeError(f"verify: shard_config must be a shardformer.ShardConfig, got {type(shard_config).__name__}")
    if shard_config is not None and shard_config.pipeline_stage_manager is not None:
        raise ValueError("verify: pipeline parallelism is not supported (its model runs through a schedule, not "
                         f"forward()); verify the tensor-parallel layout alone ({DOCS})")
    if plan is not None and policy is not None:
        raise ValueError("verify: give plan or policy, not both")
    if plan is not None and (not isinstance(plan, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                                  for k, v in plan.items())):
        raise TypeError(f"verify: plan must be a dict {{module path pattern: style}} of strings, got {plan!r:.200}")
    if policy is not None and not (isinstance(policy, Policy) or (isinstance(policy, type)
                                                                  and issubclass(policy, Policy))):
        raise TypeError(f"verify: policy must be a shardformer.Policy instance or subclass, got {policy!r:.200}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"verify: world_size must be a positive int, got {world_size!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"verify: steps must be an int >= 0, got {steps!r}")
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not (0 < rtol < 1) or math.isnan(rtol):
        raise ValueError(f"verify: rtol must be a number in (0, 1), got {rtol!r}")


def _raised_entry(raised, rank: int | None = None) -> Entry:
    path, order, message = raised
    return Entry("modules", tuple(order), path, "raised", note=message, ranks=() if rank is None else (rank,))


def _in_place(build, inputs, shard_config, plan, policy, world_size, steps, rtol) -> Report:
    import torch.distributed as dist

    from ..config import concrete_group
    from ..distributed.agree import agree
    from .ranks import run_checks

    group = concrete_group(shard_config.tensor_parallel_process_group)
    size = dist.get_world_size(group)
    if world_size != size:
        raise ValueError(f"verify: torch.distributed is initialized (rank {dist.get_rank()} of "
                         f"{dist.get_world_size()}), so verify runs in place over the tensor-parallel group of "
                         f"{size} ranks, but world_size={world_size}; pass world_size={size} ({DOCS})")
    agree("verify", {"world_size": world_size, "steps": steps, "rtol": rtol, "plan": sorted((plan or {}).items()),
                     "policy": None if policy is None else getattr(policy, "__name__", type(policy).__name__)},
          group)

    def sync(stage: str, value) -> None:
        # A rank that failed, or raised elsewhere, meets the others here: RuntimeError naming the ranks.
        agree(f"verify: {stage}", {"outcome": value}, group)

    entries, raised, setup = run_checks(build, inputs, shard_config, plan, policy, steps, rtol, sync)
    if raised is not None:
        entries = entries + [_raised_entry(raised)]
    gathered = [None] * size
    dist.all_gather_object(gathered, (entries, setup), group=group)
    return merge(gathered[0][1], [es for es, _ in gathered])   # the set-up line of the group's first rank


def _rank_main(rank, build, inputs, shard_config, plan, policy, steps, rtol):
    """One spawned rank: its entries and setup line, or, when the sharded
    model raised, an exception carrying where (read back by _spawned)."""
    from .ranks import run_checks

    entries, raised, setup = run_checks(build, inputs, shard_config, plan, policy, steps, rtol)
    if raised is not None:
        path, order, message = raised
        raise RuntimeError(_RAISED + json.dumps({"path": path, "order": list(order), "message": message,
                                                 "setup": setup}))
    return entries, setup


def _spawned(build, inputs, shard_config, plan, policy, world_size, steps, rtol) -> Report:
    from ..launch import RankError, spawn

    try:
        results = spawn(_rank_main, nprocs=world_size, args=(build, inputs, shard_config, plan, policy, steps, rtol),
                        grace_s=10.0)
    except RankError as e:
        raised = {r: _read_raised(tb) for r, tb in e.failures.items()}
        if not any(raised.values()):
            raise VerifyError(f"verify: rank {e.rank} failed before the models could be compared: {e.message}\n"
                              f"--- traceback of rank {e.rank} ---\n{e.traceback.rstrip()}") from None
        setup = next(v["setup"] for v in raised.values() if v)
        entries = [_raised_entry((v["path"], v["order"], v["message"]), r) for r, v in raised.items() if v]
        stopped = sorted(r for r, v in raised.items() if not v)
        report = merge(setup, [entries])
        if stopped:
            report.setup += f" (ranks {stopped} were stopped: {e.failures[stopped[0]].strip().splitlines()[-1]})"
        return report
    return merge(results[0][1], [entries for entries, _ in results])


def _read_raised(tb: str) -> dict | None:
    for line in reversed(tb.strip().splitlines()):
        if _RAISED in line:
            return json.loads(line.split(_RAISED, 1)[1])
    return None
