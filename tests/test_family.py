"""Families as data: the registry and the policy classes are generated from
each policy file's Family; a Llama-shaped model is a few lines of data; bad
family data is refused when it is declared."""
from __future__ import annotations

import importlib

import pytest

from checks import family as family_checks
from shardformer.autopolicy import families, registry
from shardformer.family import Family, FamilyPolicy, Head, lm
from shardformer.policies.shapes import DecoderShape


def test_registry_is_generated_from_the_families():
    table = registry()
    declared = {fam.registry_key(cls): fam for fam in families() for cls in fam.heads}
    assert set(table) == set(declared)
    for key, (family, policy_name) in table.items():
        cls = getattr(importlib.import_module(f"shardformer.policies.{family}"), policy_name)
        assert issubclass(cls, FamilyPolicy) and cls.family is declared[key]
        assert cls.model_class == key.rsplit(".", 1)[-1] and policy_name == f"{cls.model_class}Policy"


def test_every_family_file_declares_data():
    from shardformer import policies
    import pkgutil

    files = {i.name for i in pkgutil.iter_modules(policies.__path__)} - {"shapes"}
    assert files == {f.name for f in families()}


def test_a_family_names_each_head_class_once():
    fam = Family("qwen2-as-data", "qwen2.modeling_qwen2", DecoderShape, options={"prefix": "Qwen2"},
                 heads={"Qwen2Model": (), "Qwen2ForCausalLM": lm("lm_head")})
    classes = fam.policy_classes()
    assert set(classes) == {"Qwen2ModelPolicy", "Qwen2ForCausalLMPolicy"}
    assert classes["Qwen2ForCausalLMPolicy"].heads == (lm("lm_head"),)
    assert classes["Qwen2ForCausalLMPolicy"].prefix == "Qwen2"
    assert fam.registry() == {
        "transformers.models.qwen2.modeling_qwen2.Qwen2Model": ("qwen2-as-data", "Qwen2ModelPolicy"),
        "transformers.models.qwen2.modeling_qwen2.Qwen2ForCausalLM": ("qwen2-as-data", "Qwen2ForCausalLMPolicy"),
    }
    remote = Family("remote", "", DecoderShape, heads={"RemoteModel": ()})
    assert remote.registry() == {"RemoteModel": ("remote", "RemoteModelPolicy")}


def test_bad_family_data_is_refused():
    with pytest.raises(ValueError, match="unknown kind 'vocab'"):
        Head("lm_head", "vocab")
    with pytest.raises(TypeError, match="expected Head values"):
        Family("x", "llama.modeling_llama", DecoderShape, heads={"LlamaForCausalLM": "lm_head"})
    with pytest.raises(TypeError, match="shape must be a FamilyPolicy subclass"):
        Family("x", "llama.modeling_llama", object, heads={})


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["Qwen2ForCausalLM", "Qwen2ForSequenceClassification"])
def test_a_new_family_in_ten_lines(pool, name, tp):
    pool.run(family_checks.ten_line_family, tp, name)

