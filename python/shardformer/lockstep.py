"""generate() in lock-step: the ranks of a sharded model decode the same tokens.

Every rank of a tensor-parallel (or sequence-parallel) group runs the same
decoding loop: each step's forward is collective, so the ranks must choose
the same next token, and stop at the same step.  Greedy and beam search
choose from logits the group computed together, which are the same on every
rank.  Sampling draws from the torch generator of the model's device, which
is per process: ranks seeded differently (`torch.manual_seed(100 + rank)`,
a common data-parallel habit) would sample different tokens, feed different
inputs to the next collective forward and diverge silently.

A sharded model's generate() therefore:

  0. checks that the ranks call it alike: the generation settings (keyword
     arguments, the model's generation_config) and the inputs, as two
     checksums all-gathered over each group (2 int64); ranks asking for
     other lengths, other sampling, or passing other prompts would run
     different numbers of collective steps or decode tokens only rank 0's
     inputs justify, and raise RuntimeError on every rank naming the ranks;
  1. makes the group's generator state the state of its rank 0: the state
     (torch.get_rng_state(), or the CUDA generator's for a CUDA model) is
     broadcast over each group in turn (TP, then SP), so the ranks draw the
     numbers the unsharded model would draw on rank 0 with rank 0's seed;
  2. checks after every step that the ranks hold the same tokens: a
     stopping criterion all-gathers (rows, length, a checksum of the last
     tokens) -- 3 int64 per step, one small collective beside the layers'
     -- and raises RuntimeError on every rank naming the ranks that differ
     (their last tokens too) instead of carrying on;
  3. afterwards puts back the generator state of every rank but the group's
     rank 0 (whose state advanced by the sampling, as unsharded), so the
     ranks' own random streams (dropout, data order) are untouched.

The checksum of a row's last token t_i is sum_i t_i * w_i with fixed odd
weights w_i, so any single differing token changes it.

Expert parallelism.  The ranks of an expert-parallel group hold different
experts and decode different rows (they are data-parallel ranks): each
step's MoE layers exchange tokens among them (all_to_all), so every peer
must run a forward in every step, also after its own rows have stopped
(eos, another max_new_tokens, another prompt length) -- else the peers that
go on wait forever on the one that left.  generate() there runs HF's
`synced_gpus=True` loop: each step all-reduces "am I finished" over the
world (one float), and a rank whose rows are done keeps running forwards
(their outputs discarded, its sequences untouched) until every rank is
done; every rank of the world calls generate().  The inputs may differ
between EP peers; `synced_gpus=False` is refused by name (docs/parallel-modes.md).
"""
from __future__ import annotations

import itertools
import threading

import torch
from transformers import StoppingCriteria

from .distributed import collectives as C
from .distributed.agree import members, name_ranks


def _generator_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_generator_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def agree_generator(groups: list, device: torch.device) -> torch.Tensor | None:
    """Step 1: every rank's generator for `device` takes the state of the
    first group's rank 0 (broadcast over each group in turn).  Returns this
    rank's state from before, for step 3, or None on that rank 0 itself."""
    mine = _generator_state(device)
    state = mine.to(device, copy=True)     # .to(cpu) alone would be `mine` itself
    root = True
    for group in groups:
        C.broadcast(state, 0, group)
        root = root and C.rank(group) == 0
    _set_generator_state(device, state.cpu())
    return None if root else mine


class TokensAgree(StoppingCriteria):
    """Step 2, as a transformers StoppingCriteria: never stops a sequence;
    raises when the ranks of a group hold different tokens."""

    def __init__(self, groups: list, name: str):
        self.groups, self.name = groups, name

    def __call__(self, input_ids: torch.Tensor, scores=None, **kwargs) -> torch.Tensor:
        last = input_ids[:, -1].to(torch.int64)
        weights = torch.arange(last.numel(), dtype=torch.int64, device=last.device) * 2 + 1
        mine = torch.stack([torch.tensor(input_ids.shape[0], device=last.device),
                            torch.tensor(input_ids.shape[-1], device=last.device), (last * weights).sum()])
        for group in self.groups:
            size = C.world_size(group)
            every = torch.empty(3 * size, dtype=torch.int64, device=last.device)
            C.all_gather_into_tensor(every, mine, group)
            rows = every.view(size, 3).tolist()
            if any(row != rows[0] for row in rows):
                raise RuntimeError(self._message(group, rows, last))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def _message(self, group, rows: list, last: torch.Tensor) -> str:
        ranks = members(group)
        detail = ""
        if all(row[:2] == rows[0][:2] for row in rows):   # same shapes: every rank can gather the tokens
            every = torch.empty(last.numel() * len(rows), dtype=torch.int64, device=last.device)
            C.all_gather_into_tensor(every, last, group)
            tokens = every.view(len(rows), -1).tolist()
            detail = "; last tokens: " + ", ".join(f"rank {ranks[q]} {tokens[q]}" for q in range(len(rows)))
        shapes = ", ".join(f"rank {ranks[q]} {row[0]}x{row[1]}" for q, row in enumerate(rows))
        return (f"{self.name}.generate: the ranks of the group of global ranks {ranks} decoded different tokens "
                f"(sequences {shapes}{detail}); their logits differ (a model or inputs that are not the same on "
                f"every rank); stopped at this step on every rank")


