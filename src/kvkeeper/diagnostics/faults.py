"""Fault injectors for tests of the validators and of the reuse audit.  Never used by the engine itself.

Each function corrupts the KV bookkeeping or contents the way a bug would, so that
tests can check that :mod:`kvkeeper.kvcache.validate` and :mod:`kvkeeper.diagnostics.audit`
catch it and name the layer and token.  Run such engines with ``validate_every=0``
when the test is about the audit (the validators would refuse the corrupt step first).
The engine is not usable for anything else afterwards (refcounts no longer add up).
"""

from __future__ import annotations
from ..engine.handle import EngineHandle


def reuse_foreign_block(engine: EngineHandle, seq, block_id: int) -> None:
    """A block reused across namespaces: hand ``seq`` another sequence's full block as its first block.

    seq: a request just added (waiting, no blocks yet).  block_id: a computed, full block of
    another request (any namespace), e.g. found with ``engine.pool.lookup``.  ``seq`` then
    treats the block's ``block_size`` tokens as its own cached prefix, as a wrong prefix-cache
    hit would, and computes only the rest of its prompt.
    Raises ValueError if ``seq`` already holds blocks or its prompt is not longer than a block.
    """
    bs = engine.block_size
    if seq.block_table or seq.num_computed:
        raise ValueError(f"{seq.request_id} already holds blocks: inject before it is scheduled")
    if len(seq.token_ids) <= bs:
        raise ValueError(f"{seq.request_id} needs more than {bs} prompt tokens")
    engine.pool.incref(block_id)
    seq.block_table = [block_id]
    seq.block_hashes = []
    seq.num_computed = bs


def shift_positions(engine: EngineHandle, seq, start: int, end: int, by: int = 1) -> None:
    """Positions shifted by one: the next step that computes tokens ``start .. end-1`` of ``seq``
    gives them RoPE positions ``p + by`` (their K is stored rotated for the wrong position).

    Wraps ``engine.runner.build_batch`` once; the wrapper removes itself after the step that
    touched the range.  Raises ValueError for an empty range.
    """
    if end <= start:
        raise ValueError(f"empty token range {start}..{end}")
    runner = engine.runner
    original = runner.build_batch

    def build_batch(scheduled):
        input_ids, positions, meta, rows, seqs = original(scheduled)
        at, hit = 0, False
        for s, n in scheduled:
            if s is seq:
                c = s.num_computed
                lo, hi = max(start, c), min(end, c + n)
                if lo < hi:
                    positions[at + lo - c : at + hi - c] += by
                    hit = True
            at += n
        if hit:
            runner.build_batch = original
        return input_ids, positions, meta, rows, seqs

    runner.build_batch = build_batch


def free_while_referenced(engine: EngineHandle, seq, index: int) -> int:
    """A block freed while referenced: drop the pool's reference to ``seq.block_table[index]``
    although ``seq`` (a running request or a session's pinned state) still holds it, and put it
    first in line for the next allocation so that another request overwrites it.

    Returns the block id.  Raises IndexError if the table has no such entry.
    """
    pool = engine.pool
    bid = seq.block_table[index]
    pool.free(bid)
    if pool.blocks[bid].ref_count == 0:
        cached = pool._free_held if bid in pool._free_held else pool._free_cached
        if bid in cached:  # drop its prefix-cache entry and hand it out next
            del cached[bid]
            pool._evict(bid)
            pool._free_plain[bid] = None
        pool._free_plain.move_to_end(bid, last=False)
    return bid
