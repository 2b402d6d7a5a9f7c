"""The parameters every rank of a group holds whole must stay equal.

A tensor-parallel rank holds its slice of each split parameter and a whole
copy of every other one (norm weights, row-parallel biases, routers, ...).
Those copies receive the same gradient on every rank of the group, so a
correct step keeps them equal bit for bit.  A step that differs per rank
makes them drift apart without an error, and the model the ranks then
compute together is none of theirs.  The usual cause is
torch.nn.utils.clip_grad_norm_(model.parameters(), c) on a sharded model:
each rank's norm is that of its own shards,

    n_r^2 = sum over whole parameters |g|^2 + sum over rank r's slices |g_r|^2,

which differs between the ranks, so each rank scales its whole copies by
its own min(1, c / n_r).  A plain GradScaler (per-rank inf checks) or an
optimizer configured per rank do the same.

So the sharded model compares one 64-bit fingerprint of those parameters'
bytes (shardformer.hashes.value_fingerprint of each, folded: C on the CPU,
an exact integer checksum on an accelerator, no copy to the host) across its
tensor-parallel and sequence-parallel groups, one all-gather of two int64
(the names and shapes, the values), before forward call 2 (after the first
step) and then on the input check's schedule (every
ShardConfig.check_inputs_every calls; 0 turns both off).  Not at more calls
early on: a rank whose backward raised in the caller's own loss makes one
forward call more than its peers (docs/pipeline.md#when-a-stage-fails), and
a check due on a call count the ranks no longer share would meet another
collective. Ranks of a group
holding other parameters (names or shapes: pipeline stages the group spans)
have nothing to compare. Which parameters are whole is the runtime's
knowledge (shardformer.grad_norm.whole_parameters, the ones its norm counts
once); the sharder hands that function to the input check
(input_check.install). On a difference every rank raises RuntimeError naming
the first parameters that differ, the ranks on each side, and the fix.
"""
from __future__ import annotations

import zlib

import torch.distributed as dist

from .hashes import signed, value_fingerprint
from .replicas import all_gather_ints

DOCS = "docs/training.md"

FIX = ("They receive the same gradients on every rank and stay equal under a correct step, so the step differed "
       "between the ranks. The likely cause: torch.nn.utils.clip_grad_norm_ (or any norm over "
       "model.parameters()) on a sharded model, which gives each rank the norm of its own shards and scales its "
       "copies by another factor; use shardformer.clip_grad_norm_(model, max_norm), the norm of the whole model. "
       "Other causes: a plain torch GradScaler (use ShardedGradScaler), an optimizer, learning rate or weight "
       f"decay set differently per rank, or weights loaded on some ranks only. See {DOCS} (gradient clipping)")


def due(call: int, every: int) -> bool:
    """True before forward call `call` (1-based) when the parameters are
    compared: call 2 (after the first step), then every `every` calls."""
    if every <= 0 or call < 2:
        return False
    k = call - 1
    return k == 1 or k % every == 0


def check_whole_parameters(named: list, groups: list, model_name: str, call: int) -> None:
    """Raise RuntimeError on every rank of each group in `groups` ((group,
    what) pairs) unless its ranks hold the same whole parameters `named`
    ((name, parameter) pairs: shardformer.grad_norm.whole_parameters of the
    model; collective over each group)."""
    prints = [value_fingerprint(t) for _, t in named]
    layout = zlib.crc32(";".join(f"{n}:{tuple(t.shape)}" for n, t in named).encode())
    folded = 0
    for h in prints:
        folded = (folded * 1000003 + h) & ((1 << 64) - 1)
    for group, what in groups:
        if dist.get_world_size(group) < 2:
            continue
        summary = all_gather_ints([layout, signed(folded)], group)
        if bool((summary == summary[0]).all()) or not bool((summary[:, 0] == summary[0, 0]).all()):
            continue           # equal, or other parameters (pipeline stages sharing the group): nothing to compare
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        table = all_gather_ints(prints, group)
        odd = [i for i in range(len(named)) if not bool((table[:, i] == table[0, i]).all())]
        shown = []
        for i in odd[:4]:
            classes: dict[int, list[int]] = {}
            for r, h in zip(ranks, table[:, i].tolist()):
                classes.setdefault(h, []).append(r)
            shown.append(f"'{named[i][0]}' (" + " vs ".join(f"ranks {m}" for m in classes.values()) + ")")
        more = f" and {len(odd) - 4} more" if len(odd) > 4 else ""
        raise RuntimeError(
            f"{model_name}: the parameters held whole on every rank of the {what} group (global ranks {ranks}) "
            f"differ before forward call {call}: {len(odd)} of {len(named)} differ: {', '.join(shown)}{more}. "
            f"{FIX}. (ShardConfig(check_inputs_every=0) turns this check off.)")
