"""Tenants and API keys (issue 18): who may read, list, delete and dump which session, per-tenant cache
namespaces and quotas, the admin surface, hashed salts in the disk tier.

One in-process server (a tiny random Llama, ``build_server`` + FastAPI's TestClient) is shared by the module;
generations are 2 tokens long.
"""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkeeper import SamplingParams
from kvkeeper.api.common.auth import KeyRing, KeysFileError, load_keys_file
from kvkeeper.api.server import ServerConfig, build_server
from kvkeeper.kvcache.block_pool import block_hash
from kvkeeper.kvcache.namespace import Namespace, salt_hash, tenant_namespace
from kvkeeper.sessions import SessionConfig, SessionManager
from kvkeeper.sessions.disk import FORMAT, FORMAT_V1, MANIFEST, session_dir_name
from tests.utils.tiny_models import tiny_llama_folder
from tests.utils.engines import make_engine

KEYS = {"sk-alice-1": {"tenant": "alice", "max_sessions": 50},
        "sk-bob-1": "bob",
        "sk-ops-1": {"tenant": "ops", "admin": True},
        "sk-tiny-1": {"tenant": "tiny", "max_sessions": 1},
        "sk-pinny-1": {"tenant": "pinny", "max_pinned_blocks": 2}}
ALICE, BOB, OPS = ({"Authorization": f"Bearer {k}"} for k in ("sk-alice-1", "sk-bob-1", "sk-ops-1"))
WRONG = {"Authorization": "Bearer sk-nobody"}
NOKEY: dict = {}
PIN = "My PIN is 48213, keep it secret."


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("tiny-tenants"))


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("keys") / "keys.json"
    p.write_text(json.dumps({"keys": KEYS}))
    return p


def _server(folder, keys_file, data_dir, **server):
    eng = make_engine(str(folder), num_kv_blocks=256, block_size=4)
    config = ServerConfig(api_keys_file=str(keys_file), **server)
    return build_server(eng, config, SessionConfig(data_dir=str(data_dir)))


@pytest.fixture(scope="module")
def client(folder, keys_file, tmp_path_factory):
    with TestClient(_server(folder, keys_file, tmp_path_factory.mktemp("data"))) as c:
        yield c


def _turn(c, headers, sid, content="Hello there, how are you today?", salt=None, status=200):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = c.post("/v1/chat/completions", json=body, headers={**headers, "X-Session-ID": sid})
    assert r.status_code == status, r.text
    return r


def _listed(c, headers) -> dict:
    r = c.get("/v1/sessions", headers=headers)
    assert r.status_code == 200, r.text
    return {s["id"]: s for s in r.json()["data"]}


def _is_error(r, status: int, typ: str) -> None:
    assert r.status_code == status, (r.request.url, r.text)
    err = r.json()["error"]
    assert err["type"] == typ and err["message"], err


# ---- the route table: every route has a rule, and each rule holds for owner, other tenant, no key, wrong key ----

def _open(c, sid: str) -> dict:
    _turn(c, ALICE, sid, PIN)
    return _listed(c, ALICE)[sid]


def _check_public(c, method, path, sid):
    for h in (NOKEY, WRONG, ALICE):
        assert c.request(method, path, headers=h).status_code == 200


def _check_keyed(c, method, path, sid):
    bodies = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
              "/v1/completions": {"prompt": "hi", "max_tokens": 2}, "/tokenize": {"prompt": "hi"},
              "/detokenize": {"tokens": [1, 2]}, "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
              "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
    path = path.replace("{model_id:path}", c.app.state.model_name)
    kw = {"json": bodies[path]} if path in bodies else {}
    for h in (NOKEY, WRONG):
        _is_error(c.request(method, path, headers=h, **kw), 401, "authentication_error")
    for h in (ALICE, BOB):
        assert c.request(method, path, headers=h, **kw).status_code == 200


