"""Rank-side checks of output_attentions under tensor parallelism
(tests/test_attention_weights.py): every rank returns the weights of all
heads, equal to the unsharded model's."""
from __future__ import annotations

import torch

import zoo
from checks import parity
from shardformer import ShardConfig, ShardFormer
from shardformer.layer import attention_weights


def _eager(model) -> None:
    try:
        model.set_attn_implementation("eager")
    except (AttributeError, ValueError):
        pass


def _weights(out, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every attention-weights tensor of an output, nested outputs included
    (BLIP-2's vision, Q-Former and language-model outputs)."""
    found = {}
    items = out.items() if hasattr(out, "items") else ()
    for key, value in items:
        if hasattr(value, "items"):
            found.update(_weights(value, f"{prefix}{key}."))
        elif "attentions" in key and isinstance(value, tuple):
            found.update({f"{prefix}{key}[{i}]": a for i, a in enumerate(value) if isinstance(a, torch.Tensor)})
    return found


def weights_of_every_head(ctx, name: str) -> dict:
    model = zoo.build(name)
    _eager(model)
    inputs = zoo.make_inputs(name)
    model.eval()
    with torch.no_grad():
        ref = _weights(model(**inputs, output_attentions=True))
    assert ref, f"{name}: the unsharded model returned no attention weights"
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    gathering = sum(getattr(m, attention_weights._MARK, False) for m in model.modules())
    with torch.no_grad():
        got = _weights(model(**inputs, output_attentions=True))
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
    for key in ref:
        parity.assert_close(f"{name} {key}", got[key], ref[key], parity.TOL[torch.float32])
    return {"tensors": len(ref), "gathering_modules": gathering}


def weights_gradient(ctx, name: str) -> dict:
    """A loss on the attention weights: the gradient reaching the input
    embeddings equals the unsharded model's (backward keeps each rank's
    heads' slice)."""
    model = zoo.build(name)
    _eager(model)
    inputs = zoo.make_inputs(name)
    ids = inputs.pop("input_ids")
    embeds = model.get_input_embeddings()(ids).detach()
    model.eval()
    torch.manual_seed(3)
    probe = torch.randn(model.config.num_attention_heads)

    def grad_of(m):
        x = embeds.clone().requires_grad_()
        out = m(inputs_embeds=x, output_attentions=True, **inputs)
        loss = sum((a * probe.view(1, -1, 1, 1)).square().sum() for a in out.attentions)
        loss.backward()
        return loss.detach(), x.grad

    ref_loss, ref_grad = grad_of(model)
    ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).optimize(model)
    loss, grad = grad_of(model)
    parity.assert_close(f"{name} loss on the weights", loss, ref_loss, parity.TOL[torch.float32])
    parity.assert_close(f"{name} gradient of the embeddings", grad, ref_grad, parity.TOL[torch.float32])
    return {"loss": float(loss)}
