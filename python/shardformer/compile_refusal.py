"""Refusing, by name, what torch.compile cannot trace correctly yet.

A check like `if torch.compiler.is_compiling(): raise ...` in traced code
does not reach the user: dynamo turns the exception into a graph break and
runs the frame again eagerly, where the check is False, so the model would
run (and, under sequence parallelism, go on to hooks dynamo cannot trace).
Instead, refuse() calls the custom op `shardformer::refuse_compile`
whose fake (meta) implementation raises: dynamo runs every op's fake
implementation while it builds the graph, and an exception there is not a
graph break but an error of the compile, which reaches the caller of the
compiled module (wrapped in torch._dynamo's TorchRuntimeError, our message
included).  Eager code never calls the op (refuse() returns at once when
not compiling), so eager models are unaffected."""
import functools
from typing import Optional

import torch
from torch import Tensor

DOCS = "docs/compile.md"


class CompileRefused(RuntimeError):
    """What torch.compile of a sharded model cannot run (the message says why and what to do)."""


@torch.library.custom_op("shardformer::refuse_compile", mutates_args=())
def _refuse_compile(x: Tensor, message: str) -> Tensor:
    """Never computes: raises `message` (eagerly or while traced)."""
    raise CompileRefused(message)


@_refuse_compile.register_fake
def _(x, message):
    raise CompileRefused(message)


def refuse(x: Tensor, message: str) -> None:
    """Raise `message` if torch.compile is tracing this call (x: any tensor at
    hand, the op's argument); nothing eagerly."""
    if torch.compiler.is_compiling():
        _refuse_compile(x, message)


def sequence_parallel_message(model_name: str, mode: Optional[str] = None) -> str:
    what = "sequence parallelism" + (f" ({mode!r})" if mode else "")
    return (f"{model_name}: {what} does not run under torch.compile yet (its hooks "
            f"mark and gather this rank's rows of the sequence outside what dynamo traces); run this model "
            f"eagerly, or compile it with tensor parallelism and without sequence parallelism "
            f"(ShardConfig(enable_sequence_parallelism=False)); see {DOCS}")


def _first_tensor(args: tuple, kwargs: dict):
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, Tensor):
            return v
    return None


def _refuse_pre(message: str, _module, args, kwargs) -> None:
    x = _first_tensor(args, kwargs)
    refuse(torch.zeros(()) if x is None else x, message)


def refuse_sequence_parallel_compile(model: torch.nn.Module, model_name: str, mode: str):
    """A forward pre-hook on `model` (run first) that stops torch.compile of
    the sequence-parallel model with sequence_parallel_message(); returns its handle."""
    hook = functools.partial(_refuse_pre, sequence_parallel_message(model_name, mode))
    return model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)


# DDP under torch.compile with dynamo's DDPOptimizer (torch._dynamo.config.
# optimize_ddp, torch's default) splits the graph at DDP's bucket boundaries;
# around a tensor-parallel model that gave a wrong embedding gradient with no
# error (several buckets, DP=2 x TP=2; tests/checks/compile.py dp_tp_ddp).
# The setting is read when the graph is built: by the fake implementation of
# `shardformer::check_ddp_compile`, which runs as plain Python while dynamo
# traces (a read of the config in traced code itself could graph-break and
# fall back to eager, where nothing is checked).  Eagerly the op does nothing.

@torch.library.custom_op("shardformer::check_ddp_compile", mutates_args=())
def _check_ddp_compile(x: Tensor, message: str) -> Tensor:
    """Eagerly: nothing (an empty tensor)."""
    return x.new_empty(0)


@_check_ddp_compile.register_fake
def _(x, message):
    import torch._dynamo

    if torch._dynamo.config.optimize_ddp:
        raise CompileRefused(message)
    return x.new_empty(0)


def ddp_message(model_name: str) -> str:
    return (f"{model_name}: torch.compile of this tensor-parallel model inside DistributedDataParallel with "
            f"dynamo's DDPOptimizer (torch._dynamo.config.optimize_ddp = "
            f"{torch._dynamo.config.optimize_ddp!r}, torch's default) splits the graph at DDP's buckets, "
            f"which gave wrong gradients here; set torch._dynamo.config.optimize_ddp = False before compiling "
            f"(one graph; DDP's all-reduces after the backward); see {DOCS}")


def _ddp_pre(model_name: str, _module, args, kwargs) -> None:
    if torch.compiler.is_compiling():
        x = _first_tensor(args, kwargs)
        _check_ddp_compile(torch.zeros(()) if x is None else x, ddp_message(model_name))


def refuse_ddp_optimizer_compile(model: torch.nn.Module, model_name: str) -> None:
    """A forward pre-hook on the sharded `model` (once) that stops torch.compile
    while dynamo's DDPOptimizer is on: installed when DDP wraps the model
    (ddp_guard)."""
    if model.__dict__.get("_shardformer_ddp_compile_check"):
        return
    model.register_forward_pre_hook(functools.partial(_ddp_pre, model_name), with_kwargs=True, prepend=True)
    model.__dict__["_shardformer_ddp_compile_check"] = True
