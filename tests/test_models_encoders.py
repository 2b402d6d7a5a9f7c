"""Encoder and encoder-decoder families (RoBERTa, ALBERT, ERNIE, T5, Whisper)
and ChatGLM2 (remote-code structure, tests/zoo/chatglm2.py): every policy
class sharded at TP=2 and TP=4 against the unsharded model from the same
seed, generate() equality, and the family-specific hard parts."""
import pytest

from checks import encoders as encoder_checks
from zoo import encoders

NAMES = sorted(encoders.MODELS)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_fp32_forward_backward_step(pool, name, tp):
    reports = pool.run(encoder_checks.check_model, tp, name)
    assert all(r["tp"] == tp for r in reports)
    assert all(r["param_fraction"] < 1.0 for r in reports)


GENERATE = ["T5ForConditionalGeneration", "T5ForConditionalGeneration/v1.1", "WhisperForConditionalGeneration",
            "WhisperForCausalLM", "RobertaForCausalLM", "ErnieForCausalLM", "ChatGLMForConditionalGeneration"]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", GENERATE)
def test_generate_matches_unsharded(pool, name, tp):
    tokens = pool.run(encoder_checks.generate_matches, tp, name)
    assert all(t == tokens[0] for t in tokens[:tp])


@pytest.mark.parametrize("name", ["T5ForConditionalGeneration", "T5ForConditionalGeneration/v1.1"])
def test_t5_relative_bias_split_by_heads(pool, name):
    assert [r["local_heads"] for r in pool.run(encoder_checks.t5_relative_bias_and_ties, 2, name)] == [3, 3]
    reports = pool.run(encoder_checks.t5_relative_bias_and_ties, 4, name)
    assert [r["local_heads"] for r in reports] == [2, 2, 1, 1]
    # transformers 5 ties T5's LM head always; v1.1 only drops the output scaling.
    assert all(r["scale_decoder_outputs"] == (name == "T5ForConditionalGeneration") for r in reports)


@pytest.mark.parametrize("overrides", [
    dict(num_hidden_layers=3, num_hidden_groups=1, inner_group_num=1),
    dict(num_hidden_layers=4, num_hidden_groups=2, inner_group_num=2),
])
def test_albert_shared_layer_sharded_once(pool, overrides):
    reports = pool.run(encoder_checks.albert_shared_layer, 4, overrides)
    n = overrides["num_hidden_groups"] * overrides["inner_group_num"]
    assert [r["local_heads"] for r in reports] == [[h] * n for h in (2, 2, 1, 1)]


@pytest.mark.parametrize("name", ["WhisperForConditionalGeneration", "WhisperForAudioClassification"])
def test_whisper_front_end_replicated(pool, name):
    assert pool.run(encoder_checks.whisper_front_end, 4, name) == [2, 2, 1, 1]


def test_chatglm2_multi_query_layout(pool):
    # 6 query heads over 2 KV groups: at TP=2 one group per rank; at TP=4 each
    # group is replicated on two ranks that split its 3 query heads 2 + 1.
    assert pool.run(encoder_checks.chatglm2_layout, 2) == [
        {"heads": 3, "groups": 1, "q_start": 0, "kv_start": 0}, {"heads": 3, "groups": 1, "q_start": 3, "kv_start": 1}]
    assert pool.run(encoder_checks.chatglm2_layout, 4) == [
        {"heads": 2, "groups": 1, "q_start": 0, "kv_start": 0}, {"heads": 1, "groups": 1, "q_start": 2, "kv_start": 0},
        {"heads": 2, "groups": 1, "q_start": 3, "kv_start": 1}, {"heads": 1, "groups": 1, "q_start": 5, "kv_start": 1}]


@pytest.mark.parametrize("name, overrides, words", [
    ("T5ForConditionalGeneration", dict(num_heads=3), ["T5ForConditionalGeneration", "num_attention_heads=3",
                                                       "tensor_parallel_size=4"]),
    ("RobertaForMaskedLM", dict(num_attention_heads=3, hidden_size=48), ["RobertaForMaskedLM", "encoder.layer.0",
                                                                        "num_attention_heads=3"]),
    ("ChatGLMForConditionalGeneration", dict(multi_query_group_num=4),
     ["ChatGLMForConditionalGeneration", "transformer.encoder.layers.0", "num_key_value_heads=4"]),
])
def test_bad_config_raises_before_changes(pool, name, overrides, words):
    messages = pool.run(encoder_checks.bad_config_raises, 4, name, overrides)
    for w in words:
        assert w in messages[0], messages[0]


@pytest.mark.parametrize("name", ["RobertaForMaskedLM", "AlbertForPreTraining", "ErnieForMaskedLM",
                                  "T5ForConditionalGeneration/v1.1", "WhisperForConditionalGeneration",
                                  "ChatGLMForConditionalGeneration"])
def test_fused_normalization(pool, name):
    pool.run(encoder_checks.check_model, 2, name, {"enable_fused_normalization": True})


@pytest.mark.parametrize("name", ["RobertaForMaskedLM", "AlbertForPreTraining", "T5ForConditionalGeneration",
                                  "WhisperForConditionalGeneration", "ChatGLMForConditionalGeneration"])
def test_state_dict_round_trip(pool, name):
    pool.run(encoder_checks.state_dict_round_trip, 4, name)


@pytest.mark.parametrize("name", ["RobertaForMaskedLM", "T5ForConditionalGeneration",
                                  "WhisperForConditionalGeneration"])
def test_bf16_forward(pool, name):
    pool.run(encoder_checks.check_model, 2, name, None, "bfloat16")


def test_chatglm2_policy_found_by_bare_class_name():
    # Remote code lives in a per-checkpoint dynamic module; the registry's
    # bare class names match it wherever it was imported from.
    from shardformer.autopolicy import get_autopolicy

    model = encoders.build("ChatGLMForConditionalGeneration")
    assert type(model).__module__ == "zoo.chatglm2"
    assert type(get_autopolicy(model)).__name__ == "ChatGLMForConditionalGenerationPolicy"
    assert type(get_autopolicy(model.transformer)).__name__ == "ChatGLMModelPolicy"
