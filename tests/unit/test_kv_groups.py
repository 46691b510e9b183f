"""KV cache groups: every layer in exactly one group, every group the same size, one kind per
group, layers in order; a one-kind model keeps one group of all its layers."""

from __future__ import annotations

import itertools

import pytest

from kvbridge.engine.models import kv_cache_shape
from kvbridge.shape.kv_groups import KVCacheKind, layer_groups, layer_slots, slots_per_block
from kvbridge.shape.model_config import ModelArchConfig, ModelFamily

F, S = "full_attention", "sliding_attention"


def arch(types: tuple[str, ...] | None, window: int | None = 8) -> ModelArchConfig:
    n = len(types) if types else 3
    return ModelArchConfig(ModelFamily.QWEN2, 32, 16, 32, n, 4, 2, 4, layer_types=types,
                           sliding_window=window if types and S in types else None)


@pytest.mark.parametrize("types", [t for n in range(1, 7) for t in itertools.product((F, S), repeat=n)])
def test_groups_partition_the_layers_in_equal_single_kind_groups(types):
    a = arch(types)
    groups = layer_groups(a)
    sizes = {len(g.layer_ids) for g in groups}
    assert len(sizes) == 1 and slots_per_block(a) == sizes.pop()
    assert sorted(layer for g in groups for layer in g.layer_ids) == list(range(len(types)))
    for g in groups:
        assert list(g.layer_ids) == sorted(g.layer_ids)
        want = KVCacheKind.SLIDING_WINDOW if types[g.layer_ids[0]] == S else KVCacheKind.FULL_ATTENTION
        assert all((types[layer] == S) == (want is KVCacheKind.SLIDING_WINDOW) for layer in g.layer_ids)
        assert g.kind is want and g.sliding_window == (8 if want is KVCacheKind.SLIDING_WINDOW else None)
    assert [g.layer_ids[0] for g in groups] == sorted(g.layer_ids[0] for g in groups)
    slots = layer_slots(groups, len(types))
    assert all(groups[gi].layer_ids[slot] == layer for layer, (gi, slot) in enumerate(slots))
    # A block holds one slot per layer of a group: fewer layers' KV than the model has, when mixed.
    assert kv_cache_shape(a, 10, 4)[2] == slots_per_block(a)
    if len(set(types)) == 1:
        assert len(groups) == 1


def test_examples():
    assert [g.layer_ids for g in layer_groups(arch((F, F, S, S, S, S)))] == [(0, 1), (2, 3), (4, 5)]
    assert [g.layer_ids for g in layer_groups(arch((F, S, F, S)))] == [(0, 2), (1, 3)]
    assert [g.layer_ids for g in layer_groups(arch(None))] == [(0, 1, 2)]
    with pytest.raises(ValueError, match="sliding_window"):
        arch((F, S), window=None)
