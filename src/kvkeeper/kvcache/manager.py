"""Block tables of sequences on top of the :class:`BlockPool`: prefix matching, slot allocation, caching full blocks."""

from __future__ import annotations

from .block_pool import BlockPool


class KVCacheManager:
    """Gives sequences blocks for their tokens and shares full blocks through the prefix cache.

    A sequence here is anything with ``token_ids``, ``num_prompt_tokens``, ``num_computed``,
    ``block_table``, ``block_hashes``, ``namespace`` and ``num_cache_written`` (see ``engine.sequence``).
    Prefix-cache statistics are counted in tokens: ``query_tokens``, ``hit_tokens``.
    """

    def __init__(self, pool: BlockPool, window: int | None = None):
        """window: tokens a sliding-window layer attends to, with a hybrid pool (see
        :mod:`kvkeeper.kvcache.block_pool`): blocks wholly before a sequence's window give their window blocks
        back, and a prefix hit or a truncation keeps only a prefix whose last window still has them."""
        self.pool = pool
        self.block_size = pool.block_size
        self.window = window if pool.hybrid else None
        self.query_tokens = 0
        self.hit_tokens = 0

    def blocks_needed(self, seq, num_new_tokens: int) -> int:
        total = seq.num_computed - seq.kv_offset + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def usable(self, table: list[int], num_tokens: int) -> bool:
        """Whether KV of the first ``num_tokens`` tokens in ``table`` can be continued: with a hybrid pool, every
        block holding one of the last ``window - 1`` of them still has its window block (the next token's
        sliding layers attend to those)."""
        if self.window is None or num_tokens <= 0:
            return True
        bs = self.block_size
        first = max(0, num_tokens - self.window + 1) // bs
        return all(self.pool.window_id(b) is not None for b in table[first : (num_tokens - 1) // bs + 1])

    def usable_prefix(self, table: list[int], num_tokens: int) -> int:
        """The longest continuable prefix (see :meth:`usable`): ``num_tokens``, else a block boundary below it."""
        if self.usable(table, num_tokens):
            return num_tokens
        n = (num_tokens - 1) // self.block_size * self.block_size
        while n > 0 and not self.usable(table, n):
            n -= self.block_size
        return n

    def release_out_of_window(self, seq) -> int:
        """Give back the window blocks of the sequence's blocks that lie wholly before the window of its next
        token (hybrid pools; a block shared with another owner keeps its own); returns how many."""
        if self.window is None or seq.kv_offset:
            return 0
        limit = min(len(seq.block_table), max(0, seq.num_computed - self.window) // self.block_size)
        start = getattr(seq, "window_released", 0)
        n = sum(self.pool.release_window(seq.block_table[i]) for i in range(min(start, limit), limit))
        seq.window_released = max(start, limit)
        return n

    def match_prefix(self, seq) -> int:
        """On first scheduling, take cached full blocks matching the sequence's head.

        At least one token is always left to compute (its logits are needed).
        Returns the number of tokens reused.
        """
        bs = self.block_size
        if seq.block_table:
            return 0
        if getattr(seq, "computes_whole_prompt", False):
            return 0  # h2o / snapkv (attention of every prompt query) or prompt logprobs: computed whole
        limit = (len(seq.token_ids) - 1) // bs
        parent = None
        hits: list[int] = []
        hashes: list[int] = []
        for i in range(limit):
            bid, h = self.pool.lookup(parent, seq.namespace, seq.token_ids[i * bs : (i + 1) * bs])
            if bid is None:
                break
            self.pool.incref(bid)
            hits.append(bid)
            hashes.append(h)
            parent = h
        keep = self.usable_prefix(hits, len(hits) * bs) // bs  # sliding layers: the last window must be there
        self.pool.free_all(hits[keep:])
        del hits[keep:], hashes[keep:]
        seq.block_table = hits
        seq.block_hashes = hashes
        seq.num_computed = len(hits) * bs
        self.query_tokens += len(seq.token_ids)
        self.hit_tokens += seq.num_computed
        return seq.num_computed

    def allocate(self, seq, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens; False (nothing taken) if the pool is short."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.pool.num_free:
            return False
        if need:
            seq.block_table.extend(self.pool.allocate(need))
        return True

    def trim_to_computed(self, seq) -> int:
        """Give back the blocks past those holding the sequence's ``num_computed - kv_offset`` computed tokens (blocks
        a speculative step allocated for draft tokens that were rejected: never full, never registered, held by
        this sequence alone); returns how many."""
        keep = -(-(seq.num_computed - seq.kv_offset) // self.block_size)
        extra = seq.block_table[keep:]
        if extra:
            self.pool.free_all(extra)
            del seq.block_table[keep:]
        return len(extra)

    def commit(self, seq) -> None:
        """Register blocks that became full and computed in the prefix cache; adds the prompt tokens of the
        blocks this sequence stored first (not already cached under their hash) to ``seq.num_cache_written``."""
        if seq.kv_offset:  # compressed KV is never shared
            return
        bs = self.block_size
        full = seq.num_computed // bs
        for i in range(len(seq.block_hashes), full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            block = self.pool.blocks[seq.block_table[i]]
            fresh = block.hash is None
            h = self.pool.register(seq.block_table[i], parent, seq.namespace, seq.token_ids[i * bs : (i + 1) * bs])
            seq.block_hashes.append(h)
            if fresh and block.hash == h and (i + 1) * bs <= seq.num_prompt_tokens:
                seq.num_cache_written += bs
        self.release_out_of_window(seq)

    def free(self, seq) -> None:
        """Release every block of the sequence (cached ones stay reusable until evicted)."""
        self.pool.free_all(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0
        seq.window_released = 0
        seq.kv_offset = 0
        seq.observer = None  # a recomputed prefill is observed (and compressed) afresh
        seq.compressed = False

    def truncate(self, seq, keep_tokens: int) -> None:
        """Keep KV for the first ``keep_tokens`` tokens only (a later turn diverges there).

        Full blocks inside the kept range stay; the block holding position
        ``keep_tokens`` is kept only if this sequence owns it alone and it is
        not in the prefix cache (it will be overwritten), else it is dropped and
        its tokens recomputed.  Sets ``num_computed`` to what remains valid.  With a hybrid pool the prefix kept,
        after that rounding down too, is one whose last window still has its window blocks (:meth:`usable`):
        rounding down to the block boundary moves the window's start back, possibly onto a block whose window
        block was released (a session turn resending a conversation whose cut reply the client shortened, as
        Codex CLI does, failed the next step with "a block inside its window has no window block").
        """
        bs = self.block_size
        keep_tokens = self.usable_prefix(seq.block_table, min(keep_tokens, seq.num_computed))
        nfull = keep_tokens // bs
        keep_blocks = nfull
        if keep_tokens % bs and nfull < len(seq.block_table):
            b = self.pool.blocks[seq.block_table[nfull]]
            if b.ref_count == 1 and b.hash is None and len(seq.block_hashes) <= nfull:
                keep_blocks = nfull + 1
            else:
                keep_tokens = self.usable_prefix(seq.block_table, nfull * bs)
                nfull = keep_blocks = keep_tokens // bs
        seq.window_released = min(getattr(seq, "window_released", 0), keep_tokens // bs)
        self.pool.free_all(seq.block_table[keep_blocks:])
        del seq.block_table[keep_blocks:]
        del seq.block_hashes[nfull:]
        seq.num_computed = keep_tokens
