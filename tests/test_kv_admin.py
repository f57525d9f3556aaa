"""Fragmentation telemetry in /metrics, the block map (/admin/kv.json, /admin/kv, `kvkeeper kv map`).

The screenshot test loads /admin/kv in headless Chromium and checks that blocks of different
states are drawn in different colours.  It skips only when Chromium is missing outside CI; with
CI set (CI=true, as .ci/run does) a missing Chromium is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvkeeper.api.metrics import ServerMetrics
from kvkeeper.kvcache.block_pool import BlockPool
from kvkeeper.kvcache.blockmap import SHARED, STATE_COLOURS, block_map, check_block_map, owner_colour
from kvkeeper.kvcache.namespace import Namespace
from kvkeeper.kvcache.telemetry import FragmentationMonitor, pool_stats
from serverproc import running_server

NUM_BLOCKS = 64
WINDOWS = {"1s", "10s", "60s"}
FRAG_METRICS = ("kvkeeper:kv_fragmentation_internal", "kvkeeper:kv_fragmentation_external",
                "kvkeeper:kv_fragmentation_rate")


def seq(table, kv_tokens):
    return SimpleNamespace(block_table=table, num_computed=kv_tokens, kv_offset=0)


def parse_metrics(text: str) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def hex_rgb(h: str) -> tuple[int, int, int]:
    return tuple(int(h[i:i + 2], 16) for i in (1, 3, 5))


# ---- block map document (no model) ------------------------------------------------------


def mixed_pool():
    """Pool of 12 blocks of 4: a owns 0-2 (9 tokens), b owns 3 and shares 0 with a, 4-5 cached, rest free."""
    pool = BlockPool(12, 4)
    ns = Namespace("rev")
    a = pool.allocate(3)
    b = pool.allocate(1) + pool.fork([a[0]])
    c = pool.allocate(2)
    pool.register(c[0], None, ns, [1, 2, 3, 4])
    pool.register(c[1], 7, ns, [5, 6, 7, 8])
    pool.free_all(c)
    owners = [("req-a", seq(a, 9)), ("session:b", seq([b[1], b[0]], 5))]
    return pool, owners, a, b, c


def test_block_map_states_owners_and_shared_blocks():
    pool, owners, a, b, c = mixed_pool()
    doc = block_map(pool, owners)
    check_block_map(doc)
    assert doc["states"] == "ooooccffffff"
    assert doc["owner"][a[0]] == SHARED and doc["shared"] == [[a[0], [0, 1]]]
    assert doc["owner"][a[1]] == doc["owner"][a[2]] == 0 and doc["owner"][b[0]] == 1
    assert all(o == -1 for o in doc["owner"][4:])
    assert [(o["name"], o["kind"], o["blocks"], o["tokens"]) for o in doc["owners"]] == \
        [("req-a", "request", 3, 9), ("session:b", "session", 2, 5)]
    s = doc["stats"]
    assert (s["free"], s["cached"], s["owned"]) == (6, 2, 4)
    assert set(doc["windows"]) == WINDOWS and json.loads(json.dumps(doc)) == doc


def test_check_block_map_rejects_malformed_documents():
    pool, owners, *_ = mixed_pool()
    doc = block_map(pool, owners)
    with pytest.raises(ValueError, match="12 blocks has 11 states"):
        check_block_map({**doc, "states": doc["states"][:-1]})
    with pytest.raises(ValueError, match="unknown block state"):
        check_block_map({**doc, "states": "x" * 12})
    with pytest.raises(ValueError, match="owner index out of range"):
        check_block_map({**doc, "owner": [5] * 12})
    with pytest.raises(ValueError, match="GET /admin/kv.json"):
        check_block_map({"hello": 1})


def test_owner_colours_are_stable_per_name_and_clear_of_state_colours():
    import colorsys

    from kvkeeper.kvcache.blockmap import owner_hue

    names = ["req-a", "session:b", "session:conv-a", "session:conv-b", "session:x-0", "cmpl-3-0"]
    hues = [owner_hue(n) for n in names]
    assert len(set(hues)) == len(names) and all(20 <= h <= 160 for h in hues)
    assert owner_hue("session:b") == owner_hue("session:b") and owner_hue("") == 20 + 0x811C9DC5 % 141
    state_hues = {k: colorsys.rgb_to_hls(*[c / 255 for c in hex_rgb(v)])[0] * 360 for k, v in STATE_COLOURS.items()
                  if k != "owned"}
    for k, h in state_hues.items():  # grey has no hue; blue, pink and purple sit outside 20..160
        assert k == "free" or not 15 <= h <= 165, (k, h)


# ---- metrics export (ServerMetrics directly) ------------------------------------------------


def test_metrics_export_windows_and_block_states():
    pool, owners, *_ = mixed_pool()
    t = [0.0]
    mon = FragmentationMonitor(clock=lambda: t[0])
    mon.record(pool_stats(pool, owners))
    t[0] = 5.0
    pool.free_all(pool.allocate(3))  # pool changes: different figures in the 1 s and 60 s windows
    st = pool_stats(pool, owners)
    mon.record(st)
    m = ServerMetrics()
    m.update({"kv_fragmentation": mon.windows(),
              "kv_block_states": {"free": st.free, "cached": st.cached, "owned": st.owned, "offloaded": 0}})
    got = parse_metrics(m.render().decode())
    for name in FRAG_METRICS:
        assert {dict(k)["window"] for k in got[name]} == WINDOWS
        assert all(0.0 <= v <= 1.0 for v in got[name].values())
    fig = mon.windows()
    assert got["kvkeeper:kv_fragmentation_internal"][(("window", "60s"),)] == pytest.approx(fig["60s"]["internal"])
    assert got["kvkeeper:kv_fragmentation_external"][(("window", "1s"),)] == pytest.approx(st.external)
    blocks = {dict(k)["state"]: v for k, v in got["kvkeeper:kv_blocks"].items()}
    assert blocks == {"free": st.free, "cached": st.cached, "owned": st.owned, "offloaded": 0}
    assert blocks["free"] + blocks["cached"] + blocks["owned"] == pool.num_blocks


# ---- terminal map ----------------------------------------------------------------------------


def record_map(doc, width=60, max_rows=32):
    from rich.console import Console

    from kvkeeper.diagnostics.kvmap import render_block_map

    con = Console(record=True, width=width, color_system="truecolor", force_terminal=True)
    con.print(render_block_map(doc, width=width, max_rows=max_rows))
    return con


def test_terminal_map_legend_counts_and_cell_colours():
    from kvkeeper.diagnostics.kvmap import grid_cells

    pool, owners, a, b, c = mixed_pool()
    doc = block_map(pool, owners)
    con = record_map(doc)
    text = con.export_text(styles=False, clear=False)
    assert "KV block map: 12 blocks of 4 tokens" in text
    for part in ("free 6", "cached 2", "owned 3", "shared 1", "offloaded 0"):
        assert part in text
    assert "req-a  3 blocks, 9 tokens" in text and "session:b  2 blocks, 5 tokens" in text
    assert "internal" in text and "pool rate" in text and "60s" in text
    cells, k = grid_cells(doc, 29, 32)
    assert k == 1 and [x[0] for x in cells] == ["shared", "owned", "owned", "owned", "cached", "cached"] + ["free"] * 6
    html = con.export_html(inline_styles=True)
    for colour in (STATE_COLOURS["free"], STATE_COLOURS["cached"], STATE_COLOURS["shared"], owner_colour("req-a"),
                   owner_colour("session:b")):
        assert colour in html, colour


def test_terminal_map_aggregates_large_pools():
    from kvkeeper.diagnostics.kvmap import grid_cells

    pool = BlockPool(1000, 16)
    t = pool.allocate(700)
    doc = block_map(pool, [("r", seq(t, 700 * 16))])
    cells, k = grid_cells(doc, 20, 10)  # 200 cells for 1000 blocks
    assert k == 5 and len(cells) == 200
    assert cells.count(("owned", 0)) == 140 and cells.count(("free",)) == 60
    text = record_map(doc, width=41, max_rows=10).export_text(styles=False)
    assert "1 cell = 5 blocks" in text and "owned 700" in text and "free 300" in text


# ---- a real server ---------------------------------------------------------------------------


def chat(base, content, session=None, max_tokens=8):
    headers = {"X-Session-ID": session} if session else {}
    r = httpx.post(base + "/v1/chat/completions", headers=headers, timeout=120,
                   json={"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                         "temperature": 0})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server on a 64-block pool with two sessions (owned), one finished request (cached) and free blocks."""
    log = tmp_path_factory.mktemp("kvadmin") / "server.log"
    with running_server(log, "--kv-blocks", str(NUM_BLOCKS), "--max-new-tokens", "8") as base:
        chat(base, "Tell me a short story about a cat named Tom who lives in Paris and likes cheese.", "conv-a")
        chat(base, "Name three colours.", "conv-b")
        r = httpx.post(base + "/v1/completions", timeout=120, json={
            "prompt": "The history of the Roman empire begins with the founding of the city of Rome, which according "
                      "to legend happened in 753 BC, when the twins Romulus and Remus", "max_tokens": 4,
            "temperature": 0})
        assert r.status_code == 200, r.text
        yield base


