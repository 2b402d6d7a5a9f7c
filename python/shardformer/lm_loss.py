"""The loss of a model whose LM head keeps its logits split over the vocabulary.

With ShardConfig(parallel_output=True) a VocabParallelLMHead1D returns rank
i's logits z[..., V_i] (its rows of the padded vocabulary) and nobody
gathers [batch, seq, vocab].  A model called with `labels` must then compute
its loss from those shards, with HF's own rules:

    causal    targets t = labels shifted left by one (the last position gets
              ignore_index), or HF's `shift_labels` when given
    masked    targets t = labels, position for position
    loss      sum_n CE(z_n, t_n) / N,  N = num_items_in_batch when HF passes it
              (gradient accumulation), else the count of t_n != ignore_index

CE over the shards is cross_entropy_1d (one all-gather of each rank's row
max, sum-exp at that max and target logit; the gradient is softmax - onehot
written into each shard).

How HF reaches the loss differs by class, and that is policy data (LMLoss,
on the family's `lm()` head):

    "hook"     HF calls self.loss_function(logits, labels, vocab_size, **kw)
               (ForCausalLMLoss or ForMaskedLMLoss): the model's
               `loss_function` becomes VocabParallelLMLoss, so everything
               else HF does in forward (MoE auxiliary loss, multimodal
               slicing of the logits) is unchanged;
    "causal", "masked", "seq2seq"
               HF calls nn.CrossEntropyLoss on the full vocabulary itself:
               the model's forward is wrapped; it runs without `labels`
               (for "seq2seq" the decoder inputs are first made from the
               labels, as HF does) and the loss is computed on the shards;
               `also` adds a sentence-level head's cross-entropy (BERT's next
               sentence, ALBERT's sentence order) when its labels are given,
               as HF does only when both are.

Every PreTrainedModel in the tree that owns an output embedding gets this
("hook" unless its class's policy says otherwise): a multimodal model that
computes the loss of its language model's logits (BLIP-2) is covered too.
generate() switches the heads back to gathering for its duration.

Gathered logits (parallel_output=False, the default) take the same path
whenever the model is called with `labels`: the head returns its shard for
that call, the loss above is computed on it, and only then are the output's
logits all-gathered (backward: each rank keeps its own columns, no
collective).  The loss therefore never reads the gathered logits: no rank
computes the full-vocabulary softmax or its [tokens, vocab] gradient; the
logits returned still equal the unsharded model's and carry gradients if the
caller builds a loss of its own on them.  A model the shards cannot serve
(the refusals below) keeps HF's loss on the gathered logits.
"""
from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("hook", "causal", "masked", "seq2seq")


@dataclass(frozen=True)
class LMLoss:
    """How a model class computes its LM loss (see the module doc).

    kind  "hook" | "causal" | "masked" | "seq2seq"
    also  (label kwarg, output field) of a small sentence-level head whose
          cross-entropy HF adds to the LM loss, e.g. ("next_sentence_label",
          "seq_relationship_logits"); only with kind != "hook"
    """

    kind: str = "hook"
    also: tuple[str, str] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"LMLoss: kind must be one of {KINDS}, got {self.kind!r}")
        if self.also is not None and (self.kind == "hook" or len(self.also) != 2):
            raise ValueError(f"LMLoss({self.kind!r}): also=(label kwarg, output field) needs a kind other "
                             f"than 'hook', got {self.also!r}")


HOOK = LMLoss()


def declared(policy) -> LMLoss:
    """The LMLoss a policy (class or instance) declares: its LM head's, else
    its `lm_loss` (shardformer.Policy declares both), else "hook"."""
    for head in policy.heads:
        if head.kind == "lm":
            return head.loss
    return policy.lm_loss if policy.lm_loss is not None else HOOK


def declares_head(policy) -> bool:
    """Whether a policy (class or instance) declares an LM head or an LM loss."""
    return any(h.kind == "lm" for h in policy.heads) or policy.lm_loss is not None


def _targets(labels: torch.Tensor, shift: bool, ignore_index: int, shift_labels) -> torch.Tensor:
    if not shift:
        return labels
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def vocab_parallel_loss(head, logits: torch.Tensor, labels: torch.Tensor, *, shift: bool,
                        num_items_in_batch=None, ignore_index: int = -100, shift_labels=None) -> torch.Tensor:
    """HF's loss (the module doc's formula) of `head`'s logits shard."""
    from .layer.loss import cross_entropy_1d

    targets = _targets(labels, shift, ignore_index, shift_labels).to(logits.device)
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"parallel_output loss: labels of shape {tuple(targets.shape)} do not match logits of "
                         f"shape {tuple(logits.shape)} (expected labels of shape logits.shape[:-1])")
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = cross_entropy_1d(logits, targets, vocab_size=head.vocab_size, vocab_start=head.vocab_start,
                            ignore_index=ignore_index, reduction=reduction, process_group=head.process_group)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


