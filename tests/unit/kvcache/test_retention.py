"""Retention holds (kvkeeper.kvcache.retention) in the block pool: a held prefix survives LRU pressure until its
deadline, within the share bound; an allocation is never refused because of holds; a hypothesis machine checks the
pool's invariants and that a live held block is evicted only when no unheld block is left.  Time is a fake clock."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvkeeper.kvcache.block_pool import BlockPool, NoFreeBlocksError
from kvkeeper.kvcache.namespace import Namespace
from kvkeeper.kvcache.retention import RetentionHolds

NS = Namespace("rev", tenant_salt="")
BS = 2


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def computed(pool: BlockPool, tokens: list[int], ns: Namespace = NS, allocate=None) -> list[int]:
    """A request's blocks for ``tokens`` as the engine leaves them: prefix hits taken, the rest allocated (by
    ``allocate``, default ``pool.allocate``) and registered; returns the block table (the caller frees it)."""
    allocate = allocate or pool.allocate
    table, parent = [], None
    for i in range(len(tokens) // BS):
        chunk = tokens[i * BS : (i + 1) * BS]
        bid, h = pool.lookup(parent, ns, chunk)
        if bid is None:
            bid = allocate(1)[0]
            pool.register(bid, parent, ns, chunk)
        else:
            pool.incref(bid)
        table.append(bid)
        parent = h
    return table


def cached_blocks(pool: BlockPool, tokens: list[int], ns: Namespace = NS) -> int:
    """How many leading full blocks of ``tokens`` the prefix cache holds."""
    parent, n = None, 0
    for i in range(len(tokens) // BS):
        bid, h = pool.lookup(parent, ns, tokens[i * BS : (i + 1) * BS])
        if bid is None:
            break
        parent, n = h, n + 1
    return n


def pressure(pool: BlockPool, rounds: int, start: int = 10_000) -> None:
    """Unrelated requests, each as large as the unheld blocks (all the pool's free blocks but the held ones),
    computed and freed ``rounds`` times."""
    for r in range(rounds):
        n = pool.num_free - pool.num_held_free
        pool.free_all(computed(pool, list(range(start + r * 1000, start + r * 1000 + n * BS))))


SYSTEM = list(range(8))  # 4 full blocks


def test_a_hold_keeps_its_prefix_through_lru_pressure_and_no_hold_does_not():
    held, plain = BlockPool(16, BS, hold_share=0.25, clock=Clock()), BlockPool(16, BS, hold_share=0.0, clock=Clock())
    for pool in (held, plain):
        pool.free_all(computed(pool, SYSTEM + [99, 98]))
    assert held.hold(NS, SYSTEM, 300) == 4 and plain.hold(NS, SYSTEM, 300) == 0  # share 0: holds off
    assert held.num_held_free == 4 and held.num_free == 16  # held blocks stay allocatable
    for pool in (held, plain):
        pressure(pool, 5)
        pool.check_invariants()
    assert cached_blocks(held, SYSTEM) == 4
    assert cached_blocks(plain, SYSTEM) == 0  # today's LRU evicted it
    assert held.holds.gave_way == 0 and held.holds.num_blocks == 4


def test_a_hold_placed_before_its_blocks_are_computed_holds_them_once_freed():
    pool = BlockPool(16, BS, hold_share=0.25, clock=Clock())
    pool.hold(NS, SYSTEM, 300)  # the route holds at admission, before the prefill
    table = computed(pool, SYSTEM)
    assert pool.num_held_free == 0
    pool.free_all(table)
    assert pool.num_held_free == 4
    pressure(pool, 4)
    assert cached_blocks(pool, SYSTEM) == 4


def test_expiry_releases_the_blocks_and_a_rerequest_renews():
    clock = Clock()
    pool = BlockPool(16, BS, hold_share=0.25, clock=clock)
    pool.free_all(computed(pool, SYSTEM))
    pool.hold(NS, SYSTEM, 300)
    clock.t += 200
    pool.hold(NS, SYSTEM, 300)  # renewed: the deadline is now t0 + 500
    clock.t += 250
    pressure(pool, 3)
    assert cached_blocks(pool, SYSTEM) == 4 and pool.holds.expired == 0
    clock.t += 51  # past the renewed deadline
    pressure(pool, 3)
    assert pool.holds.expired == 1 and pool.holds.num_blocks == 0 and pool.num_held_free == 0
    assert cached_blocks(pool, SYSTEM) == 0
    pool.check_invariants()


def test_a_longer_ttl_is_not_shortened_by_a_shorter_one():
    clock = Clock()
    pool = BlockPool(16, BS, hold_share=0.25, clock=clock)
    pool.hold(NS, SYSTEM, 3600)
    pool.hold(NS, SYSTEM, 300)
    clock.t += 1000
    pool.expire_holds()
    assert pool.holds.num_holds == 1 and pool.holds.expired == 0


def test_the_share_bound_displaces_the_oldest_hold_and_cuts_a_long_one():
    pool = BlockPool(16, BS, hold_share=0.25, clock=Clock())  # at most 4 blocks held
    a, b = list(range(100, 106)), list(range(200, 206))  # 3 blocks each
    for toks in (a, b):
        pool.free_all(computed(pool, toks))
    assert pool.hold(NS, a, 300) == 3
    assert pool.hold(NS, b, 300) == 3
    assert pool.holds.displaced == 1 and pool.holds.num_blocks == 3 and pool.num_held_free == 3
    assert pool.hold(NS, list(range(300, 320)), 300) == 4  # 10 blocks asked: the first 4 held
    assert pool.holds.num_blocks == 4 and pool.holds.displaced == 2
    pool.check_invariants()


def test_a_shared_prefix_counts_once_and_outlives_the_longer_hold():
    clock = Clock()
    pool = BlockPool(16, BS, hold_share=0.5, clock=clock)
    pool.free_all(computed(pool, SYSTEM + [50, 51, 52, 53]))
    pool.hold(NS, SYSTEM + [50, 51, 52, 53], 300)  # 6 blocks
    pool.hold(NS, SYSTEM, 3600)  # its first 4: no new block
    assert pool.holds.num_blocks == 6 and pool.holds.num_holds == 2
    clock.t += 301
    pressure(pool, 3)
    assert cached_blocks(pool, SYSTEM + [50, 51, 52, 53]) == 4  # the 1h hold's head stays, the tail went
    pool.check_invariants()


def test_allocation_is_never_refused_because_of_holds():
    pool = BlockPool(8, BS, hold_share=1.0, clock=Clock())
    toks = list(range(16))  # 8 blocks: the whole pool
    pool.free_all(computed(pool, toks))
    pool.hold(NS, toks, 3600)
    assert pool.num_held_free == 8 and pool.num_free == 8
    got = pool.allocate(8)
    assert len(got) == 8 and pool.holds.gave_way == 1 and pool.holds.num_holds == 0
    pool.check_invariants()
    with pytest.raises(NoFreeBlocksError):  # refused only for want of blocks
        pool.allocate(1)
    pool.free_all(got)


def test_the_oldest_hold_with_a_free_block_gives_way_first():
    pool = BlockPool(12, BS, hold_share=1.0, clock=Clock())
    a, b, c = list(range(100, 104)), list(range(200, 204)), list(range(300, 304))
    for toks in (a, b, c):
        pool.free_all(computed(pool, toks))
        pool.hold(NS, toks, 300)
    busy = computed(pool, a)  # a (the oldest) is in use: giving it up would free nothing
    pool.allocate(pool.num_free - pool.num_held_free + 1)
    assert cached_blocks(pool, b) < 2 and cached_blocks(pool, c) == 2
    assert pool.holds.gave_way == 1 and [h.hashes for h in pool.holds.holds()] == [
        tuple(pool.chain_hashes(NS, a)), tuple(pool.chain_hashes(NS, c))]
    pool.free_all(busy)
    pool.check_invariants()


def test_holds_off_and_reset():
    pool = BlockPool(8, BS, hold_share=0.0, clock=Clock())
    pool.free_all(computed(pool, SYSTEM))
    assert pool.hold(NS, SYSTEM, 300) == 0 and pool.num_held_free == 0
    pool = BlockPool(8, BS, hold_share=0.5, clock=Clock())
    pool.free_all(computed(pool, SYSTEM))
    pool.hold(NS, SYSTEM, 300)
    pool.reset_prefix_cache()
    assert pool.num_cached == 0 and pool.holds.num_holds == 0 and pool.num_free == 8
    pool.check_invariants()
    with pytest.raises(ValueError):
        BlockPool(8, BS, hold_share=1.5)
    with pytest.raises(ValueError):
        RetentionHolds(4).place([1], -1.0)


def test_the_hold_metrics_are_exported():
    from kvkeeper.api.engine_client.metrics import ServerMetrics

    m = ServerMetrics()
    m.update({"kv_held_blocks": 7, "kv_holds": 2, "kv_holds_expired": 3, "kv_holds_gave_way": 1,
              "kv_holds_displaced": 4})
    text = m.render().decode()
    for line in ("kvkeeper:kv_held_blocks 7.0", "kvkeeper:kv_holds 2.0", "kvkeeper:kv_holds_expired_total 3.0",
                 "kvkeeper:kv_holds_gave_way_total 1.0", "kvkeeper:kv_holds_displaced_total 4.0"):
        assert line in text, text


# ---- a hypothesis machine over allocate / free / register / hold / advance-clock ----------------------------

PREFIXES = [list(range(k * 100, k * 100 + 8)) for k in range(3)]  # shared heads (4 blocks each)


class HoldMachine(RuleBasedStateMachine):
    """Requests (a shared head plus a random tail, prefix hits taken) computed, kept or freed; holds placed on heads;
    the clock advanced; bare allocations.  After every step the pool's invariants hold; every allocation evicts a
    live held block only when the never-cached and unheld cached blocks could not meet it."""

    @initialize(share=st.sampled_from([0.25, 0.5, 1.0]), blocks=st.integers(6, 14))
    def start(self, share, blocks):
        self.clock = Clock()
        self.pool = BlockPool(blocks, BS, hold_share=share, clock=self.clock)
        self.tables: list[list[int]] = []

    def _unheld_supply(self) -> int:
        return len(self.pool._free_plain) + len(self.pool._free_cached)

    def _checked_allocate(self, n: int) -> list[int]:
        pool = self.pool
        pool.expire_holds()  # what allocate does first: the holds live now are the ones to respect
        held = {pool.blocks[b].hash for b in pool._free_held}
        supply = self._unheld_supply()
        out = pool.allocate(n)
        lost = [h for h in held if h not in pool._by_hash]
        assert not lost or supply < n, f"{len(lost)} held blocks evicted while {supply} unheld blocks met {n}"
        return out

    @precondition(lambda self: self.pool.num_free >= 6)
    @rule(head=st.integers(0, 2), tail=st.lists(st.integers(0, 3), max_size=4), keep=st.booleans())
    def request(self, head, tail, keep):
        pool = self.pool
        table = computed(pool, PREFIXES[head] + tail, allocate=self._checked_allocate)
        if keep:
            self.tables.append(table)
        else:
            pool.free_all(table)

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        self.pool.free_all(self.tables.pop(i % len(self.tables)))

    @rule(head=st.integers(0, 2), blocks=st.integers(1, 4), ttl=st.sampled_from([0.0, 300.0, 3600.0]))
    def hold(self, head, blocks, ttl):
        n = self.pool.hold(NS, PREFIXES[head][: blocks * BS], ttl)
        assert n == min(blocks, self.pool.holds.max_blocks)

    @rule(dt=st.sampled_from([1.0, 299.0, 301.0, 4000.0]))
    def advance(self, dt):
        self.clock.t += dt

    @precondition(lambda self: self.pool.num_free > 0)
    @rule(n=st.integers(1, 3))
    def bare(self, n):
        n = min(n, self.pool.num_free)
        self.pool.free_all(self._checked_allocate(n))  # a never-registered block: back to the plain list

    @rule(n=st.none() | st.integers(0, 3))
    def evict(self, n):
        self.pool.evict_cached(n)

    @invariant()
    def consistent(self):
        if hasattr(self, "pool"):
            self.pool.check_invariants()
            refs = [0] * self.pool.num_blocks
            for t in self.tables:
                for b in t:
                    refs[b] += 1
            assert [b.ref_count for b in self.pool.blocks] == refs, "refcounts are the kept tables' references"
            assert self.pool.holds.num_blocks <= self.pool.holds.max_blocks


TestHoldMachine = HoldMachine.TestCase
TestHoldMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])