def _check_owned(c, method, path, sid):
    """A route on one session: only its owner reaches it; the others get 401 / 404 and change nothing."""
    before = _open(c, sid)
    url = path.replace("{sid}", sid)
    for h, status, typ in ((NOKEY, 401, "authentication_error"), (WRONG, 401, "authentication_error"),
                           (BOB, 404, "not_found_error"), (OPS, 404, "not_found_error")):
        _is_error(c.request(method, url, headers=h), status, typ)
        assert _listed(c, ALICE)[sid] == before  # untouched: same tokens, blocks, tier
    r = c.request(method, url, headers=ALICE)
    assert r.status_code == 200, r.text
    assert r.json()["id"] == sid


def _check_listing(c, method, path, sid):
    _open(c, sid)
    for h in (NOKEY, WRONG):
        _is_error(c.request(method, path, headers=h), 401, "authentication_error")
    assert sid in _listed(c, ALICE) and sid not in _listed(c, BOB) and sid not in _listed(c, OPS)


def _check_dump(c, method, path, sid):
    _open(c, sid)
    for h, q, status, typ in ((NOKEY, {}, 401, "authentication_error"), (WRONG, {}, 401, "authentication_error"),
                              (BOB, {}, 404, "not_found_error"), (BOB, {"tenant": "alice"}, 404, "not_found_error"),
                              (OPS, {}, 404, "not_found_error")):
        _is_error(c.request(method, path, headers=h, params={"session": sid, **q}), status, typ)
    for h, q in ((ALICE, {}), (OPS, {"tenant": "alice"})):
        r = c.request(method, path, headers=h, params={"session": sid, **q})
        assert r.status_code == 200 and r.content[:8], r.text


def _check_admin(c, method, path, sid):
    for h in (NOKEY, WRONG):
        _is_error(c.request(method, path, headers=h), 401, "authentication_error")
    for h in (ALICE, BOB):
        _is_error(c.request(method, path, headers=h), 403, "permission_error")
    assert c.request(method, path, headers=OPS).status_code == 200


def _check_lora(c, method, path, sid):
    """Loading adapters reads this machine's directories: admin keys only (and then --allow-runtime-lora)."""
    body = {"lora_name": "a", "lora_path": "/nonexistent"} if "unload" not in path else {"lora_name": "a"}
    for h in (NOKEY, WRONG):
        _is_error(c.request(method, path, headers=h, json=body), 401, "authentication_error")
    for h in (ALICE, BOB):
        _is_error(c.request(method, path, headers=h, json=body), 403, "permission_error")
    r = c.request(method, path, headers=OPS, json=body)
    assert r.status_code == 403 and "--allow-runtime-lora" in r.text, r.text


def _check_owned_session_file(c, method, path, sid):
    """Fork and export of one session: only its owner reaches them (the others get 401 / 404)."""
    _open(c, sid)
    url = path.replace("{sid}", sid)
    for h, status, typ in ((NOKEY, 401, "authentication_error"), (WRONG, 401, "authentication_error"),
                           (BOB, 404, "not_found_error"), (OPS, 404, "not_found_error")):
        _is_error(c.request(method, url, headers=h), status, typ)
    r = c.request(method, url, headers=ALICE)
    assert r.status_code == 200, r.text
    assert r.json()["forked_from"] == sid if path.endswith("/fork") else r.content.startswith(b"KVKSESS1")


def _check_import(c, method, path, sid):
    """Importing a session file puts its KV in the prefix cache: admin keys only."""
    _open(c, sid)
    data = c.get(f"/v1/sessions/{sid}/export", headers=ALICE).content
    for h in (NOKEY, WRONG):
        _is_error(c.request(method, path, headers=h, content=data), 401, "authentication_error")
    for h in (ALICE, BOB):
        _is_error(c.request(method, path, headers=h, content=data), 403, "permission_error")
    r = c.request(method, path, headers=OPS, content=data, params={"tenant": "alice", "id": sid + "-imported"})
    assert r.status_code == 200 and r.json()["tenant"] == "alice", r.text
    assert sid + "-imported" in _listed(c, ALICE)


