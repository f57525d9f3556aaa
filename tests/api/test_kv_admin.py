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

from kvkeeper.api.engine_client.metrics import ServerMetrics
from kvkeeper.kvcache.block_pool import BlockPool
from kvkeeper.kvcache.blockmap import (OWNER_MIN_DELTA_E, OWNER_PALETTE, PAGE_BACKGROUND, SHARED, STATE_COLOURS,
                                      block_map, check_block_map, owner_colours, palette_slots)
from kvkeeper.kvcache.namespace import Namespace
from kvkeeper.kvcache.telemetry import FragmentationMonitor, pool_stats
from tests.utils.serverproc import running_server

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


def srgb_to_lab(rgb) -> tuple[float, float, float]:
    """CIELAB (D65) of an sRGB colour (0..255 channels or "#rrggbb")."""
    if isinstance(rgb, str):
        rgb = hex_rgb(rgb)
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (v / 255 for v in rgb)]
    r, g, b = lin
    xyz = ((0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047, 0.2126 * r + 0.7152 * g + 0.0722 * b,
           (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883)
    fx, fy, fz = (t ** (1 / 3) if t > 216 / 24389 else (24389 / 27 * t + 16) / 116 for t in xyz)
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def delta_e(c1, c2) -> float:
    """CIE76 colour difference delta-E*ab (Euclidean distance in CIELAB)."""
    return sum((a - b) ** 2 for a, b in zip(srgb_to_lab(c1), srgb_to_lab(c2))) ** 0.5


def assert_distinct(colours: dict, min_de: float = OWNER_MIN_DELTA_E, others: dict | None = None) -> None:
    """Every two of ``colours``, and each of them and each of ``others``, at least ``min_de`` apart."""
    keys, every = list(colours), {**(others or {}), **colours}
    for i, a in enumerate(keys):
        for b in keys[i + 1:] + [k for k in every if k not in colours]:
            d = delta_e(every[a], every[b])
            assert d >= min_de, f"{a} {every[a]} and {b} {every[b]} are only delta-E {d:.1f} apart (< {min_de})"


def test_delta_e_reference_values():
    assert delta_e("#ffffff", "#ffffff") == 0
    assert srgb_to_lab("#ffffff") == pytest.approx((100, 0, 0), abs=0.02)
    assert srgb_to_lab("#ff0000") == pytest.approx((53.24, 80.09, 67.20), abs=0.05)  # the usual sRGB red
    with pytest.raises(AssertionError, match="delta-E"):
        assert_distinct({"a": "#f59e0b", "b": "#f6a600"})  # the two near-identical oranges of issue 19


def test_owner_palette_is_distinguishable_and_clear_of_state_colours():
    assert len(OWNER_PALETTE) >= 12 and len(set(OWNER_PALETTE)) == len(OWNER_PALETTE)
    named = {f"owner {i}": c for i, c in enumerate(OWNER_PALETTE)}
    assert_distinct(named, others={**{f"state {k}": v for k, v in STATE_COLOURS.items()}, "background": PAGE_BACKGROUND})


def test_palette_slots_are_assigned_in_a_stable_order():
    names = [f"session:s{i}" for i in range(14)]
    first = palette_slots(names)
    assert [first[n] for n in names] == list(range(14))
    # s3 and s7 leave, two newcomers take their slots (lowest first); the others keep theirs
    rest = [n for n in names if n not in ("session:s3", "session:s7")] + ["session:new1", "session:new2"]
    again = palette_slots(rest, first)
    assert all(again[n] == first[n] for n in rest if n in first)
    assert (again["session:new1"], again["session:new2"]) == (3, 7)
    many = palette_slots([f"r{i}" for i in range(len(OWNER_PALETTE) + 3)])
    assert sorted(set(many.values())) == list(range(len(OWNER_PALETTE)))  # every colour used before any repeats
    assert owner_colours(["x", "y"]) == OWNER_PALETTE[:2]


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
    for colour in (STATE_COLOURS["free"], STATE_COLOURS["cached"], STATE_COLOURS["shared"], *owner_colours(["req-a", "session:b"])):
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
    from tests.utils.serverproc import free_port

    assert main(["kv", "map", "--server", f"http://127.0.0.1:{free_port()}"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach" in err and "kvkeeper serve" in err


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        p = shutil.which(name)
        if p:
            return p
    return None


# Fixed page layout (see kvkeeper.api.admin.kv): canvas at (16, 56) CSS px, a 16 px label band, then cells.
LEFT, TOP, BAND, CELL, GAP, COLS = 16, 56, 16, 20, 2, 8


def need_chromium() -> str:
    chromium = find_chromium()
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed but CI is set: .ci/run must install it (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium); CI runs this test")
    return chromium


def chromium_run(chromium: str, url: str, tmp_path, size: str, png=None, budget_ms: int = 4000) -> str:
    """Load ``url`` in headless Chromium; a screenshot into ``png``, else the DOM after the scripts ran."""
    out = ["--screenshot=" + str(png)] if png else ["--dump-dom"]
    cmd = [chromium, "--headless", "--disable-gpu", "--no-sandbox", "--disable-dev-shm-usage", "--hide-scrollbars",
           "--force-device-scale-factor=1", f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={size}",
           f"--virtual-time-budget={budget_ms}", *out, url]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if png:
        assert png.exists(), r.stderr[-2000:]
    return r.stdout


def cell_centre(i: int, cols: int = COLS, cell: int = CELL, gap: int = GAP, first_row: int = 0) -> tuple[int, int]:
    return (LEFT + (i % cols) * (cell + gap) + cell // 2,
            TOP + BAND + (first_row + i // cols) * (cell + gap) + cell // 2)


def close(got, want, tol: int = 3) -> bool:
    return all(abs(a - b) <= tol for a, b in zip(got, hex_rgb(want) if isinstance(want, str) else want))


def legend_items(dom: str) -> dict[str, str]:
    """state -> swatch colour of the legend rows of a dumped /admin/kv page."""
    import re

    legend = dom[dom.index('id="legend"'):dom.index('id="figs"')]
    return dict(re.findall(r'data-state="([a-z-]+)"(?: data-colour="(#[0-9a-f]{6})")?', legend))


def test_admin_page_screenshot_colours_blocks_by_state(server, tmp_path):
    from PIL import Image

    chromium = need_chromium()
    html = httpx.get(server + "/admin/kv", timeout=30)
    assert html.status_code == 200 and "<canvas" in html.text
    assert "http://" not in html.text and "https://" not in html.text  # self-contained: no external asset
    doc = httpx.get(server + "/admin/kv.json", timeout=30).json()
    png = tmp_path / "kv.png"
    url = server + f"/admin/kv?cell={CELL}&cols={COLS}"
    chromium_run(chromium, url, tmp_path, "900,500", png)
    dom = chromium_run(chromium, url + "&tip=0", tmp_path, "900,500")
    after = httpx.get(server + "/admin/kv.json", timeout=30).json()
    assert after["states"] == doc["states"] and after["owner"] == doc["owner"]  # the pool did not change meanwhile
    img = Image.open(png).convert("RGB")
    background = img.getpixel((5, img.height - 5))
    by_key: dict[tuple, set] = {}
    for i, (letter, owner) in enumerate(zip(doc["states"], doc["owner"])):
        key = (letter,) if letter != "o" else ("o", owner)
        by_key.setdefault(key, set()).add(img.getpixel(cell_centre(i)))
    keys = sorted(by_key)
    assert ("f",) in by_key and ("c",) in by_key and any(k[0] == "o" for k in keys), keys
    for key, colours in by_key.items():
        assert len(colours) == 1, f"blocks {key} drawn in several colours: {colours}"
        assert background not in colours, f"blocks {key} not drawn (background colour)"
    colour_of = {k: next(iter(v)) for k, v in by_key.items()}
    assert len(set(colour_of.values())) == len(colour_of), f"different states or owners share a colour: {colour_of}"
    assert close(colour_of[("f",)], STATE_COLOURS["free"]) and close(colour_of[("c",)], STATE_COLOURS["cached"])
    expected = owner_colours(o["name"] for o in doc["owners"])
    drawn_owners = {k: c for k, c in colour_of.items() if k[0] == "o" and k[1] >= 0}
    for k, col in drawn_owners.items():
        assert close(col, expected[k[1]]), (k, col)
    assert_distinct(drawn_owners)  # from the pixels: the owners' colours stay apart
    # the legend lists what is drawn: no "owned" swatch (every owned block here has a session as owner)
    legend = legend_items(dom)
    assert "owned" not in legend and "by-owner" in legend and {"free", "cached"} <= set(legend), legend
    assert "pool (device memory): 64 blocks of 16 tokens" in dom
    tip = dom[dom.index('id="tip"'):].split("</div>")[0]
    want = {"f": "free", "c": "cached", "o": "owned"}[doc["states"][0]]
    assert f"block 0 · {want}" in tip and f"refcount {doc['refcount'][0]}" in tip, tip
    assert f"tokens {doc['tokens'][0]}/16" in tip, tip


# ---- the page on a fixed document: 14 owners, offloaded blocks, the chart --------------------


def many_owner_doc():
    """A 96-block pool of 16-token blocks: 14 sessions, one shared block, an owner-less allocation, cached
    and free blocks, 6 offloaded blocks."""
    pool, ns, owners = BlockPool(96, 16), Namespace("rev"), []
    for k in range(14):
        table = pool.allocate(2 + k % 3)
        owners.append((f"session:user-{k:02d}", seq(table, 16 * len(table) - k)))
    owners[1] = (owners[1][0], seq(owners[1][1].block_table + pool.fork([owners[0][1].block_table[0]]),
                                   owners[1][1].num_computed))
    raw = pool.allocate(1)  # held by no listed owner
    cached = pool.allocate(3)
    parent = None
    for j, bid in enumerate(cached):
        parent = pool.register(bid, parent, ns, list(range(16 * j, 16 * j + 16)))
    pool.free_all(cached)
    return block_map(pool, owners, offloaded_blocks=6), raw


@pytest.fixture()
def static_page(tmp_path):
    """Serve page_html() at /admin/kv and a fixed document at /admin/kv.json on 127.0.0.1."""
    import http.server
    import threading

    from kvkeeper.api.admin.kv import page_html

    doc, raw = many_owner_doc()
    body = {"/admin/kv": page_html().encode(), "/admin/kv.json": json.dumps(doc).encode()}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the http.server API)
            data = body.get(self.path.split("?")[0])
            self.send_response(200 if data else 404)
            self.send_header("Content-Type", "application/json" if self.path.endswith(".json") else "text/html")
            self.end_headers()
            self.wfile.write(data or b"")

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", doc, raw
    finally:
        httpd.shutdown()


def test_admin_page_many_owners_offloaded_rows_chart_and_tooltip(static_page, tmp_path):
    from PIL import Image

    chromium = need_chromium()
    base, doc, raw = static_page
    cols, cell = 12, 16
    url = base + f"/admin/kv?cell={cell}&cols={cols}&interval=200"
    png = tmp_path / "many.png"
    chromium_run(chromium, url, tmp_path, "1000,700", png)
    dom = chromium_run(chromium, url + "&tip=" + str(doc["owner"].index(3)), tmp_path, "1000,700")
    img = Image.open(png).convert("RGB")
    assert len(doc["owners"]) == 14
    expected = owner_colours(o["name"] for o in doc["owners"])
    drawn: dict[str, tuple] = {}
    for i, o in enumerate(doc["owner"]):
        if o >= 0:
            px = img.getpixel(cell_centre(i, cols, cell))
            assert close(px, expected[o]), (i, doc["owners"][o]["name"], px, expected[o])
            drawn[doc["owners"][o]["name"]] = px
    assert len(drawn) == 14
    assert_distinct(drawn)  # the 14 owners' colours, as drawn, pairwise at least OWNER_MIN_DELTA_E apart
    assert close(img.getpixel(cell_centre(raw[0], cols, cell)), STATE_COLOURS["owned"])
    # offloaded blocks: on rows after the pool's and a second label band
    pool_rows = -(-doc["num_blocks"] // cols)
    for j in range(doc["offloaded"]):
        x, y = cell_centre(j, cols, cell, first_row=pool_rows)
        assert close(img.getpixel((x, y + BAND)), STATE_COLOURS["offloaded"]), j
    assert "pool (device memory): 96 blocks of 16 tokens" in dom and "offloaded (host memory / disk): 6 blocks" in dom
    # the legend shows each drawn state once, with the colour it is drawn in, and each owner with its colour
    legend = legend_items(dom)
    assert set(legend) == {"free", "cached", "shared", "owned", "offloaded", "by-owner"}, legend
    for state in ("free", "cached", "shared", "owned", "offloaded"):
        assert legend[state] == STATE_COLOURS[state]
    for o, colour in zip(doc["owners"], expected):
        assert f'data-owner="{o["name"]}" data-colour="{colour}"' in dom
    # the chart: several samples, its lines drawn in the series colours inside its rectangle
    import re

    samples = int(re.search(r'data-samples="(\d+)"', dom).group(1))
    left, top, w, h = map(int, re.search(r'data-rect="([\d,]+)"', dom).group(1).split(","))
    assert samples >= 3 and w > 100 and h > 50
    chart_px = {img.getpixel((x, y)) for x in range(left + 36, left + w - 6) for y in range(top + 2, top + h - 14)}
    for colour in ("#e5e7eb", "#f472b6"):  # usage and internal lines (the other two figures are 0 here)
        assert any(close(p, colour, 10) for p in chart_px), colour
    tip = dom[dom.index('id="tip"'):].split("</div>")[0]
    assert "owned · owner: session:user-03" in tip and "refcount 1" in tip and "/16" in tip, tip


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


@pytest.mark.parametrize("query", ["interval=abc", "interval=", "interval=-5", "cell=x&cols=y"])
def test_admin_page_refresh_interval_is_never_nan(query):
    # ?interval=abc gave setInterval(refresh, NaN): the page fetched /admin/kv.json (built on the engine thread)
    # as fast as the browser could
    import json
    import re
    import shutil
    import subprocess

    from kvkeeper.api.admin.kv import page_html

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    m = re.search(r"const P = \{.*?\};", page_html(), re.S)
    assert m, "the page's parameter object P was not found"
    js = f"const q = new URLSearchParams({json.dumps(query)});\n{m.group(0)}\nconsole.log(JSON.stringify(P));"
    out = json.loads(subprocess.run([node, "-e", js], capture_output=True, text=True, timeout=30, check=True).stdout)
    assert isinstance(out["interval"], int) and out["interval"] >= 200, out
