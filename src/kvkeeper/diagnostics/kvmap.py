"""``kvkeeper kv map``: the KV block pool drawn in the terminal with rich.

The input is a block-map document (:mod:`kvkeeper.kvcache.blockmap`): fetched from a running
server's ``GET /admin/kv.json`` (:func:`fetch_block_map`), or built from a local engine
(:func:`demo_block_map` runs a few prompts on the embedded model first).

:func:`render_block_map` draws one coloured cell (``■``) per block, in block-id order, left to
right and top to bottom: free grey, cached blue, owned tinted per owner, shared (several owners)
pink, offloaded purple (after the pool).  When the pool has more blocks than ``max_rows`` rows
of cells can hold, each cell stands for ``k`` consecutive blocks and takes the colour of the
state (and owner) most of them have; the header says ``1 cell = k blocks``.  Below the grid: a
legend with the count of each state, the fragmentation figures now and over each window, and the
largest owners.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from collections import Counter

from ..errors import KVKeeperError
from ..kvcache.blockmap import SHARED, STATE_COLOURS, check_block_map, owner_colours
from ..engine.handle import EngineHandle

CELL = "■"
FIGURES = (("internal", "internal"), ("external", "external"), ("pool_rate", "pool rate"), ("usage", "usage"))


class BlockMapFetchError(KVKeeperError):
    """The server's block map could not be fetched or was not a block-map document."""


def fetch_block_map(server: str, timeout: float = 10.0) -> dict:
    """GET ``<server>/admin/kv.json`` and return the checked document.

    server: base URL such as ``http://127.0.0.1:8000`` (a trailing ``/`` or ``/v1`` is ignored).
    Raises :class:`BlockMapFetchError` saying what went wrong (unreachable, HTTP status, bad JSON).
    """
    base = server.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    if not base.startswith(("http://", "https://")):
        raise BlockMapFetchError(f"--server must be an http(s) URL such as http://127.0.0.1:8000, got {server!r}")
    url = base + "/admin/kv.json"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            doc = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise BlockMapFetchError(f"{url} answered HTTP {e.code}; is this a kvkeeper server "
                                 "(kvkeeper serve) of this version?") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise BlockMapFetchError(f"cannot reach {url}: {reason}; start `kvkeeper serve` or pass "
                                 "--server URL") from None
    except ValueError as e:
        raise BlockMapFetchError(f"{url} did not return JSON: {e}") from None
    try:
        check_block_map(doc)
    except ValueError as e:
        raise BlockMapFetchError(f"{url}: {e}") from None
    return doc


def _cell_keys(doc: dict) -> list[tuple]:
    """Per pool block: ("free",), ("cached",), ("owned", owner index) or ("shared",)."""
    out = []
    for letter, o in zip(doc["states"], doc["owner"]):
        if letter == "f":
            out.append(("free",))
        elif letter == "c":
            out.append(("cached",))
        elif o == SHARED:
            out.append(("shared",))
        else:
            out.append(("owned", o))
    return out


def _colour(key: tuple, colours: list[str]) -> str:
    """Colour of a cell key (``colours``: per owner index, from :func:`owner_colours`)."""
    if key[0] == "owned":
        return colours[key[1]] if key[1] >= 0 else STATE_COLOURS["owned"]
    return STATE_COLOURS[key[0]]


def grid_cells(doc: dict, cols: int, max_rows: int) -> tuple[list[tuple], int]:
    """The cells to draw and the blocks per cell ``k`` (>= 1).

    Pool cells come first (each the most common key among its ``k`` blocks, ties to the lower
    block id), then ``ceil(offloaded / k)`` ("offloaded",) cells.
    """
    keys = _cell_keys(doc)
    off = int(doc.get("offloaded") or 0)
    total = len(keys) + off
    k = max(1, math.ceil(total / max(1, cols * max_rows)))
    cells = []
    for i in range(0, len(keys), k):
        chunk = keys[i:i + k]
        cells.append(chunk[0] if k == 1 else Counter(chunk).most_common(1)[0][0])
    cells.extend([("offloaded",)] * math.ceil(off / k))
    return cells, k


