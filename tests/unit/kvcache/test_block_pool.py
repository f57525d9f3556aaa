"""Property tests for the KV block pool, the prefix cache and KVCacheManager.

A hypothesis state machine drives a small pool through any interleaving of
new sequence (prefix match + allocate), step / append (allocate + compute +
commit), compress (a session's KV compressed at the end of a turn: a subset of its entries copied into fresh
blocks, the old ones released, ``kv_offset`` set; later tokens appended after them), speculate (a decode row verifying drafts: allocate, compute, keep the
accepted drafts, give back the rest), fork (sharing full blocks), pin / unpin (an extra owner holding every
computed block, the partial one included), free, truncate, evict,
over-allocation and double free, and checks after every step that:

* refcounts are never negative and equal the number of owners holding a block;
* no block is both free and referenced; free + used == total;
  ``pool.check_invariants()`` passes;
* a prefix hit is never served from another namespace, and only returns blocks
  whose stored token ids equal the query's, in chain order (checked against a
  shadow model of the KV each block really holds, which also catches a block
  being handed out for writing while shared or cached);
* never-cached free blocks are allocated before cached ones, and cached free
  blocks are evicted least recently freed first;
* freeing every owner returns every block to the free list.

The machine runs three times: with the real hash (where it also predicts the
exact prefix hits: the cache must not lose hits), with a hash that ignores the
namespace, and with a 4-bit hash — in the last two, collisions are frequent,
so only the pool's own namespace / token comparison stands between a query
and foreign KV.  With the 4-bit hash a whole *chain* can collide (same block
tokens under another parent, even the same block twice in one table): the
pool compares parent hashes, but a 4-bit parent hash collides as well, so there only each hit block's own namespace
and tokens are checked, not its position or prefix.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from unittest import mock

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvkeeper.sampling.params import SamplingParams
from kvkeeper.engine.sequence import Sequence
from kvkeeper.kvcache import block_pool as block_pool_mod
from kvkeeper.kvcache.block_pool import BlockPool, NoFreeBlocksError, block_hash
from kvkeeper.kvcache.manager import KVCacheManager
from kvkeeper.kvcache.namespace import Namespace

BASE = Namespace("rev-a")
NAMESPACES = [
    BASE,
    Namespace("rev-b"),  # other weights
    Namespace("rev-a", adapter="lora-1"),  # other adapter
    Namespace("rev-a", tenant_salt="tenant-1"),  # other tenant
]
OTHER_NAMESPACES = NAMESPACES[1:] + [Namespace("rev-a", kv_dtype="fp8")]
TOKENS = st.integers(0, 2)  # a tiny alphabet so that prefixes are shared often
INDEX = st.integers(0, 10**6)

_BLIND = Namespace("blind")


def _ns_blind_hash(parent, namespace, token_ids):
    """Chained hash that ignores the namespace: identical tokens collide across namespaces."""
    return block_hash(parent, _BLIND, token_ids)


def _tiny_hash(parent, namespace, token_ids):
    """A 4-bit hash: different tokens (and chains) collide all the time."""
    return block_hash(parent, _BLIND, token_ids) % 16


def _constant_hash(parent, namespace, token_ids):
    return 7


_req_ids = itertools.count()


def make_seq(tokens, namespace=BASE) -> Sequence:
    return Sequence(f"req-{next(_req_ids)}", list(tokens), SamplingParams(), namespace)


def snapshot(pool: BlockPool):
    """Everything observable about the pool's state (to check that a failed call changed nothing)."""
    return (
        [(b.ref_count, b.hash, b.token_ids, b.namespace) for b in pool.blocks],
        list(pool._free_plain),
        list(pool._free_cached),
        dict(pool._by_hash),
        pool.evictions,
    )


def run_prompt(kv: KVCacheManager, seq: Sequence) -> int:
    """Admit a sequence like the scheduler does: prefix match, allocate, compute everything, commit."""
    hit = kv.match_prefix(seq)
    assert kv.allocate(seq, seq.num_uncomputed)
    seq.num_computed = len(seq.token_ids)
    kv.commit(seq)
    return hit


# ---------------------------------------------------------------------------
# the state machine
# ---------------------------------------------------------------------------


