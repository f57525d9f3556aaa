"""The host offload tier's KV blocks, one copy per block content, ref-counted by the offloaded sessions.

Forks of one session (and stored responses continuing one another) share their full blocks in the pool.  When
they are offloaded one by one, each would copy the shared prefix to host memory again; here a full block
registered in the prefix cache is kept once, under its content key: its chained prefix-cache hash
(:func:`~kvkeeper.kvcache.block_pool.block_hash`: parent chain, namespace, token ids) with its token ids, and
counted once per session listing it.  Blocks without a hash (the partial last block, compressed KV) are private
to their session.  An entry is dropped when the last session listing it releases it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

_private = itertools.count()


@dataclass
class _Entry:
    payload: dict[str, torch.Tensor]  # one block's raw storage: each part (1, ...) or, KIVI's residuals, (0|1, ...)
    nbytes: int
    refs: int = 1


class HostBlocks:
    """Raw KV of offloaded blocks (CPU tensors) keyed by content; see the module docstring."""

    def __init__(self):
        self._blocks: dict[tuple, _Entry] = {}
        self.nbytes = 0  # bytes held, each shared block counted once

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key) -> bool:
        return key in self._blocks

    @staticmethod
    def keys_of(st, nb: int, block_size: int) -> list[tuple]:
        """The content keys of the first ``nb`` blocks of sequence ``st``: ``("h", hash, token ids)`` for a
        full block registered under a chained hash (uncompressed KV), a fresh private key otherwise."""
        keys = []
        for i in range(nb):
            if not st.kv_offset and i < len(st.block_hashes) and st.block_hashes[i] is not None:
                keys.append(("h", st.block_hashes[i], tuple(st.token_ids[i * block_size:(i + 1) * block_size])))
            else:
                keys.append(("p", next(_private)))
        return keys

    def put(self, kv_store, block_ids: list[int], keys: list[tuple]) -> int:
        """Hold blocks ``block_ids`` (pool ids, read from ``kv_store``) under ``keys`` (same length): a key held
        already takes one more reference and nothing is copied.  Returns the bytes newly copied."""
        new = [(b, k) for b, k in zip(block_ids, keys) if k not in self._blocks]
        for k in keys:
            if k in self._blocks:
                self._blocks[k].refs += 1
        if not new:
            return 0
        copied = 0
        for k, payload in zip([k for _, k in new], _read_each(kv_store, [b for b, _ in new])):
            n = sum(t.nbytes for t in payload.values())
            self._blocks[k] = _Entry(payload, n)
            copied += n
        self.nbytes += copied
        return copied

    def size_of(self, keys: list[tuple]) -> int:
        """Bytes of the blocks of ``keys`` (held ones), each counted as often as listed."""
        return sum(self._blocks[k].nbytes for k in keys)

    def gather(self, keys: list[tuple]) -> dict[str, torch.Tensor]:
        """The blocks of ``keys`` as one payload (what ``kv_store.read_blocks`` of their pool ids gave)."""
        parts = [self._blocks[k].payload for k in keys]
        return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}

    def release(self, keys: list[tuple]) -> None:
        """Drop one reference per key; a block no session lists any more is freed."""
        for k in keys:
            e = self._blocks.get(k)
            if e is None:
                continue
            e.refs -= 1
            if e.refs <= 0:
                del self._blocks[k]
                self.nbytes -= e.nbytes


def _read_each(kv_store, block_ids: list[int]) -> list[dict[str, torch.Tensor]]:
    """One payload per block: a single read split along the block dimension, or a read per block when a part
    is not one row per block (KIVI's residuals of open blocks)."""
    payload = kv_store.read_blocks(block_ids)
    n = len(block_ids)
    if all(t.shape[0] == n for t in payload.values()):
        return [{name: t[i:i + 1].clone() for name, t in payload.items()} for i in range(n)]
    return [kv_store.read_blocks([b]) for b in block_ids]
