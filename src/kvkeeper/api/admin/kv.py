"""Admin routes: the live KV block map, KV dumps of a session, the circuit breaker's state.

Every route needs an admin key when the server has API keys (:func:`kvkeeper.api.common.auth.admin_caller`:
401 without a valid key, 403 for a tenant's key), except ``/admin/kv/dump``, which also answers the
session's own tenant (another tenant gets 404).  With ``serve --admin-port`` these routes are served
only by a second app bound to 127.0.0.1 (:func:`kvkeeper.api.app.create_admin_app`).

* ``GET /admin/kv/dump?session=ID[&tenant=T&layers=0,5&start=N&end=M]`` -- the session's K/V as a
  safetensors file (:mod:`kvkeeper.diagnostics.kvdump`); ``tenant`` (admins only) names another
  tenant's session.
* ``GET /admin/breaker`` -- the KV circuit breaker: tier, trips, action counts, recent events.
* ``POST /admin/kv/reset_prefix_cache`` -- evict every cached block no one references (the prefix cache's
  reusable KV; blocks pinned by sessions or running requests stay): ``{"evicted_blocks": N}``.
* ``GET /admin/health`` -- the cache-health detector's state
  (:meth:`kvkeeper.diagnostics.health.HealthMonitor.snapshot`): score, whether a warning is open, each
  signal's EWMA, baseline and control limit, and the warning events with their reasons.
* ``GET /admin/cache/misses?limit=N`` -- the last ``N`` (default 50, at most 256) explanations of why a session's
  or ``prompt_cache_key``'s request read less from the cache than its predecessor
  (:mod:`kvkeeper.api.engine_client.cache_miss`): reason, token index, the texts either side, newest last.

* ``GET /admin/kv.json`` -- the block map document of :mod:`kvkeeper.kvcache.blockmap` (built on
  the engine thread through ``AsyncEngine.call``; one letter per block for its state, an owner
  index, refcount and token count per block, the owners, the fragmentation figures now and their
  1/10/60 s window means).
* ``GET /admin/kv`` -- one self-contained HTML page (inline CSS and JavaScript, no external
  asset) that fetches ``/admin/kv.json`` every second and draws every block as a cell of a
  canvas: free grey, cached blue, owned in its owner's colour (a fixed qualitative palette,
  ``blockmap.OWNER_PALETTE``, slots assigned in a stable order by ``blockmap.palette_slots``'s rule),
  shared (several owners) pink, owned by no listed owner orange, offloaded purple (on their own
  labelled rows after the pool's).  Beside it: a legend listing only what is drawn, a table of the
  figures, a line chart of the figures over the last ``history`` seconds (sampled by the page at
  each refresh since it was opened; the time axis spans what was sampled, at least a minute) and
  the owners.  Hovering a block shows its id, state, owner(s), tokens and refcount.

Page query parameters (for a fixed layout, e.g. in screenshot tests): ``cell`` (cell side in
CSS pixels, 3..40; default: the largest that fits the window), ``cols`` (cells per row; default:
what fits), ``interval`` (refresh period in ms, default 1000), ``history`` (seconds of the chart,
default 300), ``tip`` (a block id whose tooltip stays shown).  Layout: the canvas's top-left corner
is at (16, 56) CSS pixels; a 16-pixel label band ("pool ...") comes first, then block ``i`` at
column ``i % cols``, row ``i // cols``, each cell ``cell`` wide with a gap of 2 pixels (1 below
8-pixel cells); offloaded blocks follow on rows of their own after a second label band.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from ...diagnostics.kvdump import dump_session, to_bytes
from ...kvcache.blockmap import OWNER_PALETTE, PAGE_BACKGROUND, STATE_COLOURS
from ..common.auth import Caller, admin_caller, caller
from ..common.context import managed_sessions, owned_session
from ..common.errors import APIError

router = APIRouter()

_PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvkeeper - KV block map</title>
<style>
  html, body { margin: 0; background: __BACKGROUND__; color: #e5e7eb; font: 13px/1.4 system-ui, sans-serif; }
  header { position: absolute; left: 16px; top: 0; height: 48px; right: 16px; display: flex; align-items: center;
           gap: 16px; white-space: nowrap; overflow: hidden; }
  header h1 { font-size: 16px; margin: 0; font-weight: 600; }
  #status { color: #9ca3af; }
  #status.err { color: #f87171; }
  #map { position: absolute; left: 16px; top: 56px; }
  .rowlabel { position: absolute; left: 16px; height: 16px; font-size: 11px; line-height: 14px; color: #9ca3af;
              white-space: nowrap; }
  #side { position: absolute; top: 56px; width: 330px; }
  #side h2 { font-size: 13px; margin: 0 0 6px 0; color: #9ca3af; font-weight: 600; }
  .sw { display: inline-block; width: 12px; height: 12px; margin-right: 6px; vertical-align: -2px; border-radius: 2px; }
  ul { list-style: none; padding: 0; margin: 0 0 14px 0; }
  li { margin: 2px 0; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
  table { border-collapse: collapse; margin-bottom: 8px; }
  td, th { padding: 2px 8px 2px 0; text-align: right; font-variant-numeric: tabular-nums; }
  td:first-child, th:first-child { text-align: left; }
  #chart { display: block; margin-bottom: 4px; }
  #chartkey { font-size: 11px; color: #9ca3af; margin-bottom: 14px; }
  #chartkey span { margin-right: 10px; white-space: nowrap; }
  #tip { position: fixed; pointer-events: none; background: #1f2937; border: 1px solid #374151; padding: 4px 6px;
         border-radius: 4px; display: none; white-space: nowrap; }
</style></head>
<body>
<header><h1>kvkeeper &middot; KV block map</h1><span id="status">loading...</span></header>
<canvas id="map" width="0" height="0"></canvas>
<div id="lab-pool" class="rowlabel"></div>
<div id="lab-off" class="rowlabel" style="display:none"></div>
<div id="side">
  <h2>Blocks</h2><ul id="legend"></ul>
  <h2>Fragmentation</h2><table id="figs"></table>
  <canvas id="chart" width="330" height="110"></canvas><div id="chartkey"></div>
  <h2>Owners</h2><ul id="owners"></ul>
</div>
<div id="tip"></div>
<script>
"use strict";
const COLOURS = __COLOURS__;
const PALETTE = __PALETTE__;
const q = new URLSearchParams(location.search);
const P = { cell: parseInt(q.get("cell") || "0", 10), cols: parseInt(q.get("cols") || "0", 10),
            interval: Math.max(200, parseInt(q.get("interval") || "1000", 10) || 1000),
            history: Math.max(10, parseInt(q.get("history") || "300", 10) || 300),
            tip: q.has("tip") ? parseInt(q.get("tip"), 10) : null };
const LEFT = 16, TOP = 56, SIDE = 360, BAND = 16;
const SERIES = [["usage", "usage", "#e5e7eb"], ["pool_rate", "pool rate", "#fbbf24"],
                ["external", "external", "#22d3ee"], ["internal", "internal", "#f472b6"]];
let doc = null, layout = null, slots = new Map(), colourOf = [];
const history = [];

function assignSlots(owners) {  // the rule of kvkeeper.kvcache.blockmap.palette_slots
  const names = [...new Set(owners.map(o => o.name))], next = new Map();
  for (const n of names) if (slots.has(n)) next.set(n, slots.get(n));
  const taken = new Set(next.values()), fresh = names.filter(n => !next.has(n));
  let k = 0;
  fresh.forEach((n, j) => {
    while (k < PALETTE.length && taken.has(k)) k++;
    if (k < PALETTE.length) next.set(n, k++);
    else next.set(n, (taken.size + j) % PALETTE.length);
  });
  slots = next;
  colourOf = owners.map(o => PALETTE[slots.get(o.name)]);
}
function cellColour(letter, owner) {
  if (letter === "f") return COLOURS.free;
  if (letter === "c") return COLOURS.cached;
  if (owner === -2) return COLOURS.shared;
  if (owner >= 0) return colourOf[owner];
  return COLOURS.owned;
}
function computeLayout(n) {
  const availW = Math.max(200, window.innerWidth - LEFT - SIDE - 24);
  const availH = Math.max(200, window.innerHeight - TOP - 2 * BAND - 16);
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
function offTop(poolRows) { return BAND + poolRows * layout.step + BAND; }
function draw() {
  if (!doc) return;
  const n = doc.num_blocks, off = doc.offloaded || 0;
  layout = computeLayout(n + off);
  const { cell, gap, cols } = layout, step = cell + gap;
  layout.step = step;
  const poolRows = Math.ceil(n / cols), offRows = Math.ceil(off / cols);
  layout.poolRows = poolRows;
  const w = cols * step, h = BAND + poolRows * step + (off ? BAND + offRows * step : 0);
  const cv = document.getElementById("map"), dpr = window.devicePixelRatio || 1;
  cv.style.width = w + "px"; cv.style.height = h + "px";
  cv.width = Math.round(w * dpr); cv.height = Math.round(h * dpr);
  const ctx = cv.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  for (let i = 0; i < n; i++) {
    ctx.fillStyle = cellColour(doc.states[i], doc.owner[i]);
    ctx.fillRect((i % cols) * step, BAND + Math.floor(i / cols) * step, cell, cell);
  }
  ctx.fillStyle = COLOURS.offloaded;
  for (let j = 0; j < off; j++) {
    ctx.fillRect((j % cols) * step, offTop(poolRows) + Math.floor(j / cols) * step, cell, cell);
  }
  const lp = document.getElementById("lab-pool"), lo = document.getElementById("lab-off");
  lp.style.top = TOP + "px";
  lp.textContent = "pool (device memory): " + n + " blocks of " + doc.block_size + " tokens";
  lo.style.top = (TOP + BAND + poolRows * step) + "px";
  lo.style.display = off ? "block" : "none";
  lo.textContent = "offloaded (host memory / disk): " + off + " blocks";
  document.getElementById("side").style.left = (LEFT + Math.max(w, 300) + 24) + "px";
}
function esc(s) { return String(s).replace(/[&<>"']/g, c => "&#" + c.charCodeAt(0) + ";"); }
function sw(colour) { return '<span class="sw" style="background:' + colour + '"></span>'; }
function pct(x) { return (100 * x).toFixed(1) + "%"; }
function legend() {  // only what the grid shows: a row per state drawn, owners' colours in the Owners list
  let unowned = 0, byOwner = 0;
  for (let i = 0; i < doc.num_blocks; i++) {
    if (doc.states[i] !== "o") continue;
    if (doc.owner[i] === -1) unowned++; else if (doc.owner[i] >= 0) byOwner++;
  }
  const s = doc.stats, rows = [["free", COLOURS.free, s.free], ["cached", COLOURS.cached, s.cached],
    ["shared", COLOURS.shared, doc.shared.length, "shared by several owners"],
    ["owned", COLOURS.owned, unowned, "owned, no listed owner"], ["offloaded", COLOURS.offloaded, doc.offloaded]];
  let html = rows.filter(r => r[2] > 0).map(r => '<li data-state="' + r[0] + '" data-colour="' + r[1] + '">' +
    sw(r[1]) + (r[3] || r[0]) + ": " + r[2] + "</li>").join("");
  if (byOwner) html += '<li data-state="by-owner">owned: ' + byOwner + " (in their owner's colour, below)</li>";
  document.getElementById("legend").innerHTML = html;
}
function panel() {
  legend();
  const s = doc.stats;
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
  document.getElementById("owners").innerHTML = shown.map(i => '<li data-owner="' + esc(doc.owners[i].name) +
    '" data-colour="' + colourOf[i] + '">' + sw(colourOf[i]) + esc(doc.owners[i].name) + " &middot; " +
    doc.owners[i].blocks + " blocks, " + doc.owners[i].tokens + " tokens</li>").join("") +
    (order.length > shown.length ? "<li>... " + (order.length - shown.length) + " more</li>" : "") +
    (order.length ? "" : "<li>none</li>");
}
function chart() {  // the figures over the last P.history seconds, as sampled at each refresh
  const cv = document.getElementById("chart"), W = cv.width, H = cv.height, ctx = cv.getContext("2d");
  const L = 34, R = 4, T = 4, B = 14, now = Date.now() / 1000;
  ctx.clearRect(0, 0, W, H);
  ctx.font = "10px system-ui, sans-serif"; ctx.fillStyle = "#9ca3af"; ctx.strokeStyle = "#374151"; ctx.lineWidth = 1;
  for (const f of [0, 0.5, 1]) {
    const y = T + (1 - f) * (H - T - B);
    ctx.beginPath(); ctx.moveTo(L, y + 0.5); ctx.lineTo(W - R, y + 0.5); ctx.stroke();
    ctx.fillText((100 * f) + "%", 2, y + 4);
  }
  // the time axis spans what was sampled (at least a minute), up to P.history seconds
  const span = Math.min(P.history, Math.max(60, history.length ? now - history[0].t : 0));
  ctx.fillText("-" + (span >= 120 ? Math.round(span / 6) / 10 + " min" : Math.round(span) + " s"), L, H - 2);
  ctx.fillText("now", W - R - 20, H - 2);
  const x = t => L + (W - L - R) * (1 - (now - t) / span), y = v => T + (1 - v) * (H - T - B);
  for (const [key, , colour] of SERIES) {
    ctx.strokeStyle = colour; ctx.lineWidth = 2; ctx.beginPath();
    history.forEach((p, i) => { const px = x(p.t), py = y(Math.min(1, Math.max(0, p[key] || 0)));
                                 if (i) ctx.lineTo(px, py); else ctx.moveTo(px, py); });
    if (history.length === 1) ctx.lineTo(W - R, y(history[0][key] || 0));
    ctx.stroke();
  }
  const r = cv.getBoundingClientRect();
  cv.dataset.samples = history.length;
  cv.dataset.rect = [r.left, r.top, r.width, r.height].map(Math.round).join(",");
  document.getElementById("chartkey").innerHTML = SERIES.map(s => '<span><span class="sw" style="background:' +
    s[2] + '"></span>' + s[1] + "</span>").join("");
}
function tipText(i) {
  const n = doc.num_blocks;
  if (i >= n) return "offloaded block " + (i - n) + " (session KV in host memory or on disk)";
  const o = doc.owner[i], st = { f: "free", c: "cached", o: "owned" }[doc.states[i]];
  let who = "none";
  if (o >= 0) who = doc.owners[o].name;
  else if (o === -2) {
    const e = doc.shared.find(p => p[0] === i);
    who = e ? e[1].map(k => doc.owners[k].name).join(", ") : "several owners";
  } else if (doc.states[i] === "o") who = "no listed owner";
  const tok = doc.tokens ? doc.tokens[i] : "?", rc = doc.refcount ? doc.refcount[i] : "?";
  return "block " + i + " \u00b7 " + st + " \u00b7 owner: " + who + " \u00b7 tokens " + tok + "/" + doc.block_size +
         " \u00b7 refcount " + rc;
}
function showTip(i, cx, cy) {
  const tip = document.getElementById("tip");
  tip.textContent = tipText(i); tip.dataset.block = i;
  tip.style.display = "block"; tip.style.left = (cx + 12) + "px"; tip.style.top = (cy + 12) + "px";
}
function blockAt(ox, oy) {  // block index under canvas offset (ox, oy): pool ids, then num_blocks + offloaded index
  if (!doc || !layout) return null;
  const { step, cols, poolRows } = layout, x = Math.floor(ox / step);
  if (x >= cols || oy < BAND) return null;
  const prow = Math.floor((oy - BAND) / step);
  if (prow < poolRows) { const i = prow * cols + x; return i < doc.num_blocks ? i : null; }
  const ot = offTop(poolRows);
  if (oy < ot) return null;
  const j = Math.floor((oy - ot) / step) * cols + x;
  return j < (doc.offloaded || 0) ? doc.num_blocks + j : null;
}
async function refresh() {
  const st = document.getElementById("status");
  try {
    const r = await fetch("kv.json", { cache: "no-store" });
    if (!r.ok) throw new Error("HTTP " + r.status);
    doc = await r.json();
    assignSlots(doc.owners);
    const now = Date.now() / 1000;
    history.push(Object.assign({ t: now }, doc.stats));
    while (history.length && history[0].t < now - P.history) history.shift();
    draw(); panel(); chart();
    if (P.tip !== null && P.tip >= 0 && P.tip < doc.num_blocks + (doc.offloaded || 0)) {
      const { step, cols } = layout;
      showTip(P.tip, LEFT + (P.tip % cols) * step, TOP + BAND + Math.floor(P.tip / cols) * step);
    }
    st.className = "";
    st.textContent = "updated " + new Date().toLocaleTimeString() + " - usage " + pct(doc.stats.usage);
  } catch (e) {
    st.className = "err";
    st.textContent = "cannot reach the server (" + e.message + "); retrying";
  }
}
document.getElementById("map").addEventListener("mousemove", ev => {
  const i = blockAt(ev.offsetX, ev.offsetY);
  if (i === null) { document.getElementById("tip").style.display = "none"; return; }
  showTip(i, ev.clientX, ev.clientY);
});
document.getElementById("map").addEventListener("mouseleave", () => { document.getElementById("tip").style.display = "none"; });
window.addEventListener("resize", () => { draw(); });
refresh();
setInterval(refresh, P.interval);
</script>
</body></html>
"""


