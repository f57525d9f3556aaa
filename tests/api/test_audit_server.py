"""The reuse audit through the server: its counters in /metrics with every request audited, and the session dump
endpoint (/admin/kv/dump) with its errors (moved from tests/unit/diagnostics/test_audit.py: it starts a server)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch

from tests.utils.serverproc import running_server

pytestmark = pytest.mark.slow


def _metrics(base):
    out = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def test_server_counters_and_session_dump(tmp_path):
    from safetensors.torch import load

    from kvkeeper.cli import main

    with running_server(tmp_path / "server.log", "--audit-fraction", "1", "--kv-blocks", "256",
                        "--quantization", "none") as base:
        m0 = _metrics(base)
        assert m0["kvkeeper:kv_audit_total"] == 0 and m0["kvkeeper:kv_audit_mismatch_total"] == 0
        msgs = [{"role": "user", "content": "Name three colours."}]
        h = {"X-Session-ID": "audit-1"}
        body = {"messages": msgs, "max_tokens": 6, "temperature": 0}
        r = httpx.post(base + "/v1/chat/completions", json=body, headers=h, timeout=120).json()
        msgs += [r["choices"][0]["message"], {"role": "user", "content": "And three animals?"}]
        r2 = httpx.post(base + "/v1/chat/completions", json=body | {"messages": msgs}, headers=h, timeout=120).json()
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        for _ in range(50):  # the snapshot is refreshed right after the step that answered
            m = _metrics(base)
            if m["kvkeeper:kv_audit_total"] >= 2:
                break
            time.sleep(0.1)
        assert m["kvkeeper:kv_audit_total"] == 2
        assert m["kvkeeper:kv_audit_mismatch_total"] == 0 and m["kvkeeper:kv_audit_skipped_total"] == 0

        d = httpx.get(base + "/admin/kv/dump", params={"session": "audit-1", "layers": "0,29", "start": 2,
                                                       "end": 20}, timeout=60)
        assert d.status_code == 200
        tensors = load(d.content)
        assert sorted(tensors) == ["layers.0.k", "layers.0.v", "layers.29.k", "layers.29.v"]
        assert tensors["layers.29.v"].shape == (18, 3, 64) and tensors["layers.0.k"].dtype == torch.float32
        from safetensors import safe_open

        p = tmp_path / "s.safetensors"
        p.write_bytes(d.content)
        with safe_open(str(p), "pt") as f:
            meta = f.metadata()
        assert meta["source"] == "session:audit-1" and meta["token_start"] == "2" and meta["token_end"] == "20"
        assert meta["bytes_per_token"] == "46080" and json.loads(meta["namespace"])[0] == meta["model_revision"]
        nf = httpx.get(base + "/admin/kv/dump", params={"session": "nope"}, timeout=30)
        assert nf.status_code == 404 and "nope" in nf.json()["error"]["message"]
        bad = httpx.get(base + "/admin/kv/dump", params={"session": "audit-1", "layers": "0,99"}, timeout=30)
        assert bad.status_code == 400 and "layer 99" in bad.json()["error"]["message"]
        rng = httpx.get(base + "/admin/kv/dump", params={"session": "audit-1", "end": 100000}, timeout=30)
        assert rng.status_code == 400 and "outside" in rng.json()["error"]["message"]

        out = tmp_path / "cli.safetensors"
        assert main(["kv", "dump", "--server", base, "--session", "audit-1", "--layers", "0,29", "--start", "2",
                     "--end", "20", "-o", str(out)]) == 0
        assert main(["kv", "diff", str(out), str(p)]) == 0
        assert main(["kv", "dump", "--server", base, "--session", "nope", "-o", str(out)]) == 2
