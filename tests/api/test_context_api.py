"""A session's context policy through the HTTP layer, in process on the real engine: a turn that gives only a
budget (or only a policy) keeps the rest of the session's setting, and ``X-KVKeeper-Context`` reports the
prompt's tokens under the ``full`` policy too."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402
from tests.utils.sessionutil import sessions_of  # noqa: E402

from kvkeeper.api.app import create_app  # noqa: E402
from kvkeeper.api.engine_client.async_engine import AsyncEngine  # noqa: E402


def _report(r) -> dict:
    return dict(kv.split("=", 1) for kv in r.headers["x-kvkeeper-context"].split("; "))


def test_a_budget_only_turn_keeps_the_sessions_policy(engine):
    # a turn with only X-Context-Budget switched a `last` session to the server's default policy (full)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
    with TestClient(create_app(AsyncEngine(engine, sessions_of(engine)), "m")) as c:
        def turn(**headers):
            r = c.post("/v1/chat/completions", json=body, headers={"X-Session-ID": "qa-ctx", **headers})
            assert r.status_code == 200, r.text
            return r, _report(r)

        try:
            _, rep = turn(**{"X-Context-Policy": "last", "X-Context-Budget": "100"})
            assert (rep["policy"], rep["budget"]) == ("last", "100")
            _, rep = turn(**{"X-Context-Budget": "200"})
            assert (rep["policy"], rep["budget"]) == ("last", "200")
            _, rep = turn()
            assert (rep["policy"], rep["budget"]) == ("last", "200")
            r, rep = turn(**{"X-Context-Policy": "full"})
            assert rep["policy"] == "full"
            # it said prompt_tokens=0 under `full`
            assert int(rep["prompt_tokens"]) == r.json()["usage"]["prompt_tokens"] > 0
        finally:
            c.delete("/v1/sessions/qa-ctx")
