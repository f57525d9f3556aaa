"""Integrity validators for the paged KV cache: block tables, refcounts, positions, prefix-cache keys.

``check_engine(engine)`` walks every owner of KV blocks (``engine.kv.holdings()``: running and
waiting sequences, and what the engine's KV holders report, e.g. the sessions' pinned states)
and returns a list of :class:`Violation` (empty when all is well).  It checks:

* **indices**: every block id in a block table is in ``[0, num_blocks)``;
* **refcounts**: each block's refcount equals the number of block tables holding it
  (a block held by two owners with one reference is "shared without a reference";
  a block in a table with refcount 0 was "freed while referenced");
* **positions**: a sequence's KV fills its table contiguously from slot zero:
  ``ceil(kv_len / block_size)`` blocks for ``kv_len = num_computed - kv_offset``
  tokens (one more block may be allocated ahead for a step being scheduled);
* **prefix keys**: every full block a sequence registered carries the chained hash of
  *its* namespace, parent hash and the tokens at *its* positions -- a block reused across
  namespaces, or whose tokens sit one position off, fails this check;
* the pool's own bookkeeping (free lists, hash index: ``BlockPool.check_invariants``).

Cost: O(total block-table length + blocks) plus one 64-bit hash per registered block;
about a millisecond for a few thousand blocks, cheap enough to sample every N steps
(``LLMEngine(validate_every=N)`` or ``KVKEEPER_VALIDATE=N``; the test suite runs it every step).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .block_pool import block_hash


class IntegrityError(AssertionError):
    """KV cache bookkeeping is inconsistent; ``violations`` lists what was found."""

    def __init__(self, violations: list["Violation"]):
        self.violations = violations
        head = "; ".join(str(v) for v in violations[:5])
        more = f" (+{len(violations) - 5} more)" if len(violations) > 5 else ""
        super().__init__(f"KV cache integrity check failed: {head}{more}")


@dataclass
class Violation:
    kind: str  # "index", "refcount", "positions", "prefix_key", "pool"
    owner: str  # request id or "session:<id>" or "pool"
    detail: str
    block: int | None = None
    token: int | None = None  # first token position concerned

    def __str__(self) -> str:
        where = f" block {self.block}" if self.block is not None else ""
        tok = f" token {self.token}" if self.token is not None else ""
        return f"[{self.kind}] {self.owner}{where}{tok}: {self.detail}"


def check_engine(engine) -> list[Violation]:
    """All violations found in ``engine``'s KV bookkeeping (see the module docstring)."""
    pool = engine.pool
    bs = pool.block_size
    out: list[Violation] = []
    holders: Counter[int] = Counter()
    seen_tables: set[int] = set()
    for owner, seq in engine.kv.holdings():
        if id(seq.block_table) in seen_tables:  # a session state that is also a live sequence
            continue
        seen_tables.add(id(seq.block_table))
        table = seq.block_table
        for i, bid in enumerate(table):
            if not (0 <= bid < pool.num_blocks):
                out.append(Violation("index", owner, f"block table entry {i} is {bid}, outside 0..{pool.num_blocks - 1}",
                                     token=i * bs))
            else:
                holders[bid] += 1
        kv_len = seq.num_computed - seq.kv_offset
        if table:
            need = -(-kv_len // bs)
            if not (need <= len(table) <= need + 1):
                out.append(Violation("positions", owner, f"{kv_len} computed KV tokens need {need} blocks, the table "
                                     f"has {len(table)}", token=min(kv_len, len(table) * bs)))
        elif kv_len:
            out.append(Violation("positions", owner, f"{kv_len} computed tokens but no blocks", token=0))
        if kv_len < 0 or seq.num_computed > len(seq.token_ids):
            out.append(Violation("positions", owner, f"num_computed {seq.num_computed} (kv_offset {seq.kv_offset}) "
                                 f"outside 0..{len(seq.token_ids)}", token=seq.num_computed))
        if seq.kv_offset == 0:
            parent = None
            for i, h in enumerate(seq.block_hashes):
                if i >= len(table) or not (0 <= table[i] < pool.num_blocks):
                    break
                toks = seq.token_ids[i * bs:(i + 1) * bs]
                want = block_hash(parent, seq.namespace, toks)
                b = pool.blocks[table[i]]
                if h != want or (b.hash is not None and b.hash != want):
                    why = ("registered under another namespace" if b.namespace is not None
                           and b.namespace != seq.namespace else "its key does not match the tokens at these positions")
                    out.append(Violation("prefix_key", owner, why, block=table[i], token=i * bs))
                    break
                parent = want
    for bid, n in holders.items():
        rc = pool.blocks[bid].ref_count
        if rc != n:
            what = "freed while referenced" if rc == 0 else (
                "shared without a reference" if rc < n else "holds references nobody owns")
            out.append(Violation("refcount", "pool", f"{what}: refcount {rc}, held by {n} block tables", block=bid))
    for b in pool.blocks:
        if b.ref_count > 0 and b.block_id not in holders:
            out.append(Violation("refcount", "pool", f"refcount {b.ref_count} but no block table holds it (leak)",
                                 block=b.block_id))
    try:
        pool.check_invariants()
    except AssertionError as e:
        out.append(Violation("pool", "pool", str(e)))
    return out


def assert_engine_ok(engine) -> None:
    """Raise :class:`IntegrityError` when :func:`check_engine` finds anything."""
    v = check_engine(engine)
    if v:
        raise IntegrityError(v)