def page_html() -> str:
    """The /admin/kv page (self-contained HTML)."""
    import json

    return (_PAGE.replace("__COLOURS__", json.dumps(STATE_COLOURS)).replace("__PALETTE__", json.dumps(OWNER_PALETTE))
            .replace("__BACKGROUND__", PAGE_BACKGROUND))


_HTML = page_html()


@router.get("/admin/kv", response_class=HTMLResponse, dependencies=[Depends(admin_caller)])
async def kv_page():
    return HTMLResponse(_HTML, headers={"Cache-Control": "no-cache"})


@router.get("/admin/kv.json", dependencies=[Depends(admin_caller)])
async def kv_json(request: Request):
    return JSONResponse(await request.app.state.engine.block_map(), headers={"Cache-Control": "no-store"})


@router.get("/admin/kv/dump")
async def kv_dump(request: Request, session: str, tenant: str | None = None, layers: str | None = None,
                  start: int | None = None, end: int | None = None, who: Caller = Depends(caller)):
    """A session's K/V as a safetensors file, built on the engine thread: the caller's own session, or with an
    admin key any tenant's (``tenant``); 404 for a session the caller may not see."""
    sessions = managed_sessions(request)
    owner = tenant if tenant is not None else who.tenant
    if owner != who.tenant and not who.admin:
        raise APIError(404, f"no open session {session!r}", type="not_found_error", code="session_not_found")

    def dump(_):
        return to_bytes(*dump_session(sessions, owned_session(sessions, owner, session).id, layers, start, end))

    data = await request.app.state.engine.call(dump)
    return Response(content=data, media_type="application/octet-stream",
                    headers={"Content-Disposition": 'attachment; filename="kv-dump.safetensors"'})


