"""Parallel layers, region operators and collectives on 2 and 4 ranks."""
import pytest

from checks import layers


@pytest.mark.parametrize("tp", [2, 4])
def test_dropout_masks(pool, tp):
    pool.run(layers.dropout_masks, tp)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("vocab", [37, 40])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_1d(pool, tp, vocab, smoothing, reduction):
    pool.run(layers.cross_entropy_matches, tp, vocab, smoothing, reduction)


def test_cross_entropy_1d_single_process():
    import types

    ctx = types.SimpleNamespace(rank=0, tp_size=1, group=None)
    layers.cross_entropy_matches(ctx, 37, 0.1, "mean")


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_gather_scatter_layouts(pool, tp):
    pool.run(layers.mappings_round_trip, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_collectives(pool, tp):
    pool.run(layers.collectives_match, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_region_operators(pool, tp):
    pool.run(layers.sequence_region_pair, tp)
