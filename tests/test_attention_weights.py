"""output_attentions=True on a tensor-parallel model returns the weights of
every head, as the unsharded model does (each rank computes only its heads;
the attention gathers them).  Eager attention, eval mode, at TP=2 and 4
(6 heads: 2,2,1,1 at TP=4)."""
import pytest

import zoo
from checks import attention_weights


def _one_per_family() -> list[str]:
    # the zoo's ChatGLM2 takes no output_attentions argument
    names = [classes[0] for family, classes in sorted(zoo.family_classes().items()) if family != "chatglm2"]
    return names + ["T5ForConditionalGeneration", "WhisperForConditionalGeneration"]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", _one_per_family())
def test_weights_of_every_head(pool, name, tp):
    result = pool.run(attention_weights.weights_of_every_head, tp, name)[0]
    assert result["gathering_modules"] > 0 and result["tensors"] > 0, result


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "BertForMaskedLM"])
def test_weights_gradient(pool, name, tp):
    pool.run(attention_weights.weights_gradient, tp, name)
