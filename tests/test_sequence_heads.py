"""Every head class of every family, in each sequence-parallel mode the family
takes: the classes the per-class tests (tests/test_sequence_parallel*.py,
tests/test_sequence_attention.py) do not already run, equal to the unsharded
model from the same seed (forward, loss, every gradient, after an optimizer
step) at TP=2 (split_gather) or SP=2 (all_to_all, ring_attn) with the plain
ShardConfig(), 7 tokens (padded to 8 inside).  One pool call per (family,
mode) checks all of that family's classes in turn (checks/sequence_heads.py);
the class names are in the test id, so docs/supported-models.md counts each
(scripts/support_matrix.py).  The per-class tests keep the explicit groups,
TP=4 and the odd lengths.

The classes a mode refuses by name are listed in REFUSED with the reason (the
support matrix's footnote says the same); their refusal is tested where the
family's other tests are."""
import pytest

import test_sequence_attention as attention
import test_sequence_parallel as split_gather
import test_sequence_parallel_mm as mm
import test_sequence_parallel_more as more
import zoo
from checks import sequence_heads

MODES = ("split_gather", "all_to_all", "ring_attn")


def _base(names) -> set:
    """The zoo names of a test's parameter list ((name, ...) tuples -> name).  A "Class/variant" stays as it
    is: its test id does not count for Class in the support matrix, so Class is run here as well."""
    return {n if isinstance(n, str) else n[0] for n in names}


# the classes each mode's per-class tests already run (the test ids the support matrix counts)
COVERED = {
    "split_gather": _base(split_gather.FAMILIES) | _base(["ViTForImageClassification", "ViTModel",
                                                          "ViTForMaskedImageModeling"])
    | _base(more.CASES) | _base(more.VISION) | _base(mm.SPLIT_GATHER) | _base(mm.BLIP2_PARTS),
    "all_to_all": _base(attention.FAMILIES + attention.OTHER_FAMILIES + attention.ALBERT + attention.WHISPER
                        + attention.T5 + attention.SEAM_FAMILIES + attention.ALIBI_FAMILIES) | _base(mm.ALL_TO_ALL),
    "ring_attn": _base(attention.FAMILIES + attention.OTHER_FAMILIES + attention.ALBERT + attention.WHISPER
                       + attention.T5 + attention.SEAM_FAMILIES + attention.ALIBI_FAMILIES) | _base(mm.RING),
}

# (family, mode) -> why the mode refuses those classes (None: every class of the family)
REFUSED = {
    **{("blip2", m): "the classes without a language model (vision, Q-Former, retrieval) have no language model's "
                     "sequence to split (split_gather splits their vision encoder and Q-Former)"
       for m in ("all_to_all", "ring_attn")},
    **{(f, m): "attention outside transformers' AttentionInterface with a bias on the [S, S] scores "
               "(relative positions, windows) that all_to_all / ring_attn never build"
       for f in ("beit", "swin", "swinv2", "sam") for m in ("all_to_all", "ring_attn")},
}
REFUSED_CLASSES = {("blip2", m): {"Blip2ForImageTextRetrieval", "Blip2QFormerModel", "Blip2TextModelWithProjection",
                                  "Blip2VisionModel", "Blip2VisionModelWithProjection"}
                   for m in ("all_to_all", "ring_attn")}
REFUSED_CLASSES[("gemma3", "ring_attn")] = {"Gemma3ForConditionalGeneration", "Gemma3Model",
                                            "Gemma3ForSequenceClassification"}


def cases() -> list:
    """(family, mode, the family's classes no per-class test of the mode runs), those not refused."""
    out = []
    for mode in MODES:
        for family, classes in zoo.family_classes().items():
            if (family, mode) in REFUSED and (family, mode) not in REFUSED_CLASSES:
                continue
            left = [c for c in classes if c not in COVERED[mode] and c not in REFUSED_CLASSES.get((family, mode), ())]
            if left:
                out.append((family, mode, left))
    return out


CASES = cases()


def _ids(mode: str) -> list:
    return [pytest.param(family, names, id="-".join([family, *names])) for family, m, names in CASES if m == mode]


# One test function per mode, named as the support matrix's columns read them (scripts/support_matrix.py FEATURES).
@pytest.mark.parametrize("family,names", _ids("split_gather"))
def test_sp_equals_unsharded(pool2, family, names):
    assert set(pool2.run(sequence_heads.heads_equal_unsharded, 2, "split_gather", names)[0]) == set(names)


@pytest.mark.parametrize("family,names", _ids("all_to_all"))
def test_all_to_all_equals_unsharded(pool2, family, names):
    assert set(pool2.run(sequence_heads.heads_equal_unsharded, 2, "all_to_all", names)[0]) == set(names)


@pytest.mark.parametrize("family,names", _ids("ring_attn"))
def test_ring_attn_equals_unsharded(pool2, family, names):
    assert set(pool2.run(sequence_heads.heads_equal_unsharded, 2, "ring_attn", names)[0]) == set(names)
