"""The decode step's layer loop in C: csrc/kernels/decode.c through _C.decode_step.

DecodeFastPath (decode.py) hands a decode step here when the C step can
compute it.  Per step, in Python: the rotary module (as a module), the cache
bookkeeping and one _C.decode_step call.  Inside that one call, with the GIL
released, the whole forward runs (the math of decode.py's docstring;
kernels/decode.h):

    x = all_reduce(E_i[ids])        the vocabulary-parallel lookup: the id's row
                                    on the rank holding it, 0 elsewhere
    per layer:
      a = rms(x) g1;  q, k, v = a Wq^T, a Wk^T, a Wv^T (+ b);  (q, k norms);  rope
      K[:, :, past] = k, V[:, :, past] = v;  o = softmax(q K^T s + mask) V  (GQA)
      x += all_reduce(o Wo^T) (+ bo);  m = rms(x) g2;  g, u = m Wg^T, m Wu^T (+ b)
      x += all_reduce((silu(g) u) Wd^T) (+ bd)
    z_i = rms(x) gN W_i^T (+ b_i)    this rank's vocabulary rows (padding included)
    logits = all_gather(z_i), each rank's real columns placed at their
             vocabulary offsets (its padding dropped: the Python gather's order)

with every collective made from C on the group's shm communicator.  The
embedding runs in C where model.model.embed_tokens is a plain
VocabParallelEmbedding1D (no hooks, no scale) and the rotary module has no
hooks; the final norm and the head where model.lm_head is a plain
VocabParallelLMHead1D without hooks.  Otherwise that end runs as a module,
as the Python step runs it, counted in `stats(model)["python_ends"]` with
the reason.  The head's weight may be the embedding's (tied): both are
read in place.

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
`shardformer.comm_stats()` ledger open, the step's collectives are recorded
there: the all-reduces (2 per layer and the embedding's, [B, h] fp32 each)
and the logits' all-gather ([B, chunk] of the model's type from each rank),
with the time the C step spent in them.
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


def norm_refusal(norm) -> str | None:
    """Why the C step cannot compute RMSNorm `norm` (None: it can)."""
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
        self._ends: tuple = (None, None)   # (embedding, head) modules the C step runs, None: Python's
        self.ends_refusal: tuple = ("not prepared", "not prepared")
        self._x = None              # [B, h] fp32: the hidden states the C step embeds into
        self.ends_enabled = True    # set_native_decode(ends=False): both ends as modules

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state) -> None:
        self.__init__()

    # -- when it can run -------------------------------------------------------------

    def prepare(self, layers, weight: torch.Tensor, model=None, ends_refusal: tuple = (None, None)) -> None:
        """Once per generate() call: what the step's weights allow (dtype,
        norms), which ends of `model` it runs (those whose `ends_refusal`,
        (embedding, final norm + head), is None: decode.py's checks), and
        packing again where a source parameter was replaced or written since
        the last packing (its data pointer or version changed).
        `weight`: the embedding's, whose dtype and device the hidden states have."""
        self._static = None
        self.ends_refusal = ("no model given", "no model given")
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
                why = norm is not None and norm_refusal(norm.__self__)
                if why:
                    self._static = f"layer {layer.index}: {why}"
                    return
        ends = (None, None)
        if model is not None:
            self.ends_refusal = tuple(ends_refusal) if self.ends_enabled else \
                ("the embedding kept out of the C step (set_native_decode(ends=False))",
                 "the final norm and LM head kept out of the C step (set_native_decode(ends=False))")
            ends = (model.model.embed_tokens if self.ends_refusal[0] is None else None,
                    (model.model.norm, model.lm_head) if self.ends_refusal[1] is None else None)
        sources = [p for layer in layers for p in _sources(layer)]
        if ends[0] is not None:
            sources.append(ends[0].weight)
        if ends[1] is not None:
            sources += [p for m in ends[1] for p in (m.weight, getattr(m, "bias", None)) if p is not None]
        key = (tuple((p.data_ptr(), p._version) for p in sources),
               tuple(id(m) for m in (ends[0], *(ends[1] or (None, None)))))
        self._ends = ends
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
        ends = self._ends_args(hidden)
        keep.append(ends)
        self._plan = _C.decode_plan(sizes, rows, keep, ends)

    def _ends_args(self, hidden: int):
        """decode_plan's `ends` (csrc/decode_module.c) for the ends the C step
        runs (self._ends), None when it runs neither."""
        embed, tail = self._ends
        if embed is None and tail is None:
            return None
        args = [None, 0, 0, 0, None, 0.0, None, None, 0, 1, ()]
        if embed is not None:
            args[0:4] = [_flat(embed.weight), embed.vocab_start, embed.vocab_end - embed.vocab_start,
                         embed.num_embeddings]
        if tail is not None:
            norm, head = tail
            shard = head.shard
            args[3] = shard.full
            args[4:6] = [_flat(norm.weight), _eps(norm)]
            args[6:8] = [_flat(head.weight), _bias(head)]
            args[8:11] = [shard.chunk, shard.tp_size,
                          tuple((r, off, n) for r, ranges in enumerate(shard.all_ranges) for off, n in ranges)]
        if embed is not None and tail is not None and embed.num_embeddings != args[3]:
            raise ValueError(f"decode: the embedding's vocabulary {embed.num_embeddings} is not the head's "
                             f"{args[3]}")
        return tuple(args)

    def _release(self, cache_ref) -> None:
        """The cache the buffers served is gone (generate() returned and its
        caller dropped the output): free the buffers, unless a newer cache
        took them over."""
        if self._cache is cache_ref:
            self._k, self._v, self._views, self._plan, self._x = [], [], [], None, None
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
        """One decode step (module doc); returns (the last hidden states
        [B, 1, h], the final norm's input, when the caller runs the head; the
        logits [B, 1, V] when the C step ran it)."""
        layers = fast.layers()
        base = fast.model.model
        past = cache.get_seq_length()
        if self._packed is None:
            self._packed = self._pack(layers)
            self._plan = None
        if position_ids is None:
            position_ids = torch.full((1, 1), past, dtype=torch.long, device=ids.device)
        dtype, batch, hidden = base.embed_tokens.weight.dtype, ids.shape[0], layers[0].q.weight.shape[1]
        in_c, tail = self._ends[0] is not None, self._ends[1] is not None
        if in_c:     # the rotary module reads only the dtype and device of its input
            x = torch.empty((batch, 1, 0), dtype=dtype)
        else:
            x = base.embed_tokens(ids)                                     # [B, 1, h]
        cos, sin = base.rotary_emb(x, position_ids=position_ids)           # [B or 1, 1, d]
        self._sync_cache(layers, cache, batch, past)
        if in_c:
            if self._x is None or self._x.shape[0] != batch:
                self._x = torch.empty((batch, hidden), dtype=torch.float32)
            x, ids = self._x, ids.reshape(batch).to(torch.int64).contiguous()
        else:
            x, ids = x.reshape(batch, hidden).float().contiguous(), None   # values of dtype, in fp32
        vocab = self._ends[1][1].shard.full if tail else 0
        logits = torch.empty((batch, 1, vocab), dtype=dtype) if tail else None
        if mask is not None:
            mask = mask.to(torch.int64).contiguous()
        comm = _comm.communicator_for(x, fast.group)
        ops.follow_torch_threads()
        seconds, gather_s = comm.shm.run_native(_C.decode_step, self._plan, x, cos.float().contiguous(),
                                                sin.float().contiguous(), mask, past, ids,
                                                logits.view(batch, vocab) if tail else None)
        self._views = []
        for n, L in enumerate(layers):
            held = cache.layers[L.index]
            held.keys, held.values = self._k[n].narrow(2, 0, past + 1), self._v[n].narrow(2, 0, past + 1)
            self._views.append((held.keys, held.values))
        if _ledger.hooked():
            _ledger.record_native("all_reduce", tuple(comm.shm.ranks), x.numel() * x.element_size(),
                                  seconds, 2 * len(layers) + in_c)
            if tail:
                _ledger.record_native("all_gather", tuple(comm.shm.ranks),
                                      batch * self._ends[1][1].shard.chunk * logits.element_size(), gather_s, 1)
        if tail:
            return None, logits
        return x.view(batch, 1, hidden).to(dtype), None
