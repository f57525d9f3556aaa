"""KV cache events: what a replica's prefix cache stored and dropped, in vLLM's event schema and wire format.

A router that follows these events knows, block hash by block hash, which KV each replica holds
(:mod:`kvkeeper.cluster.kv_index`).  The schema is vLLM's ``vllm.distributed.kv_events``:

* :class:`BlockStored` -- full blocks registered in the prefix cache: ``block_hashes`` (a chain: each block's
  parent is the one before it, the first one's is ``parent_block_hash``, None for a prompt's first block),
  ``token_ids`` (the blocks' tokens, concatenated; empty unless the publisher was asked for them),
  ``block_size`` (tokens), ``lora_id`` (always None: the adapter is part of the namespace), ``medium``
  (``"CPU"`` or ``"GPU"``: where the KV lies), then kvkeeper's one extension, ``namespace``: the cache
  namespace's hashed identity (:attr:`kvkeeper.kvcache.namespace.Namespace.digest`, 16 hex digits; no tenant,
  salt or model revision in clear).
* :class:`BlockRemoved` -- blocks dropped from the prefix cache (evicted for reuse, or by a reset).
* :class:`AllBlocksCleared` -- the replica's prefix cache is empty (sent first by every publisher, so a
  replica that restarts clears what a router knew of it).

Block hashes are :func:`kvkeeper.kvcache.block_pool.block_hash`'s signed 64-bit ints, chained over the
namespace digest and the block's token ids, so a router that tokenizes a prompt as the replica does computes
the same hashes without any token id from the replica.

Wire format (vLLM's msgspec structs with ``array_like=True, tag=True``, encoded with msgpack): a batch is the
array ``[ts, [event, ...]]`` (``ts``: Unix time in seconds, a float) and each event the array
``[class name, field, field, ...]`` in the order above.  msgpack is imported only by :func:`encode_batch` /
:func:`decode_batch` (the ``events`` extra).

:class:`EventRecorder` is what a :class:`~kvkeeper.kvcache.block_pool.BlockPool` reports to (``pool.events``);
it merges consecutive stores of one chain into one event, as vLLM's block pool does per request.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Union


@dataclass
class BlockStored:
    """Full blocks registered in a prefix cache (a chain of ``len(block_hashes)`` blocks)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    namespace: str = ""


@dataclass
class BlockRemoved:
    """Blocks dropped from a prefix cache."""

    block_hashes: list[int]
    medium: str | None = None


@dataclass
class AllBlocksCleared:
    """The prefix cache holds no block."""


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
_CLASSES = {c.__name__: c for c in (BlockStored, BlockRemoved, AllBlocksCleared)}
_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "namespace"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


@dataclass
class EventBatch:
    """Events in the order they happened; ``ts``: Unix time (seconds) when the batch was taken."""

    ts: float
    events: list = field(default_factory=list)


def _to_wire(ev) -> list:
    name = type(ev).__name__
    return [name] + [getattr(ev, f) for f in _FIELDS[name]]


def _from_wire(raw) -> KVCacheEvent:
    if not isinstance(raw, (list, tuple)) or not raw or raw[0] not in _CLASSES:
        raise ValueError(f"not a KV cache event (an array tagged BlockStored, BlockRemoved or AllBlocksCleared): "
                         f"{str(raw)[:80]}")
    name, values = raw[0], list(raw[1:])
    names = _FIELDS[name][:len(values)]  # trailing fields left out take their defaults (msgspec's omit_defaults)
    return _CLASSES[name](**dict(zip(names, values)))


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack bytes of a batch: ``[ts, [[tag, fields...], ...]]``."""
    import msgpack

    return msgpack.packb([batch.ts, [_to_wire(e) for e in batch.events]], use_bin_type=True)


def decode_batch(payload: bytes) -> EventBatch:
    """A batch back from :func:`encode_batch`'s bytes (or vLLM's).  Raises ValueError for bytes that are not one."""
    import msgpack

    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several types for malformed input
        raise ValueError(f"not a msgpack KV event batch: {e}") from None
    if not isinstance(raw, (list, tuple)) or len(raw) < 2 or not isinstance(raw[1], (list, tuple)):
        raise ValueError("a KV event batch is the array [ts, events]")
    return EventBatch(float(raw[0]), [_from_wire(e) for e in raw[1]])


class EventRecorder:
    """Collects a block pool's events until :meth:`take` (thread-safe: the engine thread records, a publisher
    thread takes).

    include_token_ids: put the blocks' token ids into :class:`BlockStored` (off: an empty list).
    medium: where the KV lies (``"CPU"`` or ``"GPU"``).  ``pending`` is set while events wait.
    """

    def __init__(self, block_size: int, include_token_ids: bool = False, medium: str | None = "CPU"):
        self.block_size = block_size
        self.include_token_ids = include_token_ids
        self.medium = medium
        self.pending = threading.Event()
        self._lock = threading.Lock()
        self._events: list = []
        self.recorded = 0  # events recorded so far (merged stores count once)

    def _add(self, ev) -> None:
        self._events.append(ev)
        self.recorded += 1
        self.pending.set()

    def stored(self, block_hash: int, parent: int | None, namespace: str, token_ids) -> None:
        """One block registered under ``block_hash`` (its parent's hash, the namespace digest, its tokens)."""
        toks = list(token_ids) if self.include_token_ids else []
        with self._lock:
            last = self._events[-1] if self._events else None
            if (isinstance(last, BlockStored) and last.namespace == namespace and last.block_hashes[-1] == parent):
                last.block_hashes.append(block_hash)
                last.token_ids.extend(toks)
                return
            self._add(BlockStored([block_hash], parent, toks, self.block_size, None, self.medium, namespace))

    def removed(self, block_hash: int) -> None:
        """One block dropped from the prefix cache."""
        with self._lock:
            last = self._events[-1] if self._events else None
            if isinstance(last, BlockRemoved):
                last.block_hashes.append(block_hash)
                return
            self._add(BlockRemoved([block_hash], self.medium))

    def cleared(self) -> None:
        """The prefix cache is empty (events before it are moot: dropped)."""
        with self._lock:
            self._events.clear()
            self._add(AllBlocksCleared())

    def take(self) -> EventBatch | None:
        """The events recorded since the last call as one batch (None when there are none)."""
        with self._lock:
            events, self._events = self._events, []
            self.pending.clear()
        return EventBatch(time.time(), events) if events else None