_BODIES = {("POST", "/v1/responses"): {"input": "hi", "max_output_tokens": 2},
           ("POST", "/v1/conversations"): {"items": [{"role": "user", "content": "hi"}]},
           ("POST", "/v1/conversations/{cid}"): {"metadata": {"k": "v"}},
           ("POST", "/v1/conversations/{cid}/items"): {"items": [{"role": "user", "content": "more"}]}}


def _check_stored(c, method, path, sid):
    """Stored responses and conversations: any key may create its own; on one of alice's, every other caller
    gets 401 / 404 and only alice 200."""
    body = _BODIES.get((method, path))
    if "{" not in path:
        for h in (NOKEY, WRONG):
            _is_error(c.request(method, path, headers=h, json=body), 401, "authentication_error")
        for h in (ALICE, BOB):
            assert c.request(method, path, headers=h, json=body).status_code == 200
        return
    rid = c.post("/v1/responses", headers=ALICE, json={"input": PIN, "max_output_tokens": 2}).json()["id"]
    cid = c.post("/v1/conversations", headers=ALICE, json=_BODIES[("POST", "/v1/conversations")]).json()["id"]
    iid = c.get(f"/v1/conversations/{cid}/items", headers=ALICE).json()["data"][0]["id"]
    url = path.replace("{rid}", rid).replace("{cid}", cid).replace("{iid}", iid)
    for h, status, typ in ((NOKEY, 401, "authentication_error"), (WRONG, 401, "authentication_error"),
                           (BOB, 404, "not_found_error"), (OPS, 404, "not_found_error")):
        _is_error(c.request(method, url, headers=h, json=body), status, typ)
    assert c.request(method, url, headers=ALICE, json=body).status_code == 200


RULES = {
    ("GET", "/health"): _check_public, ("GET", "/metrics"): _check_public, ("GET", "/openapi.json"): _check_public,
    ("GET", "/v1/models"): _check_keyed, ("GET", "/v1/models/{model_id:path}"): _check_keyed,
    ("POST", "/v1/chat/completions"): _check_keyed, ("POST", "/v1/completions"): _check_keyed,
    ("POST", "/tokenize"): _check_keyed, ("POST", "/detokenize"): _check_keyed,
    ("POST", "/v1/messages"): _check_keyed, ("POST", "/v1/messages/count_tokens"): _check_keyed,
    ("GET", "/tokenizer_info"): _check_keyed,
    ("GET", "/v1/sessions"): _check_listing,
    ("DELETE", "/v1/sessions/{sid}"): _check_owned, ("POST", "/v1/sessions/{sid}/offload"): _check_owned,
    ("GET", "/admin/kv/dump"): _check_dump,
    ("GET", "/admin/kv"): _check_admin, ("GET", "/admin/kv.json"): _check_admin,
    ("GET", "/admin/breaker"): _check_admin, ("GET", "/admin/sessions"): _check_admin,
    ("GET", "/admin/health"): _check_admin, ("GET", "/admin/cache/misses"): _check_admin,
    ("POST", "/v1/load_lora_adapter"): _check_lora, ("POST", "/v1/unload_lora_adapter"): _check_lora,
    ("POST", "/v1/sessions/{sid}/fork"): _check_owned_session_file,
    ("GET", "/v1/sessions/{sid}/export"): _check_owned_session_file,
    ("POST", "/admin/sessions/import"): _check_import, ("POST", "/admin/kv/reset_prefix_cache"): _check_admin,
    **{(m, p): _check_stored for m, p in (
        ("POST", "/v1/responses"), ("GET", "/v1/responses/{rid}"), ("DELETE", "/v1/responses/{rid}"),
        ("GET", "/v1/responses/{rid}/input_items"), ("POST", "/v1/conversations"), ("GET", "/v1/conversations/{cid}"),
        ("POST", "/v1/conversations/{cid}"), ("DELETE", "/v1/conversations/{cid}"),
        ("GET", "/v1/conversations/{cid}/items"), ("POST", "/v1/conversations/{cid}/items"),
        ("GET", "/v1/conversations/{cid}/items/{iid}"), ("DELETE", "/v1/conversations/{cid}/items/{iid}"))},
}


