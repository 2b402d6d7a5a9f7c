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


def gathered_loss_on_shards(ctx, cases: list, default_group: bool = False) -> dict:
    """ShardConfig() with gathered logits (parallel_output=False), called with
    labels: the loss is computed on the rank's vocabulary shard (the C
    vocabulary-parallel cross-entropy once forward and once backward; no
    full-vocabulary softmax), the output's logits are the gathered unsharded
    ones and the loss does not depend on them (no [tokens, vocab] gradient in
    its backward).  Counted in the ledger:
    the labelled forward makes exactly the unlabelled forward's collectives
    plus the cross-entropy's ONE all-gather of its per-row statistics (3
    floats per row: max, sum-exp, target logit), so the logits are
    all-gathered once and the loss adds a single collective.  Loss, logits and every gradient of
    loss + a loss of the caller's own on the returned logits equal the
    unsharded model's.  `cases`: (zoo name, with num_items_in_batch,
    return_dict); labels get ignore_index (-100) at the first two positions.
    default_group: the plain ShardConfig() (the world is the group)."""
    from shardformer import comm_stats

    report = {}
    for name, num_items, return_dict in cases:
        torch.manual_seed(0)
        model = zoo.build(name).train()
        ref = copy.deepcopy(model)
        inputs = dict(zoo.make_inputs(name))
        labels = inputs["labels"].clone()
        labels[..., :2] = -100
        inputs["labels"] = labels
        extra = {} if return_dict is None else {"return_dict": return_dict}
        if num_items:
            extra["num_items_in_batch"] = torch.tensor(int((labels[..., 1:] != -100).sum()) + 3)
        cfg = ShardConfig() if default_group else ShardConfig(tensor_parallel_process_group=ctx.group)
        ShardFormer(cfg).optimize(model)
        head = _head(model)
        assert head.gather_output and head.tp_size == ctx.tp_size, f"{name}: the head does not gather"
        unlabelled = {k: v for k, v in inputs.items() if k != "labels"}
        if "decoder_input_ids" not in unlabelled and hasattr(model, "prepare_decoder_input_ids_from_labels"):
            unlabelled["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(labels)
        for _ in range(2):      # the first calls' checks: input agreement (call 1), whole parameters (call 2)
            model(**unlabelled)
        with comm_stats() as plain:
            model(**unlabelled)
        with counting_xent() as calls:
            with comm_stats() as stats:
                out = model(**inputs, **extra)
            loss, logits = _loss(out), _logits(out)
            assert logits.shape[-1] == head.vocab_size, f"{name}: returned logits {tuple(logits.shape)} not gathered"
            assert torch.autograd.grad(loss, logits, retain_graph=True, allow_unused=True)[0] is None, \
                f"{name}: the loss reads the gathered logits"
            rows = labels.numel()
            got, base = stats.summary(), plain.summary()
            count = {k: (v["calls"], v["bytes"]) for k, v in got.items()}
            want = {k: (v["calls"], v["bytes"]) for k, v in base.items()}
            ag = want.get("all_gather", (0, 0))   # the cross-entropy's ONE collective: 3 floats per row
            want["all_gather"] = (ag[0] + 1, ag[1] + 3 * 4 * rows)
            assert count == want, f"{name}: labelled forward collectives {count}; expected {want}"
            own = logits.float().square().mean() * 0.5           # the caller's own loss on the returned logits
            (loss + own).backward()
        assert calls == {"xent_stats": 1, "xent_grad": 1}, f"{name}: vocabulary-parallel cross-entropy calls {calls}"
        exp = ref(**inputs, **extra)
        ref_loss, ref_logits = _loss(exp), _logits(exp)
        (ref_loss + ref_logits.float().square().mean() * 0.5).backward()
        tol = TOL[torch.float32]
        report[name] = {"loss": assert_close(f"{name} loss", loss, ref_loss, tol),
                        "logits": assert_close(f"{name} logits", logits, ref_logits, tol),
                        "grad": compare_grads(model, ref, name, tol)}
    return report


def nan_logit_stays_nan(ctx, name: str = "LlamaForCausalLM") -> dict:
    """Plain ShardConfig() (the loss on vocabulary shards): one LM-head row
    of NaN -- a column of NaN logits inside rank 1's shard, in the kernel's
    vector body -- gives a NaN loss and NaN logit gradients, as the unsharded
    model does (the vector exp turned the NaN into ~0, so the sharded loss
    was finite and training went on).  The row is one of a token not in
    the batch (a tied embedding's row is not read)."""
    torch.manual_seed(0)
    model = zoo.build(name).train()
    inputs = zoo.make_inputs(name)
    head_rows = model.lm_head.weight.shape[0]
    local = -(-head_rows // ctx.tp_size)
    used = set(inputs["input_ids"].flatten().tolist())
    row = next(local + j for j in range(16) if local + j not in used)
    with torch.no_grad():
        model.lm_head.weight[row] = float("nan")
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig()).optimize(model)
    with counting_xent() as calls:
        loss = model(**inputs).loss
    exp = ref(**inputs).loss
    assert calls.get("xent_stats") == 1, f"{name}: the loss did not run on the shards: {calls}"
    assert bool(exp.isnan()), f"{name}: the unsharded loss is {exp} with a NaN logit column"
    assert bool(loss.isnan()), f"{name}: rank {ctx.rank}: loss {loss} with NaN logits in column {row}; HF {exp}"
    return {"row": row, "loss": str(loss.item())}
