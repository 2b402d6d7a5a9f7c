"""Lazy construction (shardformer.lazy_init): no parameter storage until
optimize(), which materializes each rank's shards; the result equals the
eagerly built model sharded the same way, bit for bit, for every model of
the zoo at TP=2 (a spread of them at TP=4), trains like the unsharded model,
and its ranks must agree as eager ones must."""
import pytest

import zoo
from checks import lazy

ALL = zoo.names()
TP4 = ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM", "MixtralForCausalLM", "T5ForConditionalGeneration",
       "BloomForCausalLM", "FalconForCausalLM", "ViTForImageClassification", "Gemma3ForConditionalGeneration",
       "WhisperForConditionalGeneration"]


@pytest.mark.parametrize("name", ALL)
def test_lazy_shards_equal_eager_tp2(pool, name):
    pool.run(lazy.lazy_equals_eager, 2, name)


@pytest.mark.parametrize("name", TP4)
def test_lazy_shards_equal_eager_tp4(pool, name):
    pool.run(lazy.lazy_equals_eager, 4, name)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForSequenceClassification",
                                  "Qwen3ForCausalLM", "SamModel", "MixtralForCausalLM"])
def test_lazy_model_trains_like_unsharded(pool, name, tp):
    pool.run(lazy.lazy_trains_like_unsharded, tp, name)


def test_lazy_replicas_must_agree(pool):
    msgs = pool.run(lazy.replicas_differ, 2, "LlamaForCausalLM")
    assert all("different weights" in m for m in msgs), msgs


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM", "T5ForConditionalGeneration"])
def test_lazy_with_all_optimizations(pool, name):
    pool.run(lazy.lazy_equals_eager, 2, name, {"enable_all_optimization": True})


def test_deepcopy_of_a_lazy_model_records_apart():
    import copy

    import torch
    from shardformer import lazy_init
    from shardformer.lazy import materialize_module

    with lazy_init():
        a = torch.nn.Linear(4, 3)
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.weight.fill_(2.0)
    materialize_module(a)
    materialize_module(b)
    assert torch.equal(b.weight, torch.full((3, 4), 2.0))
    assert not torch.equal(a.weight, b.weight)


def _llama(**overrides):
    import transformers

    cfg = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)
    cfg.update(overrides)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))


_GROWTH = """
import gc, sys, torch, transformers
from shardformer import lazy_init
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                               num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)
mode = sys.argv[1]
torch.manual_seed(0)
transformers.LlamaForCausalLM(transformers.LlamaConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                              num_attention_heads=2, vocab_size=16))    # warm: first-call allocations
gc.collect()
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
if mode == "eager":
    model = transformers.LlamaForCausalLM(cfg)
else:
    with lazy_init(exact=(mode == "exact")):
        model = transformers.LlamaForCausalLM(cfg)
growth = status("VmHWM") - base
sizes = [p.numel() * p.element_size() for p in model.parameters()]
print(growth, sum(sizes), max(sizes))
"""