def render_block_map(doc: dict, width: int = 100, max_rows: int = 32, max_owners: int = 10):
    """A rich renderable of ``doc``: header, grid, legend, figures table and owners.

    width: terminal columns for the grid (one cell is two columns: ``■`` and a space).
    """
    from rich.columns import Columns
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    check_block_map(doc)
    cols = max(8, (width - 1) // 2)
    cells, k = grid_cells(doc, cols, max_rows)
    st = doc["stats"]
    head = Text(f"KV block map: {doc['num_blocks']} blocks of {doc['block_size']} tokens", style="bold")
    if k > 1:
        head.append(f"  (1 cell = {k} blocks, coloured by the state most of them have)", style="dim")
    colours = owner_colours(o["name"] for o in doc["owners"])
    grid = Text()
    for i, key in enumerate(cells):
        if i and i % cols == 0:
            grid.append("\n")
        grid.append(CELL, style=_colour(key, colours))
        grid.append(" ")
    shared = len(doc.get("shared") or [])
    items = []
    for name, colour, n in (("free", STATE_COLOURS["free"], st["free"]), ("cached", STATE_COLOURS["cached"], st["cached"]),
                            ("owned", STATE_COLOURS["owned"], st["owned"] - shared), ("shared", STATE_COLOURS["shared"], shared),
                            ("offloaded", STATE_COLOURS["offloaded"], doc.get("offloaded", 0))):
        items.append(Text.assemble((CELL + " ", colour), f"{name} {n}"))
    legend = Columns(items, padding=(0, 3))
    figs = Table(title="fragmentation", title_justify="left", box=None, pad_edge=False)
    figs.add_column("figure")
    figs.add_column("now", justify="right")
    wins = list(doc.get("windows") or {})
    for w in wins:
        figs.add_column(w, justify="right")
    for key, label in FIGURES:
        figs.add_row(label, f"{st[key]:.1%}", *[f"{doc['windows'][w].get(key, 0.0):.1%}" for w in wins])
    owners = doc.get("owners") or []
    order = sorted(range(len(owners)), key=lambda i: -owners[i]["blocks"])
    own = Text()
    for i in order[:max_owners]:
        o = owners[i]
        own.append(CELL + " ", style=colours[i])
        own.append(f"{o['name']}  {o['blocks']} blocks, {o['tokens']} tokens\n")
    if len(order) > max_owners:
        own.append(f"... {len(order) - max_owners} more owners\n", style="dim")
    if not order:
        own.append("no owners\n", style="dim")
    return Group(head, grid, Text(""), legend, Text(""), figs, Text(""), Text("owners", style="italic"), own)


def demo_block_map(engine: EngineHandle) -> dict:
    """Run a few prompts on a local engine so every pool state shows, then build its block map.

    A session keeps a two-turn conversation (owned blocks), a finished request without a session
    leaves its full blocks in the prefix cache (cached), the rest stays free.
    """
    from ..sampling.params import SamplingParams
    from ..kvcache.blockmap import engine_block_map
    from ..sessions.manager import SessionManager

    p = SamplingParams(max_tokens=16, temperature=0.0)
    s = SessionManager(engine).open(system="You are a helpful assistant.")
    s.send("Name three colours.", p)
    s.send("And three animals?", p)
    engine.generate(["The history of the Roman empire begins with the founding of the city of Rome, which "
                     "according to legend happened in 753 BC, when the twins Romulus and Remus"], p)
    return engine_block_map(engine)


def show(console, get_doc, watch: bool = False, interval: float = 1.0, max_rows: int = 32) -> None:
    """Print the map of ``get_doc()`` once, or redraw it in place every ``interval`` s until Ctrl-C.

    While watching, a fetch that fails (:class:`BlockMapFetchError`, e.g. the server restarts) is
    shown in place of the map and retried at the next refresh; KeyboardInterrupt ends the watch.
    """
    width = console.width or 100
    if not watch:
        console.print(render_block_map(get_doc(), width=width, max_rows=max_rows))
        return
    from rich.live import Live
    from rich.text import Text

    def frame():
        try:
            return render_block_map(get_doc(), width=console.width or width, max_rows=max_rows)
        except BlockMapFetchError as e:
            return Text(f"{e} (retrying every {interval:g} s; Ctrl-C to stop)", style="red")

    with Live(frame(), console=console, refresh_per_second=4, screen=False) as live:
        while True:
            time.sleep(interval)
            live.update(frame(), refresh=True)
