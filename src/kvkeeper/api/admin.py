"""Admin routes: the live KV block map and the cache-health detector.

* ``GET /admin/health`` -- the health detector's state (:meth:`kvkeeper.diagnostics.health.HealthMonitor.snapshot`):
  score, whether a warning is open, each signal's EWMA, baseline and control limit, and the warning events
  with their reasons.

* ``GET /admin/kv.json`` -- the block map document of :mod:`kvkeeper.kvcache.blockmap` (built on
  the engine thread through ``AsyncEngine.call``; one letter per block for its state, an owner
  index per block, the owners, the fragmentation figures now and their 1/10/60 s window means).
* ``GET /admin/kv`` -- one self-contained HTML page (inline CSS and JavaScript, no external
  asset) that fetches ``/admin/kv.json`` every second and draws every block as a cell of a
  canvas: free grey, cached blue, owned tinted per owner (orange to green hues, from the owner's name), shared
  (several owners) pink, offloaded purple (after the pool, on their own rows); a legend with
  counts and owners, and a table of the figures.

Page query parameters (for a fixed layout, e.g. in screenshot tests): ``cell`` (cell side in
CSS pixels, 3..40; default: the largest that fits the window), ``cols`` (cells per row; default:
what fits), ``interval`` (refresh period in ms, default 1000).  Layout: the canvas's top-left
corner is at (16, 56) CSS pixels; block ``i`` is drawn at column ``i % cols``, row ``i // cols``,
each cell ``cell`` wide with a gap of 2 pixels (1 below 8-pixel cells).
"""

from __future__ import annotations

from fastapi.responses import HTMLResponse, JSONResponse

from ..kvcache.blockmap import STATE_COLOURS

_PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvkeeper - KV block map</title>
<style>
  html, body { margin: 0; background: #111827; color: #e5e7eb; font: 13px/1.4 system-ui, sans-serif; }
  header { position: absolute; left: 16px; top: 0; height: 48px; right: 16px; display: flex; align-items: center;
           gap: 16px; white-space: nowrap; overflow: hidden; }
  header h1 { font-size: 16px; margin: 0; font-weight: 600; }
  #status { color: #9ca3af; }
  #status.err { color: #f87171; }
  #map { position: absolute; left: 16px; top: 56px; }
  #side { position: absolute; top: 56px; width: 330px; }
  #side h2 { font-size: 13px; margin: 0 0 6px 0; color: #9ca3af; font-weight: 600; }
  .sw { display: inline-block; width: 12px; height: 12px; margin-right: 6px; vertical-align: -2px; border-radius: 2px; }
  ul { list-style: none; padding: 0; margin: 0 0 14px 0; }
  li { margin: 2px 0; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
  table { border-collapse: collapse; margin-bottom: 14px; }
  td, th { padding: 2px 8px 2px 0; text-align: right; font-variant-numeric: tabular-nums; }
  td:first-child, th:first-child { text-align: left; }
  #tip { position: fixed; pointer-events: none; background: #1f2937; border: 1px solid #374151; padding: 4px 6px;
         border-radius: 4px; display: none; white-space: nowrap; }
</style></head>
<body>
<header><h1>kvkeeper &middot; KV block map</h1><span id="status">loading...</span></header>
<canvas id="map" width="0" height="0"></canvas>
<div id="side">
  <h2>Blocks</h2><ul id="legend"></ul>
  <h2>Fragmentation</h2><table id="figs"></table>
  <h2>Owners</h2><ul id="owners"></ul>
</div>
<div id="tip"></div>
<script>
"use strict";
const COLOURS = __COLOURS__;
const q = new URLSearchParams(location.search);
const P = { cell: parseInt(q.get("cell") || "0", 10), cols: parseInt(q.get("cols") || "0", 10),
            interval: Math.max(200, parseInt(q.get("interval") || "1000", 10) || 1000) };
const LEFT = 16, TOP = 56, SIDE = 360;
let doc = null, layout = null;

const ENC = new TextEncoder();
function ownerColour(name) {  // same rule as kvkeeper.kvcache.blockmap.owner_colour (FNV-1a of the name)
  let h = 0x811c9dc5;
  for (const b of ENC.encode(name)) h = Math.imul(h ^ b, 0x01000193) >>> 0;
  return "hsl(" + (20 + h % 141) + ", 75%, 50%)";
}
function cellColour(letter, owner) {
  if (letter === "f") return COLOURS.free;
  if (letter === "c") return COLOURS.cached;
  if (owner === -2) return COLOURS.shared;
  if (owner >= 0) return ownerColour(doc.owners[owner].name);
  return COLOURS.owned;
}
function computeLayout(n) {
  const availW = Math.max(200, window.innerWidth - LEFT - SIDE - 24);
  const availH = Math.max(200, window.innerHeight - TOP - 16);
  let cell = P.cell > 0 ? Math.min(40, Math.max(3, P.cell)) : 0;
  if (!cell) {
    cell = 3;
    for (let c = 24; c >= 3; c--) {
      const g = c >= 8 ? 2 : 1, cols = Math.max(1, Math.floor(availW / (c + g)));
      if (Math.ceil(n / cols) * (c + g) <= availH) { cell = c; break; }
    }
  }
  const gap = cell >= 8 ? 2 : 1;
  const cols = P.cols > 0 ? P.cols : Math.max(1, Math.floor(availW / (cell + gap)));
  return { cell, gap, cols };
}
function draw() {
  if (!doc) return;
  const n = doc.num_blocks, off = doc.offloaded || 0;
  layout = computeLayout(n + off);
  const { cell, gap, cols } = layout;
  const poolRows = Math.ceil(n / cols), offRows = Math.ceil(off / cols);
  const w = cols * (cell + gap), h = (poolRows + (off ? offRows + 1 : 0)) * (cell + gap);
  const cv = document.getElementById("map"), dpr = window.devicePixelRatio || 1;
  cv.style.width = w + "px"; cv.style.height = h + "px";
  cv.width = Math.round(w * dpr); cv.height = Math.round(h * dpr);
  const ctx = cv.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  for (let i = 0; i < n; i++) {
    ctx.fillStyle = cellColour(doc.states[i], doc.owner[i]);
    ctx.fillRect((i % cols) * (cell + gap), Math.floor(i / cols) * (cell + gap), cell, cell);
  }
  ctx.fillStyle = COLOURS.offloaded;
  for (let j = 0; j < off; j++) {
    ctx.fillRect((j % cols) * (cell + gap), (poolRows + 1 + Math.floor(j / cols)) * (cell + gap), cell, cell);
  }
  document.getElementById("side").style.left = (LEFT + w + 24) + "px";
}
function esc(s) { return String(s).replace(/[&<>"']/g, c => "&#" + c.charCodeAt(0) + ";"); }
function sw(colour) { return '<span class="sw" style="background:' + colour + '"></span>'; }
function pct(x) { return (100 * x).toFixed(1) + "%"; }
function panel() {
  const s = doc.stats, shared = doc.shared.length;
  const rows = [["free", COLOURS.free, s.free], ["cached", COLOURS.cached, s.cached],
                ["owned", COLOURS.owned, s.owned - shared], ["shared", COLOURS.shared, shared],
                ["offloaded", COLOURS.offloaded, doc.offloaded]];
  document.getElementById("legend").innerHTML = rows.map(r =>
    '<li data-state="' + r[0] + '">' + sw(r[1]) + r[0] + ": " + r[2] + "</li>").join("") +
    "<li>" + doc.num_blocks + " blocks of " + doc.block_size + " tokens</li>";
  const names = [["internal", "internal"], ["external", "external"], ["pool_rate", "pool rate"], ["usage", "usage"]];
  const wins = Object.keys(doc.windows);
  let t = "<tr><th></th><th>now</th>" + wins.map(w => "<th>" + esc(w) + "</th>").join("") + "</tr>";
  for (const [k, label] of names) {
    t += "<tr><td>" + label + "</td><td>" + pct(s[k]) + "</td>" +
         wins.map(w => "<td>" + pct(doc.windows[w][k] || 0) + "</td>").join("") + "</tr>";
  }
  document.getElementById("figs").innerHTML = t;
  const order = doc.owners.map((o, i) => i).sort((a, b) => doc.owners[b].blocks - doc.owners[a].blocks);
  const shown = order.slice(0, 20);
  document.getElementById("owners").innerHTML = shown.map(i => "<li>" + sw(ownerColour(doc.owners[i].name)) +
    esc(doc.owners[i].name) + " &middot; " + doc.owners[i].blocks + " blocks, " + doc.owners[i].tokens +
    " tokens</li>").join("") + (order.length > shown.length ? "<li>... " + (order.length - shown.length) +
    " more</li>" : "") + (order.length ? "" : "<li>none</li>");
}
async function refresh() {
  const st = document.getElementById("status");
  try {
    const r = await fetch("kv.json", { cache: "no-store" });
    if (!r.ok) throw new Error("HTTP " + r.status);
    doc = await r.json();
    draw(); panel();
    st.className = "";
    st.textContent = "updated " + new Date().toLocaleTimeString() + " - usage " + pct(doc.stats.usage);
  } catch (e) {
    st.className = "err";
    st.textContent = "cannot reach the server (" + e.message + "); retrying";
  }
}
document.getElementById("map").addEventListener("mousemove", ev => {
  const tip = document.getElementById("tip");
  if (!doc || !layout) return;
  const { cell, gap, cols } = layout;
  const x = Math.floor(ev.offsetX / (cell + gap)), y = Math.floor(ev.offsetY / (cell + gap)), i = y * cols + x;
  if (x >= cols || i >= doc.num_blocks) { tip.style.display = "none"; return; }
  const o = doc.owner[i], st = { f: "free", c: "cached", o: "owned" }[doc.states[i]];
  let who = "";
  if (o >= 0) who = " - " + doc.owners[o].name;
  else if (o === -2) {
    const e = doc.shared.find(p => p[0] === i);
    who = " - shared by " + (e ? e[1].map(k => doc.owners[k].name).join(", ") : "several owners");
  }
  tip.textContent = "block " + i + ": " + st + who;
  tip.style.display = "block"; tip.style.left = (ev.clientX + 12) + "px"; tip.style.top = (ev.clientY + 12) + "px";
});
document.getElementById("map").addEventListener("mouseleave", () => { document.getElementById("tip").style.display = "none"; });
window.addEventListener("resize", draw);
refresh();
setInterval(refresh, P.interval);
</script>
</body></html>
"""


def page_html() -> str:
    """The /admin/kv page (self-contained HTML)."""
    import json

    return _PAGE.replace("__COLOURS__", json.dumps(STATE_COLOURS))


def add_admin_routes(app, engine) -> None:
    """Register ``GET /admin/kv`` and ``GET /admin/kv.json`` on ``app`` for ``engine`` (an AsyncEngine)."""
    html = page_html()

    @app.get("/admin/kv", response_class=HTMLResponse)
    async def kv_page():
        return HTMLResponse(html, headers={"Cache-Control": "no-cache"})

    @app.get("/admin/kv.json")
    async def kv_json():
        return JSONResponse(await engine.block_map(), headers={"Cache-Control": "no-store"})

    @app.get("/admin/health")
    async def health_state():
        """The cache-health detector (kvkeeper.diagnostics.health): score, charts, warning events."""
        if engine.health is None:
            return {"enabled": False, "score": 1.0, "events": []}
        return {"enabled": True, **await engine.call(lambda _: engine.health.snapshot())}
