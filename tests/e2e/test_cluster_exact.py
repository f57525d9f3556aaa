"""``kvkeeper serve --replicas 2 --kv-events-config`` on Ray Serve: the token-exact router, end to end with the official
openai client on 127.0.0.1.

Each replica publishes its KV events on its own ports (endpoint port + 2 x rank); the gateway tokenizes, the router
follows both streams.  Sessions (X-Session-ID) stay on their ring replica; every later turn of a conversation sent
without a session goes to the replica holding its prefix (its prompt's cached tokens cover the previous turn's
prompt); a fresh conversation sharing a long system prompt lands on the replica holding it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="needs the cluster extra: pip install -e '.[cluster]'")
pytest.importorskip("zmq", reason="needs the events extra: pip install -e '.[events]'")

import httpx  # noqa: E402
import openai  # noqa: E402

from kvkeeper.cluster.kv_index import KVIndex  # noqa: E402
from kvkeeper.cluster.kv_subscriber import Feed, KVEventSubscriber  # noqa: E402
from tests.utils.serverproc import free_ports, server_process  # noqa: E402

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[2] / "data" / "topical_chat" / "test_freq_conversations_first20.jsonl"
BLOCK = 16
SYSTEM = ("You are the help desk of a travel company. Answer briefly, name the sources you use, and never invent "
          "prices, dates or opening hours. " * 10)


def full_blocks(tokens: int) -> int:
    """Tokens of the full blocks a prompt of ``tokens`` leaves in the prefix cache (its last token is computed)."""
    return (tokens - 1) // BLOCK * BLOCK


def test_token_exact_router_on_two_replicas(tmp_path):
    port = free_ports(4)
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}",
              "replay_endpoint": f"tcp://127.0.0.1:{port + 1}"}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the default path (GGUF blocks in place, bf16 KV; named here so that a $KVKEEPER_QUANTIZATION of the caller's
    # does not change it): each replica loads and runs it in a third of the fp32 path's memory, and the router's
    # subject, which replica holds which blocks, does not depend on the weights' format
    # --affinity-wait-s 120: a session's turn waits for its replica however busy the machine (at the default 2 s, a
    # full run beside a build sent all 16 sessions to one replica while the other was slow to answer its probes)
    # timeout_s=600: at the start of a full run (three workers on two cores, every one starting models) Ray took
    # 168 s from its start to the app's readiness (2026-12-08, AMD EPYC); this whole test took 60 s in another run
    with server_process(tmp_path / "server.log", "--replicas", "2", "--kv-events-config", json.dumps(events),
                        "--no-access-log", "--quantization", "gguf", "--affinity-wait-s", "120", timeout_s=600,
                        env=env) as (base, _proc):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=180)
        model = client.models.list().data[0].id
        # Ray Serve hands the router its second replica a while after the app is up (seen: a whole run on one
        # replica under a loaded CI machine): a bounded poll until both replicas have answered through the router
        seen, deadline = set(), time.monotonic() + 180
        with httpx.Client(timeout=60) as http:  # one client: httpx.get builds one (about 40 ms of CPU) per call
            while len(seen) < 2:
                assert time.monotonic() < deadline, f"only {seen} answered through the router"
                seen.add(http.get(base + "/v1/models").headers["x-kvkeeper-replica"])
                time.sleep(0.2)

        def chat(messages, **headers):
            raw = client.chat.completions.with_raw_response.create(
                model=model, messages=messages, max_tokens=8, temperature=0, extra_headers=headers)
            r = raw.parse()
            return r.choices[0].message.content, r.usage, raw.headers["x-kvkeeper-replica"]

        # sessions: the ring, as without events
        for sid in ("ring-a", "ring-b"):
            msgs, where = [], set()
            for q in ("Name a colour.", "Another one?"):
                msgs.append({"role": "user", "content": q})
                reply, _, rep = chat(msgs, **{"X-Session-ID": sid})
                msgs.append({"role": "assistant", "content": reply})
                where.add(rep)
            assert len(where) == 1, (sid, where)

        # conversations without a session: every later turn where its prefix is
        rows = [json.loads(line) for line in DATA.read_text().splitlines()[:4]]
        convs = [[t["text"] for t in r["turns"][:3]] for r in rows]
        history = [[] for _ in convs]
        home, last_prompt = {}, {}
        for turn in range(3):
            for c, texts in enumerate(convs):
                history[c].append({"role": "user", "content": texts[turn]})
                reply, usage, rep = chat(history[c])
                history[c].append({"role": "assistant", "content": reply})
                if turn == 0:
                    home[c] = rep
                else:
                    assert rep == home[c], (c, turn, rep, home[c])
                    assert usage.prompt_tokens_details.cached_tokens >= full_blocks(last_prompt[c]), (c, turn, usage)
                last_prompt[c] = usage.prompt_tokens

        # a fresh conversation sharing a long system prompt: on the replica holding it
        _, first, holder = chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is Lisbon nice?"}])
        system_tokens = full_blocks(first.prompt_tokens) - 2 * BLOCK  # the system prompt's blocks, less the question's
        for q in ("What should I pack for Oslo?", "Do trains run at night in Rome?", "Is Porto far from Lisbon?"):
            _, usage, rep = chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            assert rep == holder, (q, rep, holder)
            assert usage.prompt_tokens_details.cached_tokens >= system_tokens, (q, usage)

        metrics = openai.DefaultHttpxClient().get(base + "/metrics").text
        prefix = float(metrics.split('kvkeeper:cluster_routing_decisions_total{reason="prefix"} ')[1].split()[0])
        assert prefix >= 8 + 3, metrics  # the later turns and the fresh conversations: decided on the KV index
        indexed = [ln for ln in metrics.splitlines() if ln.startswith("kvkeeper:cluster_kv_index_blocks{")]
        assert len(indexed) == 2 and all(float(ln.split()[-1]) > 0 for ln in indexed), indexed

        # each replica on its own ports: both streams replay what their replica holds
        index = KVIndex()
        sub = KVEventSubscriber(index, [Feed(f"rank{r}", f"tcp://127.0.0.1:{port + 2 * r}",
                                             f"tcp://127.0.0.1:{port + 1 + 2 * r}") for r in (0, 1)])
        try:
            deadline = time.monotonic() + 30
            while not (index.num_blocks("rank0") and index.num_blocks("rank1")):
                assert time.monotonic() < deadline, "a replica's stream is not on its ports"
                sub.poll(100)
        finally:
            sub.close()