@pytest.fixture(scope="module")
def peak_growth() -> dict:
    """{mode: (peak RSS growth of building a 180 MB Llama, its parameter bytes, its largest
    parameter's bytes)} for the eager, exact and inexact builds, each in a fresh process.  (CI time:
    the three processes run at once, and the eager one once for both parameters of the test.)"""
    import subprocess
    import sys

    procs = {mode: subprocess.Popen([sys.executable, "-c", _GROWTH, mode], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for mode in ("eager", "exact", "inexact")}
    out = {}
    for mode, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"the {mode} build failed:\n{stderr[-4000:]}"
        out[mode] = tuple(int(v) for v in stdout.split()[-3:])
    return out


@pytest.mark.parametrize("exact", [True, False])
def test_lazy_construction_allocates_no_parameter_storage(exact, peak_growth):
    """A 180 MB Llama built under lazy_init(): the peak RSS grows by at most
    the largest parameter (exact=True draws each parameter's random numbers
    once on a scratch tensor) plus a few MB of Python objects; the eager
    build grows by the whole model (each measured in a fresh process)."""
    eager_growth, total, largest = peak_growth["eager"]
    lazy_growth, lazy_total, _ = peak_growth["exact" if exact else "inexact"]
    assert lazy_total == total
    assert eager_growth > 0.9 * total, (eager_growth, total)
    limit = (1.2 * largest if exact else 0) + 24 * 2**20
    assert lazy_growth < limit, f"lazy build grew RSS by {lazy_growth / 2**20:.1f} MiB (limit {limit / 2**20:.1f}, " \
                                f"model {total / 2**20:.1f} MiB)"


def test_lazy_model_to_dtype_stays_lazy_and_equals_eager():
    import torch
    from shardformer import lazy_init
    from shardformer.lazy import is_lazy, materialize_module

    torch.manual_seed(0)
    eager = _llama(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=100).to(torch.bfloat16)
    torch.manual_seed(0)
    with lazy_init():
        model = _llama(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=100)
    model = model.to(torch.bfloat16)
    assert all(is_lazy(p) and p.dtype == torch.bfloat16 for p in model.parameters())
    materialize_module(model)
    for (name, a), b in zip(eager.state_dict().items(), model.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def _small_eager_and_lazy():
    """A small Llama built eagerly and under lazy_init(), both from seed 0."""
    import torch
    from shardformer import lazy_init

    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=100)
    torch.manual_seed(0)
    eager = _llama(**small)
    torch.manual_seed(0)
    with lazy_init():
        model = _llama(**small)
    return eager, model


def test_forward_of_an_unsharded_lazy_model_equals_eager():
    """Reading a lazy parameter (here: a forward without optimize(), under
    torch.no_grad()) materializes it for that operation: slow, but the
    values are right."""
    import torch

    eager, model = _small_eager_and_lazy()
    ids = torch.randint(0, 100, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, eager(ids).logits)


def test_shape_changing_in_place_ops_are_refused():
    import torch
    from shardformer import lazy_init

    with lazy_init():
        layer = torch.nn.Linear(4, 3)
    with pytest.raises(RuntimeError, match="resize_ changes the shape"):
        layer.weight.data.resize_(2, 2)


def test_inexact_replays_agree():
    """exact=False draws nothing at construction; the state is fixed at the
    first replay, so two materializations of one parameter (a tied weight
    cut twice) agree."""
    import torch
    from shardformer import lazy_init
    from shardformer.lazy import materialize

    with lazy_init(exact=False):
        layer = torch.nn.Linear(16, 8)
    assert torch.equal(materialize(layer.weight), materialize(layer.weight))


@pytest.mark.parametrize("tp", [2, 4])
def test_lazy_custom_model_with_its_policy(pool, tp):
    pool.run(lazy.lazy_custom_model, tp)


def test_training_forward_before_optimize_is_refused():
    """A forward with autograd on, on a lazy model not yet sharded, would
    return a result detached from the parameters (no gradient reaches them):
    refused by name, inside and after the lazy_init() context, pointing to
    optimize(); under torch.no_grad() it still computes exact values, and
    after materialize_module() it trains like the eager model."""
    import torch
    from shardformer import lazy_init
    from shardformer.lazy import materialize_module

    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=100)
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    eager = _llama(**small)
    torch.manual_seed(0)
    with lazy_init():
        model = _llama(**small)
        with pytest.raises(RuntimeError, match=r"lazy parameter .* requires grad.*optimize\(\)"):
            model(ids, labels=ids)
    with pytest.raises(RuntimeError, match=r"lazy parameter .* requires grad.*optimize\(\)"):
        model(ids, labels=ids)
    with torch.no_grad():
        assert torch.equal(model(ids, labels=ids).loss, eager(ids, labels=ids).loss)
    materialize_module(model)
    loss, ref = model(ids, labels=ids).loss, eager(ids, labels=ids).loss
    assert loss.requires_grad and torch.equal(loss, ref)
    loss.backward()
    ref.backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_saved_state_dict_of_a_lazy_model_loads_with_plain_torch(tmp_path):
    """torch.save(lazy_model.state_dict()) writes ordinary tensors (the
    values eager construction gives from the same seed), which plain
    torch.load (weights_only) reads; the model stays lazy.  A tensor still to
    be loaded (mark_uninitialized) has no values: refused by name when saved."""
    import torch
    from shardformer.lazy import is_lazy, mark_uninitialized

    eager, model = _small_eager_and_lazy()
    torch.save(model.state_dict(), tmp_path / "lazy.pt")
    loaded = torch.load(tmp_path / "lazy.pt")
    expected = eager.state_dict()
    assert list(loaded) == list(expected)
    for key, value in expected.items():
        assert type(loaded[key]) is torch.Tensor and torch.equal(loaded[key], value), key
    assert all(is_lazy(p) for p in model.parameters())
    mark_uninitialized(model, ["lm_head.weight"])
    with pytest.raises(TypeError, match=r"still to be loaded"):
        torch.save(model.state_dict(), tmp_path / "unloaded.pt")
