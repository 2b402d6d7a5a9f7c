"""The decode step's layer loop in C: csrc/kernels/decode.c through _C.decode_step.

DecodeFastPath (decode.py) hands a decode step here when the C step can
compute it.  Per step, in Python: the embedding and the rotary module (as
modules), the cache bookkeeping, one _C.decode_step call, and after it the
final norm and the LM head.  Inside that one call, with the GIL released,
every layer runs (the math of decode.py's docstring; kernels/decode.h):

    a = rms(x) g1;  [q k v] = a Wqkv^T (+ b);  (q, k per-head norms);  rope
    K[:, :, past] = k, V[:, :, past] = v;  o = softmax(q K^T s + mask) V  (GQA)
    x += all_reduce(o Wo^T) (+ bo);  m = rms(x) g2;  [g u] = m Wgu^T (+ b)
    x += all_reduce((silu(g) u) Wd^T) (+ bd)

with both all-reduces made from C on the group's shm communicator.

What it keeps (NativeStep, one per fast path):
  * no copy of the weights: the plan points at the modules' own shards
    (q, k, v, o, gate, up, down and the norms), read in place, so writes
    to them are seen; biases of 16-bit models as fp32 copies.  The plan is
    built again when any parameter it reads was replaced or written in
    place (its data pointer or version counter changed: checked once per
    generate() call);
  * the KV cache: per layer K, V [B, Hk_i, cap, d] buffers it owns, the
    capacity doubled when full; after each step HF's cache layers hold views
    K[:, :, :L], V[:, :, :L] of them, so generate()'s bookkeeping (and any
    later HF forward) sees the same cache.  Where a layer's keys / values are
    not the views it set (a prefill, HF's forward ran in between, a reorder)
    the buffers are seeded again from HF's tensors.  The buffers serve one
    DynamicCache: another cache (a new generate(), a deep copy of a kept
    past_key_values) gets new ones, so a cache the caller keeps is never
    written by another's steps.

Where it cannot run (`refusal`), the Python fast step runs, counted in
`decode.stats(model)["python_step"]` with the reason: weights not all of
one type among float32, bfloat16, float16, a sliding-window cache layer, a group whose communicator is not the
shm backend (torch.distributed, NCCL, the checked communicator of
SHARDFORMER_CHECK_COLLECTIVES), a norm with an offset.  With a
`shardformer.comm_stats()` ledger open, the step's all-reduces are recorded
there (2 per layer, [B, h] fp32 each, with the time the C loop spent in
them).
"""
from __future__ import annotations

import weakref

import torch

from . import _C, ops
from .distributed import communicator as _comm
from .distributed import ledger as _ledger


def _eps(norm) -> float:
    return float(norm.eps if hasattr(norm, "eps") and not hasattr(norm, "variance_epsilon")
                 else norm.variance_epsilon)


def _norm_refusal(norm) -> str | None:
    if getattr(norm, "offset", 0.0):
        return f"{type(norm).__name__} with offset {norm.offset}"
    return None


def _sources(layer) -> list:
    """Every parameter the C step reads of one decode.py _Layer's modules."""
    mods = [layer.ln1.__self__, layer.ln2.__self__, layer.q, layer.k, layer.v, layer.o,
            layer.gate, layer.up, layer.down]
    if layer.q_norm is not None:
        mods += [layer.q_norm.__self__, layer.k_norm.__self__]
    return [p for m in mods for p in (m.weight, getattr(m, "bias", None)) if p is not None]


def _flat(t):
    return None if t is None else t.detach().contiguous()


def _bias(module):
    """The module's bias as the C step reads it: fp32 (a copy for 16-bit weights)."""
    b = getattr(module, "bias", None)
    return None if b is None else b.detach().float().contiguous()


_TYPES = (torch.float32, torch.bfloat16, torch.float16)


def _release(step_ref, cache_ref) -> None:
    step = step_ref()
    if step is not None:
        step._release(cache_ref)