@router.get("/admin/sessions", dependencies=[Depends(admin_caller)])
async def all_sessions(request: Request):
    """Every tenant's open sessions, for the operator: each :meth:`~kvkeeper.sessions.session.Session.info`
    (``id``, ``turns``, ``tokens``, ``blocks`` pinned, ``messages``, ``tier``) with its ``tenant`` (None: opened
    without keys, or migrated from a manifest without tenants).  404 when the server keeps no sessions."""
    sessions = managed_sessions(request)

    def ls(_):
        return [{**s.info(), "tenant": s.tenant, "object": "session"} for s in sessions]

    return {"object": "list", "data": await request.app.state.engine.call(ls)}


@router.get("/admin/breaker", dependencies=[Depends(admin_caller)])
async def breaker_state(request: Request):
    br = request.app.state.engine.breaker
    if br is None:
        return {"tier": 0, "enabled": False}
    return await request.app.state.engine.call(lambda _: br.snapshot())


@router.get("/admin/health", dependencies=[Depends(admin_caller)])
async def health_state(request: Request):
    """The cache-health detector (kvkeeper.diagnostics.health): score, charts, warning events."""
    engine = request.app.state.engine
    if engine.health is None:
        return {"enabled": False, "score": 1.0, "events": []}
    return {"enabled": True, **await engine.call(lambda _: engine.health.snapshot())}


@router.post("/admin/kv/reset_prefix_cache", dependencies=[Depends(admin_caller)])
async def reset_prefix_cache(request: Request):
    """Evict the unreferenced cached blocks (``BlockPool.evict_cached``); held blocks keep their KV."""
    return {"evicted_blocks": await request.app.state.engine.call(lambda eng: eng.kv.evict_cached())}


@router.get("/admin/cache/misses", dependencies=[Depends(admin_caller)])
async def cache_misses(request: Request, limit: int = 50):
    """The last ``limit`` (1 to 256) explanations of why a session's or ``prompt_cache_key``'s request read less
    from the cache than its predecessor (:class:`~kvkeeper.api.engine_client.cache_miss.CacheMiss`), newest last."""
    if not 1 <= limit <= 256:
        raise APIError(400, "limit must be 1 to 256", param="limit")
    misses = request.app.state.engine.tracker.misses
    return {"object": "list", "data": misses.recent(limit)}