class VocabParallelLMLoss:
    """A model's `loss_function` (HF's signature) over `head`'s logits shard:
    ForCausalLMLoss's rules when `shift`, else ForMaskedLMLoss's.  HF's
    `vocab_size` argument is checked against the head's vocabulary."""

    def __init__(self, head, shift: bool, model_name: str, fallback=None):
        """`fallback`: HF's own loss function, for logits the head gathered
        (a call the gathering forward did not switch to shards)."""
        self.head, self.shift, self.model_name, self.fallback = head, shift, model_name, fallback

    def __call__(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index: int = -100,
                 shift_labels=None, **kwargs):
        if vocab_size is not None and int(vocab_size) != self.head.vocab_size:
            raise ValueError(f"{self.model_name}: the loss was asked for vocab_size={vocab_size} but the LM head's "
                             f"vocabulary is {self.head.vocab_size}")
        if self.head.gather_output and self.fallback is not None:     # full logits: HF's rule on them
            return self.fallback(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                 ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        return vocab_parallel_loss(self.head, logits, labels, shift=self.shift, num_items_in_batch=num_items_in_batch,
                                   ignore_index=ignore_index, shift_labels=shift_labels)

    def __repr__(self):
        return f"VocabParallelLMLoss({'causal' if self.shift else 'masked'}, vocab={self.head.vocab_size})"


def calls_loss_function(cls) -> bool:
    """Whether `cls.forward` (in the installed transformers) computes its loss
    through self.loss_function: the "hook" rule needs that.  (Some classes
    moved to it between transformers versions; BLIP-2's and Gemma 3's
    multimodal heads compute nn.CrossEntropyLoss themselves in 5.15.)"""
    try:
        source = inspect.getsource(inspect.unwrap(cls.forward))
    except (OSError, TypeError):
        return True         # no source to read (compiled, generated): trust the policy's data
    return "loss_function" in source


def _hf_rule(model, path: str, name: str) -> bool:
    """True for ForCausalLMLoss (shift), False for ForMaskedLMLoss; anything
    else HF would run on the full vocabulary is refused."""
    from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss

    import transformers

    where = f" ({path})" if path else ""
    if not calls_loss_function(type(model)):
        raise NotImplementedError(
            f"{name}{where}: parallel_output=True needs {type(model).__name__}'s loss on vocabulary shards, but in "
            f"transformers {transformers.__version__} its forward computes the loss itself (not through "
            f"self.loss_function) on the full vocabulary; use parallel_output=False")
    fn = model.loss_function
    if fn is ForCausalLMLoss:
        return True
    if fn is ForMaskedLMLoss:
        return False
    raise NotImplementedError(
        f"{name}{where}: parallel_output=True needs the loss of {type(model).__name__} on vocabulary shards, but its "
        f"loss_function is {getattr(fn, '__name__', fn)!r} (only ForCausalLMLoss and ForMaskedLMLoss are known); "
        f"use parallel_output=False")


@dataclass
class _Entry:
    path: str
    rule: LMLoss
    shift: bool


class LMLossPlan:
    """Which models of the tree get the vocabulary-parallel loss, decided
    (and checked) before anything changes; `install` runs after the heads
    are swapped in."""

    def __init__(self, model: nn.Module, policy, name: str, policy_class_of, gathered: bool = False):
        """`policy_class_of(module)`: the registered Policy class of a module
        inside `model` or None (shardformer.autopolicy.registered_class,
        passed down by the sharder).  `gathered` (parallel_output=False):
        the loss goes to the shards only when the model is called with
        labels, the output's logits gathered after it (the module doc); a
        model the shards cannot serve is left to HF's loss, not refused."""
        from transformers import PreTrainedModel

        self.name = name
        self.gathered = gathered
        self.entries: list[_Entry] = []
        if gathered and not _honours_shards(policy):
            return
        for path, module in model.named_modules():
            found = policy if module is model else policy_class_of(module)
            rule, has_head = (declared(found), declares_head(found)) if found is not None else (HOOK, False)
            hf = isinstance(module, PreTrainedModel)
            if not (has_head or (hf and module.get_output_embeddings() is not None)):
                continue
            if rule.kind == "hook" and not hf:
                continue        # no loss_function to redirect: the model's own forward decides
            try:
                shift = _hf_rule(module, path, name) if rule.kind == "hook" else rule.kind == "causal"
                if rule.kind == "seq2seq":
                    _decoder_inputs_maker(module, name)      # refuses a model it cannot make them for
            except NotImplementedError:
                if not gathered:
                    raise
                continue                                     # HF's loss on the gathered logits
            if gathered and not _takes_return_dict(type(module)):
                continue                                     # a tuple output: its logits could not be found
            self.entries.append(_Entry(path, rule, shift))

    def install(self, model: nn.Module) -> int:
        """Redirect each planned model's loss to its head's shards; returns
        how many models were changed."""
        from .layer.linear import VocabParallelLMHead1D

        changed = 0
        for entry in self.entries:
            module = model.get_submodule(entry.path)
            heads = [m for m in module.modules() if isinstance(m, VocabParallelLMHead1D)
                     and m.gather_output == self.gathered and (m.tp_size > 1 or not self.gathered)]
            if not heads:       # tensor parallelism off, or another pipeline stage holds the head
                continue
            if len(heads) > 1:
                if self.gathered:
                    continue    # which head's logits the loss reads is unknown: HF's loss on gathered logits
                raise ValueError(f"{self.name}: parallel_output=True: {type(module).__name__} holds {len(heads)} "
                                 f"vocabulary-parallel LM heads; its loss would be ambiguous")
            label = f"{self.name}.{entry.path}" if entry.path else self.name
            if entry.rule.kind == "hook":
                module.loss_function = VocabParallelLMLoss(heads[0], entry.shift, label, module.loss_function)
            else:
                module.__dict__["forward"] = LossForward(module, heads[0], entry.rule, label)
            if self.gathered:
                module.__dict__["forward"] = GatheringForward(module, heads[0])
            elif callable(getattr(type(module), "generate", None)):
                module.__dict__["generate"] = _gathering_generate(module)
            changed += 1
        return changed


def _decoder_inputs_maker(model, name: str):
    """labels -> decoder_input_ids as the model's own forward makes them."""
    if callable(getattr(model, "prepare_decoder_input_ids_from_labels", None)):
        return model.prepare_decoder_input_ids_from_labels
    shift = getattr(sys.modules.get(type(model).__module__), "shift_tokens_right", None)
    cfg = model.config
    if callable(shift) and getattr(cfg, "decoder_start_token_id", None) is not None:
        return functools.partial(shift, pad_token_id=cfg.pad_token_id, decoder_start_token_id=cfg.decoder_start_token_id)
    raise NotImplementedError(f"{name}: parallel_output=True: cannot make {type(model).__name__}'s decoder inputs "
                              f"from its labels; use parallel_output=False")


def _honours_shards(policy) -> bool:
    """Whether a policy's LM heads honour parallel_output (a PolicySpec's
    capabilities may say they do not; hand-written policies do)."""
    spec = policy.build_spec()
    return spec is None or spec.capabilities.parallel_output


@functools.lru_cache(maxsize=None)
def _forward_signature(cls) -> inspect.Signature:
    """The signature of cls.forward, read once per class (the loss forwards
    bind every call's arguments with it: a training step's hot path)."""
    return inspect.signature(cls.forward)


def _takes_return_dict(cls) -> bool:
    signature = _forward_signature(cls)
    return "return_dict" in signature.parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())


