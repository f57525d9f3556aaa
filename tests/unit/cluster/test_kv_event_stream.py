"""A replica's KV event stream over ZMQ (``kv_events_config``), replayed into an empty index, reproduces its prefix
cache exactly -- block hashes and parents -- after evictions, a compaction and a restart whose sessions come back
from disk; a subscriber that starts late resyncs through the replay socket; no tenant name, salt, model revision or
token id is on the wire unless token ids were asked for."""

from __future__ import annotations

import socket
import time

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from kvkeeper import SamplingParams  # noqa: E402
from kvkeeper.cluster.kv_index import KVIndex  # noqa: E402
from kvkeeper.cluster.kv_subscriber import Feed, KVEventSubscriber  # noqa: E402
from kvkeeper.kvcache.kv_events.publisher import END_SEQ  # noqa: E402
from kvkeeper.errors import InvalidRequestError  # noqa: E402
from kvkeeper.kvcache.kv_events.wire import BlockStored, decode_batch  # noqa: E402
from kvkeeper.kvcache.namespace import tenant_namespace  # noqa: E402
from kvkeeper.sessions import SessionManager  # noqa: E402
from tests.utils.engines import make_engine  # noqa: E402
from tests.utils.serverproc import free_port  # noqa: E402

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=4, temperature=0)
# the default weight format (GGUF blocks in place): what a replica serves by default; the stream's events do not
# depend on the format
QUANT = "gguf"
TENANT, SALT = "acme-corp-tenant", "client-salt-4242"


def events_config(pub: int, replay: int, **extra) -> dict:
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{pub}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv", **extra}


def cached(eng) -> dict[int, int | None]:
    return {b.hash: b.parent for b in eng.pool.blocks if b.hash is not None}


def settle(sub: KVEventSubscriber, eng, replica: str, limit_s: float = 20.0) -> None:
    """Poll until the subscriber has applied every batch the engine's publisher sent (bounded)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        sub.poll(50)
        if eng.kv_events.flushed() and sub.last_seq(replica) == eng.kv_events.seq:
            return
    raise AssertionError(f"subscriber at seq {sub.last_seq(replica)}, publisher at {eng.kv_events.seq}")


def replay_payloads(endpoint: str) -> list[bytes]:
    """Every batch the replay socket keeps, raw."""
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    d.connect(endpoint)
    d.send_multipart([b"", (0).to_bytes(8, "big", signed=True)])
    out = []
    while d.poll(5000):
        _, seq, payload = d.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == END_SEQ:
            break
        out.append(payload)
    d.close(linger=0)
    return out


def prompts(n: int, words: int = 60) -> list[str]:
    return [" ".join(f"item{i}-{j}" for j in range(words)) for i in range(n)]


def test_stream_reproduces_the_prefix_cache_through_evictions_compaction_and_a_restart(tmp_path):
    pub, rep = free_port(), free_port()
    eng = make_engine(quantization=QUANT, num_kv_blocks=64, kv_events_config=events_config(pub, rep))
    index = KVIndex()
    sub = KVEventSubscriber(index, [Feed("r0", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}", "kv")])
    try:
        sessions = SessionManager(eng, data_dir=tmp_path)
        chats = [sessions.open(session_id=f"s{i}", system="You are terse.") for i in range(2)]
        for c in chats:
            c.send("Name three colours.", GREEDY)
        eng.generate(prompts(6), GREEDY)  # more than the pool holds: cached blocks are evicted
        eng.generate(prompts(2), GREEDY, namespace=tenant_namespace(eng.namespace, TENANT, SALT))
        assert eng.pool.evictions > 0
        settle(sub, eng, "r0")
        assert index.blocks("r0") == cached(eng)

        assert eng.kv.compact(evict_cache=True)["evicted"] > 0  # compaction: ids move, dropped blocks are removed
        settle(sub, eng, "r0")
        assert index.blocks("r0") == cached(eng)

        late = KVIndex()  # a router that starts now: the replay socket gives it everything since seq 0
        late_sub = KVEventSubscriber(late, [Feed("r0", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}", "kv")])
        eng.generate(prompts(1, 40), GREEDY)
        settle(late_sub, eng, "r0")
        late_sub.close()
        assert late_sub.replays >= 1 and late.blocks("r0") == cached(eng)

        payloads = replay_payloads(f"tcp://127.0.0.1:{rep}")
        wire = b"".join(payloads)
        ns = tenant_namespace(eng.namespace, TENANT, SALT)
        for secret in (TENANT, SALT, ns.tenant_salt, eng.namespace.model_revision):
            assert secret.encode() not in wire
        stored = [e for p in payloads for e in decode_batch(p).events if isinstance(e, BlockStored)]
        assert stored and all(e.token_ids == [] for e in stored)
        assert {e.namespace for e in stored} == {eng.namespace.digest, ns.digest}

        assert sessions.save_all() == 2  # the replica stops: sessions to disk, then a new process comes up
        eng.kv_events.close()
        del sessions, chats
        eng = make_engine(quantization=QUANT, num_kv_blocks=64, kv_events_config=events_config(pub, rep))
        sessions = SessionManager(eng, data_dir=tmp_path)
        r = sessions.get("s0").send("And three animals?", GREEDY)
        assert r.cached_tokens > 0  # its KV came back from disk and was registered again
        settle(sub, eng, "r0")
        assert index.blocks("r0") == cached(eng) and cached(eng)
    finally:
        sub.close()
        if eng.kv_events is not None:
            eng.kv_events.close()


def test_token_ids_on_the_wire_only_when_asked():
    pub, rep = free_port(), free_port()
    eng = make_engine(quantization=QUANT, num_kv_blocks=64,
                      kv_events_config=events_config(pub, rep, include_token_ids=True))
    try:
        out = eng.generate(prompts(1), GREEDY)[0]
        deadline = time.monotonic() + 10
        while not eng.kv_events.flushed() and time.monotonic() < deadline:
            time.sleep(0.01)
        stored = [e for p in replay_payloads(f"tcp://127.0.0.1:{rep}") for e in decode_batch(p).events
                  if isinstance(e, BlockStored)]
        toks = [t for e in stored for t in e.token_ids]
        assert toks == list(out.prompt_token_ids[:len(toks)]) and len(toks) >= eng.block_size
    finally:
        eng.kv_events.close()


def test_an_endpoint_in_use_is_refused_with_the_reason():
    pub = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", pub))
        s.listen()
        with pytest.raises(InvalidRequestError, match="cannot bind endpoint"):
            make_engine(quantization=QUANT, num_kv_blocks=16, kv_events_config={"enable_kv_cache_events": True,
                                                            "endpoint": f"tcp://127.0.0.1:{pub}"})
