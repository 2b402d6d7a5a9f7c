"""generate() on a pipelined model: HF's own decoding loop on every rank.

Every rank of the pipeline (and of each stage's tensor-parallel group) calls
`model.generate(input_ids, ...)` with the same arguments, as with the
unsharded model.  The loop (logits processors, stopping, padding of
finished rows) is transformers' own and runs on every rank; only the
model's forward, each step, is the pipeline's:

    stage 0        runs the embeddings and its layers on the step's tokens
                   (the whole prompt at the prefill, then the new token),
                   sends the hidden states [B, q, H] to stage 1
    stage s        receives them, runs its layers, sends them on
    stage p-1      receives them, runs its layers, the final norm and the head:
                   the logits [B, k, V] (k = 1 with HF's logits_to_keep)
    every stage    gets the last stage's logits by one broadcast over the
                   pipeline group, and returns them as the step's output

So each step costs p - 1 transfers of the new token's hidden states and one
broadcast of its logits; the prompt's states cross each stage edge once.

The token.  Every rank picks the next token from the same logits (bitwise:
they are one broadcast tensor; the TP ranks of the last stage computed
theirs together).  Greedy decoding then agrees by construction.  Sampling
draws from torch's generator of the model's device, which is per process:
before decoding, every rank's generator takes the state of global rank 0
(shardformer.lockstep.agree_generator, over the TP group and then the
pipeline group), so every rank draws the numbers the unsharded model would
draw on rank 0 with rank 0's seed, whatever seed each rank set; afterwards
the other ranks get their own state back.  After every step a stopping
criterion checks that the ranks hold the same tokens (lockstep.TokensAgree:
3 int64 all-gathered per group), so max_new_tokens and eos stop every rank
at the same step, and a divergence raises, naming the ranks, at the step it
happens.  The arguments are compared over the groups first
(lockstep.check_call).  Broadcasting the logits rather than the token keeps
HF's loop whole on every rank (scores, output_logits, streamers and custom
logits processors see what they see unsharded); the logits of one position
are small next to the weights a step reads.

The KV cache.  HF's loop makes one cache (DynamicCache) per rank; each
stage's attention layers fill the entries of their own layers only.  The
model's forward asks the cache for its length (masks, positions) at a layer
index the stage may not hold (layer 0): every entry of a layer another stage
holds becomes a _HeldElsewhere, which stores nothing and answers length
questions from a layer this stage holds of the same kind (every layer of a
step sees the same past length).  use_cache=False runs the whole sequence
through every stage each step.

Refused by name before anything runs: beam search and every mode but greedy
and sampling (assisted / prompt-lookup decoding, contrastive search, DoLa),
a cache passed in or a cache_implementation other than the dynamic one,
output_attentions / output_hidden_states (each stage holds its own layers'),
encoder-decoder models, interleaved stages (num_model_chunks > 1: a rank
would run two chunks in one step against one cache length), and sequence
parallelism inside the stages.
"""
from __future__ import annotations

import inspect
import threading

import torch

from .. import distributed as D
from ..distributed import failures
from .. import lockstep
from ..lockstep import LockstepGenerate
from .p2p import StageLink

__all__ = ["PipelineGenerate", "install", "refusal"]

# Decoding steps this process ran through its stage (for tests: proof the pipeline ran them).
COUNTS = {"steps": 0}
DOCS = "docs/pipeline.md#generate"
_MODES = ("greedy_search", "sample")
_inside = threading.local()


def refusal(model, name: str, kwargs: dict, sequence_parallel: bool) -> str | None:
    """Why generate(**kwargs) cannot run on the pipelined `model` (None: it can)."""
    rt = model.__dict__["_shardformer_pipeline"]
    why = []
    if getattr(model.config, "is_encoder_decoder", False):
        why.append(f"{type(model).__name__} is an encoder-decoder model")
    if rt.manager.num_model_chunks > 1:
        why.append(f"interleaved stages (num_model_chunks={rt.manager.num_model_chunks})")
    if sequence_parallel:
        why.append("sequence parallelism inside the stages")
    if kwargs.get("past_key_values") is not None:
        why.append("a cache passed in (past_key_values=): the stages make their own")
    for flag in ("output_attentions", "output_hidden_states"):
        if kwargs.get(flag):
            why.append(f"{flag}=True (each stage holds its own layers' only)")
    if not why:
        config, _ = model._prepare_generation_config(kwargs.get("generation_config"),
                                                      **{k: v for k, v in kwargs.items() if k != "generation_config"})
        mode = config.get_generation_mode(kwargs.get("assistant_model"))
        mode = getattr(mode, "value", mode)
        if mode not in _MODES:
            detail = {"beam_search": f"num_beams={config.num_beams}", "beam_sample": f"num_beams={config.num_beams}",
                      "assisted_generation": "assistant_model / prompt_lookup_num_tokens"}.get(mode, "")
            why.append(f"{mode.replace('_', ' ')}{f' ({detail})' if detail else ''}; greedy decoding and sampling "
                       f"are supported")
        cache = getattr(config, "cache_implementation", None)
        if cache not in (None, "dynamic"):
            why.append(f"cache_implementation={cache!r} (the dynamic cache only)")
        for flag in ("output_attentions", "output_hidden_states"):
            if getattr(config, flag, False) and not kwargs.get(flag):
                why.append(f"generation_config.{flag}=True (each stage holds its own layers' only)")
    if not why:
        return None
    return (f"{name}.generate under pipeline parallelism ({rt.manager.num_stages} stages): "
            f"{'; '.join(why)} is not supported ({DOCS})")