def _call_arguments(signature: inspect.Signature, model, args, kwargs) -> dict:
    """The call's arguments by name (var-keyword arguments flattened in)."""
    bound = signature.bind(model, *args, **kwargs).arguments
    bound.pop(next(iter(signature.parameters)))         # self
    extra = bound.pop(next((p.name for p in signature.parameters.values()
                            if p.kind is inspect.Parameter.VAR_KEYWORD), "\0"), {})
    return {**bound, **extra}


#: Output fields holding an LM head's logits (BERT's pretraining head: prediction_logits).
LOGIT_FIELDS = ("logits", "prediction_logits")


def _gather_logits(out, head, done: dict):
    """Gather every logits field of `out` (nested model outputs too, e.g.
    BLIP-2's language_model_outputs) that holds `head`'s shard; returns how
    many were gathered.  `done`: id(shard) -> gathered, so a tensor held
    twice is gathered once."""
    from .distributed.mappings import gather_from_tp_region

    count = 0
    for key, value in list(out.items()):
        if torch.is_tensor(value) and key in LOGIT_FIELDS and value.shape[-1] == head.shard.length:
            if id(value) not in done:
                done[id(value)] = gather_from_tp_region(value, -1, head.shard, head.process_group)
            out[key] = done[id(value)]
            count += 1
        elif hasattr(value, "items") and not torch.is_tensor(value):
            count += _gather_logits(value, head, done)
    return count


