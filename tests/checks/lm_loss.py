"""Rank-side checks of ShardConfig(parallel_output=True): the model's own loss
computed on vocabulary shards (shardformer.lm_loss) against the unsharded HF
model from the same seed."""
from __future__ import annotations

import copy
import torch

import zoo
from checks.optimizations import counting_kernels
from checks.parity import TOL, assert_close, compare_grads, prompt_ids
from shardformer import ShardConfig, ShardFormer
from shardformer.layer import VocabParallelLMHead1D


def counting_xent():
    """Calls of the vocabulary-parallel cross-entropy's C halves."""
    return counting_kernels(("xent_stats", "xent_grad"))


def _head(model) -> VocabParallelLMHead1D:
    heads = [m for m in model.modules() if isinstance(m, VocabParallelLMHead1D)]
    assert len(heads) == 1, f"expected one vocabulary-parallel head, found {len(heads)}"
    return heads[0]


def _logits(out):
    if isinstance(out, dict) or hasattr(out, "keys"):
        return out["logits"] if "logits" in out else out["prediction_logits"]
    return next(t for t in out if isinstance(t, torch.Tensor) and t.dim() >= 3)   # a tuple: after the losses


def _loss(out):
    return out["loss"] if isinstance(out, dict) or hasattr(out, "keys") else out[0]


def equals_unsharded(ctx, name: str, dropout: float = 0.0, num_items: bool = False, return_dict=None) -> dict:
    """Loss, this rank's logits shard and every gradient of the model sharded
    with parallel_output=True equal the unsharded model's (its logits columns
    [vocab_start, vocab_start + real) and their gradients); the C
    cross-entropy ran once forward and once backward; no rank holds the full
    vocabulary.  dropout > 0: built with that dropout, compared in eval mode."""
    torch.manual_seed(0)
    model = zoo.build_with_dropout(name, dropout) if dropout else zoo.build(name)
    return compare(ctx, model, zoo.make_inputs(name), name, dropout, num_items, return_dict)


def compare(ctx, model, inputs: dict, name: str, dropout: float = 0.0, num_items: bool = False,
            return_dict=None) -> dict:
    """equals_unsharded's checks for a model built by the caller (unsharded; sharded here)."""
    model.train(not dropout)
    ref = copy.deepcopy(model)
    assert "labels" in inputs, f"{name}: no labels"
    extra = {}
    if num_items:
        extra["num_items_in_batch"] = torch.tensor(int((inputs["labels"][..., 1:] != -100).sum()) + 3)
    if return_dict is not None:
        extra["return_dict"] = return_dict
    cfg = ShardConfig(tensor_parallel_process_group=ctx.group, parallel_output=True)
    ShardFormer(cfg).optimize(model)
    head = _head(model)
    with counting_xent() as calls:
        out = model(**inputs, **extra)
        loss = _loss(out)
        loss.backward()
    exp = ref(**inputs, **extra)
    ref_loss = _loss(exp)
    ref_loss.backward()
    assert calls == {"xent_stats": 1, "xent_grad": 1}, f"{name}: vocabulary-parallel cross-entropy calls {calls}"
    tol = TOL[torch.float32]
    report = {"loss": assert_close(f"{name} loss", loss, ref_loss, tol)}
    logits, full = _logits(out), _logits(exp)
    local = head.shard.length if hasattr(head.shard, "length") else logits.shape[-1]
    assert logits.shape[-1] == local < full.shape[-1] or ctx.tp_size == 1, \
        f"{name}: logits have {logits.shape[-1]} columns; the full vocabulary is {full.shape[-1]}"
    start = head.vocab_start
    real = max(0, min(logits.shape[-1], head.vocab_size - start))
    report["logits"] = assert_close(f"{name} logits shard", logits[..., :real], full[..., start:start + real], tol)
    report["grad"] = compare_grads(model, ref, name, tol)
    return report


def generate_equals_unsharded(ctx, name: str) -> list:
    """generate() under parallel_output gathers the logits it decodes from:
    the same tokens as the unsharded model; the heads are back to shards after."""
    model = zoo.build(name).eval()
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group, parallel_output=True)).optimize(model)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = model.generate(prompt_ids(), **kwargs)
        exp = ref.generate(prompt_ids(), **kwargs)
    assert torch.equal(got, exp), f"{name}: generate() differs:\n{got}\n{exp}"
    assert not _head(model).gather_output, "the head still gathers after generate()"
    return got.tolist()


def refuses_unknown_loss(ctx, name: str) -> str:
    """A model whose loss_function is not one HF's vocabulary losses (a
    user's own) is refused before anything changes."""
    model = zoo.build(name)
    model.loss_function = lambda logits, labels, **kw: logits.sum()
    return _refused_unchanged(ctx, model, name)


def _refused_unchanged(ctx, model, name: str) -> str:
    """optimize(parallel_output=True) must raise NotImplementedError and leave
    the model as it was (no tensor changed, no head swapped in); returns the message."""
    cfg = ShardConfig(tensor_parallel_process_group=ctx.group, parallel_output=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        ShardFormer(cfg).optimize(model)
    except NotImplementedError as e:
        message = str(e)
    else:
        raise AssertionError(f"{name}: parallel_output was not refused")
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(v, after[k]) for k, v in before.items()), \
        f"{name}: the refused model changed"
    assert not any(isinstance(m, VocabParallelLMHead1D) for m in model.modules())
    return message


def refuses_own_loss(ctx, name: str) -> str:
    """optimize(parallel_output=True) refuses a class whose forward computes its
    loss without self.loss_function, before anything changes."""
    return _refused_unchanged(ctx, zoo.build(name), name)
