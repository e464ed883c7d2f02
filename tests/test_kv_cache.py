"""`KVCache`: one stacked array or separate buffers move a kept path the same way."""

from __future__ import annotations

import numpy as np

from specx.runtime.kv_cache import KVCache


def _filled(rng) -> KVCache:
    cache = KVCache.allocate(3, 2, 2, 12, 4, spare_slots=1)
    cache.stacked[:] = rng.standard_normal(cache.stacked.shape)
    return cache


def test_keep_path_moves_only_the_path_in_every_layer(rng):
    stacked = _filled(rng)
    separate = KVCache([k.copy() for k in stacked.keys], [v.copy() for v in stacked.values],
                       stacked.lengths.copy())  # fmt: skip
    before = stacked.stacked.copy()
    nodes = np.array([0, 2, 3, 7])
    for cache in (stacked, separate):
        cache.keep_path(1, 4, nodes)
    expected = before.copy()
    expected[:, 1, :, 4 + np.arange(4)] = before[:, 1, :, 4 + nodes]
    np.testing.assert_array_equal(stacked.stacked, expected)
    np.testing.assert_array_equal(np.stack(separate.keys + separate.values), expected)
    assert stacked.keys[0].base is not None  # the layers are views of the stacked array


def test_row_views_write_into_the_batch(rng):
    cache = _filled(rng)
    row = cache.row(1)
    assert row.batch == 1 and row.capacity == 12 and row.stacked.shape[1] == 1
    row.keys[2][0, :, 5] = 7.0
    row.keep_path(0, 3, np.array([0, 2]))  # slot 5 -> slot 4, through the view
    assert (cache.keys[2][1, :, 4] == 7.0).all() and (cache.keys[2][0, :, 4] != 7.0).all()
    assert cache.rows(0, 2).stacked.shape == cache.stacked.shape
