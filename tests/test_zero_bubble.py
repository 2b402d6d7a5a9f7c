"""Zero-bubble pipeline schedules (shardformer.pipeline.ZeroBubbleSchedule: ZB-H1;
ZeroBubbleVSchedule: ZB-V, two chunks per stage folded in a V).  Against the
unsharded HF model from the same seed, over two SGD-with-momentum steps: the
loss, every gradient and the stepped model, at PP=2 (two pipelines on 4
ranks) for Llama, GPT-2, BERT and T5, PP=4 over the default group with 8
micro-batches, and TP=2 x PP=2 (ZB-V's from shardformer.mesh).  Without processes: the step lists (every
step once, W after its B, the in-flight bound, the unit-time bubbles), the
B / W split of the linear products on its own, and the refusals."""
import pytest
import torch
import torch.nn as nn

from checks import zero_bubble as check
from shardformer.pipeline import (InterleavedSchedule, OneForwardOneBackwardSchedule, PipelineStageManager,
                                  ZeroBubbleSchedule, ZeroBubbleVSchedule, weight_grads)
from shardformer.pipeline import schedule as S
from shardformer.pipeline import zero_bubble as Z

FAMILIES = ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM", "T5ForConditionalGeneration"]


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
@pytest.mark.parametrize("name", FAMILIES)
def test_pp2_equals_unsharded(pool, name, schedule):
    report = pool.run(check.equals_unsharded, 4, name, 2, schedule, 4)     # two pipelines of 2 stages
    assert all(r["deferred"] > 0 for r in report), report


@pytest.mark.compat_covered_by("test_pp2_equals_unsharded")    # the same HF layers, over more stages
@pytest.mark.parametrize("schedule, layers", [("zb-h1", 4), ("zb-v", 8)])
def test_pp4_default_group(pool, schedule, layers):
    """PipelineStageManager() over the world, ShardConfig's default group; 8 micro-batches, uneven stages
    for ZB-H1 (5 layers over 4 stages)."""
    pool.run(check.equals_unsharded, 4, "LlamaForCausalLM", 4, schedule, 8, 1, layers + (schedule == "zb-h1"),
             "default")


@pytest.mark.compat_covered_by("test_pp2_equals_unsharded")    # the same HF layers, TP-sharded
@pytest.mark.parametrize("schedule, m", [("zb-h1", 8), ("zb-v", 4)])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_tp2_pp2(pool, name, schedule, m):
    """Explicit groups for ZB-H1; ZB-V from shardformer.mesh(pp=2, tp=2).shard_config(num_model_chunks=2,
    pipeline_layout="v")."""
    pool.run(check.equals_unsharded, 4, name, 2, schedule, m, 2, how="mesh" if schedule == "zb-v" else "groups")


@pytest.mark.parametrize("schedule, reentrant", [("zb-h1", False), ("zb-v", True)])
def test_gradient_checkpointing(pool, schedule, reentrant):
    """HF's gradient checkpointing inside the stages: the layers recompute in B; the schedules then defer
    nothing (every gradient in B) and still equal the unsharded model."""
    pool.run(check.equals_unsharded, 4, "LlamaForCausalLM", 2, schedule, 4, reentrant=reentrant)


# ---- without processes -----------------------------------------------------------------

def _in_flight(steps) -> int:
    """The most (chunk, micro-batch) pairs run forward whose W has not run."""
    live = peak = 0
    for kind, _, _ in steps:
        live += {"F": 1, "W": -1}.get(kind, 0)
        peak = max(peak, live)
    return peak


GRID = [(2, 2), (2, 4), (2, 8), (3, 3), (3, 7), (4, 4), (4, 5), (4, 8), (8, 8), (8, 16)]


@pytest.mark.transformers_independent      # the step lists alone
@pytest.mark.parametrize("p, m", GRID)
def test_step_lists(p, m):
    for steps_of, v, layout, bound in ((Z._zb_h1_steps, 1, "loop", p), (Z._zb_v_steps, 2, "v", 2 * p)):
        plan = S._plan(steps_of, p, v, m, True, layout)        # raises when the lists deadlock
        for s in range(p):
            steps = steps_of(s, p, v, m)
            assert sorted(steps) == sorted((k, c, i) for k in "FBW" for c in range(v) for i in range(m))
            assert [st for st in plan[s] if st[0] in ("F", "B", "W")] == steps
            for k, (kind, c, i) in enumerate(steps):
                if kind != "F":
                    assert ("F" if kind == "B" else "B", c, i) in steps[:k], (s, kind, c, i)
            assert _in_flight(steps) <= bound, (s, steps)
        sends = sorted((s, st[1], st[2]) for s in range(p) for st in plan[s] if st[0] == "send")
        recvs = sorted((st[1], s, st[2]) for s in range(p) for st in plan[s] if st[0] == "recv")
        assert sends == recvs
    # the V: stage 0 holds the first and the last virtual stage, the turn at stage p-1 stays local
    v_plan = S._plan(Z._zb_v_steps, p, 2, m, True, "v")
    assert sum(st[0] == "local" for st in v_plan[p - 1]) == 2 * m       # an activation and a gradient per mb


