"""Offload tiers for idle sessions: host memory, then disk, restored on the session's next turn.

An idle session (no request in flight, uncompressed KV) pins blocks in the KV pool.
:meth:`SessionStore.offload` copies those blocks' raw storage out of the pool
(``PagedKV.read_blocks``: values plus scales when quantized, so the round trip is
bit-exact for every KV dtype), frees them, and keeps the copy in a tier:

* **host**: CPU tensors in a dict, within a byte budget (``host_offload_bytes``).
  When the tier is over budget its least recently used sessions move on to disk
  (or, without a data directory, are dropped: their next turn recomputes).
* **disk**: ``DATA_DIR/sessions/<session id>/`` holds ``kv-<uuid>.safetensors`` (one
  tensor ``"<layer>.<part>"`` of shape ``(num_blocks, block_size, num_kv_heads,
  head_dim)`` per layer and part k / v, plus k_scale / v_scale ``(num_blocks,
  block_size, num_kv_heads)`` float16 when quantized) and ``manifest.json`` (the
  session's token ids, namespace, turns, messages, the model revision, KV dtype and
  block size, and the sha256 of the tensor file).

Disk writes are atomic: each file is written to a temporary file in the same
directory, flushed and ``os.fsync``-ed, then ``os.replace``-d into place, and the
directory is fsync-ed.  The tensor file gets a fresh name and the manifest, which
names it, is replaced last; the old tensor file is removed only afterwards.  So a
crash at any point leaves either the previous whole session or the new whole one;
a directory without a manifest, and temporary files, are removed at startup.

On the next turn (``Session.hand_over``) the KV is restored: fresh blocks are
allocated, the raw storage written back, ``num_computed`` set and the full blocks
re-registered in the prefix cache under the same chained hashes
(``KVCacheManager.commit``).  A tensor file whose checksum, model revision, KV dtype,
namespace or shapes do not match raises :class:`OffloadError`; the restore path
logs it and recomputes the prompt instead (never wrong KV).  When the pool has no
room even after unpinning other idle sessions, the turn recomputes too.

Test hook: ``KVKEEPER_TEST_OFFLOAD_DELAY`` (seconds) sleeps between writing a
temporary file and renaming it into place (to kill a server in the middle of a write).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import InvalidRequestError, KVKeeperError
from ..kvcache.namespace import Namespace

log = logging.getLogger(__name__)

TIERS = ("host", "disk")
DEFAULT_HOST_OFFLOAD_BYTES = 1 << 30  # 1 GiB
MANIFEST = "manifest.json"
FORMAT = "kvkeeper-session/1"
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_:\-][A-Za-z0-9._:\-]{0,127}$")


class OffloadError(KVKeeperError):
    """Offloaded KV cannot be written or read back (I/O error, corrupt or foreign file)."""


@dataclass
class OffloadRecord:
    """Where one session's KV went.

    tier: "host" or "disk".  num_blocks: blocks' worth of KV (``ceil(num_computed / block_size)``).
    nbytes: size of the raw KV (bytes).  tensors: the host tier's CPU copies (None on disk).
    path: the session's directory on disk (None in host memory).
    """

    session_id: str
    tier: str
    num_blocks: int
    num_computed: int
    nbytes: int
    last_used: float
    tensors: dict[str, torch.Tensor] | None = None
    path: Path | None = None


@dataclass
class OffloadCounters:
    """Monotonic counters per tier (sessions and bytes) plus sessions whose KV could not come back."""

    offloads: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    offload_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    restores: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    restore_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    restore_failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    dropped: int = 0  # host-tier sessions dropped for want of room and of a data directory


def session_dir_name(session_id: str) -> str:
    """The directory name of a session: the id itself when it is a plain file name, else ``%`` + hex.

    (``.`` and ``..`` are valid session ids but not directory names; ``%`` never occurs in an id.)
    """
    if _PLAIN_NAME.match(session_id):
        return session_id
    h = session_id.encode().hex()
    return "%" + h if len(h) <= 200 else "%h" + hashlib.sha256(session_id.encode()).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the new one, whole.

    temp file in the same directory -> flush + fsync -> os.replace -> fsync of the directory.
    """
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        delay = float(os.environ.get("KVKEEPER_TEST_OFFLOAD_DELAY", "0") or 0)
        if delay > 0:
            time.sleep(delay)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _ns_dict(ns: Namespace) -> dict:
    return asdict(ns)


