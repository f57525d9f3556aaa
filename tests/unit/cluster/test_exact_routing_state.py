"""ClusterExactRouter's bookkeeping, with a scripted subscriber (no ZMQ, no model): the text-hash fallback until a
replica advertises events, the hint's tokens hashed once under the request's namespace, the load of each replica,
replicas that leave, and the read-your-writes wait that never stalls on a stream it cannot get."""

from __future__ import annotations

import threading

from kvkeeper.cluster.exact_router import ClusterExactRouter, token_block_hashes
from kvkeeper.kvcache.kv_events.wire import BlockStored, EventBatch
from kvkeeper.kvcache.namespace import Namespace, salt_hash

NS = Namespace("rev-1", kv_dtype="float32")


class Scripted:
    def __init__(self, index):
        self.index, self.lock, self.seqs, self.followed, self.forgotten = index, threading.Lock(), {}, [], []

    def follow(self, feed):
        self.followed.append(feed.replica)

    def forget(self, replica):
        self.forgotten.append(replica)
        self.index.remove_replica(replica)

    def last_seq(self, replica):
        return self.seqs.get(replica)


def stats(name: str, running: int = 0, usage: float = 0.0) -> dict:
    return {"replica": name, "kv_events": {"endpoint": f"tcp://127.0.0.1:1/{name}", "replay_endpoint": None},
            "block_size": 4, "namespace": {"model_revision": NS.model_revision, "kv_dtype": NS.kv_dtype,
                                           "digest": NS.digest},
            "load": {"running": running, "waiting": 0, "kv_usage": usage}}


def router() -> ClusterExactRouter:
    return ClusterExactRouter(subscriber=Scripted)


def test_no_advertised_events_means_the_text_router_decides():
    r = router()
    assert r.choose([("a", {"prefix": []}, 0), ("b", {}, 0)], {"tokens": list(range(20))}) is None
    assert r.sub is None


def test_tokens_are_hashed_once_under_the_requests_namespace_and_the_holder_wins():
    r = router()
    ids = list(range(40))
    salted = Namespace(NS.model_revision, tenant_salt=salt_hash("acme", "s1"), kv_dtype=NS.kv_dtype)
    held = token_block_hashes(ids, salted.digest, 4)
    r.choose([("a", stats("a"), 0), ("b", stats("b"), 0)], {})  # follows both
    r.index.apply("b", EventBatch(0.0, [BlockStored(held, None, 4, salted.digest)]))
    hint = {"tokens": ids, "salt": salt_hash("acme", "s1")}
    d = r.choose([("a", stats("a"), 0), ("b", stats("b"), 1)], hint)
    assert d.reason == "prefix" and d.ranks[0] == ["b"]
    assert "tokens" not in hint and hint["hashes"] == held  # a retried request is not hashed again
    unsalted = {"tokens": ids}
    d = r.choose([("a", stats("a"), 0), ("b", stats("b"), 1)], unsalted)  # another namespace: nothing held
    assert d.reason == "load" and d.ranks[0] == ["a"] and unsalted["hashes"] == token_block_hashes(ids, NS.digest, 4)


def test_load_from_ray_queue_lengths_else_the_replicas_stats():
    r = router()
    d = r.choose([("a", stats("a", running=5), None), ("b", stats("b", running=0), 3)], {"tokens": [1, 2, 3]})
    assert d.ranks[0] == ["b"]  # ongoing requests: a's 5 from its stats, b's 3 as Ray Serve counts them
    d = r.choose([("a", stats("a", usage=0.9), 0), ("b", stats("b"), 0)], {"tokens": [1, 2, 3]})
    assert d.ranks[0] == ["b"]  # KV usage breaks the tie
    assert r.choose([("a", stats("a"), 0)], {"session": "s"}).reason == "session"


def test_replicas_that_leave_are_forgotten():
    r = router()
    r.choose([("a", stats("a"), 0), ("b", stats("b"), 0)], {})
    r.forget_others(["b"])
    assert r.sub.forgotten == ["a"] and r.sub.followed == ["a", "b"]
    r.choose([("b", stats("b"), 0)], {})
    assert r.sub.followed == ["a", "b"]  # b is followed once


def test_read_your_writes_waits_only_for_streams_that_arrive():
    r = router()
    r.choose([("a", stats("a"), 0), ("b", stats("b"), 0)], {})
    assert not r.behind({"a": 5})  # nothing applied from a yet: an unreachable stream is never waited for
    r.sub.seqs["a"] = 3
    assert r.behind({"a": 5}) and not r.behind({"a": 3}) and not r.behind({"zz": 9})
    r.give_up({"a": 5})  # the router waited its bound: a is skipped until it catches up
    assert not r.behind({"a": 6})
    r.sub.seqs["a"] = 5
    assert r.behind({"a": 6})  # caught up with the lag: waited for again