@pytest.mark.transformers_independent      # the step lists alone
@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_unit_time_bubbles(p, m):
    """F = B = W = one unit: 1F1B idles (p-1)/(m+p-1) of the step, ZB-H1 (p-1)/(3m+p-1), ZB-V less."""
    one_f_one_b = Z.ideal_bubble(S._one_f_one_b_steps, p, 1, m, split=False)
    h1 = Z.ideal_bubble(Z._zb_h1_steps, p, 1, m)
    zbv = Z.ideal_bubble(Z._zb_v_steps, p, 2, m, "v")
    assert max(one_f_one_b) == pytest.approx((p - 1) / (m + p - 1))
    assert max(h1) == pytest.approx((p - 1) / (3 * m + p - 1))
    assert max(zbv) <= p / (6 * m + p) + 1e-12 and max(zbv) < max(h1)     # at most p idle units of 6m


class _Conv1D(nn.Module):
    """HF's Conv1D: addmm(b, x, W), W [in, out]."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out))
        self.bias = nn.Parameter(torch.randn(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], -1)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)                         # F.linear
        self.b = _Conv1D(5, 7)                           # torch.addmm
        self.w = nn.Parameter(torch.randn(7, 3))         # x @ W
        self.norm = nn.LayerNorm(3)                      # not a linear product: its gradient in B
        self.hooked = nn.Linear(3, 2, bias=False)        # a weight with a hook: its gradient in B
        self.hooked.weight.register_hook(lambda g: g * 2)

    def forward(self, x):
        return self.hooked(self.norm(torch.tanh(self.b(torch.relu(self.a(x)))) @ self.w)).square().sum()


@pytest.mark.transformers_independent      # plain torch modules
def test_weight_grads_split():
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(2, 4, 6, requires_grad=True)
    net(x).backward()
    expected = {n: p.grad.clone() for n, p in net.named_parameters()}
    x_grad = x.grad.clone()
    net.zero_grad(set_to_none=True)
    x.grad = None
    sink = []
    with weight_grads.deferring(sink):
        loss = net(x)
        loss.backward()                                  # B
    assert x.grad is not None and torch.allclose(x.grad, x_grad, rtol=1e-5, atol=1e-6)
    deferred = {"a.weight", "a.bias", "b.weight", "b.bias", "w"}
    held_back = {n for n, p in net.named_parameters() if p.grad is None}
    assert held_back == deferred and len(sink) == 3
    weight_grads.apply(sink)                             # W
    assert not sink
    for n, p in net.named_parameters():
        assert torch.allclose(p.grad, expected[n], rtol=1e-5, atol=1e-6), n


@pytest.mark.transformers_independent      # constructor checks
def test_refusals():
    with pytest.raises(ValueError, match="layout='v' folds the chain once: it needs num_model_chunks=2, got 3"):
        PipelineStageManager(num_model_chunks=3, layout="v")
    with pytest.raises(ValueError, match="layout must be one of"):
        PipelineStageManager(layout="w")
    with pytest.raises(ValueError, match="ZB-V runs exactly 2 chunks per stage"):
        ZeroBubbleVSchedule(PipelineStageManager(num_model_chunks=3), num_microbatches=4)
    with pytest.raises(ValueError, match="ZB-V runs exactly 2 chunks per stage"):
        ZeroBubbleVSchedule(PipelineStageManager(), num_microbatches=4)
    with pytest.raises(ValueError, match="laid out 'loop'.*ZB-V needs the V"):
        ZeroBubbleVSchedule(PipelineStageManager(num_model_chunks=2), num_microbatches=4)
    sm = PipelineStageManager(num_model_chunks=2, layout="v")
    sm.num_stages = 4                                    # the arithmetic alone
    with pytest.raises(ValueError, match="num_microbatches=3 is fewer than the 4 pipeline stages"):
        ZeroBubbleVSchedule(sm, num_microbatches=3)
    with pytest.raises(ValueError, match="folds its chunks in a V"):
        InterleavedSchedule(sm, num_microbatches=4)
    for cls in (ZeroBubbleSchedule, OneForwardOneBackwardSchedule):
        with pytest.raises(ValueError, match="num_model_chunks=2"):
            cls(sm, num_microbatches=4)
    assert [sm.stage_of(vs) for vs in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
