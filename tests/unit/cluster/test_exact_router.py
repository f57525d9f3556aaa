"""The token-exact router over two in-process engine replicas that publish KV events on ZMQ (not a Ray cluster:
two Ray replicas of the embedded model take minutes on this 2-core machine, and the router is not yet wired into
the Ray deployment).  Every later turn of each conversation, routed without a session id, goes to the replica
holding its prefix, and the router's predicted cached blocks are exactly the replica's prefix hit; a fresh
conversation that shares a long system prompt lands on the replica holding it; the session ring stays first."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from kvkeeper import SamplingParams  # noqa: E402
from kvkeeper.cluster.exact_router import ExactRouter, ReplicaLoad, token_block_hashes  # noqa: E402
from kvkeeper.cluster.kv_index import KVIndex  # noqa: E402
from kvkeeper.cluster.kv_subscriber import Feed, KVEventSubscriber  # noqa: E402
from tests.utils.engines import make_engine  # noqa: E402
from tests.utils.serverproc import free_port  # noqa: E402

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[3] / "data" / "topical_chat" / "test_freq_conversations_first20.jsonl"
GREEDY = SamplingParams(max_tokens=4, temperature=0)
SYSTEM = ("You are a helpful assistant for a travel company. Answer briefly, name the sources you use, and never "
          "invent prices, dates or opening hours. " * 12)  # about 19 blocks: more than one queued request weighs


@pytest.fixture(scope="module")
def cluster():
    engines, feeds = {}, []
    for name in ("r0", "r1"):
        pub, rep = free_port(), free_port()
        # the default weight format (GGUF blocks in place): what a replica serves by default; which blocks a replica
        # holds does not depend on the format
        engines[name] = make_engine(quantization="gguf", num_kv_blocks=256, kv_events_config={
            "enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{pub}",
            "replay_endpoint": f"tcp://127.0.0.1:{rep}"})
        feeds.append(Feed(name, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"))
    index = KVIndex()
    sub = KVEventSubscriber(index, feeds)
    yield engines, index, sub
    sub.close()
    for e in engines.values():
        e.kv_events.close()


def settle(sub, engines, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        sub.poll(50)
        if all(e.kv_events.flushed() and sub.last_seq(n) == e.kv_events.seq for n, e in engines.items()):
            return
    raise AssertionError("the subscriber did not catch up with the replicas' KV events")


def conversations(n: int, turns: int) -> list[list[str]]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[:n]]
    return [[t["text"] for t in r["turns"][:turns]] for r in rows]


def serve(eng, messages) -> tuple[str, int, int]:
    """One chat request on a replica: (reply, prompt tokens, cached tokens)."""
    ids = eng.encode_chat(messages)
    out = eng.generate([ids], GREEDY)[0]
    return out.text, len(ids), out.cached_tokens


def test_later_turns_follow_their_prefix_and_the_prediction_is_exact(cluster):
    engines, index, sub = cluster
    ref = engines["r0"]
    router = ExactRouter(index, ref.namespace.digest, ref.block_size)
    assert all(e.namespace.digest == ref.namespace.digest for e in engines.values())  # same model, same hashes
    names = list(engines)
    convs = conversations(4, 3)
    history = [[] for _ in convs]
    home: dict[int, str] = {}
    for turn in range(3):
        for c, texts in enumerate(convs):
            history[c].append({"role": "user", "content": texts[turn]})
            ids = ref.encode_chat(history[c])  # the gateway's tokenization, as the replica renders it
            settle(sub, engines)
            loads = {r: ReplicaLoad(running=sum(1 for h in home.values() if h == r)) for r in names}
            d = router.choose(names, loads, ids)
            chosen = d.ranks[0][0]
            predicted = index.match(router.hashes(ids)).get(chosen, 0) * ref.block_size
            reply, n_prompt, cached = serve(engines[chosen], history[c])
            assert cached == predicted, (turn, c, chosen)  # token-exact: the router knew the replica's hit
            if turn == 0:
                home[c] = chosen
            else:
                assert d.reason == "prefix" and chosen == home[c], (turn, c, d)
                assert cached > 0
            history[c].append({"role": "assistant", "content": reply})
    assert set(home.values()) == set(names)  # the load term spread the new conversations


def test_a_fresh_conversation_lands_where_its_long_system_prompt_is(cluster):
    engines, index, sub = cluster
    ref = engines["r0"]
    router = ExactRouter(index, ref.namespace.digest, ref.block_size)
    names = list(engines)
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is Lisbon nice in May?"}]
    serve(engines["r1"], first)  # only r1 has seen the system prompt
    settle(sub, engines)
    fresh = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What should I pack for Oslo?"}]
    ids = ref.encode_chat(fresh)
    d = router.choose(names, {"r0": ReplicaLoad(), "r1": ReplicaLoad(running=1)}, ids)
    assert d.ranks[0] == ["r1"] and d.reason == "prefix"
    _, _, cached = serve(engines["r1"], fresh)
    assert cached >= len(ref.tokenizer.encode(SYSTEM)) // ref.block_size * ref.block_size - ref.block_size


def test_session_ring_first_and_load_without_a_hit():
    index = KVIndex()
    router = ExactRouter(index, "0" * 16, 16)
    names = [f"r{i}" for i in range(8)]
    d = router.choose(names, {}, list(range(100)), session_id="conv-1")
    assert d.reason == "session" and d.ranks[0] == [router.policy.ring(names).owner("conv-1")]
    assert router.choose(names, {}, list(range(100)), cache_key="k").reason == "cache_key"
    loads = {r: ReplicaLoad(running=1) for r in names} | {"r5": ReplicaLoad()}
    d = router.choose(names, loads, list(range(100)))
    assert d.reason == "load" and d.ranks[0] == ["r5"]
    assert token_block_hashes(list(range(33)), "0" * 16, 16) == router.hashes(list(range(33)))
    assert len(router.hashes(list(range(32)))) == 1  # the last token is always computed
    with pytest.raises(ValueError):
        router.choose([], {})


def test_the_deployments_router_follows_advertised_streams_and_tokenizes_at_the_gateway(cluster):
    """The pieces ``kvkeeper serve --replicas N --kv-events-config`` runs, without Ray: each replica's routing stats
    (what EngineReplica publishes), the gateway's tokenizer over JSON bodies, and ClusterExactRouter following the
    advertised streams.  A later turn (also under a cache_salt, whose namespace the router derives from the salt's
    hash) goes to the replica holding its prefix, and the router's prediction is that replica's prefix hit."""
    from kvkeeper.cluster.exact_router import ClusterExactRouter, replica_routing_stats
    from kvkeeper.cluster.gateway_tokens import GatewayTokenizer, load_renderer
    from kvkeeper.kvcache.namespace import tenant_namespace

    engines, _, _ = cluster
    ref = engines["r0"]
    stats = {n: replica_routing_stats(e, e.kv_events, "127.0.0.1", {"running": 0, "waiting": 0, "kv_usage": 0.0})
             for n, e in engines.items()}
    assert stats["r0"]["kv_events"]["endpoint"] == ref.kv_events.bound_endpoint
    assert "tenant" not in repr(stats) and stats["r0"]["namespace"]["digest"] == ref.namespace.digest
    gw = GatewayTokenizer(load_renderer(ref.config), "smol")
    router = ClusterExactRouter()
    try:
        def caught_up():
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if all(e.kv_events.flushed() and (router.sub.last_seq(n) or -1) >= e.kv_events.seq
                       for n, e in engines.items()):
                    return
                time.sleep(0.05)
            raise AssertionError("the router did not catch up with the replicas' KV events")

        for salt in (None, "client-salt-7"):
            ns = ref.namespace if salt is None else tenant_namespace(ref.namespace, None, salt)
            msgs = [{"role": "system", "content": SYSTEM[:400]}, {"role": "user", "content": f"Hi there, {salt}!"}]
            home = None
            for turn in range(2):
                body = {"model": "smol", "messages": msgs, **({"cache_salt": salt} if salt else {})}
                hint = {"session": None, "cache_key": None} | gw.prompt("/v1/chat/completions", {}, body)
                assert hint["tokens"] == ref.encode_chat(msgs)  # the gateway's tokens are the replica's
                router.choose([(n, s, 0) for n, s in stats.items()], hint)  # starts following
                caught_up()
                d = router.choose([(n, s, 0) for n, s in stats.items()], hint)
                chosen = d.ranks[0][0]
                predicted = router.index.match(hint["hashes"]).get(chosen, 0) * ref.block_size
                out = engines[chosen].generate([ref.encode_chat(msgs)], SamplingParams(max_tokens=1, temperature=0),
                                               namespace=ns)[0]
                assert out.cached_tokens == predicted, (salt, turn, chosen)
                if turn == 0:
                    home = chosen
                else:
                    assert d.reason == "prefix" and chosen == home and predicted > 0, (salt, d)
                msgs = msgs + [{"role": "assistant", "content": out.text}, {"role": "user", "content": "And then?"}]
                caught_up()
        assert gw.prompt("/v1/chat/completions", {}, {"model": "an-adapter", "messages": msgs}) is None
        assert gw.prompt("/v1/completions", {}, {"model": "smol", "prompt": "Hello"})["tokens"] == \
            ref.tokenizer.encode("Hello")
        assert gw.prompt("/v1/chat/completions", {}, {"messages": "not a list"}) is None  # the replica's 400
        router.forget_others(["r1"])
        deadline = time.monotonic() + 10
        while router.sub.followed != ["r1"] or router.index.num_blocks("r0"):
            assert time.monotonic() < deadline, "a replica that left is still followed"
            time.sleep(0.05)
    finally:
        router.close()