def _plain(value):
    """`value` as plain data that is the same on every rank that passed the
    same thing: tensors by shape, dtype and a checksum of their values,
    GenerationConfigs by their settings, other objects by their class."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.is_floating_point() or t.is_complex():
            sums = (float(t.double().sum()), float(t.double().abs().sum())) if not t.is_complex() else ()
        else:
            flat = t.reshape(-1).to(torch.int64)
            sums = (int((flat * (torch.arange(flat.numel(), device=flat.device) * 2 + 1)).sum()),)
        return ("tensor", tuple(t.shape), str(t.dtype), sums)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _plain(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "to_diff_dict"):          # a GenerationConfig
        return _plain(value.to_diff_dict())
    return type(value).__qualname__


def check_call(groups: list, model, args: tuple, kwargs: dict, name: str) -> None:
    """Step 0: the ranks of each group call generate() alike (see the module doc)."""
    import zlib

    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    settings = {k: v for k, v in kwargs.items() if k not in tensors}
    settings["generation_config (model)"] = getattr(model, "generation_config", None)
    seen = {"settings": repr(_plain(settings)), "inputs": repr(_plain((args, tensors)))}
    device = next(model.parameters()).device
    mine = torch.tensor([zlib.crc32(seen["settings"].encode()), zlib.crc32(seen["inputs"].encode())],
                        dtype=torch.int64, device=device)
    for group in groups:
        size = C.world_size(group)
        every = torch.empty(2 * size, dtype=torch.int64, device=device)
        C.all_gather_into_tensor(every, mine, group)
        rows = every.view(size, 2).tolist()
        for col, what in enumerate(("settings", "inputs")):
            sides: dict = {}
            for q, row in enumerate(rows):
                sides.setdefault(row[col], []).append(members(group)[q])
            if len(sides) > 1:
                split = " vs ".join(name_ranks(ranks) for ranks in sides.values())
                raise RuntimeError(
                    f"{name}.generate: the ranks of the group of global ranks {members(group)} were called with "
                    f"different {what} ({split}); every rank of a sharded model decodes "
                    f"together and must pass the same arguments and inputs. This rank "
                    f"({dist_rank()}) has {what} {seen[what][:300]}")


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


_inside = threading.local()
_calls = itertools.count(1)      # one number per outermost lock-step generate() call, process-wide


def inside_generate() -> bool:
    """True while this thread runs a lock-step generate() (a decode step's
    forward, e.g. shardformer.decode's fast path, may take that as its cue)."""
    return getattr(_inside, "generate", False)


def generate_call() -> int:
    """The number of the lock-step generate() call this thread runs (0:
    none), unique in the process: a decode step's forward re-checks what it
    relies on once per call (shardformer.decode)."""
    return getattr(_inside, "call", 0) if getattr(_inside, "generate", False) else 0


class LockstepGenerate:
    """model.generate (whatever was installed before: HF's, or lm_loss's
    gathering one, `inner`) run in lock-step over `groups` (see the module
    doc).  A module-level class, not a closure, so a sharded model still
    pickles and deep-copies (shardformer.pickling): a copy's generate() is
    its own model's."""

    def __init__(self, model, groups: list, name: str, inner=None, experts=None):
        self.model, self.groups, self.name, self.inner = model, groups, name, inner
        self.experts = experts if experts is not None and C.world_size(experts) > 1 else None
        self.__doc__ = type(model).generate.__doc__

    def synced(self, kwargs: dict) -> dict:
        """kwargs with HF's synced_gpus=True where an expert-parallel group
        exchanges tokens in every step (module doc); refuses synced_gpus=False there."""
        experts = getattr(self, "experts", None)       # None in a wrapper pickled before it existed
        if experts is None:
            return kwargs
        if kwargs.get("synced_gpus") is False:
            raise ValueError(
                f"{self.name}.generate with synced_gpus=False under expert parallelism (an expert-parallel group "
                f"of global ranks {members(experts)}): its ranks decode different rows but exchange tokens "
                f"in every step's MoE layers, so a rank whose rows stop first would leave the others waiting; "
                f"leave synced_gpus unset (docs/parallel-modes.md)")
        return dict(kwargs, synced_gpus=True)

    def _original(self, *args, **kwargs):
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.model).generate(self.model, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        from transformers import StoppingCriteriaList

        if getattr(_inside, "generate", False):     # a model's generate() calling a sub-model's: agreed already
            return self._original(*args, **kwargs)
        model, groups = self.model, self.groups
        device = next(model.parameters()).device
        check_call(groups, model, args, kwargs, self.name)
        kwargs = self.synced(kwargs)
        criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        criteria.append(TokensAgree(groups, self.name))
        saved = agree_generator(groups, device)
        _inside.generate, _inside.call = True, next(_calls)
        try:
            return self._original(*args, stopping_criteria=criteria, **kwargs)
        finally:
            _inside.generate = False
            if saved is not None:
                _set_generator_state(device, saved)


def install(model, groups: list, name: str, experts=None) -> int:
    """Wrap generate() of every generating model in the tree (groups of one
    rank left out; nothing to do without any, nor an expert-parallel group
    `experts` of more than one); returns how many."""
    groups = [g for g in groups if C.world_size(g) > 1]
    if experts is not None and C.world_size(experts) < 2:
        experts = None
    if not groups and experts is None:
        return 0
    count = 0
    for module in model.modules():
        if callable(getattr(type(module), "generate", None)) and hasattr(module, "generation_config"):
            module.__dict__["generate"] = LockstepGenerate(module, groups, name, module.__dict__.get("generate"),
                                                           experts)
            count += 1
    return count