class _HeldElsewhere:
    """The cache entry of a layer another pipeline stage holds: stores
    nothing (its layer never runs here), and answers the questions the
    model's forward asks of an entry it may not hold (its past length, its
    mask sizes: the same for every layer of one kind in a step) from
    `twin`, an entry of this stage's layers of the same kind.  Calls that
    change entries (reset, crop, reorder, offload, past recording) leave it
    as it is; update, which only its own layer's attention would call, raises."""

    def __init__(self, twin, index: int, stage: int):
        self.__dict__.update(_twin=twin, _index=index, _stage=stage, keys=None, values=None, is_initialized=False)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_twin"], name)

    def __repr__(self) -> str:
        return f"HeldElsewhere(layer {self._index}, as {self._twin!r})"

    def update(self, *args, **kwargs):
        raise RuntimeError(f"pipeline generate: cache layer {self._index} is held by another stage than "
                           f"{self._stage}; its attention ran here")

    def get_seq_length(self, *args, **kwargs):
        return self._twin.get_seq_length(*args, **kwargs)

    def get_mask_sizes(self, *args, **kwargs):
        return self._twin.get_mask_sizes(*args, **kwargs)

    def _nothing(self, *args, **kwargs):
        return None

    lazy_initialization = reset = crop = reorder_cache = offload = prefetch = activate_past_recording = _nothing
    batch_repeat_interleave = batch_select_indices = _nothing


def _kind(layer):
    return type(layer), getattr(layer, "sliding_window", None)