class PoolMachine(RuleBasedStateMachine):
    """Several sequences sharing one small pool; a shadow model of refcounts, cache contents, LRU order and KV."""

    MODE = "exact"  # "exact": real hash | "ns_blind" | "tiny": colliding hashes (patched in by the test)

    def __init__(self):
        super().__init__()
        self.pool: BlockPool | None = None
        self.bs = 1
        self.seqs: list[Sequence] = []
        # extra reference holders (a session pin, a snapshot): (blocks, [(block, slot, KV it must keep)])
        self.pins: list[tuple[list[int], list[tuple]]] = []
        self.history: list[tuple[Namespace, list[int]]] = []
        self.kept: dict[int, list[int]] = {}  # compressed sequence (seq_id) -> the token position of each KV slot

    # ---- set-up ------------------------------------------------------------
    @initialize(num_blocks=st.integers(4, 24), block_size=st.integers(1, 8))
    def make_pool(self, num_blocks, block_size):
        self.pool = BlockPool(num_blocks, block_size)
        self.kv = KVCacheManager(self.pool)
        self.bs = block_size
        # what each slot really holds: (namespace, token ids up to and including that position) or None
        self.content = {bid: [None] * block_size for bid in range(num_blocks)}
        self.bid_key: dict[int, tuple] = {}  # registered block -> (namespace, token prefix through its end)
        self.cache: dict[tuple, int] = {}  # exact mode: predicted key -> block
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached free blocks, least recently freed first

    # ---- model helpers -------------------------------------------------------
    @property
    def exact(self) -> bool:
        return self.MODE == "exact"

    @property
    def full_identity(self) -> bool:
        # with a 4-bit hash a *chain* can collide (same block tokens, other parent); the pool only
        # promises that each hit block's own namespace and tokens are the query's
        return self.MODE != "tiny"

    def refs(self) -> Counter:
        c = Counter()
        for s in self.seqs:
            c.update(s.block_table)
        for blocks, _ in self.pins:
            c.update(blocks)
        return c

    def can_write(self, seq) -> bool:
        """False while the partial block the sequence would write next is shared (there is no copy-on-write)."""
        nc, bs = seq.num_computed - seq.kv_offset, self.bs
        return not (nc % bs and self.pool.blocks[seq.block_table[nc // bs]].ref_count > 1)

    def key(self, seq, i):
        return (seq.namespace, tuple(seq.token_ids[: (i + 1) * self.bs]))

    def identity_ok(self, got, namespace, prefix) -> bool:
        if got is None:
            return False
        if self.full_identity:
            return got == (namespace, prefix)
        return got[0] == namespace and got[1][-1] == prefix[-1]

    def forget(self, bid):
        """The block was evicted from the prefix cache."""
        key = self.bid_key.pop(bid)
        if self.exact:
            assert self.cache.pop(key) == bid
        self.lru.pop(bid, None)

    def released(self, bids):
        """Blocks given up by one owner, in block-table order; the pool frees them tail first."""
        refs = self.refs()
        for b in reversed(list(bids)):
            if refs[b] == 0 and b in self.bid_key:
                # (a block twice in one table, possible only after a chain collision, joins at its last free)
                self.lru.pop(b, None)
                self.lru[b] = None

    def alloc(self, seq, n) -> bool:
        """manager.allocate, checking the all-or-nothing contract and which blocks it takes."""
        pool, bs = self.pool, self.bs
        refs = self.refs()
        need = max(0, -(-(seq.num_computed - seq.kv_offset + n) // bs) - len(seq.block_table))
        assert self.kv.blocks_needed(seq, n) == need
        free_before = pool.num_free
        assert free_before == sum(1 for b in range(pool.num_blocks) if refs[b] == 0)
        before, old_bt, lru_before = snapshot(pool), list(seq.block_table), list(self.lru)
        ok = self.kv.allocate(seq, n)
        if need > free_before:
            assert not ok, "allocate succeeded with too few free blocks"
            assert snapshot(pool) == before, "a failed allocate changed the pool"
            assert seq.block_table == old_bt
            return False
        assert ok, f"allocate failed: needs {need}, {free_before} free"
        new = seq.block_table[len(old_bt) :]
        assert seq.block_table[: len(old_bt)] == old_bt
        assert len(new) == need == len(set(new))
        assert all(refs[b] == 0 for b in new), "allocated a referenced block"
        n_plain = min(need, free_before - len(lru_before))
        n_evict = need - n_plain
        assert all(b not in self.bid_key for b in new[:n_plain]), "used a cached block while never-cached ones were free"
        assert new[n_plain:] == lru_before[:n_evict], "cached blocks not evicted least recently freed first"
        assert pool.evictions == before[4] + n_evict
        for b in new[n_plain:]:
            self.forget(b)
        assert all(pool.blocks[b].ref_count == 1 for b in new)
        return True

    def compute(self, seq, n):
        """The model writes K/V for the next n tokens, then the engine commits full blocks."""
        bs = self.bs
        off = seq.kv_offset  # compressed: position p goes to slot p - off
        for p in range(seq.num_computed, seq.num_computed + n):
            bid = seq.block_table[(p - off) // bs]
            b = self.pool.blocks[bid]
            assert b.ref_count == 1 and b.hash is None, (
                f"position {p} would be written into block {bid} (refcount {b.ref_count}, "
                f"cached {b.hash is not None}): shared or cached KV would be overwritten"
            )
            self.content[bid][(p - off) % bs] = (seq.namespace, tuple(seq.token_ids[: p + 1]))
            if off:
                self.kept[seq.seq_id].append(p)
        seq.num_computed += n
        self.commit(seq)

    def commit(self, seq):
        """manager.commit: the blocks that became full and computed are registered (the shadow cache with them)."""
        if seq.kv_offset:  # compressed KV never enters the prefix cache
            self.kv.commit(seq)
            assert seq.block_hashes == []
            return
        start, full = len(seq.block_hashes), seq.num_computed // self.bs
        for i in range(start, full):
            assert seq.block_table[i] not in self.bid_key
        self.kv.commit(seq)
        assert len(seq.block_hashes) == full
        for i in range(start, full):
            bid, key = seq.block_table[i], self.key(seq, i)
            registered = self.pool.blocks[bid].hash is not None
            if self.exact:
                if key in self.cache:
                    assert not registered, "a second block registered for a key already cached"
                else:
                    assert registered, "a full computed block was not cached"
                    self.cache[key] = bid
                    self.bid_key[bid] = key
            elif registered:
                self.bid_key[bid] = key

    def free_seq(self, seq):
        pool = self.pool
        released = list(seq.block_table)
        before = {b: pool.blocks[b].ref_count for b in released}
        self.kv.free(seq)
        self.kept.pop(seq.seq_id, None)
        assert seq.kv_offset == 0
        self.seqs = [s for s in self.seqs if s is not seq]
        assert seq.block_table == [] and seq.block_hashes == [] and seq.num_computed == 0
        for b, k in Counter(released).items():
            assert pool.blocks[b].ref_count == before[b] - k
        self.released(released)
        self.history.append((seq.namespace, list(seq.token_ids)))

    def pick(self, i, pred=lambda s: True):
        cands = [s for s in self.seqs if pred(s)]
        return cands[i % len(cands)]

    # ---- rules ---------------------------------------------------------------
    @rule(
        ns=st.integers(0, len(NAMESPACES) - 1),
        reuse=INDEX,
        same_ns=st.booleans(),
        cut=st.integers(0, 40),
        suffix=st.lists(TOKENS, max_size=12),
        chunk=st.integers(1, 64),
    )
    def new_seq(self, ns, reuse, same_ns, cut, suffix, chunk):
        pool, bs = self.pool, self.bs
        namespace = NAMESPACES[ns]
        base = []
        if self.history and reuse % 4:  # mostly start from an earlier sequence's tokens
            h_ns, h_tokens = self.history[reuse % len(self.history)]
            base = h_tokens[:cut]
            if same_ns:
                namespace = h_ns
        tokens = (base + suffix) or [0]
        seq = make_seq(tokens, namespace)
        self.history.append((namespace, list(tokens)))

        refs = self.refs()
        hit = self.kv.match_prefix(seq)
        bt = seq.block_table
        assert hit == seq.num_computed == len(bt) * bs
        assert len(seq.block_hashes) == len(bt)
        limit = (len(tokens) - 1) // bs
        assert len(bt) <= limit, "prefix match left no token to compute"
        if self.full_identity:
            assert len(set(bt)) == len(bt), f"one block hit twice: {bt}"
        hits = Counter(bt)
        for i, bid in enumerate(bt):
            b = pool.blocks[bid]
            assert b.ref_count == refs[bid] + hits[bid]
            assert b.namespace == namespace, f"hit block {bid} from namespace {b.namespace}, query {namespace}"
            assert b.token_ids == tuple(tokens[i * bs : (i + 1) * bs]), f"hit block {bid} holds other tokens"
            assert b.hash == seq.block_hashes[i]
            for o in range(bs):
                assert self.identity_ok(self.content[bid][o], namespace, tuple(tokens[: i * bs + o + 1])), (
                    f"block {bid} (hit {i}) really holds {self.content[bid][o]}"
                )
            self.lru.pop(bid, None)
        if self.exact:
            expected = []
            for i in range(limit):
                b = self.cache.get(self.key(seq, i))
                if b is None:
                    break
                expected.append(b)
            assert bt == expected, f"prefix match {bt}, cache holds the chain {expected}"
        self.seqs.append(seq)
        n = min(chunk, seq.num_uncomputed)
        if not self.alloc(seq, n):
            self.free_seq(seq)  # like the scheduler: do not hold prefix hits while waiting
            return
        self.compute(seq, n)

    @precondition(lambda self: any(s.num_uncomputed for s in self.seqs))
    @rule(i=INDEX, chunk=st.integers(1, 64))
    def step(self, i, chunk):
        seq = self.pick(i, lambda s: s.num_uncomputed > 0)
        n = min(chunk, seq.num_uncomputed)
        if self.can_write(seq) and self.alloc(seq, n):
            self.compute(seq, n)

    @precondition(lambda self: self.seqs)
    @rule(i=INDEX, new=st.lists(TOKENS, min_size=1, max_size=10), chunk=st.integers(0, 64))
    def append(self, i, new, chunk):
        seq = self.pick(i)
        seq.token_ids.extend(new)
        n = min(chunk, seq.num_uncomputed)
        if n and self.can_write(seq) and self.alloc(seq, n):
            self.compute(seq, n)

    @precondition(lambda self: any(s.num_uncomputed == 1 and not s.kv_offset for s in self.seqs))
    @rule(i=INDEX, drafts=st.lists(TOKENS, min_size=1, max_size=9), accepted=st.integers(0, 9), bonus=TOKENS)
    def speculate(self, i, drafts, accepted, bonus):
        """A decode row verifying draft tokens, as the engine runs it (speculative decoding): blocks for the last
        token and the drafts, K/V written for all of them (the drafts' slots hold the drafts' prefixes), the last
        token counted; then ``accepted`` drafts and one token that differs from the next draft (or a bonus token)
        are appended, only the accepted drafts' K/V counted, and the blocks past it given back
        (``trim_to_computed``).  The invariants then check that no rejected draft's K/V is counted, cached or
        left in a block nobody owns."""
        pool, bs = self.pool, self.bs
        seq = self.pick(i, lambda s: s.num_uncomputed == 1 and not s.kv_offset)
        if not self.can_write(seq) or not self.alloc(seq, 1 + len(drafts)):
            return
        c, written = seq.num_computed, seq.token_ids + drafts
        for p in range(c, c + 1 + len(drafts)):
            bid = seq.block_table[p // bs]
            assert pool.blocks[bid].ref_count == 1 and pool.blocks[bid].hash is None, f"draft K/V into block {bid}"
            self.content[bid][p % bs] = (seq.namespace, tuple(written[: p + 1]))
        seq.num_computed += 1
        self.commit(seq)
        a = min(accepted, len(drafts))
        last = bonus if a == len(drafts) else (drafts[a] + 1 + bonus % 2) % 3  # the first rejected row's token
        seq.token_ids.extend(drafts[:a] + [last])
        seq.num_computed = c + 1 + a
        old_bt, keep = list(seq.block_table), -(-(c + 1 + a) // bs)
        assert self.kv.trim_to_computed(seq) == len(old_bt) - keep
        assert seq.block_table == old_bt[:keep]
        self.released(old_bt[keep:])
        self.commit(seq)

    @precondition(lambda self: any(s.num_computed for s in self.seqs))
    @rule(i=INDEX)
    def pin(self, i):
        """Another owner holds references to every computed block of a sequence, its partial block included."""
        pool, bs = self.pool, self.bs
        seq = self.pick(i, lambda s: s.num_computed > 0)
        slots = seq.num_computed - seq.kv_offset
        blocks = seq.block_table[: -(-slots // bs)]
        before = {b: pool.blocks[b].ref_count for b in blocks}
        assert pool.fork(blocks) == blocks
        for b, k in Counter(blocks).items():
            assert pool.blocks[b].ref_count == before[b] + k
        kept = [(blocks[p // bs], p % bs, self.content[blocks[p // bs]][p % bs]) for p in range(slots)]
        self.pins.append((blocks, kept))

    @precondition(lambda self: self.pins)
    @rule(i=INDEX)
    def unpin(self, i):
        blocks, _ = self.pins.pop(i % len(self.pins))
        self.pool.free_all(blocks)
        self.released(blocks)

    @precondition(lambda self: any(s.num_computed >= self.bs and not s.kv_offset for s in self.seqs))
    @rule(i=INDEX)
    def fork(self, i):
        """A new owner shares the full computed blocks (a partial block is never shared for writing); compressed KV
        is never forked (``fork_kv`` hands over the token ids only)."""
        pool, bs = self.pool, self.bs
        parent = self.pick(i, lambda s: s.num_computed >= bs and not s.kv_offset)
        nfull = parent.num_computed // bs
        shared = parent.block_table[:nfull]
        before = {b: pool.blocks[b].ref_count for b in shared}
        got = pool.fork(shared)
        assert got == shared
        for b, k in Counter(shared).items():
            assert pool.blocks[b].ref_count == before[b] + k
        child = make_seq(parent.token_ids[: nfull * bs], parent.namespace)
        child.block_table = got
        child.block_hashes = list(parent.block_hashes[:nfull])
        child.num_computed = nfull * bs
        assert len(child.block_hashes) == nfull
        self.seqs.append(child)

    @precondition(lambda self: self.seqs)
    @rule(i=INDEX)
    def free(self, i):
        self.free_seq(self.pick(i))

    @precondition(lambda self: any(not s.kv_offset for s in self.seqs))
    @rule(i=INDEX, keep=st.integers(0, 48), suffix=st.lists(TOKENS, max_size=6))
    def truncate(self, i, keep, suffix):
        """Keep the first ``keep`` tokens' KV; the next turn's tokens diverge after them (never compressed KV: a
        session frees it and recomputes an edited history)."""
        pool, bs = self.pool, self.bs
        seq = self.pick(i, lambda s: not s.kv_offset)
        old_bt, old_hashes = list(seq.block_table), list(seq.block_hashes)
        k = min(keep, seq.num_computed)
        nfull = k // bs
        keep_blocks, keep_tokens = nfull, nfull * bs
        if k % bs and nfull < len(old_bt):
            b = pool.blocks[old_bt[nfull]]
            if b.ref_count == 1 and b.hash is None and len(old_hashes) <= nfull:
                keep_blocks, keep_tokens = nfull + 1, k
        self.kv.truncate(seq, keep)
        assert seq.num_computed == keep_tokens
        assert seq.block_table == old_bt[:keep_blocks]
        assert seq.block_hashes == old_hashes[:nfull]
        self.released(old_bt[keep_blocks:])
        seq.token_ids = seq.token_ids[:k] + suffix

    @precondition(lambda self: any(s.num_computed - s.kv_offset >= 2 for s in self.seqs))
    @rule(i=INDEX, mask=st.lists(st.booleans(), min_size=48, max_size=48))
    def compress(self, i, mask):
        """A session's end-of-turn compression (``kvkeeper.sessions.compress``): the kept entries (``mask`` over the
        slots, in order) are copied into fresh blocks, every old block is released (full ones stay cached),
        ``kv_offset`` grows by the entries dropped; with no room the KV stays whole."""
        pool, bs = self.pool, self.bs
        seq = self.pick(i, lambda s: s.num_computed - s.kv_offset >= 2)
        slots = seq.num_computed - seq.kv_offset
        idx = [j for j in range(slots) if mask[j % len(mask)]][: slots - 1] or [slots - 1]
        positions = self.kept.get(seq.seq_id) or list(range(seq.num_computed))
        assert len(positions) == slots
        tmp = make_seq([0] * len(idx), seq.namespace)  # fresh blocks for the kept entries (evicting cached ones)
        if not self.alloc(tmp, len(idx)):
            return
        old = list(seq.block_table)
        for j, src in enumerate(idx):
            self.content[tmp.block_table[j // bs]][j % bs] = self.content[old[src // bs]][src % bs]
        pool.free_all(old)
        seq.block_table, seq.block_hashes = tmp.block_table, []
        seq.kv_offset = seq.num_computed - len(idx)
        self.kept[seq.seq_id] = [positions[j] for j in idx]
        self.released(old)

    @rule(n=st.none() | st.integers(0, 4))
    def evict(self, n):
        pool = self.pool
        lru_before, ev_before = list(self.lru), pool.evictions
        k = pool.evict_cached(n)
        assert k == (len(lru_before) if n is None else min(n, len(lru_before)))
        for b in lru_before[:k]:  # least recently freed first
            assert pool.blocks[b].hash is None and pool.blocks[b].ref_count == 0
            self.forget(b)
        assert pool.evictions == ev_before + k

    @rule(extra=st.integers(1, 3))
    def over_allocate(self, extra):
        pool = self.pool
        before = snapshot(pool)
        with pytest.raises(NoFreeBlocksError):
            pool.allocate(pool.num_free + extra)
        assert snapshot(pool) == before

    @precondition(lambda self: self.pool is not None and self.pool.num_free > 0)
    @rule(i=INDEX)
    def double_free(self, i):
        pool = self.pool
        refs = self.refs()
        free = [b for b in range(pool.num_blocks) if refs[b] == 0]
        before = snapshot(pool)
        with pytest.raises(RuntimeError):
            pool.free(free[i % len(free)])
        assert snapshot(pool) == before

    @rule()
    def free_everything(self):
        self.free_all_and_check()

    def free_all_and_check(self):
        pool = self.pool
        for s in list(self.seqs):
            self.free_seq(s)
        while self.pins:
            self.unpin(0)
        assert pool.num_free == pool.num_blocks and pool.num_used == 0, "blocks leaked"
        assert all(b.ref_count == 0 for b in pool.blocks)
        assert pool.num_cached_free == pool.num_cached == len(self.bid_key)
        pool.check_invariants()

    # ---- invariants ------------------------------------------------------------
    @invariant()
    def pool_consistent(self):
        pool, bs = self.pool, self.bs
        if pool is None:
            return
        pool.check_invariants()
        refs = self.refs()
        free = set(pool._free_plain) | set(pool._free_cached)
        for b in pool.blocks:
            assert b.ref_count >= 0, f"block {b.block_id} refcount {b.ref_count}"
            assert b.ref_count == refs[b.block_id], f"block {b.block_id}: refcount {b.ref_count}, owners {refs[b.block_id]}"
            assert not (b.block_id in free and b.ref_count > 0), f"block {b.block_id} free and referenced"
            assert (b.block_id in free) == (b.ref_count == 0), f"block {b.block_id} unreferenced but not free"
        assert pool.num_free + pool.num_used == pool.num_blocks
        assert pool.num_free == len(free) == pool.num_blocks - len(refs)

    @invariant()
    def cache_consistent(self):
        pool, bs = self.pool, self.bs
        if pool is None:
            return
        registered = {b.block_id for b in pool.blocks if b.hash is not None}
        assert registered == set(self.bid_key)
        assert pool.num_cached == len(registered)
        assert list(pool._free_cached) == list(self.lru), "LRU order of cached free blocks"
        assert pool.num_cached_free == len(self.lru)
        for bid in registered:
            b, cont = pool.blocks[bid], self.content[bid]
            ns, prefix = self.bid_key[bid]
            # the cache's metadata is what the block really holds, and the block is full
            assert b.namespace == ns and b.token_ids == prefix[-bs:]
            assert cont == [(ns, prefix[: len(prefix) - bs + o + 1]) for o in range(bs)]
        if self.exact:
            assert len(self.cache) == len(self.bid_key)
            assert all(self.cache[k] == b for b, k in self.bid_key.items())

    @invariant()
    def sequences_see_their_own_kv(self):
        pool, bs = self.pool, self.bs
        if pool is None:
            return
        for _, kept in self.pins:
            for bid, o, kv in kept:
                assert self.content[bid][o] == kv, f"pinned KV in block {bid} slot {o} was overwritten"
        for s in self.seqs:
            if self.full_identity:
                assert len(set(s.block_table)) == len(s.block_table)
            if s.kv_offset:  # compressed: slot j holds the token at position kept[j], in position order
                pos = self.kept[s.seq_id]
                assert len(pos) == s.num_computed - s.kv_offset <= len(s.block_table) * bs
                assert pos == sorted(set(pos)) and pos[-1] < s.num_computed and not s.block_hashes
                for j, p in enumerate(pos):
                    got = self.content[s.block_table[j // bs]][j % bs]
                    assert self.identity_ok(got, s.namespace, tuple(s.token_ids[: p + 1])), (
                        f"{s.request_id} compressed slot {j} (position {p}): block {s.block_table[j // bs]} holds {got}")
                continue
            assert s.num_computed <= len(s.block_table) * bs
            assert s.num_computed <= len(s.token_ids)
            assert len(s.block_hashes) == s.num_computed // bs
            for p in range(s.num_computed):
                got = self.content[s.block_table[p // bs]][p % bs]
                assert self.identity_ok(got, s.namespace, tuple(s.token_ids[: p + 1])), (
                    f"{s.request_id} position {p}: block {s.block_table[p // bs]} holds {got}"
                )
            if self.exact:
                parent = None
                for i, h in enumerate(s.block_hashes):
                    assert h == block_hash(parent, s.namespace, s.token_ids[i * bs : (i + 1) * bs])
                    parent = h


class ExactHashMachine(PoolMachine):
    MODE = "exact"


class NamespaceBlindHashMachine(PoolMachine):
    MODE = "ns_blind"


class TinyHashMachine(PoolMachine):
    MODE = "tiny"


MACHINE_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.mark.parametrize(
    "machine,hash_fn",
    [(ExactHashMachine, None), (NamespaceBlindHashMachine, _ns_blind_hash), (TinyHashMachine, _tiny_hash)],
    ids=["real-hash", "namespace-blind-hash", "4-bit-hash"],
)
def test_pool_state_machine(machine, hash_fn):
    if hash_fn is None:
        run_state_machine_as_test(machine, settings=MACHINE_SETTINGS)
    else:
        with mock.patch.object(block_pool_mod, "block_hash", hash_fn):
            run_state_machine_as_test(machine, settings=MACHINE_SETTINGS)


# ---------------------------------------------------------------------------
# plain unit tests
# ---------------------------------------------------------------------------


def test_allocate_beyond_free_raises_and_leaves_pool_unchanged():
    pool = BlockPool(6, 2)
    a = pool.allocate(3)
    pool.register(a[0], None, BASE, [1, 2])
    pool.free(a[0])  # one cached free block, two plain free ones
    before = snapshot(pool)
    assert pool.num_free == 4
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(5)
    assert snapshot(pool) == before
    assert pool.lookup(None, BASE, [1, 2])[0] == a[0]  # nothing was evicted on the way
    assert pool.allocate(4)  # exactly what is free works
    assert pool.num_free == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.check_invariants()


def test_manager_allocate_short_pool_returns_false_and_takes_nothing():
    pool = BlockPool(4, 2)
    kv = KVCacheManager(pool)
    held = make_seq([1, 2, 3])
    assert run_prompt(kv, held) == 0
    seq = make_seq(list(range(20)))
    kv.match_prefix(seq)
    before = snapshot(pool)
    assert not kv.allocate(seq, seq.num_uncomputed)
    assert snapshot(pool) == before and seq.block_table == []
    kv.free(held)
    assert pool.num_free == pool.num_blocks


def test_double_free_raises():
    pool = BlockPool(4, 2)
    (b,) = pool.allocate(1)
    pool.free(b)
    before = snapshot(pool)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(b)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(3)  # never allocated
    assert snapshot(pool) == before
    pool.check_invariants()


def test_lru_plain_blocks_first_then_oldest_cached():
    pool = BlockPool(6, 2)
    bids = pool.allocate(6)
    for k, bid in enumerate(bids[:3]):
        pool.register(bid, None, BASE, [k, k])
    for bid in (bids[2], bids[0], bids[1]):  # cached blocks freed: 2 is the oldest, 1 the newest
        pool.free(bid)
    for bid in bids[3:]:
        pool.free(bid)
    assert pool.num_free == 6 and pool.num_cached_free == 3

    # never-cached free blocks go first: nothing evicted
    plain = pool.allocate(3)
    assert sorted(plain) == sorted(bids[3:])
    assert pool.evictions == 0
    assert all(pool.lookup(None, BASE, [k, k])[0] == bids[k] for k in range(3))

    # then the least recently freed cached block
    assert pool.allocate(1) == [bids[2]]
    assert pool.evictions == 1
    assert pool.lookup(None, BASE, [2, 2])[0] is None
    assert pool.blocks[bids[2]].hash is None

    # a hit refreshes a block: block 0 becomes the newest
    pool.incref(bids[0])
    pool.free(bids[0])
    assert pool.allocate(1) == [bids[1]]
    assert pool.evict_cached() == 1  # the rest
    assert pool.lookup(None, BASE, [0, 0])[0] is None
    assert pool.num_cached == pool.num_cached_free == 0 and pool.evictions == 3
    pool.check_invariants()


def test_freed_sequence_tail_is_evicted_before_its_head():
    pool = BlockPool(4, 2)
    kv = KVCacheManager(pool)
    a = make_seq([1, 2, 3, 4, 5, 6, 7])
    run_prompt(kv, a)
    head, mid, tail, partial = a.block_table
    kv.free(a)  # three cached blocks, one plain
    assert pool.allocate(2) == [partial, tail]
    b = make_seq([1, 2, 3, 4, 9])
    assert kv.match_prefix(b) == 4 and b.block_table == [head, mid]


@pytest.mark.parametrize("other", OTHER_NAMESPACES, ids=lambda n: n.key)
@pytest.mark.parametrize("hash_fn", [None, _ns_blind_hash], ids=["real-hash", "namespace-blind-hash"])
def test_prefix_cache_never_crosses_namespaces(other, hash_fn):
    with mock.patch.object(block_pool_mod, "block_hash", hash_fn or block_hash):
        pool = BlockPool(12, 2)
        kv = KVCacheManager(pool)
        tokens = [1, 2, 3, 4, 5]
        a = make_seq(tokens, BASE)
        run_prompt(kv, a)
        assert pool.num_cached == 2

        b = make_seq(tokens, other)
        assert kv.match_prefix(b) == 0 and b.block_table == []
        assert pool.lookup(None, other, [1, 2])[0] is None
        run_prompt(kv, b)
        assert not set(b.block_table) & set(a.block_table)

        c = make_seq(tokens, BASE)
        assert kv.match_prefix(c) == 4 and c.block_table == a.block_table[:2]
        for s in (a, b, c):
            kv.free(s)
        assert pool.num_free == pool.num_blocks
        pool.check_invariants()


def test_hash_collisions_never_return_foreign_blocks():
    with mock.patch.object(block_pool_mod, "block_hash", _constant_hash):
        pool = BlockPool(8, 2)
        (bid,) = pool.allocate(1)
        assert pool.register(bid, None, BASE, [1, 2]) == 7
        assert pool.lookup(None, BASE, [1, 2])[0] == bid
        assert pool.lookup(None, BASE, [2, 1])[0] is None  # other tokens
        for other in OTHER_NAMESPACES:
            assert pool.lookup(None, other, [1, 2])[0] is None  # other namespace, same tokens
        # a colliding block is simply not cached
        (bid2,) = pool.allocate(1)
        pool.register(bid2, None, BASE, [3, 3])
        assert pool.blocks[bid2].hash is None and pool.num_cached == 1
        pool.check_invariants()


def test_prefix_match_is_chained():
    pool = BlockPool(16, 2)
    kv = KVCacheManager(pool)
    a = make_seq([1, 2, 3, 4, 5, 6, 7])
    run_prompt(kv, a)
    assert pool.num_cached == 3

    def match(tokens):
        s = make_seq(tokens)
        n = kv.match_prefix(s)
        assert n == len(s.block_table) * 2
        bt = list(s.block_table)
        kv.free(s)
        return bt

    assert match([1, 2, 3, 4, 5, 6, 7]) == a.block_table[:3]
    assert match([1, 2, 3, 4, 5, 6]) == a.block_table[:2]  # the last token is always computed
    assert match([1, 2, 9, 9, 5, 6, 7]) == a.block_table[:1]  # [5, 6] is cached, but after another parent
    assert match([9, 9, 3, 4, 5, 6, 7]) == []
    assert match([3, 4, 5, 6, 7]) == []  # a block is never matched out of its position in the chain
    assert pool.lookup(None, BASE, [5, 6])[0] is None
    kv.free(a)
    assert pool.num_free == pool.num_blocks


def test_freeing_all_owners_returns_every_block():
    pool = BlockPool(8, 4)
    kv = KVCacheManager(pool)
    a = make_seq(list(range(10)))
    run_prompt(kv, a)
    child = make_seq(a.token_ids[:8])
    child.block_table = pool.fork(a.block_table[:2])
    child.block_hashes = list(a.block_hashes)
    child.num_computed = 8
    hit = make_seq(list(range(10)))
    assert kv.match_prefix(hit) == 8
    assert [pool.blocks[b].ref_count for b in a.block_table] == [3, 3, 1]
    kv.free(a)
    kv.free(hit)
    assert pool.num_used == 2
    kv.free(child)
    assert pool.num_free == pool.num_blocks and pool.num_used == 0
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert pool.num_cached_free == pool.num_cached == 2
    pool.check_invariants()


def test_truncate_keeps_an_exclusive_partial_block_only():
    pool = BlockPool(8, 4)
    kv = KVCacheManager(pool)
    a = make_seq(list(range(10)))
    run_prompt(kv, a)
    full0, full1, partial = a.block_table
    kv.truncate(a, 9)  # inside the unshared, uncached last block: kept
    assert a.block_table == [full0, full1, partial] and a.num_computed == 9
    kv.truncate(a, 6)  # inside a cached block: dropped, its tokens recomputed
    assert a.block_table == [full0] and a.num_computed == 4 and len(a.block_hashes) == 1
    assert pool.blocks[partial].ref_count == 0 and pool.blocks[full1].ref_count == 0
    kv.free(a)
    assert pool.num_free == pool.num_blocks
    pool.check_invariants()


def test_truncate_drops_a_shared_or_cached_partial_block():
    pool = BlockPool(8, 4)
    kv = KVCacheManager(pool)
    a = make_seq(list(range(6)))
    run_prompt(kv, a)
    full0, partial = a.block_table
    pin = pool.fork([full0, partial])  # another owner holds the partial block too
    kv.truncate(a, 5)
    assert a.block_table == [full0] and a.num_computed == 4  # it will be rewritten: never in place
    assert pool.blocks[partial].ref_count == 1
    pool.free_all(pin)

    # a block in the prefix cache is never kept for rewriting either, even by its only owner
    b = make_seq(list(range(10, 16)))
    assert kv.match_prefix(b) == 0 and kv.allocate(b, 6)
    b.num_computed = 6  # computed, not yet committed by b ...
    pool.register(b.block_table[0], None, b.namespace, b.token_ids[:4])  # ... but cached meanwhile
    kv.truncate(b, 2)
    assert b.block_table == [] and b.num_computed == 0
    kv.free(a)
    kv.free(b)
    assert pool.num_free == pool.num_blocks
    pool.check_invariants()


def test_truncate_in_a_hybrid_pool_keeps_a_prefix_whose_window_is_there():
    """A truncation inside a cached block rounds down to the block boundary; in a hybrid pool the window of the
    prefix kept must still have its window blocks, after the rounding too (window 8, blocks of 4: the next
    token's window after a 15-token prefix starts in block 2, after the 12-token boundary in block 1)."""
    pool = BlockPool(16, 4, window_blocks=8)
    kv = KVCacheManager(pool, window=8)
    a = make_seq(list(range(18)))
    run_prompt(kv, a)  # 18 tokens computed, full blocks 0-3 cached
    kv.release_out_of_window(a)  # blocks 0 and 1 lie wholly before the window of token 18: no window blocks
    assert [pool.window_id(b) is None for b in a.block_table] == [True, True, False, False, False]
    assert not kv.usable(a.block_table, 12) and kv.usable(a.block_table, 15)
    kv.truncate(a, 15)  # inside cached block 3: rounded down to 12, whose window needs block 1: not there
    assert a.num_computed % 4 == 0 and kv.usable(a.block_table, a.num_computed)
    assert a.num_computed == 0 and a.block_table == []  # no block boundary below keeps a whole window
    kv.free(a)
    pool.check_invariants()


def test_match_stops_at_a_missing_block_even_if_later_blocks_are_cached():
    pool = BlockPool(8, 2)
    kv = KVCacheManager(pool)
    tokens = [1, 2, 3, 4, 5]
    a, b = make_seq(tokens), make_seq(tokens)
    kv.match_prefix(a)
    kv.match_prefix(b)  # both admitted before either cached anything
    assert kv.allocate(a, 5) and kv.allocate(b, 5)
    a.num_computed = 2
    kv.commit(a)  # a caches block [1, 2]
    b.num_computed = 5
    kv.commit(b)  # b's [1, 2] is a duplicate (not cached); b caches [3, 4] after it
    assert pool.blocks[b.block_table[0]].hash is None and pool.blocks[b.block_table[1]].hash is not None
    kv.free(a)
    assert pool.evict_cached() == 1  # [1, 2] is gone, [3, 4] (held by b) is still cached
    c = make_seq(tokens)
    assert kv.match_prefix(c) == 0 and c.block_table == []
    kv.free(b)
    assert pool.num_free == pool.num_blocks
