"""Fragmentation figures of the block pool, against hand-computed values, and their sliding windows."""

from types import SimpleNamespace

import pytest

from kvkeeper.kvcache.block_pool import BlockPool
from kvkeeper.kvcache.namespace import Namespace
from kvkeeper.kvcache.telemetry import FragmentationMonitor, pool_stats


def owner(table, kv_tokens):
    return SimpleNamespace(block_table=table, num_computed=kv_tokens, kv_offset=0)


def test_empty_pool_has_no_fragmentation():
    s = pool_stats(BlockPool(8, 4))
    assert (s.free, s.cached, s.owned) == (8, 0, 0)
    assert s.internal == s.external == s.pool_rate == s.usage == 0.0


def test_hand_computed_figures():
    pool = BlockPool(10, 4)
    a = pool.allocate(3)  # blocks 0,1,2
    b = pool.allocate(3)  # 3,4,5
    c = pool.allocate(2)  # 6,7
    pool.free_all(b)      # 3,4,5 free again
    # owners: a holds 9 tokens (2 full blocks + 1 slot), c holds 5 tokens (1 full + 1 slot)
    s = pool_stats(pool, [("a", owner(a, 9)), ("c", owner(c, 5))])
    assert (s.owned, s.free, s.cached) == (5, 5, 0)
    assert s.owned_slots == 20 and s.used_slots == 14
    assert s.internal == pytest.approx(6 / 20)
    # free ids: 3,4,5,8,9 -> longest run 3 of 5
    assert s.largest_free_run == 3 and s.external == pytest.approx(1 - 3 / 5)
    # owned ids: 0,1,2,6,7 -> longest run 3 of 5
    assert s.largest_owned_run == 3 and s.pool_rate == pytest.approx((5 - 3) / 5)
    assert s.usage == pytest.approx(0.5)


def test_cached_blocks_count_as_free_runs_and_shared_blocks_once():
    pool = BlockPool(4, 2)
    ns = Namespace("rev")
    x = pool.allocate(2)
    pool.register(x[0], None, ns, [1, 2])
    y = pool.fork([x[0]])  # a second owner of the full first block
    pool.free(x[1])
    pool.free(x[0])  # x's owner left; y still holds block 0
    s = pool_stats(pool, [("y", owner(y, 2))])
    assert (s.owned, s.cached, s.free) == (1, 0, 3)
    pool.free(y[0])
    s = pool_stats(pool)
    assert (s.owned, s.cached, s.free) == (0, 1, 3)
    assert s.external == 0.0  # cached + free blocks form one run


def test_windows_average_recent_samples():
    t = [0.0]
    mon = FragmentationMonitor(clock=lambda: t[0])
    pool = BlockPool(4, 2)
    mon.record(pool_stats(pool))  # usage 0 at t=0
    pool.allocate(2)
    t[0] = 30.0
    mon.record(pool_stats(pool))  # usage 0.5 at t=30
    t[0] = 30.5
    w = mon.windows()
    assert set(w) == {"1s", "10s", "60s"}
    assert w["1s"]["usage"] == pytest.approx(0.5)
    assert w["60s"]["usage"] == pytest.approx(0.25)
    t[0] = 100.0  # nothing new for 70 s: the latest sample still describes the pool
    assert mon.window(1.0)["usage"] == pytest.approx(0.5)
    mon.record(pool_stats(pool))
    assert len(mon.samples) == 1  # older than the longest window: dropped
    with pytest.raises(ValueError):
        FragmentationMonitor(windows_s=(0,))
