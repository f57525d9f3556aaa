"""KV events of a block pool (kvkeeper.kvcache.kv_events.wire): replayed into an empty index they give back the
pool's prefix cache exactly (hashes and parents), through stores, evictions, resets and defragmentation; the wire
format is vLLM's (msgpack arrays tagged with the event's class name)."""

from __future__ import annotations

import random

import pytest

msgpack = pytest.importorskip("msgpack")

from kvkeeper.cluster.kv_index import KVIndex  # noqa: E402
from kvkeeper.kvcache.block_pool import BlockPool  # noqa: E402
from kvkeeper.kvcache.kv_events.wire import (AllBlocksCleared, BlockRemoved, BlockStored, EventBatch,  # noqa: E402
                                        EventRecorder, decode_batch, encode_batch)
from kvkeeper.kvcache.namespace import Namespace  # noqa: E402

NS = Namespace("rev-a", tenant_salt="acme-secret-salt")


def cached(pool: BlockPool) -> dict[int, int | None]:
    return {b.hash: b.parent for b in pool.blocks if b.hash is not None}


def random_workload(pool: BlockPool, rng: random.Random, steps: int, on_step=None) -> None:
    """Sequences of a small token alphabet (shared prefixes) allocated, registered, freed; evictions under
    pressure, resets and defragmentations now and then."""
    bs = pool.block_size
    owners: list[list[int]] = []
    for _ in range(steps):
        op = rng.random()
        if op < 0.55:
            n = rng.randint(1, 5)
            toks = [rng.randint(0, 2) for _ in range(n * bs)]
            table, parent, hashes = [], None, []
            for i in range(n):  # prefix hits first, as the manager does
                bid, h = pool.lookup(parent, NS, toks[i * bs:(i + 1) * bs])
                if bid is None:
                    break
                pool.incref(bid)
                table.append(bid)
                parent = h
            k = len(table)
            if n - k > pool.num_free:
                pool.free_all(table)
                continue
            table += pool.allocate(n - k)
            for i in range(k, n):
                parent = pool.register(table[i], parent, NS, toks[i * bs:(i + 1) * bs])
            owners.append(table)
        elif op < 0.85 and owners:
            pool.free_all(owners.pop(rng.randrange(len(owners))))
        elif op < 0.92:
            pool.evict_cached(rng.randint(1, 4))
        elif op < 0.97:
            order = [b for t in owners for b in t]
            seen: set[int] = set()
            mapping = pool.defragment([b for b in order if not (b in seen or seen.add(b))])
            owners = [[mapping[b] for b in t] for t in owners]
        else:
            pool.reset_prefix_cache()
        if on_step is not None:
            on_step()
    pool.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_replayed_events_reproduce_the_prefix_cache(seed):
    pool = BlockPool(24, 4)
    rec = EventRecorder(4)
    pool.attach_events(rec)
    index = KVIndex()
    rng = random.Random(seed)

    def ship():  # every few operations a batch goes over the wire (msgpack round trip) into the index
        if rng.random() < 0.3 and (batch := rec.take()) is not None:
            index.apply("r0", decode_batch(encode_batch(batch)))

    random_workload(pool, rng, 400, ship)
    if (batch := rec.take()) is not None:
        index.apply("r0", decode_batch(encode_batch(batch)))
    assert pool.evictions > 0
    assert index.blocks("r0") == cached(pool)
    assert len(index) == len(cached(pool))


def test_attaching_to_a_warm_pool_starts_with_a_snapshot():
    pool = BlockPool(16, 2)
    random_workload(pool, random.Random(7), 60)
    rec = EventRecorder(2)
    pool.attach_events(rec)
    batch = rec.take()
    assert isinstance(batch.events[0], AllBlocksCleared)
    index = KVIndex()
    index.apply("r", EventBatch(0.0, [BlockStored([1], None, [], 2)]))  # stale knowledge of the replica: cleared
    index.apply("r", batch)
    assert index.blocks("r") == cached(pool)


def test_wire_format_is_vllms_tagged_arrays_without_tokens_or_tenant():
    pool = BlockPool(8, 2)
    rec = EventRecorder(2)
    pool.attach_events(rec)
    a, b = pool.allocate(2)
    h0 = pool.register(a, None, NS, [101, 102])
    h1 = pool.register(b, h0, NS, [103, 104])
    pool.free_all([a, b])
    pool.evict_cached()
    payload = encode_batch(rec.take())
    ts, events = msgpack.unpackb(payload)
    assert isinstance(ts, float)
    assert events[0] == ["AllBlocksCleared"]
    # one BlockStored for the chain: [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
    # namespace digest]; token ids left out unless asked for
    assert events[1] == ["BlockStored", [h0, h1], None, [], 2, None, "CPU", NS.digest]
    assert events[2] == ["BlockRemoved", [h1, h0], "CPU"]
    for secret in (b"acme-secret-salt", NS.tenant_salt.encode(), NS.key.encode(), b"rev-a"):
        assert secret not in payload
    assert events[1][3] == []  # the whole content, above: no token id anywhere


def test_token_ids_only_when_asked():
    pool = BlockPool(4, 2)
    rec = EventRecorder(2, include_token_ids=True)
    pool.attach_events(rec)
    a, b = pool.allocate(2)
    h0 = pool.register(a, None, NS, [5, 6])
    pool.register(b, h0, NS, [7, 8])
    ev = decode_batch(encode_batch(rec.take())).events[1]
    assert ev.token_ids == [5, 6, 7, 8] and ev.block_size == 2


def test_decoding_refuses_what_is_not_a_batch():
    with pytest.raises(ValueError, match="KV cache event"):
        decode_batch(msgpack.packb([1.0, [["BlockMoved", [1]]]]))
    with pytest.raises(ValueError, match="msgpack"):
        decode_batch(b"\xc1")
    assert decode_batch(msgpack.packb([1.0, [["BlockRemoved", [3]]]])).events == [BlockRemoved([3])]


def test_index_match_counts_leading_blocks_per_replica():
    index = KVIndex()
    index.apply("a", EventBatch(0.0, [BlockStored([1, 2, 3], None, [], 4)]))
    index.apply("b", EventBatch(0.0, [BlockStored([1, 2], None, [], 4), BlockStored([9], None, [], 4)]))
    assert index.match([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert index.match([9, 7]) == {"b": 1}
    assert index.match([5]) == {}
    index.apply("a", EventBatch(0.0, [BlockRemoved([2])]))
    assert index.match([1, 2, 3]) == {"a": 1, "b": 2}
    index.remove_replica("b")
    assert index.match([1, 2, 3], replicas=["a"]) == {"a": 1}