def _routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route (HEAD left out), routers included by ``include_router`` walked into (FastAPI
    >= 0.130 keeps them as included routers; earlier versions copy their routes into the app's list)."""
    out = []

    def walk(routes, prefix: str):
        for r in routes:
            inner = getattr(r, "original_router", None)
            if inner is not None:
                walk(inner.routes, prefix + r.include_context.prefix)
                continue
            out.extend((m, prefix + r.path) for m in sorted(getattr(r, "methods", None) or ()) if m != "HEAD")

    walk(app.routes, "")
    return out


def test_every_route_has_an_access_rule_and_keeps_it(client):
    """Over the app's route list: a route without a rule here fails (a new route must say who may call it)."""
    routes = _routes(client.app)
    missing = [r for r in routes if r not in RULES]
    assert not missing, f"routes without an access rule in RULES: {missing}"
    assert set(routes) == set(RULES), f"rules of routes that are gone: {set(RULES) - set(routes)}"
    for i, (method, path) in enumerate(routes):
        RULES[(method, path)](client, method, path, f"route-{i}")


def test_admins_list_every_tenants_sessions_with_their_tenant(client):
    """/v1/sessions lists the caller's own; /admin/sessions (admin key) lists every tenant's, labelled."""
    _turn(client, ALICE, "ops-view", PIN)
    _turn(client, BOB, "ops-view", PIN)
    r = client.get("/admin/sessions", headers=OPS)
    assert r.status_code == 200, r.text
    rows = [x for x in r.json()["data"] if x["id"] == "ops-view"]
    assert sorted(x["tenant"] for x in rows) == ["alice", "bob"], rows
    assert all(x["tokens"] > 0 and x["tier"] == "pool" for x in rows), rows
    assert "ops-view" not in _listed(client, OPS)  # the admin's own listing stays its own tenant's
    for h in (ALICE, BOB):
        client.delete("/v1/sessions/ops-view", headers=h)
    assert not [x for x in client.get("/admin/sessions", headers=OPS).json()["data"] if x["id"] == "ops-view"]


def test_the_same_id_is_two_sessions_for_two_tenants(client):
    _turn(client, ALICE, "twin", PIN)
    _turn(client, BOB, "twin", "A different and much longer first message from bob, about the weather in May.")
    a, b = _listed(client, ALICE)["twin"], _listed(client, BOB)["twin"]
    assert a["tokens"] != b["tokens"] and a["turns"] == b["turns"] == 1
    assert client.delete("/v1/sessions/twin", headers=BOB).status_code == 200
    assert _listed(client, ALICE)["twin"] == a and "twin" not in _listed(client, BOB)


def test_prefix_cache_hits_stay_inside_a_tenant(client):
    prompt = "A shared system-like preamble that is long enough to fill several blocks of four tokens each. " * 3

    def cached(h, salt=None):
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **({"cache_salt": salt} if salt else {})}
        r = client.post("/v1/completions", json=body, headers=h)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(ALICE) == 0 and cached(ALICE) > 0  # the tenant's own second request hits
    assert cached(BOB) == 0  # another tenant never does
    assert cached(ALICE, "narrow") == 0 and cached(ALICE, "narrow") > 0  # a salt narrows alice's namespace
    assert cached(BOB, "narrow") == 0  # and never joins another tenant's namespace of the same salt


def test_metrics_name_no_session_and_hold_no_text(client):
    _turn(client, ALICE, "metrics-secret-session", PIN)
    text = client.get("/metrics").text
    # the PIN as a number of its own: a latency such as 0.05648213... holds its digits by chance
    assert "metrics-secret-session" not in text and not re.search(r"(?<![\d.])48213(?!\d)", text)
    assert "alice" not in text and "My PIN" not in text
    assert not re.search(r'session(_id)?="', text)


