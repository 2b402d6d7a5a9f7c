"""A sharded model keeps the run-time state of the model it came from:
eval() before optimize() stays eval with every dropout > 0 (each
family, every class the zoos build, TP=2; the first class of each at TP=4),
train()/eval() after optimize() reach every module, frozen parameters stay
frozen, hooks move to the parallel layers, HF's init flags survive, gradient
checkpointing recomputes the same dropout masks, and a patched forward is
refused before anything changes."""
import pytest

import zoo
from checks import runtime_state

FAMILIES = zoo.family_classes()


def test_every_family_has_a_zoo_class():
    from shardformer.autopolicy import registry

    families = {family for family, _ in registry().values()}
    assert families == set(FAMILIES), sorted(families ^ set(FAMILIES))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_eval_before_optimize_tp2(pool, family):
    reports = pool.run(runtime_state.eval_matches, 2, FAMILIES[family])
    assert set(reports[0]) == set(FAMILIES[family])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_eval_before_optimize_tp4(pool, family):
    pool.run(runtime_state.eval_matches, 4, FAMILIES[family][:1])


@pytest.mark.parametrize("name", ["BertForMaskedLM", "GPT2LMHeadModel", "LlamaForCausalLM", "T5ForConditionalGeneration"])
def test_train_eval_after_optimize(pool, name):
    pool.run(runtime_state.train_eval_follow, 2, name)


@pytest.mark.parametrize("tp", [2, 4])
def test_frozen_parameters_stay_frozen(pool, tp):
    reports = pool.run(runtime_state.frozen_stay_frozen, tp)
    assert "model.embed_tokens.weight" in reports[0]["frozen"]


def test_forward_hooks_move_to_parallel_layer(pool):
    assert pool.run(runtime_state.hooks_carried, 2)[0]["calls"] == 1


def test_hf_initialized_flags_carried(pool):
    pool.run(runtime_state.hf_flags_carried, 2)


def test_patched_forward_refused_before_changes(pool):
    msg = pool.run(runtime_state.patched_forward_refused, 2)[0]["message"]
    assert "patched on the instance" in msg


def _checkpointable() -> list[str]:
    """One class per family whose HF model supports gradient checkpointing
    (ALBERT and the zoo's ChatGLM2 do not)."""
    import zoo

    return [classes[0] for family, classes in sorted(zoo.family_classes().items())
            if family not in ("albert", "chatglm2")]


@pytest.mark.parametrize("name", _checkpointable())
def test_gradient_checkpointing_same_gradients(pool, name):
    """Every family, non-reentrant checkpointing: the recomputed layers draw
    the first forward's masks again, also where a module runs twice per layer
    (Swin's, BEiT's, ViT's) and checkpoints nest (Swin's stages and blocks)."""
    pool.run(runtime_state.checkpointing_matches, 2, name, False)


@pytest.mark.parametrize("name", ["BertForMaskedLM", "LlamaForCausalLM", "ViTForImageClassification",
                                  "SwinForImageClassification", "Blip2ForConditionalGeneration"])
def test_gradient_checkpointing_reentrant_same_gradients(pool, name):
    pool.run(runtime_state.checkpointing_matches, 2, name, True)


@pytest.mark.parametrize("name", ["ViTForImageClassification", "SwinForImageClassification"])
def test_gradient_checkpointing_same_gradients_tp4(pool, name):
    pool.run(runtime_state.checkpointing_matches, 4, name, False)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", _checkpointable() + ["AlbertForMaskedLM"])
def test_ranks_agree_in_training_with_dropout(pool, name, tp):
    pool.run(runtime_state.ranks_agree_in_training, tp, name)


def test_recompute_without_rng_state_refused(pool):
    msg = pool.run(runtime_state.recompute_without_rng_state_refused, 2, "ViTForImageClassification")[0]["message"]
    assert "preserve_rng_state" in msg


@pytest.mark.parametrize("tp", [2, 4])
def test_layerdrop_same_layers_on_every_rank(pool, tp):
    pool.run(runtime_state.layerdrop_ranks_agree, tp, "OPTForCausalLM", True)


def test_layerdrop_refused_when_ranks_seeded_differently(pool):
    msg = pool.run(runtime_state.layerdrop_ranks_agree, 2, "OPTForCausalLM", False)[0]["message"]
    assert "OPTForCausalLM" in msg and "model.decoder" in msg


def test_modules_added_by_postprocess_follow_their_parent():
    """A module a policy's postprocess creates (no module it replaces) takes
    its parent's training flag; replaced ones take the replaced module's,
    even when the user left parts of the model in different modes."""
    import torch

    from zoo.custom import ToyModel, ToyPolicy
    from shardformer import ShardConfig, ShardFormer

    class AddsADropout(ToyPolicy):
        def postprocess(self):
            self.model.blocks[0].extra = torch.nn.Dropout(0.5)   # new, under an eval parent
            self.model.extra = torch.nn.Dropout(0.5)             # new, under the train root
            return self.model

    torch.manual_seed(0)
    model = ToyModel()
    model.blocks[0].eval()                                       # mixed modes, as a user may leave them
    ShardFormer(ShardConfig()).optimize(model, policy=AddsADropout())
    assert model.training and model.extra.training
    assert not model.blocks[0].training and not model.blocks[0].extra.training
    assert not model.blocks[0].fc1.training and model.blocks[1].fc1.training
    assert type(model.blocks[0].fc1).__name__ == "Linear1D_Col"
