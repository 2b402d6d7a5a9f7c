"""shardformer.verify and `python -m shardformer verify`: a sharded model
against the unsharded one from the same seed, located to the first module
that departs (checks in checks/verify.py run in place on the rank pools; the
CLI starts its own ranks)."""
import json

import pytest
import torch

import zoo
from checks import verify as V
from shardformer import ShardConfig, verify
from shardformer.__main__ import main as shardformer_main
from shardformer.verification.cli import main as verify_cli


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("layout", ["world+plan", "group+policy"])
def test_correct_layout_passes(pool, world_pool, tp, layout):
    """Llama with 6 query / 2 KV heads, 90 MLP features and a vocabulary of
    101 (uneven at TP=4): its plan dict under ShardConfig() (the world), and
    the built-in policy over an explicit group, match module by module."""
    if layout == "world+plan":
        reports = world_pool(tp).run(V.verify_correct, tp, False, True)
    else:
        reports = pool.run(V.verify_correct, tp, True, False)
    for r in reports[:tp]:
        assert r["ok"], r["text"]
        assert r["first"] is None
        # every check compared something: modules both ways, all gradients, all parameters after the steps
        assert all(n > 0 for n in r["compared"].values()), r["compared"]
        assert r["compared"]["modules"] >= 55 and r["compared"]["grads"] >= 20, r["compared"]
    assert reports[0]["text"] == reports[tp - 1]["text"]    # every rank returns the merged report


def test_wrong_policy_is_located(pool):
    """A custom Policy right in layer 0 and wrong in layer 1's mlp.down_proj:
    a missing all-reduce is found at that module's output, with the numbers;
    a row-parallel layer declared column-parallel at the module whose forward
    raised; the same policy without the fault passes."""
    reports = pool.run(V.verify_wrong, 2)[0]
    assert reports["_LlamaPolicy"]["ok"], reports["_LlamaPolicy"]["text"]

    missing = reports["MissingAllReducePolicy"]
    assert not missing["ok"]
    assert missing["first"]["module"] == "model.layers.1.mlp.down_proj", missing["text"]
    assert missing["first"]["what"] == "output" and missing["first"]["max_abs"] > 1e-3
    assert missing["first"]["ranks"] == [0, 1]
    assert "MISMATCH: first departs at model.layers.1.mlp.down_proj (output)" in missing["text"]
    assert "max abs diff" in missing["text"] and "shape [2, 8, 96]" in missing["text"]

    column = reports["RowAsColumnPolicy"]
    assert not column["ok"]
    assert column["first"]["module"] == "model.layers.1.mlp.down_proj", column["text"]
    assert column["first"]["what"] == "raised"
    assert "RuntimeError" in column["first"]["message"], column["first"]["message"]


def test_in_place_world_size_must_match(pool):
    message = pool.run(V.verify_world_size_mismatch, 2)[0]
    assert "runs in place" in message and "2 ranks" in message and "world_size=3" in message, message
    assert "docs/verify.md" in message


def test_one_rank_failing_is_named(pool):
    """A build() failing on rank 1 alone: every rank raises an error naming
    rank 1 and its failure, within seconds (no hang)."""
    import time

    start = time.monotonic()
    messages = pool.run(V.verify_one_rank_fails, 2)
    assert time.monotonic() - start < 60
    for m in messages[:2]:
        assert "verify: set-up" in m and "rank 1: outcome='OSError: checkpoint not found" in m, m


def _args(**kw):
    base = dict(build=V.build_llama, inputs=V.llama_inputs)
    base.update(kw)
    build, inputs = base.pop("build"), base.pop("inputs")
    return build, inputs, base


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(plan={"lm_head": "colwise"}, policy=V._LlamaPolicy), ValueError, ["plan or policy, not both"]),
    (dict(plan={"lm_head": 3}), TypeError, ["plan must be a dict"]),
    (dict(policy=object()), TypeError, ["policy must be a shardformer.Policy"]),
    (dict(world_size=0), ValueError, ["world_size", "0"]),
    (dict(steps=-1), ValueError, ["steps", "-1"]),
    (dict(rtol=0.0), ValueError, ["rtol", "0.0"]),
    (dict(build=3), TypeError, ["build must be a function", "int"]),
    (dict(inputs=[1]), TypeError, ["inputs must be a dict", "list"]),
    (dict(shard_config={"tp": 2}), TypeError, ["shard_config must be a shardformer.ShardConfig", "dict"]),
])
def test_bad_arguments(kwargs, error, words):
    """Refused in the calling process, before any rank starts."""
    build, inputs, kw = _args(**kwargs)
    with pytest.raises(error) as e:
        verify(build, inputs, **kw)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_group_outside_a_job_is_refused():
    config = ShardConfig()
    config.tensor_parallel_process_group = object()     # a group of some other job
    with pytest.raises(ValueError, match="tensor_parallel_process_group.*not initialized.*docs/verify.md"):
        verify(V.build_llama, V.llama_inputs, shard_config=config)


def test_cli_on_a_checkpoint(tmp_path, capsys):
    """`python -m shardformer verify --model DIR`: the saved tiny Llama over 2
    ranks it starts itself matches (exit 0); a plan.json declaring the row
    layer down_proj colwise is located at that module (exit 1)."""
    zoo.build(V.LLAMA).save_pretrained(tmp_path / "ckpt")
    assert shardformer_main(["verify", "--model", str(tmp_path / "ckpt"), "--tp", "2", "--seq", "6"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM at TP=2" in out and "OK: the sharded model matches" in out, out

    plan = V.llama_plan()
    plan["model.layers.*.mlp.down_proj"] = "colwise"
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert verify_cli(["--model", str(tmp_path / "ckpt"), "--plan", str(tmp_path / "plan.json")]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH: first departs at model.layers.0.mlp.down_proj (raised)" in out, out


def test_cli_bad_arguments(tmp_path, capsys):
    assert verify_cli(["--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "plan.json").write_text("[1, 2]")
    assert verify_cli(["--model", str(tmp_path), "--plan", str(tmp_path / "plan.json")]) == 2
    assert "expected a JSON object" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        verify_cli(["--model", str(tmp_path), "--tp", "0"])
    assert e.value.code == 2 and "positive integer" in capsys.readouterr().err
    assert shardformer_main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err
    assert shardformer_main([]) == 2


def test_inputs_and_build_are_checked_on_the_ranks():
    """build() must be deterministic under the seed; inputs must hold a tensor."""
    from shardformer.verification.ranks import build_pair, make_inputs

    calls = []

    def drifting():             # a weight that depends on a counter, not only on the seed
        calls.append(1)
        m = torch.nn.Linear(3, 3)
        with torch.no_grad():
            m.weight.add_(len(calls))
        return m

    with pytest.raises(ValueError, match="not deterministic.*manual_seed.*'weight'.*Linear"):
        build_pair(drifting)
    with pytest.raises(ValueError, match="no tensor"):
        make_inputs({"use_cache": False})
