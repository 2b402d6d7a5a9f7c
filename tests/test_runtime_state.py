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


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("name", ["BertForMaskedLM", "LlamaForCausalLM"])
def test_gradient_checkpointing_same_gradients(pool, name, use_reentrant):
    pool.run(runtime_state.checkpointing_matches, 2, name, use_reentrant)


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