class NativeStep:
    """The C step of one DecodeFastPath: the layers' tensors, the KV buffers
    and the _C plan over both (module doc).  bf16 / fp16 models: the weights
    and the cache in their type, the step's values in fp32 rounded to it
    where HF's modules round (kernels/decode.h)."""

    def __init__(self):
        self._key = None            # (data_ptr, _version) of every source parameter when packed
        self._packed: list | None = None
        self._batch = 0
        self._cap = 0
        self._k: list = []
        self._v: list = []
        self._views: list = []      # (keys view, values view) set on each HF cache layer
        self._plan = None
        self._static: str | None = "not prepared"
        self._cache = None          # weak reference to the DynamicCache the buffers hold

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state) -> None:
        self.__init__()

    # -- when it can run -------------------------------------------------------------

    def prepare(self, layers, weight: torch.Tensor) -> None:
        """Once per generate() call: what the step's weights allow (dtype,
        norms), and packing again where a source parameter was replaced or
        written since the last packing (its data pointer or version changed).
        `weight`: the embedding's, whose dtype and device the hidden states have."""
        self._static = None
        if weight.dtype not in _TYPES or weight.device.type != "cpu":
            self._static = (f"hidden states of {weight.dtype} on {weight.device} (the C step computes float32, "
                            f"bfloat16 or float16 on the CPU)")
            return
        for layer in layers:
            for p in _sources(layer):
                if p.dtype != weight.dtype:
                    self._static = (f"layer {layer.index}: a weight of {p.dtype} in a model of {weight.dtype} "
                                    f"(the C step takes one type)")
                    return
            for norm in (layer.ln1, layer.ln2, layer.q_norm, layer.k_norm):
                why = norm is not None and _norm_refusal(norm.__self__)
                if why:
                    self._static = f"layer {layer.index}: {why}"
                    return
        key = tuple((p.data_ptr(), p._version) for layer in layers for p in _sources(layer))
        if key != self._key:
            self._packed, self._plan, self._key = None, None, key

    def refusal(self, layers, group, weight: torch.Tensor, cache) -> str | None:
        """Why the C step cannot compute this step (None: it can)."""
        from transformers.cache_utils import DynamicLayer

        if self._static is not None:
            return self._static
        past = cache.get_seq_length()
        for layer in layers:
            held = cache.layers[layer.index]
            if type(held) is not DynamicLayer:
                return f"cache layer {type(held).__name__} (the C step keeps full caches)"
            if held.keys.shape[-2] != past:
                return "cache layers of different lengths"
        comm = _comm.communicator_for(weight, group)
        if type(comm) is not _comm.ShmBackend:
            return f"the group's communicator is {type(comm).__name__} ({comm.backend}), not the shm backend"
        return None

    # -- packing, caches, the plan ----------------------------------------------------

    def _pack(self, layers) -> list:
        """Per layer what the plan reads: the modules' own weights (no copy
        where they are contiguous, as the sharder leaves them) and fp32 biases."""
        packed = []
        for L in layers:
            qn = L.q_norm.__self__ if L.q_norm is not None else None
            kn = L.k_norm.__self__ if L.k_norm is not None else None
            packed.append(dict(
                ln1=_flat(L.ln1.__self__.weight), eps1=_eps(L.ln1.__self__),
                ln2=_flat(L.ln2.__self__.weight), eps2=_eps(L.ln2.__self__),
                wq=_flat(L.q.weight), wk=_flat(L.k.weight), wv=_flat(L.v.weight),
                bq=_bias(L.q), bk=_bias(L.k), bv=_bias(L.v),
                q_norm=_flat(qn.weight) if qn is not None else None,
                k_norm=_flat(kn.weight) if kn is not None else None,
                qk_eps=_eps(qn) if qn is not None else 0.0,
                wo=_flat(L.o.weight), bo=_bias(L.o), wg=_flat(L.gate.weight), wu=_flat(L.up.weight),
                bg=_bias(L.gate), bu=_bias(L.up), wd=_flat(L.down.weight), bd=_bias(L.down),
                scale=float(L.scaling), dtype=L.q.weight.dtype,
                heads=L.q.weight.shape[0] // L.head_dim, kv_heads=L.k.weight.shape[0] // L.head_dim,
                head_dim=L.head_dim, ffn=L.gate.weight.shape[0]))
        return packed

    def _build_plan(self, hidden: int) -> None:
        P = self._packed
        first = P[0]
        sizes = (self._batch, hidden, first["heads"], first["kv_heads"], first["head_dim"], first["ffn"],
                 self._cap)
        rows, keep = [], []
        for n, p in enumerate(P):
            if (p["heads"], p["kv_heads"], p["head_dim"], p["ffn"]) != sizes[2:6]:
                raise ValueError(f"decode: layer {n} has (heads, kv_heads, head_dim, ffn) "
                                 f"{(p['heads'], p['kv_heads'], p['head_dim'], p['ffn'])}, layer 0 {sizes[2:6]}")
            row = tuple(p[k] for k in ("ln1", "eps1", "ln2", "eps2", "wq", "wk", "wv", "bq", "bk", "bv",
                                       "q_norm", "k_norm", "qk_eps", "wo", "bo", "wg", "wu", "bg", "bu",
                                       "wd", "bd")) + (self._k[n], self._v[n], p["scale"])
            rows.append(row)
            keep.append(row)
        self._plan = _C.decode_plan(sizes, rows, keep)

    def _release(self, cache_ref) -> None:
        """The cache the buffers served is gone (generate() returned and its
        caller dropped the output): free the buffers, unless a newer cache
        took them over."""
        if self._cache is cache_ref:
            self._k, self._v, self._views, self._plan = [], [], [], None
            self._batch = self._cap = 0
            self._cache = None

    def _sync_cache(self, layers, cache, batch: int, past: int) -> None:
        """Make the buffers hold HF's cache of `past` positions with room for
        one more: seed them from HF's tensors where a layer does not hold the
        views set last step; grow (doubling) when full.  The buffers live as
        long as the cache object they serve (weakref.finalize), so a finished
        generate() leaves no KV memory behind."""
        P = self._packed
        if self._cache is None or self._cache() is not cache:
            # Buffers belong to one cache: the one they served may still be
            # alive (a past_key_values kept by the caller, to continue or to
            # deep-copy as a prefix) and its layers hold views of them, so a
            # new cache never writes into them: it gets buffers of its own.
            self._k, self._v, self._views, self._plan = [], [], [], None
            self._batch = self._cap = 0
            self._cache = weakref.ref(cache)
            weakref.finalize(cache, _release, weakref.ref(self), self._cache)
        stale = [n for n, L in enumerate(layers)
                 if n >= len(self._views) or batch != self._batch
                 or cache.layers[L.index].keys is not self._views[n][0]
                 or cache.layers[L.index].values is not self._views[n][1]]
        if past + 1 > self._cap or batch != self._batch:
            cap = max(2 * self._cap if batch == self._batch else 0, past + 2)
            olds = list(zip(self._k, self._v)) if batch == self._batch else [None] * len(layers)
            self._k, self._v = [], []
            for n, p in enumerate(P):
                shape = (batch, p["kv_heads"], cap, p["head_dim"])
                k, v = torch.empty(shape, dtype=p["dtype"]), torch.empty(shape, dtype=p["dtype"])
                if olds[n] is not None and n not in stale:
                    k[:, :, :past].copy_(olds[n][0][:, :, :past])
                    v[:, :, :past].copy_(olds[n][1][:, :, :past])
                self._k.append(k)
                self._v.append(v)
            self._batch, self._cap, self._plan = batch, cap, None
        for n in stale:
            held = cache.layers[layers[n].index]
            self._k[n][:, :, :past].copy_(held.keys)
            self._v[n][:, :, :past].copy_(held.values)
        if self._plan is None:
            self._build_plan(layers[0].q.weight.shape[1])

    # -- the step --------------------------------------------------------------------

    def run(self, fast, ids: torch.Tensor, cache, mask, position_ids):
        """One decode step (module doc); returns the last hidden states
        [B, 1, h] after the final norm's input (the caller runs the norm and
        the head)."""
        layers = fast.layers()
        base = fast.model.model
        past = cache.get_seq_length()
        if self._packed is None:
            self._packed = self._pack(layers)
            self._plan = None
        if position_ids is None:
            position_ids = torch.full((1, 1), past, dtype=torch.long, device=ids.device)
        x = base.embed_tokens(ids)                                         # [B, 1, h]
        cos, sin = base.rotary_emb(x, position_ids=position_ids)           # [B or 1, 1, d]
        batch, hidden = x.shape[0], x.shape[-1]
        self._sync_cache(layers, cache, batch, past)
        dtype = x.dtype
        x = x.reshape(batch, hidden).float().contiguous()                 # values of dtype, in fp32
        if mask is not None:
            mask = mask.to(torch.int64).contiguous()
        comm = _comm.communicator_for(x, fast.group)
        ops.follow_torch_threads()
        seconds = comm.shm.run_native(_C.decode_step, self._plan, x, cos.float().contiguous(),
                                      sin.float().contiguous(), mask, past)
        self._views = []
        for n, L in enumerate(layers):
            held = cache.layers[L.index]
            held.keys, held.values = self._k[n].narrow(2, 0, past + 1), self._v[n].narrow(2, 0, past + 1)
            self._views.append((held.keys, held.values))
        if _ledger.hooked():
            _ledger.record_native("all_reduce", tuple(comm.shm.ranks), x.numel() * x.element_size(),
                                  seconds, 2 * len(layers))
        return x.view(batch, 1, hidden).to(dtype)