def test_server_metrics_and_block_map_agree(server):
    doc = httpx.get(server + "/admin/kv.json", timeout=30).json()
    check_block_map(doc)
    assert doc["num_blocks"] == NUM_BLOCKS
    states = doc["states"]
    assert {"f", "c", "o"} <= set(states)
    sessions = {s["id"]: s["blocks"] for s in httpx.get(server + "/v1/sessions", timeout=30).json()["data"]}
    owners = {o["name"]: o["blocks"] for o in doc["owners"]}
    assert owners == {f"session:{k}": v for k, v in sessions.items()}
    # a block both sessions hold (a shared chat-template prefix) counts once in the pool
    assert states.count("o") == sum(sessions.values()) - sum(len(ids) - 1 for _, ids in doc["shared"])
    got = parse_metrics(httpx.get(server + "/metrics", timeout=30).text)
    for name in FRAG_METRICS:
        assert {dict(k)["window"] for k in got[name]} == WINDOWS
        assert all(0.0 <= v <= 1.0 for v in got[name].values())
    blocks = {dict(k)["state"]: v for k, v in got["kvkeeper:kv_blocks"].items()}
    assert set(blocks) == {"free", "cached", "owned", "offloaded"}
    assert blocks["free"] + blocks["cached"] + blocks["owned"] == NUM_BLOCKS
    assert (blocks["free"], blocks["cached"], blocks["owned"]) == \
        (states.count("f"), states.count("c"), states.count("o"))
    # owned blocks hold the sessions' KV: some slots of their last blocks are unused
    assert got["kvkeeper:kv_fragmentation_internal"][(("window", "1s"),)] > 0


