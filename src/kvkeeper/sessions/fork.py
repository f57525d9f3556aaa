"""Forking a session's KV copy-on-write: the branch shares the full blocks, and copies only the partial last one.

A fork of a session's pinned KV (``Session.kv``, a finished :class:`~kvkeeper.engine.sequence.Sequence`) is a
new sequence of the same token ids whose block table takes one more reference on every full block (the block
pool's refcount: nothing is copied, and a full block is never written again) and holds a copy of the partial
last block, the only block a continuation writes into.  Two branches of one conversation therefore share their
common prefix in the pool and never see each other's tokens.  The idea is the copy-on-write fork of paged
attention (Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention",
SOSP 2023, section 4.4), done once at the fork since only the last block can be written.
"""

from __future__ import annotations

import torch

from ..engine.sequence import Sequence, SeqStatus
from ..sampling.params import SamplingParams
from ..engine.handle import EngineHandle


def fork_kv(engine: EngineHandle, kv: Sequence, request_id: str) -> Sequence:
    """A finished sequence with ``kv``'s token ids sharing its KV: full blocks by reference, the partial last
    block copied into a fresh block.  Compressed KV (``kv_offset``) is never shared: the fork then holds the
    token ids only (its next turn recomputes them, from the prefix cache where it can).  When no block is free
    for the copy (after asking the KV holders), or in a hybrid KV cache (whose window blocks are not copied),
    the partial block is left out and its tokens are recomputed.  Raises nothing."""
    fork = Sequence(request_id, list(kv.token_ids), SamplingParams(), kv.namespace,
                    num_prompt_tokens=len(kv.token_ids), status=SeqStatus.FINISHED)
    if not kv.block_table or kv.kv_offset:
        return fork
    bs = engine.block_size
    nfull = min(kv.num_computed // bs, len(kv.block_table))
    fork.block_table = engine.kv.share_blocks(kv.block_table[:nfull])
    fork.block_hashes = list(kv.block_hashes[:nfull])
    fork.num_computed = nfull * bs
    rest = kv.num_computed - nfull * bs
    if rest and nfull < len(kv.block_table) and engine.kv.store.uniform:
        src = kv.block_table[nfull]
        engine.kv.share_blocks([src])  # held while room is made: a reclaim may unpin ``kv`` itself
        try:
            got = engine.kv.allocate_blocks(1)
            if got is not None:
                dev = engine.kv.store.device
                engine.kv.store.move_blocks(torch.tensor([src], device=dev), torch.tensor(got, device=dev))
                fork.block_table.append(got[0])
                fork.num_computed = kv.num_computed
        finally:
            engine.kv.free_blocks([src])
    return fork
