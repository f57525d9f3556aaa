"""The block map: each pool block's state and owner, in a compact JSON-ready form.

Built on the thread that owns the engine (the server's engine thread, or the caller of a
local engine) and drawn by ``kvkeeper kv map`` (terminal) and the server page ``/admin/kv``
(browser).  The document (``block_map``'s return value, served as ``GET /admin/kv.json``)::

    {
      "num_blocks": B, "block_size": S,
      "states": "ffoocc...",       # one letter per block id: f free, c cached, o owned (len B)
      "owner":  [-1, -1, 0, 3, ...],  # per block id: index into "owners", -1 none, -2 shared (len B)
      "shared": [[bid, [i, j]], ...], # owners of each block held by several owners
      "owners": [{"name", "kind", "blocks", "tokens"}, ...],  # kind: request / session
      "offloaded": N,                # blocks' worth of session KV outside the pool
      "stats": PoolStats.to_dict(),  # counts and figures now (kvkeeper.kvcache.telemetry)
      "windows": {"1s": {...}, "10s": {...}, "60s": {...}},  # figure means (FragmentationMonitor)
    }

States follow :mod:`kvkeeper.kvcache.telemetry`: *owned* = refcount above zero, *cached* =
free but registered in the prefix cache, *free* otherwise.  An owned block that no listed
owner holds (a raw allocation outside any sequence) has owner -1.  Owner names are those of
``LLMEngine.kv_owners()``: request ids and ``session:<id>``.

Cost: O(B + total block-table length), about the cost of one ``pool_stats`` call.
"""

from __future__ import annotations

STATE_LETTERS = {"free": "f", "cached": "c", "owned": "o"}
LETTER_STATES = {v: k for k, v in STATE_LETTERS.items()}
NO_OWNER = -1
SHARED = -2

# Colours of the block maps (the /admin/kv page and ``kvkeeper kv map``).
STATE_COLOURS = {
    "free": "#4b5563",
    "cached": "#3b82f6",
    "owned": "#f59e0b",  # an owned block no listed owner holds; listed owners get their own hue
    "shared": "#ec4899",  # held by several owners
    "offloaded": "#a855f7",
}


def owner_hue(name: str) -> int:
    """Hue in degrees (20..160, orange to green) of an owner, from its name: 20 + FNV-1a-32(UTF-8 name) mod 141.

    Derived from the name (not the owner's position in the list) so that an owner keeps its colour
    while others come and go; the hues stay clear of the free (grey), cached (blue), shared (pink)
    and offloaded (purple) colours.  The /admin/kv page computes the same function in JavaScript.
    """
    h = 0x811C9DC5
    for byte in name.encode("utf-8"):
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return 20 + h % 141


def owner_colour(name: str) -> str:
    """"#rrggbb" tint of the owner ``name``: HSL(:func:`owner_hue`, 75%, 50%)."""
    import colorsys

    r, g, b = colorsys.hls_to_rgb(owner_hue(name) / 360.0, 0.5, 0.75)
    return "#%02x%02x%02x" % (round(r * 255), round(g * 255), round(b * 255))


def owner_kind(name: str) -> str:
    """"session" or "request" from an owner name of ``LLMEngine.kv_owners()``."""
    return "session" if name.startswith("session:") else "request"


def block_map(pool, owners=(), offloaded_blocks: int = 0, stats=None, windows=None) -> dict:
    """The block-map document of ``pool`` (a BlockPool); see the module docstring.

    owners: (name, sequence) pairs as ``LLMEngine.kv_owners()`` yields them (a sequence has
    ``block_table``, ``num_computed`` and ``kv_offset``).  stats: a PoolStats to include (default:
    computed here); windows: ``FragmentationMonitor.windows()`` (default: the stats' figures for
    every default window).
    """
    from .telemetry import DEFAULT_WINDOWS_S, FIGURES, block_states, pool_stats

    owners = list(owners)
    n = pool.num_blocks
    letters = [STATE_LETTERS[st] for st in block_states(pool)]
    owner_of = [NO_OWNER] * n
    holders: dict[int, list[int]] = {}
    info = []
    for name, seq in owners:
        table = list(seq.block_table or ())
        if not table:
            continue
        i = len(info)
        info.append({"name": str(name), "kind": owner_kind(str(name)), "blocks": len(table),
                     "tokens": max(0, seq.num_computed - seq.kv_offset)})
        for bid in table:
            if not 0 <= bid < n:
                continue  # the validators report it; the map just skips it
            cur = owner_of[bid]
            if cur == NO_OWNER:
                owner_of[bid] = i
            elif cur == SHARED:
                if i not in holders[bid]:
                    holders[bid].append(i)
            elif cur != i:
                holders[bid] = [cur, i]
                owner_of[bid] = SHARED
    if stats is None:
        stats = pool_stats(pool, owners, offloaded_blocks)
    if windows is None:
        windows = {f"{w:g}s": {f: getattr(stats, f) for f in FIGURES} for w in DEFAULT_WINDOWS_S}
    return {
        "num_blocks": n, "block_size": pool.block_size, "states": "".join(letters), "owner": owner_of,
        "shared": [[bid, ids] for bid, ids in sorted(holders.items())], "owners": info,
        "offloaded": int(offloaded_blocks), "stats": stats.to_dict(), "windows": windows,
    }


def engine_block_map(engine, windows=None) -> dict:
    """:func:`block_map` of an :class:`~kvkeeper.engine.llm_engine.LLMEngine` (call on its own thread).

    windows: ``FragmentationMonitor.windows()`` to include (default: the figures now for every window).
    """
    return block_map(engine.pool, engine.kv_owners(), engine.offloaded_blocks(), windows=windows)


def check_block_map(doc: dict) -> None:
    """Raise ValueError if ``doc`` is not a well-formed block-map document (what a client checks)."""
    try:
        n = int(doc["num_blocks"])
        states, owner = doc["states"], doc["owner"]
        nown = len(doc["owners"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a block-map document (missing or bad field: {e}); "
                         "expected the JSON of GET /admin/kv.json") from None
    if len(states) != n or len(owner) != n:
        raise ValueError(f"block map of {n} blocks has {len(states)} states and {len(owner)} owner entries")
    bad = set(states) - set(LETTER_STATES)
    if bad:
        raise ValueError(f"unknown block state letters {sorted(bad)} (expected f, c, o)")
    if any(not (SHARED <= o < nown) for o in owner):
        raise ValueError(f"owner index out of range (expected -2..{nown - 1})")