def test_cli_kv_map_from_server(server, capsys):
    from kvkeeper.cli import main

    assert main(["kv", "map", "--server", server]) == 0
    out = capsys.readouterr().out
    doc = httpx.get(server + "/admin/kv.json", timeout=30).json()
    assert f"KV block map: {NUM_BLOCKS} blocks of 16 tokens" in out
    assert f"free {doc['stats']['free']}" in out and f"cached {doc['stats']['cached']}" in out
    assert "session:conv-a" in out and "session:conv-b" in out
    assert main(["kv", "map", "--server", server, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_blocks"] == NUM_BLOCKS


def test_cli_kv_map_unreachable_server(capsys):
    from kvkeeper.cli import main
    from serverproc import free_port

    assert main(["kv", "map", "--server", f"http://127.0.0.1:{free_port()}"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach" in err and "kvkeeper serve" in err


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        p = shutil.which(name)
        if p:
            return p
    return None


# Fixed page layout (see kvkeeper.api.admin): canvas at (16, 56) CSS px, cell 20 px, gap 2 px, 8 columns.
LEFT, TOP, CELL, GAP, COLS = 16, 56, 20, 2, 8


def test_admin_page_screenshot_colours_blocks_by_state(server, tmp_path):
    from PIL import Image

    chromium = find_chromium()
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed but CI is set: .ci/run must install it (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium); CI runs this test")
    html = httpx.get(server + "/admin/kv", timeout=30)
    assert html.status_code == 200 and "<canvas" in html.text
    assert "http://" not in html.text and "https://" not in html.text  # self-contained: no external asset
    doc = httpx.get(server + "/admin/kv.json", timeout=30).json()
    png = tmp_path / "kv.png"
    cmd = [chromium, "--headless", "--disable-gpu", "--no-sandbox", "--disable-dev-shm-usage", "--hide-scrollbars", "--force-device-scale-factor=1",
           f"--user-data-dir={tmp_path / 'profile'}", "--window-size=900,500", "--virtual-time-budget=4000",
           f"--screenshot={png}", server + f"/admin/kv?cell={CELL}&cols={COLS}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert png.exists(), r.stderr[-2000:]
    after = httpx.get(server + "/admin/kv.json", timeout=30).json()
    assert after["states"] == doc["states"] and after["owner"] == doc["owner"]  # the pool did not change meanwhile
    img = Image.open(png).convert("RGB")
    background = img.getpixel((5, img.height - 5))
    by_key: dict[tuple, set] = {}
    for i, (letter, owner) in enumerate(zip(doc["states"], doc["owner"])):
        x = LEFT + (i % COLS) * (CELL + GAP) + CELL // 2
        y = TOP + (i // COLS) * (CELL + GAP) + CELL // 2
        key = (letter,) if letter != "o" else ("o", owner)
        by_key.setdefault(key, set()).add(img.getpixel((x, y)))
    keys = sorted(by_key)
    assert ("f",) in by_key and ("c",) in by_key and any(k[0] == "o" for k in keys), keys
    for key, colours in by_key.items():
        assert len(colours) == 1, f"blocks {key} drawn in several colours: {colours}"
        assert background not in colours, f"blocks {key} not drawn (background colour)"
    colour_of = {k: next(iter(v)) for k, v in by_key.items()}
    assert len(set(colour_of.values())) == len(colour_of), f"different states or owners share a colour: {colour_of}"

    def close(got, want):
        return all(abs(a - b) <= 3 for a, b in zip(got, hex_rgb(want)))

    assert close(colour_of[("f",)], STATE_COLOURS["free"]) and close(colour_of[("c",)], STATE_COLOURS["cached"])
    for k, col in colour_of.items():
        if k[0] == "o" and k[1] >= 0:
            assert close(col, owner_colour(doc["owners"][k[1]]["name"])), (k, col)


def test_terminal_map_watch_refreshes_until_interrupted():
    from rich.console import Console

    from kvkeeper.diagnostics.kvmap import BlockMapFetchError, show

    pool, owners, *_ = mixed_pool()
    calls = []

    def get_doc():
        calls.append(1)
        if len(calls) > 3:
            raise KeyboardInterrupt
        if len(calls) == 2:
            raise BlockMapFetchError("cannot reach the test server")  # shown, then retried
        pool.free_all(pool.allocate(1))  # something changes between refreshes
        return block_map(pool, owners)

    con = Console(record=True, width=60, force_terminal=True)
    with pytest.raises(KeyboardInterrupt):
        show(con, get_doc, watch=True, interval=0.01)
    assert len(calls) == 4
    out = con.export_text()
    assert "KV block map: 12 blocks of 4 tokens" in out and "cannot reach the test server (retrying" in out