def test_tenant_quotas_answer_429_with_retry_after(client):
    tiny = {"Authorization": "Bearer sk-tiny-1"}
    _turn(client, tiny, "t1")
    r = _turn(client, tiny, "t2", status=429)
    assert r.json()["error"]["code"] == "tenant_quota_exceeded" and int(r.headers["Retry-After"]) > 0
    assert set(_listed(client, tiny)) == {"t1"}  # the refused request opened nothing
    _turn(client, tiny, "t1", "Hello there, how are you today? Still here.")  # its open session goes on
    assert client.delete("/v1/sessions/t1", headers=tiny).status_code == 200
    _turn(client, tiny, "t2")

    pinny = {"Authorization": "Bearer sk-pinny-1"}
    _turn(client, pinny, "p1", "A first message long enough to pin more than two blocks of four tokens.")
    assert _listed(client, pinny)["p1"]["blocks"] > 2
    r = _turn(client, pinny, "p2", status=429)
    assert "pin" in r.json()["error"]["message"] and "Retry-After" in r.headers
    assert client.post("/v1/sessions/p1/offload", headers=pinny).json()["tier"] == "host"
    _turn(client, pinny, "p2", "Short one.")


def test_admin_port_serves_admin_routes_apart(folder, keys_file, tmp_path):
    app = _server(folder, keys_file, tmp_path, admin_port=1)
    assert not [p for _, p in _routes(app) if p.startswith("/admin")]
    admin = app.state.admin_app
    assert {p for _, p in _routes(admin)} == {p for _, p in RULES if p.startswith("/admin")}
    with TestClient(app) as c, TestClient(admin) as a:
        _is_error(c.get("/admin/kv.json", headers=OPS), 404, "not_found_error")
        _is_error(a.get("/admin/kv.json"), 401, "authentication_error")
        _is_error(a.get("/admin/kv.json", headers=ALICE), 403, "permission_error")
        assert a.get("/admin/kv.json", headers=OPS).status_code == 200
        _turn(c, ALICE, "over-there", PIN)
        assert a.get("/admin/kv/dump", params={"session": "over-there"}, headers=ALICE).status_code == 200
        _is_error(a.get("/admin/kv/dump", params={"session": "over-there"}, headers=BOB), 404, "not_found_error")


# ---- restart: each tenant's sessions come back to that tenant only; salts are hashed on disk ----

def test_a_restart_restores_each_tenants_sessions_to_that_tenant_only(folder, keys_file, tmp_path):
    with TestClient(_server(folder, keys_file, tmp_path)) as c:
        _turn(c, ALICE, "s1", PIN, salt="alice-very-secret-salt")
        _turn(c, BOB, "s1", "Bob's own first message, which is not alice's at all.")
        _turn(c, BOB, "bob-only")
        before_a, before_b = _listed(c, ALICE), _listed(c, BOB)
    manifests = [p.read_text() for p in (tmp_path / "sessions").glob("*/" + MANIFEST)]
    assert len(manifests) == 3
    for text in manifests:  # no plain salt on disk; each manifest names its tenant
        man = json.loads(text)
        assert man["format"] == FORMAT and man["tenant"] in ("alice", "bob")
        assert "alice-very-secret-salt" not in text
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", man["namespace"]["tenant_salt"])
    with TestClient(_server(folder, keys_file, tmp_path)) as c:
        after_a, after_b = _listed(c, ALICE), _listed(c, BOB)
        assert set(after_a) == {"s1"} and set(after_b) == {"s1", "bob-only"}
        assert after_a["s1"]["tier"] == "disk" and after_a["s1"]["tokens"] == before_a["s1"]["tokens"]
        assert after_b["s1"]["tokens"] == before_b["s1"]["tokens"]
        assert _listed(c, OPS) == {}
        _is_error(c.delete("/v1/sessions/bob-only", headers=ALICE), 404, "not_found_error")
        r = c.post("/v1/chat/completions", headers={**ALICE, "X-Session-ID": "s1"}, json={
            "messages": [{"role": "user", "content": PIN}, {"role": "assistant", "content": "x"},
                         {"role": "user", "content": "What was it?"}], "max_tokens": 2,
            "cache_salt": "alice-very-secret-salt"})
        assert r.status_code == 200, r.text
        assert _listed(c, ALICE)["s1"]["tier"] == "pool" and _listed(c, BOB)["s1"]["tier"] == "disk"