def adopt_cache(cache, held: range, name: str, stage: int) -> None:
    """Make the entries of the layers other stages hold _HeldElsewhere
    (once per cache; a cache without a layer list is left as it is)."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or getattr(cache, "_shardformer_stage", None) is not None:
        return
    if any(i >= len(layers) for i in held):
        raise RuntimeError(f"{name}.generate: the cache has {len(layers)} layers; pipeline stage {stage} holds "
                           f"layers {held.start}-{held.stop - 1}")
    for i, layer in enumerate(layers):
        if i in held:
            continue
        twin = next((layers[j] for j in held if _kind(layers[j]) == _kind(layer)), None)
        if twin is None:
            raise RuntimeError(f"{name}.generate: pipeline stage {stage} holds no cache layer of the kind of layer {i} "
                               f"({type(layer).__name__}, sliding_window={getattr(layer, 'sliding_window', None)}), "
                               f"whose length the model's forward reads; choose num_layers_per_stage so that every "
                               f"stage holds one ({DOCS})")
        layers[i] = _HeldElsewhere(twin, i, stage)
    cache._shardformer_stage = stage


class StageForward:
    """The model's forward while generate() runs (installed as the
    instance's `forward`): one decoding step through the pipeline (see the
    module doc).  Its signature is the model's, which HF's loop inspects."""

    def __init__(self, model, runtime, name: str):
        self.model, self.rt, self.name = model, runtime, name
        self.original = type(model).forward.__get__(model)
        self.__signature__ = inspect.signature(self.original)
        self.link = StageLink(runtime.manager)
        self.logit_shapes: dict = {}
        self.steps = 0                               # decoding steps begun (for failures.guard's where)

    def __call__(self, **kwargs):
        model, rt = self.model, self.rt
        sm = rt.manager
        self.steps += 1
        last = sm.num_stages - 1
        tokens = kwargs.get("input_ids")
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        device = next(model.parameters()).device
        key = ("generate", tuple(tokens.shape[:2]))
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(model.config, "use_cache", False)
        cache = kwargs.get("past_key_values")
        if use_cache and cache is None:           # a cache every stage knows (a model may make its own inside)
            from transformers import DynamicCache

            cache = kwargs["past_key_values"] = DynamicCache(config=model.config)
        if use_cache:
            adopt_cache(cache, rt.plan.chunks[0], self.name, sm.stage)
        entry, shape = None, None
        if sm.stage > 0:
            entry = self.link.recv_message(sm.stage - 1, key, device, rt.messages_are_tuples)
            shape = self.link.input_shape(key)
        out = rt.run(model, 0, entry, kwargs, shape, call=self.original)
        COUNTS["steps"] += 1
        if sm.stage < last:
            self.link.send_message(_detached(out), sm.stage + 1, key, rt.input_shape)
            logits = None
        else:
            logits = out["logits"] if isinstance(out, dict) else out.logits
        keep = kwargs.get("logits_to_keep")          # an int, or the positions to keep (a tensor)
        keep = keep if keep is None or isinstance(keep, int) else ("positions", len(keep))
        logits = self._broadcast_logits(logits, (key, keep), device)
        if sm.stage == last:
            return out
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(logits=logits, past_key_values=cache if use_cache else None)

    def _broadcast_logits(self, logits, key, device) -> torch.Tensor:
        """The last stage's logits on every rank of the pipeline; their shape
        and dtype travel once per step shape (an int64 header)."""
        sm = self.rt.manager
        last = sm.num_stages - 1
        if sm.num_stages == 1:
            return logits
        if key not in self.logit_shapes:
            header = torch.zeros(5, dtype=torch.int64, device=device)
            if sm.stage == last:
                from .p2p import WIRE_DTYPES

                if logits.dim() != 3:
                    raise RuntimeError(f"{self.name}.generate: the last stage's logits have shape "
                                       f"{tuple(logits.shape)}, expected [batch, positions, vocabulary]")
                header[0] = WIRE_DTYPES.index(logits.dtype)
                header[1:4] = torch.tensor(logits.shape)
            D.broadcast(header, last, sm.group)
            from .p2p import WIRE_DTYPES

            self.logit_shapes[key] = (WIRE_DTYPES[int(header[0])], tuple(int(x) for x in header[1:4]))
        dtype, shape = self.logit_shapes[key]
        buf = logits.contiguous() if sm.stage == last else torch.empty(shape, dtype=dtype, device=device)
        return D.broadcast(buf, last, sm.group)


def _detached(message):
    return tuple(t.detach() for t in message) if isinstance(message, tuple) else message.detach()


class PipelineGenerate(LockstepGenerate):
    """model.generate (whatever was installed before: HF's, or lm_loss's
    gathering one, `inner`) on a pipelined model, every rank calling it (see
    the module doc): lock-step's agreement, each step through the stages."""

    def __init__(self, model, groups: list, name: str, sequence_parallel: bool, inner=None, experts=None):
        super().__init__(model, groups, name, inner, experts)
        self.sequence_parallel = sequence_parallel

    def __call__(self, *args, **kwargs):
        from transformers import StoppingCriteriaList

        if getattr(_inside, "generate", False):
            raise RuntimeError(f"{self.name}.generate: called again inside a pipelined generate()")
        model, groups = self.model, self.groups
        rt = model.__dict__["_shardformer_pipeline"]
        device = next(model.parameters()).device
        lockstep.check_call(groups, model, args, kwargs, self.name)   # every rank: the same call
        if args:                                   # generate(inputs, generation_config, ...): by name
            names = list(inspect.signature(type(model).generate).parameters)[1:]
            kwargs = dict(kwargs, **dict(zip(names, args)))
            args = ()
        why = refusal(model, self.name, kwargs, self.sequence_parallel)
        if why is not None:
            raise NotImplementedError(why)
        kwargs = self.synced(kwargs)               # expert parallelism: every EP peer steps until all are done
        criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        criteria.append(lockstep.TokensAgree(groups, self.name))
        saved = lockstep.agree_generator(groups, device)
        forward = StageForward(model, rt, self.name)
        model.__dict__["forward"] = forward
        rt.decoding, _inside.generate = True, True
        sm, experts = rt.manager, getattr(self, "experts", None)

        def where() -> str:            # for failures.guard: this rank's place when something raised
            return f"generate, stage {sm.stage} of {sm.num_stages}, decoding step {forward.steps}"

        try:
            with failures.guard(list(groups) + [sm.group] + ([experts] if experts is not None else []),
                                f"{self.name}.generate", where):
                return self._original(*args, stopping_criteria=criteria, **kwargs)
        finally:
            rt.decoding, _inside.generate = False, False
            del model.__dict__["forward"]
            if saved is not None:
                lockstep._set_generator_state(device, saved)


def install(model, groups: list, name: str, sequence_parallel: bool, experts=None) -> bool:
    """Give the pipelined `model` (when it generates) its pipelined generate().
    `groups`: every group whose ranks decode together (TP, SP, pipeline);
    `experts`: the expert-parallel group (lockstep's module doc)."""
    if not (callable(getattr(type(model), "generate", None)) and hasattr(model, "generation_config")):
        return False
    from ..distributed import collectives as C

    groups = [g for g in groups if C.world_size(g) > 1]
    model.__dict__["generate"] = PipelineGenerate(model, groups, name, sequence_parallel,
                                                  model.__dict__.get("generate"), experts)
    return True
