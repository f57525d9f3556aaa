"""Offload tiers for idle sessions: host memory, then disk, restored on the session's next turn.

An idle session (no turn in flight) pins blocks in the KV pool; compressed KV (a session compression policy,
:mod:`kvkeeper.sessions.compress`) is offloaded as it is, with its ``kv_offset``.
:meth:`SessionStore.offload` copies those blocks' raw storage out of the pool
(``engine.kv.store.read_blocks``: values plus scales when quantized, so the round trip is
bit-exact for every KV dtype), frees them, and keeps the copy in a tier:

* **host**: CPU tensors, within a byte budget (``host_offload_bytes``), each block once
  (:class:`~kvkeeper.sessions.host_blocks.HostBlocks`: forks sharing a prefix in the pool share it here too).
  When the tier is over budget its least recently used sessions move on to disk
  (or, without a data directory, are dropped: their next turn recomputes).
* **disk**: a folder per session under ``DATA_DIR/sessions`` (format and crash safety:
  :mod:`kvkeeper.sessions.disk`).

On the next turn (``Session.begin_turn``) the KV is restored: fresh blocks are allocated,
the raw storage written back, ``num_computed`` set and the full blocks re-registered in the
prefix cache under the same chained hashes (``KVCacheManager.commit``).  A file that fails its
checks is logged and the prompt recomputed instead (never wrong KV); so is a restore for which
the pool has no room even after reclaiming other idle sessions' blocks.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InvalidRequestError, KVKeeperError
from .disk import DiskTier, OffloadError, SavedSession, session_manifest
from .host_blocks import HostBlocks
from ..engine.handle import EngineHandle

log = logging.getLogger(__name__)

TIERS = ("host", "disk")
DEFAULT_HOST_OFFLOAD_BYTES = 1 << 30  # 1 GiB

__all__ = ["SessionStore", "OffloadError", "OffloadRecord", "TIERS", "DEFAULT_HOST_OFFLOAD_BYTES"]


@dataclass
class OffloadRecord:
    """Where one session's KV went.

    tier: "host" or "disk".  num_blocks: blocks' worth of KV (``ceil(num_computed / block_size)``).
    nbytes: size of the raw KV (bytes).  keys: its blocks' keys in the host tier's :class:`HostBlocks` (None on
    disk).  path: the session's directory on disk (None in host memory).  session: the session itself.
    """

    session_id: str
    tier: str
    num_blocks: int
    num_computed: int
    nbytes: int
    last_used: float
    keys: list[tuple] | None = None
    path: Path | None = None
    session: object | None = None
    kv_offset: int = 0  # tokens session compression dropped: the KV holds num_computed - kv_offset entries


@dataclass
class OffloadCounters:
    """Monotonic counters per tier (sessions and bytes) plus sessions whose KV could not come back."""

    offloads: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    offload_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    restores: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    restore_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    restore_failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    dropped: int = 0  # host-tier sessions dropped for want of room and of a data directory
    checkpoints: int = 0  # idle sessions copied to disk, their KV kept in the pool (SessionStore.checkpoint)


class SessionStore:
    """The host and disk tiers of the sessions of one :class:`~kvkeeper.engine.llm_engine.LLMEngine`.

    data_dir: root of the disk tier (sessions go under ``data_dir/sessions``); None disables it.
    host_offload_bytes: the host tier's budget (bytes, default 1 GiB).  write_delay_s: test hook.
    Raises :class:`InvalidRequestError` when ``data_dir`` cannot be created or the budget is negative.
    """

    def __init__(self, engine: EngineHandle, data_dir: str | os.PathLike | None = None,
                 host_offload_bytes: int = DEFAULT_HOST_OFFLOAD_BYTES, write_delay_s: float = 0.0):
        self.engine = engine
        self.host_budget = int(host_offload_bytes)
        if self.host_budget < 0:
            raise InvalidRequestError(f"host_offload_bytes must be >= 0, got {self.host_budget}")
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.sessions_dir: Path | None = None
        self.disk: DiskTier | None = None
        if self.data_dir is not None:
            self.sessions_dir = self.data_dir / "sessions"
            try:
                self.sessions_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise InvalidRequestError(f"cannot create the data directory {self.sessions_dir}: {e}; "
                                          "give a writable --data-dir") from None
            self.disk = DiskTier(self.sessions_dir, self.identity(), write_delay_s)
        self.records: dict[str, OffloadRecord] = {}
        self.host = HostBlocks()  # the host tier's blocks, each once
        self.counters = OffloadCounters()
        # checkpoints (shared data dirs, kvkeeper.cluster): a restored session's folder stays on disk
        self.keep_disk_copies = False
        self.checkpointed: dict[str, tuple[int, int]] = {}  # session id -> (turns, tokens) of its last checkpoint

    def identity(self) -> dict:
        """What saved KV must match to be continued here: model revision, KV dtype, block size and KV shapes, and
        every other setting that changes a K/V entry's bytes (``engine.kv.numerics()``: weight format, activation
        dtype, KIVI group, RoPE, sliding window, attention backend and kernel mode).  A saved session of another
        identity is skipped with a warning naming the setting (its next turn recomputes); an import is refused."""
        eng, cfg = self.engine, self.engine.model_config
        return {"model_revision": eng.namespace.model_revision, "kv_dtype": eng.namespace.kv_dtype,
                "block_size": eng.block_size, "num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads,
                "head_dim": cfg.head_dim, **eng.kv.numerics()}

    # ---- queries -----------------------------------------------------------------------------
    def tier_of(self, session_id: str) -> str | None:
        rec = self.records.get(session_id)
        return rec.tier if rec is not None else None

    def bytes_in(self, tier: str) -> int:
        """Bytes of KV the tier holds (the host tier's shared blocks once)."""
        if tier == "host":
            return self.host.nbytes
        return sum(r.nbytes for r in self.records.values() if r.tier == tier)

    def num_blocks(self) -> int:
        """Blocks' worth of KV held in the host (each shared block once) and disk tiers."""
        return len(self.host) + sum(r.num_blocks for r in self.records.values() if r.tier == "disk")

    def stats(self) -> dict:
        c = self.counters
        return {"offload_total": dict(c.offloads), "offload_bytes_total": dict(c.offload_bytes),
                "restore_total": dict(c.restores), "restore_bytes_total": dict(c.restore_bytes),
                "restore_failures_total": dict(c.restore_failures), "dropped_total": c.dropped,
                "checkpoint_total": c.checkpoints,
                "offloaded_bytes": {t: self.bytes_in(t) for t in TIERS},
                "offloaded_sessions": {t: sum(r.tier == t for r in self.records.values()) for t in TIERS},
                "offloaded_blocks": self.num_blocks()}

    # ---- offload -----------------------------------------------------------------------------
    def check_tier(self, tier: str) -> None:
        """Raise :class:`InvalidRequestError` for an unknown tier or the disk tier without a data directory."""
        if tier not in TIERS:
            raise InvalidRequestError(f"unknown offload tier {tier!r}; choose one of {', '.join(TIERS)}", param="tier")
        if tier == "disk" and self.disk is None:
            raise InvalidRequestError("the disk tier is disabled: start with a data directory "
                                      "(kvkeeper serve --data-dir DIR, or SessionManager(engine, data_dir=...))",
                                      param="tier")

    def offload(self, session, tier: str = "host") -> int:
        """Move an idle session's KV out of the pool into ``tier``; returns the pool blocks released: those
        returned to the pool's free list (a block a fork or another session still holds is not).

        A session already in the host tier moves to disk when ``tier`` is "disk"; a session
        already in ``tier``, holding no KV, or with a turn in flight (its KV belongs to the turn) gives
        0.  Raises :class:`InvalidRequestError` for an unknown or disabled tier, and
        :class:`OffloadError` when the disk write fails (the session then keeps its KV in the pool).
        """
        self.check_tier(tier)
        rec = self.records.get(session.id)
        if rec is not None:
            if rec.tier == "host" and tier == "disk":
                self._host_to_disk(rec)
            return 0
        st = session.kv
        if st is None or not st.block_table:
            return 0
        self.engine.kv.require_uniform("offloading a session's KV")
        if not session.idle:
            return 0
        eng = self.engine
        nc = st.num_computed
        nb = -(-(nc - st.kv_offset) // eng.block_size)
        rec = OffloadRecord(session.id, tier, nb, nc, 0, session.last_used, session=session, kv_offset=st.kv_offset)
        if tier == "disk":
            tensors = eng.kv.store.read_blocks(st.block_table[:nb])
            rec.nbytes = sum(t.nbytes for t in tensors.values())
            rec.path = self.disk.write(tensors, session_manifest(session, st, nc, nb, rec.nbytes))  # raises first
        else:
            rec.keys = HostBlocks.keys_of(st, nb, eng.block_size)
            self.host.put(eng.kv.store, st.block_table[:nb], rec.keys)
            rec.nbytes = self.host.size_of(rec.keys)
        nbytes = rec.nbytes
        freed = eng.kv.free(st)  # full blocks stay in the prefix cache as cached-free; token ids stay
        self.records[session.id] = rec
        self.counters.offloads[tier] += 1
        self.counters.offload_bytes[tier] += nbytes
        if tier == "host":
            self._enforce_host_budget()
        return freed

    def forget(self, session_id: str) -> OffloadRecord | None:
        """Forget a session's record, releasing its host-tier blocks (disk files stay); returns it."""
        rec = self.records.pop(session_id, None)
        if rec is not None and rec.keys is not None:
            self.host.release(rec.keys)
            rec.keys = None
        return rec

    def _enforce_host_budget(self) -> None:
        while self.bytes_in("host") > self.host_budget:
            victim = min((r for r in self.records.values() if r.tier == "host"), key=lambda r: r.last_used)
            if self.disk is not None:
                try:
                    self._host_to_disk(victim)
                    continue
                except OffloadError as e:
                    log.warning("%s; dropping its KV instead (the next turn recomputes)", e)
            log.info("host offload tier over budget (%d bytes): dropping session %s's KV", self.host_budget,
                     victim.session_id)
            self.forget(victim.session_id)
            self.counters.dropped += 1

    def _host_to_disk(self, rec: OffloadRecord) -> None:
        s = rec.session
        rec.path = self.disk.write(self.host.gather(rec.keys), session_manifest(
            s, s.kv, rec.num_computed, rec.num_blocks, rec.nbytes, rec.kv_offset))
        self.host.release(rec.keys)
        rec.tier, rec.keys = "disk", None
        self.counters.offloads["disk"] += 1
        self.counters.offload_bytes["disk"] += rec.nbytes

    def adopt(self, saved: SavedSession, session) -> None:
        """Register a saved session found on disk (:meth:`DiskTier.scan`) as ``session``'s offloaded KV."""
        self.records[saved.session_id] = OffloadRecord(saved.session_id, "disk", saved.num_blocks,
                                                       saved.num_computed, saved.nbytes, session.last_used,
                                                       path=saved.path, session=session, kv_offset=saved.kv_offset)

    def scan(self) -> list[SavedSession]:
        """The saved sessions of the disk tier (none without a data directory); see :meth:`DiskTier.scan`."""
        return self.disk.scan() if self.disk is not None else []

    def save_all(self, sessions) -> int:
        """Write every session that holds KV (idle in the pool, or in the host tier) to disk.

        Called on a graceful shutdown, so that the sessions can be continued after a restart.
        Returns the sessions saved; does nothing without a data directory.  Failures are logged.
        """
        if self.disk is None:
            return 0
        n = 0
        for s in list(sessions):
            if self.tier_of(s.id) == "disk" or not (self.tier_of(s.id) == "host" or s.idle):
                continue
            try:
                self.offload(s, "disk")
                n += 1
            except KVKeeperError as e:
                log.warning("could not save session %s: %s", s.id, e)
        return n

    def checkpoint(self, session) -> bool:
        """Copy an idle session's KV to the disk tier and keep it in the pool (a checkpoint another process
        sharing the data directory can continue the session from).  Returns True when written; False when
        there is no disk tier, the session is not idle in the pool, or its checkpoint is already current.
        Raises :class:`OffloadError` when the write fails."""
        if self.disk is None or not session.idle or session.id in self.records:
            return False
        st = session.kv
        sig = (len(session.turns), st.num_computed)
        if self.checkpointed.get(session.id) == sig:
            return False
        nc, nb = st.num_computed, -(-(st.num_computed - st.kv_offset) // self.engine.block_size)
        tensors = self.engine.kv.store.read_blocks(st.block_table[:nb])
        nbytes = sum(t.nbytes for t in tensors.values())
        self.disk.write(tensors, session_manifest(session, st, nc, nb, nbytes))
        self.checkpointed[session.id] = sig
        self.counters.checkpoints += 1
        return True

    def read_saved(self, session_id: str) -> SavedSession | None:
        """The disk tier's saved copy of one session (None: no disk tier, no folder, or unreadable: logged)."""
        if self.disk is None:
            return None
        d = self.disk.path(session_id)
        if not (d / "manifest.json").is_file():
            return None
        try:
            return self.disk.read_saved(d)
        except (OSError, ValueError, TypeError, KeyError, OffloadError) as e:
            log.warning("cannot read the saved session in %s: %s", d, e)
            return None

    # ---- restore / discard ---------------------------------------------------------------------
    def restore(self, session) -> bool:
        """Put an offloaded session's KV back into the pool (fresh blocks, same prefix-cache hashes).

        Returns True when restored; False when the KV could not come back (corrupt or foreign
        file, no room in the pool): the record is dropped and the session's next prompt is
        recomputed.  Never raises for those cases.
        """
        rec = self.records.get(session.id)
        if rec is None:
            return False
        st = session.kv
        try:
            bids = self._write_back(session, rec)
        except OffloadError as e:
            log.warning("%s; recomputing the session's prompt instead", e)
            self.counters.restore_failures[rec.tier] += 1
            self.discard(session.id)
            return False
        st.block_table, st.block_hashes, st.num_computed, st.kv_offset = bids, [], rec.num_computed, rec.kv_offset
        self.engine.kv.commit(st)  # re-register the full blocks under their chained hashes (none when compressed)
        self.counters.restores[rec.tier] += 1
        self.counters.restore_bytes[rec.tier] += rec.nbytes
        self.forget(session.id)
        if rec.tier == "disk" and not self.keep_disk_copies:
            self.disk.remove(rec.path)
        return True

    def _write_back(self, session, rec: OffloadRecord) -> list[int]:
        """Fresh pool blocks holding the record's KV; raises :class:`OffloadError` when it cannot."""
        st, eng = session.kv, self.engine
        if st is None:
            raise OffloadError(f"session {session.id} has no token state to restore into")
        tensors = self.host.gather(rec.keys) if rec.tier == "host" else self.disk.load(
            rec.path, session.id, st.namespace, rec.num_computed, rec.num_blocks, st.token_ids, rec.kv_offset)
        if not eng.kv.store.uniform:
            raise OffloadError(f"session {session.id}: saved KV cannot be restored into a hybrid (sliding-window) KV "
                               "cache; its next prompt is recomputed")
        bids = eng.kv.allocate_blocks(rec.num_blocks)
        if bids is None:
            raise OffloadError(f"no room in the KV pool for session {session.id}'s {rec.num_blocks} blocks, even after "
                               "reclaiming other idle sessions' blocks")
        try:
            eng.kv.store.write_blocks(bids, tensors)
        except (ValueError, RuntimeError) as e:
            eng.kv.free_blocks(bids)
            raise OffloadError(f"session {session.id}: its saved KV does not fit this cache: {e}") from None
        return bids

    def discard(self, session_id: str) -> None:
        """Forget a session's offloaded KV (host copy dropped, disk files removed, a checkpoint too)."""
        rec = self.forget(session_id)
        if rec is not None and rec.tier == "disk":
            self.disk.remove(rec.path)
        elif self.checkpointed.pop(session_id, None) is not None or (self.keep_disk_copies and self.disk is not None):
            d = self.disk.path(session_id)
            if d.exists():
                self.disk.remove(d)