#: logits dtypes of the vocabulary-parallel cross-entropy kernels
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class GatheringForward:
    """model.forward under parallel_output=False: called with `labels`, the
    head returns its shard for the call, the loss is computed on it (the
    model's loss_function or LossForward), then the output's logits are
    all-gathered; the model is run with return_dict=True and its output
    turned into a tuple after when the caller asked for one.  Without labels,
    inside an outer model's call that already switched the head, or under
    torch.compile (dynamo guards on the head's mode), the call is the
    model's own.  A module-level class held in the model's __dict__ (not a
    closure), so the model still pickles and deep-copies: the copy's
    forward is its own (shardformer.pickling)."""

    #: shardformer.decode's fast path may wrap it: a decode step passes no labels
    WRAPPABLE_IN_DECODE = True

    def __init__(self, model, head):
        self.model, self.head = model, head
        self.inner = model.__dict__.get("forward")      # a LossForward, or None: the class's forward

    @property
    def __signature__(self) -> inspect.Signature:
        """The model's own forward's (generate() reads which inputs it takes)."""
        return inspect.signature(type(self.model).forward.__get__(self.model))

    def _inner(self, *args, **kwargs):
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.model).forward(self.model, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        model, head = self.model, self.head
        if torch.compiler.is_compiling():   # switching the head's mode would recompile every step
            return self._inner(*args, **kwargs)
        call = _call_arguments(_forward_signature(type(model)), model, args, kwargs)
        if call.get("labels") is None or not head.gather_output or head.weight.dtype not in _KERNEL_DTYPES:
            return self._inner(*args, **kwargs)     # (float64: HF's loss, the cross-entropy kernel takes 32 / 16 bits)
        want_dict = call.pop("return_dict", None)
        if want_dict is None:
            want_dict = getattr(getattr(model, "config", None), "return_dict", True)
        call["return_dict"] = True
        head.gather_output = False
        try:
            out = self._inner(**call)
        finally:
            head.gather_output = True
        if not hasattr(out, "items") or _gather_logits(out, head, {}) == 0:
            raise RuntimeError(f"{type(model).__name__}: called with labels, the LM head's logits were computed on "
                               f"vocabulary shards for the loss but the output ({type(out).__name__}) holds no field "
                               f"{' or '.join(LOGIT_FIELDS)} of {head.shard.length} columns to gather")
        return out if want_dict or not hasattr(out, "to_tuple") else out.to_tuple()


class LossForward:
    """model.forward computing the loss on `head`'s shards (kinds causal,
    masked, seq2seq): HF's forward runs without the labels, then the loss
    is added to its output as HF would have placed it.  A module-level class
    (not a closure), so the model pickles and deep-copies."""

    def __init__(self, model, head, rule: LMLoss, name: str):
        self.model, self.head, self.rule, self.name = model, head, rule, name
        if rule.kind == "seq2seq":
            _decoder_inputs_maker(model, name)          # refused now, by name, not at the first call

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.model).forward.__get__(self.model))

    def __call__(self, *args, **kwargs):
        model, head, rule = self.model, self.head, self.rule
        original = type(model).forward.__get__(model)
        if head.gather_output:      # the head gathers (GatheringForward's fallbacks: float64, torch.compile):
            return original(*args, **kwargs)    # HF's own loss on the whole logits, as VocabParallelLMLoss does
        call = _call_arguments(_forward_signature(type(model)), model, args, kwargs)
        labels = call.pop("labels", None)
        side = call.pop(rule.also[0], None) if rule.also else None
        if labels is None:
            if side is not None:
                call[rule.also[0]] = side
            return original(**call)
        if rule.kind == "seq2seq" and call.get("decoder_input_ids") is None \
                and call.get("decoder_inputs_embeds") is None:
            call["decoder_input_ids"] = _decoder_inputs_maker(model, self.name)(labels)
        want_dict = call.pop("return_dict", None)
        if want_dict is None:
            want_dict = getattr(getattr(model, "config", None), "return_dict", True)
        num_items = call.pop("num_items_in_batch", None)
        if _takes_return_dict(type(model)):
            call["return_dict"] = True
        out = original(**call)
        logits = out["logits"] if "logits" in out else out["prediction_logits"]
        loss = None
        if rule.also is None or side is not None:
            loss = vocab_parallel_loss(head, logits, labels, shift=rule.kind == "causal", num_items_in_batch=num_items)
            if rule.also is not None:
                small = out[rule.also[1]]
                loss = loss + F.cross_entropy(small.reshape(-1, small.shape[-1]).float(), side.reshape(-1).to(small.device))
        if loss is not None:
            out = type(out)(loss=loss, **{k: v for k, v in out.items() if k != "loss"})
        return out if want_dict or not hasattr(out, "to_tuple") else out.to_tuple()


def _gathering_generate(model):
    """model.generate with every vocabulary-parallel head gathering its
    logits (decoding needs the whole distribution on every rank)."""
    from .layer.linear import VocabParallelLMHead1D

    original = type(model).generate.__get__(model)

    @functools.wraps(type(model).generate)
    def generate(*args, **kwargs):
        heads = [m for m in model.modules() if isinstance(m, VocabParallelLMHead1D) and not m.gather_output]
        for head in heads:
            head.gather_output = True
        try:
            return original(*args, **kwargs)
        finally:
            for head in heads:
                head.gather_output = False

    return generate
