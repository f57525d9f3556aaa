"""The block map: each pool block's state and owner, in a compact JSON-ready form.

Built on the thread that owns the engine (the server's engine thread, or the caller of a
local engine) and drawn by ``kvkeeper kv map`` (terminal) and the server page ``/admin/kv``
(browser).  The document (``block_map``'s return value, served as ``GET /admin/kv.json``)::

    {
      "num_blocks": B, "block_size": S,
      "states": "ffoocc...",       # one letter per block id: f free, c cached, o owned (len B)
      "owner":  [-1, -1, 0, 3, ...],  # per block id: index into "owners", -1 none, -2 shared (len B)
      "shared": [[bid, [i, j]], ...], # owners of each block held by several owners
      "refcount": [0, 0, 2, 1, ...],  # per block id: the pool's reference count (len B)
      "tokens": [0, 16, 16, 9, ...],  # per block id: token slots holding KV (owned: the largest fill an
                                      # owner gives it; cached: its registered tokens; free: 0) (len B)
      "owners": [{"name", "kind", "blocks", "tokens"}, ...],  # kind: request / session
      "offloaded": N,                # blocks' worth of session KV outside the pool
      "stats": PoolStats.to_dict(),  # counts and figures now (kvkeeper.kvcache.telemetry)
      "windows": {"1s": {...}, "10s": {...}, "60s": {...}},  # figure means (FragmentationMonitor)
    }

States follow :mod:`kvkeeper.kvcache.telemetry`: *owned* = refcount above zero, *cached* =
free but registered in the prefix cache, *free* otherwise.  An owned block that no listed
owner holds (a raw allocation outside any sequence) has owner -1.  Owner names are those of
``LLMEngine.kv.holdings()``: request ids and ``session:<id>``.

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
    "owned": "#f59e0b",  # an owned block no listed owner holds; listed owners get their palette colour
    "shared": "#ec4899",  # held by several owners
    "offloaded": "#a855f7",
}


# Owner colours: a fixed qualitative palette, most distinct first (picked greedily for the largest smallest
# CIELAB distance, from Kelly's 22 colours of maximum contrast, Tableau 20 and a few saturated extras, against
# the state colours above and the page background #111827).  Any two of these, and any one of them and a state
# colour or the background, are at least OWNER_MIN_DELTA_E apart (CIE76 delta-E*ab; tests/test_kv_admin.py
# computes it).  The /admin/kv page receives the same list.
OWNER_PALETTE = [
    "#76ff03", "#b9f6ca", "#882d17", "#1b5e20", "#f7b6d2", "#ff1744", "#8db600", "#00e5ff", "#ffea00",
    "#827717", "#f99379", "#ffd180", "#875692", "#e65100", "#1f77b4", "#a1caf1", "#00bfa5", "#2ca02c",
]
OWNER_MIN_DELTA_E = 30.0
PAGE_BACKGROUND = "#111827"


def palette_slots(names, previous: dict[str, int] | None = None) -> dict[str, int]:
    """Palette slot (index into :data:`OWNER_PALETTE`) of each owner name, assigned in a stable order.

    Owners in ``previous`` (the last assignment) keep their slot; a new owner takes the lowest slot no
    current owner holds, in the order of ``names``; with more owners than colours, slots repeat
    (the extra owners get slot ``k mod len(OWNER_PALETTE)``).  The /admin/kv page runs the same rule
    across its refreshes; from an empty ``previous`` the slots follow the order of ``names``.
    """
    names = list(dict.fromkeys(names))
    previous = previous or {}
    out = {n: previous[n] for n in names if n in previous}
    taken = set(out.values())
    free = (k for k in range(len(OWNER_PALETTE)) if k not in taken)
    for k, n in enumerate(x for x in names if x not in out):
        slot = next(free, None)
        out[n] = slot if slot is not None else (len(taken) + k) % len(OWNER_PALETTE)
    return out


def owner_colours(names) -> list[str]:
    """"#rrggbb" colour of each owner of ``names`` (in that order), from a fresh :func:`palette_slots`."""
    names = list(names)
    slots = palette_slots(names)
    return [OWNER_PALETTE[slots[n]] for n in names]


def owner_kind(name: str) -> str:
    """"session" or "request" from an owner name of ``LLMEngine.kv.holdings()``."""
    return "session" if name.startswith("session:") else "request"


def _owner_index(owners, n: int) -> tuple[list[int], dict[int, list[int]], list[dict]]:
    """Per block id: its owner's index (or NO_OWNER / SHARED); the holders of shared blocks; the owners' info."""
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
    return owner_of, holders, info


def block_map(pool, owners=(), offloaded_blocks: int = 0, stats=None, windows=None) -> dict:
    """The block-map document of ``pool`` (a BlockPool); see the module docstring.

    owners: (name, sequence) pairs as ``LLMEngine.kv.holdings()`` yields them (a sequence has
    ``block_table``, ``num_computed`` and ``kv_offset``).  stats: a PoolStats to include (default:
    computed here); windows: ``FragmentationMonitor.windows()`` (default: the stats' figures for
    every default window).
    """
    from .telemetry import DEFAULT_WINDOWS_S, FIGURES, block_states, pool_stats, used_slots_per_block

    owners = list(owners)
    n = pool.num_blocks
    letters = [STATE_LETTERS[st] for st in block_states(pool)]
    owner_of, holders, info = _owner_index(owners, n)
    fills = used_slots_per_block(pool, owners)
    tokens = [fills.get(bid, 0) if st == "o" else
              (len(pool.blocks[bid].token_ids or ()) or pool.block_size) if st == "c" else 0
              for bid, st in enumerate(letters)]
    if stats is None:
        stats = pool_stats(pool, owners, offloaded_blocks)
    if windows is None:
        windows = {f"{w:g}s": {f: getattr(stats, f) for f in FIGURES} for w in DEFAULT_WINDOWS_S}
    return {
        "num_blocks": n, "block_size": pool.block_size, "states": "".join(letters), "owner": owner_of,
        "shared": [[bid, ids] for bid, ids in sorted(holders.items())], "owners": info,
        "refcount": [b.ref_count for b in pool.blocks], "tokens": tokens,
        "offloaded": int(offloaded_blocks), "stats": stats.to_dict(), "windows": windows,
    }


def engine_block_map(engine, windows=None) -> dict:
    """:func:`block_map` of an :class:`~kvkeeper.engine.llm_engine.LLMEngine` (call on its own thread).

    windows: ``FragmentationMonitor.windows()`` to include (default: the figures now for every window).
    """
    return block_map(engine.pool, engine.kv.holdings(), engine.kv.offloaded_blocks(), windows=windows)


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