class SessionStore:
    """The host and disk tiers of one :class:`~kvkeeper.engine.llm_engine.LLMEngine`.

    data_dir: root of the disk tier (sessions go under ``data_dir/sessions``); None disables it.
    host_offload_bytes: the host tier's budget (bytes, default 1 GiB).
    Raises :class:`InvalidRequestError` when ``data_dir`` cannot be created.
    """

    def __init__(self, engine, data_dir: str | os.PathLike | None = None, host_offload_bytes: int | None = None):
        self.engine = engine
        self.host_budget = DEFAULT_HOST_OFFLOAD_BYTES if host_offload_bytes is None else int(host_offload_bytes)
        if self.host_budget < 0:
            raise InvalidRequestError(f"host_offload_bytes must be >= 0, got {self.host_budget}")
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.sessions_dir: Path | None = None
        if self.data_dir is not None:
            self.sessions_dir = self.data_dir / "sessions"
            try:
                self.sessions_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise InvalidRequestError(f"cannot create the data directory {self.sessions_dir}: {e}; "
                                          "give a writable --data-dir") from None
        self.records: dict[str, OffloadRecord] = {}
        self.counters = OffloadCounters()

    # ---- queries -----------------------------------------------------------------------------
    def tier_of(self, session_id: str) -> str | None:
        rec = self.records.get(session_id)
        return rec.tier if rec is not None else None

    def bytes_in(self, tier: str) -> int:
        return sum(r.nbytes for r in self.records.values() if r.tier == tier)

    def num_blocks(self) -> int:
        """Blocks' worth of KV held in the host and disk tiers."""
        return sum(r.num_blocks for r in self.records.values())

    def stats(self) -> dict:
        c = self.counters
        return {"offload_total": dict(c.offloads), "offload_bytes_total": dict(c.offload_bytes),
                "restore_total": dict(c.restores), "restore_bytes_total": dict(c.restore_bytes),
                "restore_failures_total": dict(c.restore_failures), "dropped_total": c.dropped,
                "offloaded_bytes": {t: self.bytes_in(t) for t in TIERS},
                "offloaded_sessions": {t: sum(r.tier == t for r in self.records.values()) for t in TIERS},
                "offloaded_blocks": self.num_blocks()}

    def is_idle(self, session) -> bool:
        """True when the session pins uncompressed KV and no request of it is running, waiting or unkept."""
        st = session._state
        if session.closed or st is None or not st.block_table or st.kv_offset:
            return False
        eng = self.engine
        sched = eng.scheduler
        if any(st is q for q in list(sched.running) + list(sched.waiting)):
            return False
        return id(st) not in eng.detached

    # ---- offload -----------------------------------------------------------------------------
    def _check_tier(self, tier: str) -> None:
        if tier not in TIERS:
            raise InvalidRequestError(f"unknown offload tier {tier!r}; choose one of {', '.join(TIERS)}")
        if tier == "disk" and self.sessions_dir is None:
            raise InvalidRequestError("the disk tier is disabled: start the engine with a data directory "
                                      "(kvkeeper serve --data-dir DIR, or LLMEngine(data_dir=...))")

    def offload(self, session, tier: str = "host") -> int:
        """Move an idle session's KV out of the pool into ``tier``; returns the pool blocks released.

        A session already in the host tier moves to disk when ``tier`` is "disk"; a session
        already in ``tier`` (or holding no KV) gives 0.  Raises :class:`InvalidRequestError` for
        an unknown or disabled tier or a session with a request in flight, :class:`OffloadError`
        when the disk write fails (the session then keeps its KV in the pool).
        """
        self._check_tier(tier)
        rec = self.records.get(session.id)
        if rec is not None:
            if rec.tier == "host" and tier == "disk":
                self._host_to_disk(session, rec)
            return 0
        st = session._state
        if st is None or not st.block_table:
            return 0
        if not self.is_idle(session):
            if st.kv_offset:
                raise InvalidRequestError(f"session {session.id} holds compressed KV, which is never offloaded")
            raise InvalidRequestError(f"session {session.id} has a request in flight; offload it when idle")
        eng = self.engine
        bs = eng.block_size
        nc = st.num_computed
        nb = -(-nc // bs)
        tensors = self._read(st.block_table[:nb])
        nbytes = sum(t.nbytes for t in tensors.values())
        rec = OffloadRecord(session.id, tier, nb, nc, nbytes, session.last_used)
        if tier == "disk":
            rec.path = self._write_disk(session, st, tensors, nc, nb, nbytes)  # raises before anything is freed
        else:
            if eng.runner.device.type == "cuda":
                tensors = {k: t.pin_memory() for k, t in tensors.items()}
            rec.tensors = tensors
        freed = len(st.block_table)
        eng.kv.free(st)  # full blocks stay in the prefix cache as cached-free; token ids stay
        self.records[session.id] = rec
        self.counters.offloads[tier] += 1
        self.counters.offload_bytes[tier] += nbytes
        if tier == "host":
            self._enforce_host_budget()
        return freed

    def _read(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        idx = torch.tensor(block_ids, dtype=torch.int64)
        out = {}
        for i, cache in enumerate(self.engine.runner.kv_caches):
            for name, t in cache.read_blocks(idx).items():
                out[f"{i}.{name}"] = t
        return out

    def _enforce_host_budget(self) -> None:
        while self.bytes_in("host") > self.host_budget:
            victim = min((r for r in self.records.values() if r.tier == "host"), key=lambda r: r.last_used)
            s = self.engine.sessions.get(victim.session_id)
            if self.sessions_dir is not None and s is not None:
                try:
                    self._host_to_disk(s, victim)
                    continue
                except OffloadError as e:
                    log.warning("%s; dropping its KV instead (the next turn recomputes)", e)
            log.info("host offload tier over budget (%d bytes): dropping session %s's KV", self.host_budget,
                     victim.session_id)
            self.records.pop(victim.session_id, None)
            self.counters.dropped += 1

    def _host_to_disk(self, session, rec: OffloadRecord) -> None:
        st = session._state
        rec.path = self._write_disk(session, st, rec.tensors, rec.num_computed, rec.num_blocks, rec.nbytes)
        rec.tier, rec.tensors = "disk", None
        self.counters.offloads["disk"] += 1
        self.counters.offload_bytes["disk"] += rec.nbytes

    # ---- disk --------------------------------------------------------------------------------
    def _manifest(self, session, st, nc: int, nb: int, nbytes: int, kv_file: str, sha: str) -> dict:
        eng = self.engine
        cfg = eng.config
        turns = []
        for t in session.turns:
            d = t.to_dict()
            d["prompt_token_ids"] = []  # the conversation's ids are kept once, below
            turns.append(d)
        return {"format": FORMAT, "session_id": session.id, "kv_file": kv_file, "sha256": sha, "nbytes": nbytes,
                "model_revision": eng.namespace.model_revision, "kv_dtype": eng.namespace.kv_dtype,
                "block_size": eng.block_size, "num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads,
                "head_dim": cfg.head_dim, "namespace": _ns_dict(st.namespace), "num_computed": nc,
                "num_blocks": nb, "token_ids": list(st.token_ids), "messages": session.messages,
                "text": session._text, "turns": turns, "reuse": session.reuse, "saved_at": time.time()}

    def _write_disk(self, session, st, tensors: dict[str, torch.Tensor], nc: int, nb: int, nbytes: int) -> Path:
        from safetensors.torch import save

        d = self.sessions_dir / session_dir_name(session.id)
        try:
            d.mkdir(parents=True, exist_ok=True)
            _fsync_dir(self.sessions_dir)
            old = None
            if (d / MANIFEST).exists():
                try:
                    prev = json.loads((d / MANIFEST).read_text())
                    if not isinstance(prev, dict):
                        raise ValueError("not a JSON object")
                except (OSError, ValueError) as e:
                    raise OffloadError(f"{d} holds a saved session whose manifest cannot be read ({e}); it is left "
                                       f"in place: move it away to offload session {session.id} to disk") from None
                try:
                    self._check_manifest(prev)  # a session saved by another model or KV settings is never overwritten
                except OffloadError as e:
                    raise OffloadError(f"{e}; its files in {d} are left in place, so this session cannot be "
                                       "offloaded to disk (move them away, or use another session id)") from None
                old = prev.get("kv_file")
            kv_file = f"kv-{uuid.uuid4().hex[:12]}.safetensors"
            blob = save({k: t.contiguous() for k, t in tensors.items()},
                        metadata={"session_id": session.id, "model_revision": self.engine.namespace.model_revision,
                                  "kv_dtype": self.engine.namespace.kv_dtype})
            sha = hashlib.sha256(blob).hexdigest()
            atomic_write(d / kv_file, blob)
            man = self._manifest(session, st, nc, nb, nbytes, kv_file, sha)
            atomic_write(d / MANIFEST, json.dumps(man).encode())  # the session becomes visible here
            if old and old != kv_file and "/" not in old:
                (d / old).unlink(missing_ok=True)
        except OSError as e:
            raise OffloadError(f"could not write session {session.id} to {d}: {e}") from None
        return d

    def _load_disk(self, rec: OffloadRecord, namespace: Namespace,
                   token_ids: list[int] | None = None) -> dict[str, torch.Tensor]:
        """Read and verify a session's tensor file; raises :class:`OffloadError` on any mismatch
        (token_ids: the session's, whose first ``num_computed`` must be the file's)."""
        from safetensors.torch import load

        d = rec.path
        try:
            man = json.loads((d / MANIFEST).read_text())
            blob = (d / man["kv_file"]).read_bytes()
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise OffloadError(f"session {rec.session_id}: cannot read its files in {d}: {e}") from None
        self._check_manifest(man, rec.session_id)
        sha = hashlib.sha256(blob).hexdigest()
        if sha != man["sha256"]:
            raise OffloadError(f"session {rec.session_id}: {d / man['kv_file']} is corrupt (sha256 {sha[:16]}..., "
                               f"the manifest says {man['sha256'][:16]}...)")
        if Namespace(**man["namespace"]) != namespace:
            raise OffloadError(f"session {rec.session_id}: the file's KV namespace differs from the session's")
        if man["num_computed"] != rec.num_computed or man["num_blocks"] != rec.num_blocks:
            raise OffloadError(f"session {rec.session_id}: the file holds {man['num_computed']} tokens, "
                               f"the session expects {rec.num_computed}")
        nc = rec.num_computed
        if token_ids is not None and list(man["token_ids"][:nc]) != list(token_ids[:nc]):
            raise OffloadError(f"session {rec.session_id}: the file's token ids differ from the session's "
                               "(rewritten by another server on the same data directory?)")
        try:
            return load(blob)
        except Exception as e:  # safetensors raises its own error types on a malformed header
            raise OffloadError(f"session {rec.session_id}: malformed safetensors file: {e}") from None

    def _check_manifest(self, man: dict, session_id: str | None = None) -> None:
        eng = self.engine
        cfg = eng.config
        sid = session_id or man.get("session_id")
        if man.get("format") != FORMAT:
            raise OffloadError(f"session {sid}: unknown file format {man.get('format')!r} (want {FORMAT})")
        want = {"model_revision": eng.namespace.model_revision, "kv_dtype": eng.namespace.kv_dtype,
                "block_size": eng.block_size, "num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads,
                "head_dim": cfg.head_dim}
        for k, v in want.items():
            if man.get(k) != v:
                raise OffloadError(f"session {sid} was saved with {k}={man.get(k)!r} but this engine has {v!r}; "
                                   "it can only be continued by an engine with the same model and KV settings")
        for k in ("session_id", "kv_file", "sha256", "namespace", "num_computed", "num_blocks", "token_ids"):
            if k not in man:
                raise OffloadError(f"session {sid}: the manifest lacks {k!r}")

    def _remove_dir(self, d: Path | None) -> None:
        if d is None:
            return
        try:
            (d / MANIFEST).unlink(missing_ok=True)  # invisible first, then the rest
            shutil.rmtree(d, ignore_errors=True)
            _fsync_dir(d.parent)
        except OSError as e:
            log.warning("could not remove %s: %s", d, e)

    def load_sessions(self) -> list[str]:
        """Register the sessions found under the data directory as open sessions offloaded to disk.

        Temporary files and directories without a manifest (writes cut short by a crash) are
        removed; sessions saved by another model, KV dtype or block size, or with an unreadable
        manifest, are skipped with a warning (and left in place).  Returns the ids registered.
        """
        from ..engine.sampling_params import SamplingParams
        from ..engine.sequence import Sequence, SeqStatus
        from .session import Session, TurnResult

        if self.sessions_dir is None:
            return []
        eng = self.engine
        out = []
        for d in sorted(self.sessions_dir.iterdir()):
            if not d.is_dir():
                continue
            for tmp in d.glob(".*.tmp-*"):
                tmp.unlink(missing_ok=True)
            if not (d / MANIFEST).exists():
                log.warning("removing %s: a session write that never completed", d)
                shutil.rmtree(d, ignore_errors=True)
                continue
            try:
                man = json.loads((d / MANIFEST).read_text())
                if not isinstance(man, dict):
                    raise ValueError("not a JSON object")
                self._check_manifest(man)
                kv = d / man["kv_file"]
                if "/" in man["kv_file"] or not kv.is_file():
                    raise OffloadError(f"its tensor file {man['kv_file']!r} is missing")
                for f in d.glob("kv-*.safetensors"):
                    if f.name != man["kv_file"]:
                        f.unlink(missing_ok=True)  # left by a crash between the manifest and the cleanup
                sid = man["session_id"]
                if not isinstance(sid, str) or session_dir_name(sid) != d.name:
                    raise OffloadError(f"its manifest names session {sid!r}, which does not live in {d.name!r}")
                if sid in eng.sessions:
                    raise OffloadError(f"session id {sid!r} is already open")
                ns = Namespace(**man["namespace"])
                nc, nb = int(man["num_computed"]), int(man["num_blocks"])
                ids = [int(t) for t in man["token_ids"]]
                if not 0 < nc <= len(ids) or nb != -(-nc // eng.block_size):
                    raise OffloadError(f"inconsistent sizes: {nc} tokens, {nb} blocks, {len(ids)} token ids")
                turns = [TurnResult(**t) for t in man.get("turns", [])]
                messages, text = man.get("messages") or [], man.get("text") or ""
                if not isinstance(text, str) or not isinstance(messages, list) or not all(
                        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                        for m in messages):
                    raise OffloadError("its messages or text are malformed")
            except (OSError, ValueError, TypeError, KeyError, OffloadError) as e:
                log.warning("skipping the saved session in %s: %s", d, e)
                continue
            s = Session(eng, session_id=sid, reuse=bool(man.get("reuse", True)))
            s.messages = list(messages)
            s._text = text
            s.turns = turns
            st = Sequence(f"{sid}-saved", ids, SamplingParams(), ns, num_prompt_tokens=len(ids))
            st.status = SeqStatus.FINISHED
            s._state = st
            self.records[sid] = OffloadRecord(sid, "disk", nb, nc, int(man.get("nbytes", 0)), s.last_used, path=d)
            out.append(sid)
        if out:
            log.info("registered %d saved sessions from %s", len(out), self.sessions_dir)
        return out

    def save_all(self) -> int:
        """Write every session that holds KV (idle in the pool, or in the host tier) to disk.

        Called on a graceful shutdown, so that the sessions can be continued after a restart.
        Returns the sessions saved; does nothing without a data directory.  Failures are logged.
        """
        if self.sessions_dir is None:
            return 0
        n = 0
        for s in list(self.engine.sessions.values()):
            if self.tier_of(s.id) == "disk" or not (self.tier_of(s.id) == "host" or self.is_idle(s)):
                continue
            try:
                self.offload(s, "disk")
                n += 1
            except KVKeeperError as e:
                log.warning("could not save session %s: %s", s.id, e)
        return n

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
        st = session._state
        eng = self.engine
        try:
            if st is None:
                raise OffloadError(f"session {session.id} has no token state to restore into")
            tensors = rec.tensors if rec.tier == "host" else self._load_disk(rec, st.namespace, st.token_ids)
            need = rec.num_blocks
            if need > eng.pool.num_free:
                eng._reclaim_from_sessions(need - eng.pool.num_free)
            if need > eng.pool.num_free:
                raise OffloadError(f"no room in the KV pool for session {session.id}'s {need} blocks "
                                   f"({eng.pool.num_free} free)")
            bids = eng.pool.allocate(need)
            try:
                for i, cache in enumerate(eng.runner.kv_caches):
                    prefix = f"{i}."
                    part = {k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)}
                    cache.write_blocks(bids, part)
            except (ValueError, RuntimeError) as e:
                eng.pool.free_all(bids)
                raise OffloadError(f"session {session.id}: its saved KV does not fit this cache: {e}") from None
        except OffloadError as e:
            log.warning("%s; recomputing the session's prompt instead", e)
            self.counters.restore_failures[rec.tier] += 1
            self.discard(session.id)
            return False
        st.block_table, st.block_hashes, st.num_computed, st.kv_offset = bids, [], rec.num_computed, 0
        eng.kv.commit(st)  # re-register the full blocks under their chained hashes
        self.counters.restores[rec.tier] += 1
        self.counters.restore_bytes[rec.tier] += rec.nbytes
        self.records.pop(session.id, None)
        if rec.tier == "disk":
            self._remove_dir(rec.path)
        return True

    def discard(self, session_id: str) -> None:
        """Forget a session's offloaded KV (host copy dropped, disk files removed)."""
        rec = self.records.pop(session_id, None)
        if rec is not None and rec.tier == "disk":
            self._remove_dir(rec.path)
