"""Continuous batching with chunked prefill and preemption by recomputation.

Each step spends a token budget (``max_num_batched_tokens``): running
sequences first, oldest first (one token each when decoding, a chunk of their
prompt while prefilling), then waiting sequences are admitted, their prompt
cut into chunks that fit what is left.  When the pool runs out of blocks the
newest running sequence is preempted: its blocks are released (full ones stay
in the prefix cache) and it goes back to the head of the queue to be
recomputed later, as vLLM does in its v1 scheduler.  Nothing crashes for want
of blocks; a request that could never fit even in an empty pool is finished
with an error.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..kvcache.manager import KVCacheManager
from .sequence import SeqStatus, Sequence


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens this step)
    preempted: list[Sequence] = field(default_factory=list)
    rejected: list[Sequence] = field(default_factory=list)  # can never fit; finished with an error

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool, reclaim: Callable[[int], int] | None = None,
                 drafter: Callable[[Sequence, int, int], list[int]] | None = None):
        """Settings as in :class:`~kvkeeper.engine.config.EngineConfig`.  reclaim(n_blocks) is called when admission
        lacks blocks; it may release idle sessions' blocks and returns how many it freed.  drafter(seq, budget,
        running): draft tokens for a decode row (speculative decoding, :meth:`Drafter.propose
        <kvkeeper.spec_decode.drafter.Drafter.propose>`); they ride with the row when their blocks can be had
        without taking the one free block each later running sequence may need."""
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.reclaim, self.drafter = reclaim, drafter
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _release_waiting(self, head: Sequence, n_blocks: int) -> int:
        """Free blocks held by waiting sequences other than ``head`` (KV a session handed over, newest first).

        Their full blocks stay in the prefix cache, so they are usually found again on admission.
        Returns the number of blocks whose last reference this dropped (an estimate of what was freed).
        """
        before = self.kv.pool.num_free
        for seq in reversed(self.waiting):
            if self.kv.pool.num_free - before >= n_blocks:
                break
            if seq is not head and seq.block_table:
                self.kv.free(seq)
        return self.kv.pool.num_free - before

    def _chunk(self, remaining: int, budget: int, first: bool) -> int:
        if self.enable_chunked_prefill:
            return min(remaining, budget)
        # without chunking a prompt goes in whole; an oversized one only as the step's first item
        return remaining if (remaining <= budget or first) else 0

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work: running sequences first, then admissions while budget and blocks last."""
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Give running sequences their tokens, preempting the newest when blocks run out; returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq.num_uncomputed, budget, not out.scheduled)
            if n == 0:
                i += 1
                continue
            n = self._with_drafts(seq, n, budget, len(self.running) - i - 1)
            while not self.kv.allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    return budget  # seq itself was preempted: it was the last running one
            out.scheduled.append((seq, n))
            budget -= n
            i += 1
        return budget

    def _with_drafts(self, seq: Sequence, n: int, budget: int, later: int) -> int:
        """``n``, or 1 + the drafts of a decode row whose blocks are allocated now (``seq.spec_tokens`` set);
        ``later``: running sequences after it, each keeping one free block to grow into."""
        seq.spec_tokens = []
        if self.drafter is None or n != 1:
            return n
        drafts = self.drafter(seq, budget, len(self.running))
        if not drafts or self.kv.blocks_needed(seq, 1 + len(drafts)) + later > self.kv.pool.num_free:
            return n
        self.kv.allocate(seq, 1 + len(drafts))
        seq.spec_tokens = drafts
        return 1 + len(drafts)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences, oldest first, while the budget, ``max_num_seqs`` and the pool allow."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if -(-len(seq.token_ids) // self.kv.block_size) > self.kv.pool.num_blocks:
                self._reject(seq, out)  # more blocks than the whole pool: refused before any work or reclaim
                continue
            if not seq.block_table:
                self.kv.match_prefix(seq)
            n = self._chunk(seq.num_uncomputed, budget, not out.scheduled)
            if n == 0:
                break
            # admit only with headroom: one free block per running sequence to grow into, so that an
            # admission does not force a preemption on the next step (vLLM keeps a watermark likewise)
            if self.running and self.kv.blocks_needed(seq, n) + len(self.running) > self.kv.pool.num_free:
                self.kv.free(seq)  # do not hold prefix hits while waiting
                break
            if not self._allocate(seq, n):
                if self.running or out.scheduled:
                    self.kv.free(seq)  # do not hold prefix hits while waiting
                    break
                self._reject(seq, out)  # nothing else holds blocks that could be waited for: it can never fit
                continue
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            if seq.num_cached_tokens is None:  # first admission: what it holds now was reused, not computed
                seq.num_cached_tokens = seq.num_computed
            if seq.t_scheduled is None:
                seq.t_scheduled = time.perf_counter()
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n

    def _allocate(self, seq: Sequence, n: int) -> bool:
        """Blocks for ``n`` more tokens of ``seq``, reclaiming idle sessions' KV (then waiting requests') if short."""
        if self.kv.allocate(seq, n):
            return True
        short = self.kv.blocks_needed(seq, n) - self.kv.pool.num_free
        if self.reclaim is not None and self.reclaim(short) > 0 and self.kv.allocate(seq, n):
            return True
        return not self.running and self._release_waiting(seq, short) > 0 and self.kv.allocate(seq, n)

    def _reject(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.waiting.popleft()
        pool = self.kv.pool
        total_need = -(-len(seq.token_ids) // self.kv.block_size)
        can_have = (f"the pool has only {pool.num_blocks} blocks" if total_need > pool.num_blocks else
                    f"only {pool.num_free + len(seq.block_table)} of the pool's {pool.num_blocks} blocks can be had")
        seq.error = (f"request needs {total_need} KV blocks ({len(seq.token_ids)} tokens of {self.kv.block_size}) "
                     f"but {can_have}; raise the KV budget or close sessions")
        self.kv.free(seq)
        out.rejected.append(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