def test_a_first_format_manifest_with_a_plain_salt_is_migrated(folder, tmp_path):
    eng = make_engine(str(folder), num_kv_blocks=64, block_size=4)
    ns = Namespace(eng.namespace.model_revision, tenant_salt="old-plain-salt", kv_dtype=eng.namespace.kv_dtype)
    s = SessionManager(eng, data_dir=tmp_path).open(session_id="old")
    seq = s.begin_turn(messages=[{"role": "user", "content": "Hello there, how are you?"}],
                       params=SamplingParams(max_tokens=2, ignore_eos=True), namespace=ns)
    eng.run_until_done([seq])
    s.offload("disk")
    path = tmp_path / "sessions" / session_dir_name("old") / MANIFEST
    man = json.loads(path.read_text())
    old = {k: v for k, v in man.items() if k not in ("tenant", "name")}
    path.write_text(json.dumps({**old, "format": FORMAT_V1, "namespace": {**man["namespace"],
                                                                          "tenant_salt": "old-plain-salt"}}))
    eng2 = make_engine(str(folder), num_kv_blocks=64, block_size=4)
    s2 = SessionManager(eng2, data_dir=tmp_path).get("old")
    text = path.read_text()
    assert "old-plain-salt" not in text and json.loads(text)["format"] == FORMAT and s2.tenant is None
    seq = s2.begin_turn(messages=[{"role": "user", "content": "Hello there, how are you?"},
                                  {"role": "assistant", "content": "fine"}, {"role": "user", "content": "Good."}],
                        params=SamplingParams(max_tokens=2, ignore_eos=True), namespace=ns)
    assert seq.num_handed_over > 0  # restored from disk under the same (now hashed) namespace


# ---- keys files ----

def test_keys_files_json_and_toml(tmp_path):
    t = tmp_path / "k.toml"
    t.write_text('[keys."sk-a"]\ntenant = "a"\nmax_pinned_blocks = 64\n[keys."sk-b"]\ntenant = "b"\nadmin = true\n')
    ring = KeyRing.from_file(t)
    a, b = ring.lookup("sk-a"), ring.lookup("sk-b")
    assert (a.tenant, a.admin, a.quota.max_pinned_blocks, a.quota.max_sessions) == ("a", False, 64, None)
    assert (b.tenant, b.admin, b.quota) == ("b", True, None) and ring.lookup("sk-c") is None
    bad = [({"keys": {}}, "non-empty 'keys'"), ({"keys": {"k1": {"tenant": "a/b"}}}, "tenant must be"),
           ({"keys": {"k1": {"tenant": "a", "max_sessions": 0}}}, "positive integer"),
           ({"keys": {"k1": {"tenant": "a", "colour": 1}}}, "unknown field 'colour'"),
           ({"keys": {"k1": {"tenant": "a", "max_sessions": 2}, "k2": "a"}}, "other limits"),
           ({"keys": {"k 1": "a"}}, "white space")]
    for doc, msg in bad:
        p = tmp_path / "bad.json"
        p.write_text(json.dumps(doc))
        with pytest.raises(KeysFileError, match=msg) as e:
            KeyRing.from_file(p)
        assert "k1" not in str(e.value) and "k2" not in str(e.value)  # a key is never echoed
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(KeysFileError, match="not valid JSON"):
        load_keys_file(tmp_path / "broken.json")


# ---- property: prefix-cache namespaces never meet across tenants ----

_names = st.one_of(st.none(), st.text(st.sampled_from("abAB09._-"), min_size=1, max_size=6))
_salts = st.one_of(st.none(), st.text(min_size=1, max_size=12))


@settings(max_examples=300, deadline=None)
@given(_names, _salts, _names, _salts, st.lists(st.integers(0, 50_000), min_size=4, max_size=24))
def test_block_hashes_never_shared_across_tenant_namespaces(t1, s1, t2, s2, tokens):
    """Two (tenant, salt) pairs that differ give different namespaces and so different chained block hashes for
    every block of the same tokens; a tenant's namespace is never the engine's own (unsalted) one."""
    base = Namespace("rev", kv_dtype="bf16")
    n1, n2 = tenant_namespace(base, t1, s1), tenant_namespace(base, t2, s2)
    if t1 is not None:
        assert n1 != base and n1.tenant_salt == salt_hash(t1, s1)
    same = (t1 or "", s1 or "") == (t2 or "", s2 or "")
    assert (n1 == n2) == same
    h1 = h2 = None
    for i in range(0, len(tokens) - 3, 4):
        h1, h2 = block_hash(h1, n1, tokens[i:i + 4]), block_hash(h2, n2, tokens[i:i + 4])
        assert (h1 == h2) == same


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alice", "bob", None]), st.sampled_from([None, "s1", "s2"])),
                min_size=2, max_size=5))
def test_engine_reuses_a_prefix_only_inside_its_namespace(tiny_engine, owners):
    """Requests of the same prompt from a sequence of (tenant, salt) owners: a request gets cached tokens
    exactly when an earlier request had the same owner."""
    eng = tiny_engine
    eng.pool.reset_prefix_cache()
    prompt = list(range(300, 340))
    seen = set()
    for tenant, salt in owners:
        ns = tenant_namespace(eng.namespace, tenant, salt)
        out = eng.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True), namespace=ns)[0]
        assert (out.cached_tokens > 0) == ((tenant, salt) in seen), (tenant, salt, seen)
        seen.add((tenant, salt))


@pytest.fixture(scope="module")
def tiny_engine(folder):
    return make_engine(str(folder), num_kv_blocks=128, block_size=4)


# ---- the command line: $KVKEEPER_API_KEY, --admin-port on 127.0.0.1, the warning without keys ----

def test_serve_reads_the_key_from_the_environment_and_splits_the_admin_port(folder, tmp_path):
    import os

    import httpx
    from tests.utils.serverproc import free_port, server_process

    admin_port = free_port()
    env = {**os.environ, "KVKEEPER_API_KEY": "sk-from-env"}
    with server_process(tmp_path / "keyed.log", "--model", str(folder), "--kv-blocks", "64", "--admin-port",
                        str(admin_port), env=env, timeout_s=120) as (base, _):
        assert httpx.get(base + "/v1/models").status_code == 401
        h = {"Authorization": "Bearer sk-from-env"}
        assert httpx.get(base + "/v1/models", headers=h).status_code == 200
        assert httpx.get(base + "/admin/kv.json", headers=h).status_code == 404  # not on the public port
        admin = f"http://127.0.0.1:{admin_port}"
        assert httpx.get(admin + "/admin/kv.json").status_code == 401
        assert httpx.get(admin + "/admin/kv.json", headers=h).json()["num_blocks"] == 64
    log = (tmp_path / "keyed.log").read_text()
    assert "sk-from-env" not in log and "no API keys" not in log and "Traceback" not in log

    with server_process(tmp_path / "open.log", "--model", str(folder), "--kv-blocks", "64", timeout_s=120) as (b, _):
        assert httpx.get(b + "/v1/models").status_code == 200
    assert "no API keys" in (tmp_path / "open.log").read_text()

    (tmp_path / "bad.json").write_text('{"keys": {"sk-x": {"tenant": "no/slash"}}}')
    r = _cli_serve("--model", str(folder), "--api-keys-file", str(tmp_path / "bad.json"))
    assert r.returncode == 2 and "tenant must be" in r.stderr and "Traceback" not in r.stderr


def _cli_serve(*args):
    import subprocess
    import sys

    from tests.utils.serverproc import free_port

    return subprocess.run([sys.executable, "-m", "kvkeeper.cli", "serve", "--port", str(free_port()), *args],
                          capture_output=True, text=True, timeout=120)
