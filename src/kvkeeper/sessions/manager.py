"""The session manager: opens, lists, closes, reclaims and offloads the sessions of one engine.

::

    from kvkeeper import LLMEngine, SessionManager
    eng = LLMEngine()
    sessions = SessionManager(eng, data_dir="state")   # a disk tier; saved sessions are reopened
    s = sessions.open(system="You are terse.")
    s.send("Name three colours.")

The manager registers itself with the engine as a *KV holder*: the engine asks it to release
blocks when the pool runs short (idle sessions go to the host tier, else are unpinned, least
recently used first) and lists its sessions' blocks for the validators and the telemetry.
A circuit breaker (:mod:`kvkeeper.sessions.breaker`) may install an ``admission`` check that
refuses new sessions while KV memory is short.
"""

from __future__ import annotations

import copy
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ..argtypes import fraction, positive_int, size_or_zero
from ..sampling.params import SamplingParams
from ..engine.sequence import Sequence, SeqStatus
from ..errors import InvalidRequestError, KVKeeperError, QuotaExceededError, SessionNotFoundError
from ..options import option
from .compress import SESSION_COMPRESSION_POLICIES, SessionCompression
from .context import CONTEXT_POLICIES, ContextSpec, ContextState, turn_text
from .disk import session_dir_name
from .fork import fork_kv
from .offload import DEFAULT_HOST_OFFLOAD_BYTES, SessionStore
from .session import Session, session_key
from ..engine.handle import EngineHandle

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TenantQuota:
    """A tenant's limits: ``max_sessions`` open sessions (offloaded ones included) and ``max_pinned_blocks``
    KV blocks its idle sessions pin in the pool (None: no limit).  ``retry_after_s``: the ``Retry-After``
    (seconds) of a refusal."""

    max_sessions: int | None = None
    max_pinned_blocks: int | None = None
    retry_after_s: int = 5


@dataclass
class SessionConfig:
    """Offload tiers of idle sessions: ``data_dir`` (disk tier under ``data_dir/sessions``; None: none)
    and ``host_offload_bytes`` (host tier budget, bytes).  ``offload_write_delay_s``: a test hook
    (seconds slept before each file of a disk write is renamed into place)."""

    data_dir: str | None = field(default=None, metadata=option(
        "--data-dir", "disk tier of session offload: sessions are saved under DIR/sessions and reopened at start "
        "(default: none, no disk tier)", metavar="DIR"))
    host_offload_bytes: int = field(default=DEFAULT_HOST_OFFLOAD_BYTES, metadata=option(
        "--host-offload-bytes", "host-memory budget of offloaded session KV, suffixes K/M/G allowed; 0 keeps none "
        "there (offloaded KV moves on to the disk tier, if any) (default: 1G)", type=size_or_zero,
        metavar="N"))
    offload_write_delay_s: float = 0.0
    context_policy: str = field(default="full", metadata=option(
        "--context-policy", "what a session's prompt keeps of a long conversation: full, last, summary, memory or "
        "hybrid (README: Context policies)", choices=CONTEXT_POLICIES))
    context_budget: int | None = field(default=None, metadata=option(
        "--context-budget", "prompt tokens a session's context policy keeps within (needed by every policy but "
        "full)", type=positive_int, metavar="N"))
    context_every: int = field(default=4, metadata=option(
        "--context-every", "turns leave a session's prompt (and the summary is rewritten) at least N at a time",
        type=positive_int, metavar="N"))
    context_low_water: float | None = field(default=None, metadata=option(
        "--context-low-water", "when turns must leave a session's prompt, they leave until the kept turns take at "
        "most this share of the room the budget leaves them, so that fewer turns rewrite the prompt (default: 0.6 "
        "for memory and hybrid, 1 for last and summary)", type=fraction, metavar="F"))
    checkpoint_every_s: float | None = field(default=None, metadata=option(
        "--checkpoint-every", "copy idle sessions' KV to the disk tier every S seconds, keeping it in the pool, and "
        "continue a session from a newer copy another server wrote (servers sharing --data-dir, `--replicas`; "
        "default: never)", type=float, metavar="S"))
    session_ttl_s: float | None = field(default=None, metadata=option(
        "--session-ttl", "close sessions idle for S seconds (their KV freed, offloaded copies removed), stored "
        "responses and conversations with them; counted in kvkeeper:sessions_expired_total (default: never)",
        type=float, metavar="S"))
    session_compression: str = field(default="none", metadata=option(
        "--session-compression", "compress a session's KV at the end of each turn and continue the next turn from "
        "it: none, streaming_llm, knorm or kvzip (docs/serving/context-policies.md: Session compression)",
        choices=SESSION_COMPRESSION_POLICIES))
    session_compression_ratio: float = field(default=0.5, metadata=option(
        "--session-compression-ratio", "fraction of a session's KV dropped at the end of each turn, in [0, 1) "
        "(default: 0.5)", type=float, metavar="F"))
    summary_tokens: int = 96
    memory_top_k: int = 8
    memory_threshold: float = 0.25

    def context_spec(self, policy: str | None = None, budget: int | None = None) -> ContextSpec:
        """The :class:`ContextSpec` of these defaults, with ``policy`` / ``budget`` given instead when not None."""
        return ContextSpec(policy or self.context_policy, budget if budget is not None else self.context_budget,
                           self.context_every, self.summary_tokens, self.memory_top_k, self.memory_threshold,
                           low_water=self.context_low_water)

    def compression_spec(self, policy: str | None = None, ratio: float | None = None) -> SessionCompression:
        """The :class:`SessionCompression` of these defaults, with ``policy`` / ``ratio`` given instead when not None."""
        return SessionCompression(policy or self.session_compression,
                                  ratio if ratio is not None else self.session_compression_ratio)


class SessionManager:
    """The sessions of one :class:`~kvkeeper.engine.llm_engine.LLMEngine` and their offload tiers.

    ``SessionManager(engine, config=None, **settings)``: settings are the fields of :class:`SessionConfig`.
    Sessions saved in the disk tier are reopened (offloaded to disk) at construction.
    Raises :class:`InvalidRequestError` when the data directory cannot be created.
    """

    def __init__(self, engine: EngineHandle, config: SessionConfig | None = None, **settings):
        self.engine = engine
        self.config = config or SessionConfig(**settings)
        c = self.config
        self.sessions: dict[str, Session] = {}
        self.admission: Callable[[str], None] | None = None  # raises OverloadedError to refuse a new session
        self.store = SessionStore(engine, c.data_dir, c.host_offload_bytes, c.offload_write_delay_s)
        if c.checkpoint_every_s is not None:
            if c.checkpoint_every_s <= 0 or c.data_dir is None:
                raise InvalidRequestError("checkpoints need a data directory and a positive period (seconds): "
                                          "give --data-dir and --checkpoint-every S > 0")
            self.store.keep_disk_copies = True
        self.default_context = c.context_spec()  # raises InvalidRequestError for a policy without a budget
        self.default_compression = c.compression_spec()  # raises InvalidRequestError for a bad policy or ratio
        if c.session_ttl_s is not None and c.session_ttl_s <= 0:
            raise InvalidRequestError(f"--session-ttl must be a positive number of seconds, got {c.session_ttl_s}")
        self.expired = 0  # sessions closed by expire_idle (a counter)
        self._embedder = None
        self._memories: dict[str, object] = {}
        engine.kv.add_holder(self)
        self._reopen_saved()

    # ---- opening and closing ----------------------------------------------------------------
    def open(self, system: str | None = None, session_id: str | None = None, reuse: bool = True,
             params: SamplingParams | None = None, context: ContextSpec | None = None,
             tenant: str | None = None, compression: SessionCompression | None = None) -> Session:
        """A new session (id ``sess-<hex>`` unless given) with a context policy and a session compression policy
        (:mod:`kvkeeper.sessions.compress`; defaults: the config's), owned
        by ``tenant`` (None: no tenant; its key in :attr:`sessions` is :func:`session_key`).
        Raises :class:`InvalidRequestError` for an id the tenant has open already, and ``OverloadedError``
        while a circuit breaker refuses new sessions."""
        sid = session_id or f"sess-{uuid.uuid4().hex[:12]}"
        key = session_key(tenant, sid)
        if key in self.sessions:
            raise InvalidRequestError(f"session id {sid!r} is already open")
        if self.admission is not None:
            self.admission(key)
        s = Session(self, key, system=system, reuse=reuse, params=params, context=context or self.default_context,
                    tenant=tenant, name=sid, compression=compression or self.default_compression)
        self.sessions[key] = s
        return s

    def fork(self, source: Session, session_id: str | None = None, tenant: str | None = None) -> Session:
        """A new session (``tenant``'s, id as :meth:`open`) continuing from ``source`` as it stands: the same
        conversation, turns and context policy, and its KV forked copy-on-write (:func:`~kvkeeper.sessions.fork.
        fork_kv`: full blocks shared by reference, the partial last block copied), so a turn of either session
        never shows in the other.  An offloaded source's KV is restored to the pool first.  Raises
        :class:`InvalidRequestError` for a closed source, one with a turn in flight or an id already open, and
        ``OverloadedError`` while a circuit breaker refuses new sessions."""
        if source.closed or source.turn is not None:
            raise InvalidRequestError(f"session {source.name!r} cannot be forked while "
                                      f"{'closed' if source.closed else 'a turn is in flight'}")
        s = self.open(session_id=session_id, reuse=source.reuse, params=source.params, context=source.context,
                      tenant=tenant, compression=source.compression)
        if self.store.tier_of(source.id) and source.kv is not None:
            self.store.restore(source)
        s.messages, s.text, s.turns = [dict(m) for m in source.messages], source.text, list(source.turns)
        s.priority, s.context_state = source.priority, copy.deepcopy(source.context_state)
        if source.kv is not None:
            s.kv, s.kv_source = fork_kv(self.engine, source.kv, f"{s.id}-fork"), "fork"
        return s

    def find(self, tenant: str | None, session_id: str) -> Session | None:
        """``tenant``'s open session ``session_id`` (the client's id), or None (another tenant's never, nor a
        session of no tenant whose library-given id happens to read ``tenant/id``)."""
        s = self.sessions.get(session_key(tenant, session_id))
        return s if s is not None and s.tenant == tenant else None

    def of_tenant(self, tenant: str | None) -> list[Session]:
        """The open sessions ``tenant`` owns (None: those of no tenant)."""
        return [s for s in self.sessions.values() if s.tenant == tenant]

    def check_quota(self, tenant: str | None, quota: TenantQuota | None, opening: bool) -> None:
        """Raise :class:`QuotaExceededError` when a turn of ``tenant`` would go over ``quota``: ``opening`` a
        session while it has ``max_sessions`` open, or any turn while its idle sessions pin
        ``max_pinned_blocks`` pool blocks or more (a shared prefix block counted once)."""
        if quota is None:
            return
        mine = self.of_tenant(tenant)
        if opening and quota.max_sessions is not None and len(mine) >= quota.max_sessions:
            raise QuotaExceededError(f"tenant {tenant!r} has {len(mine)} open sessions, its limit: close one "
                                     "(DELETE /v1/sessions/ID) before opening another", quota.retry_after_s)
        if quota.max_pinned_blocks is not None:
            pinned = len({b for s in mine if s.kv is not None for b in s.kv.block_table})
            if pinned >= quota.max_pinned_blocks:
                raise QuotaExceededError(
                    f"tenant {tenant!r}'s sessions pin {pinned} KV blocks (its limit: {quota.max_pinned_blocks}): "
                    "offload (POST /v1/sessions/ID/offload) or close one of them, or retry later",
                    quota.retry_after_s)

    def get(self, session_id: str) -> Session:
        """The open session ``session_id``; raises :class:`SessionNotFoundError`."""
        s = self.sessions.get(session_id)
        if s is None:
            raise SessionNotFoundError(f"no open session {session_id!r}")
        return s

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.sessions

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self.sessions.values()))

    def __len__(self) -> int:
        return len(self.sessions)

    def list(self) -> list[dict]:
        """One :meth:`Session.info` dict per open session."""
        return [s.info() for s in self.sessions.values()]

    def close(self, session_id: str) -> int:
        """Free a session's blocks (and any offloaded copy) and forget it; returns the blocks this put back on the
        pool's free list (a block a fork still references stays held).

        A turn in flight runs on and frees its blocks when it finishes.  Raises :class:`SessionNotFoundError`.
        """
        s = self.get(session_id)
        freed = s.unpin()
        self.store.discard(s.id)
        s.kv, s.closed = None, True
        del self.sessions[session_id]
        mem = self._memories.pop(session_id, None)
        if mem is not None:
            mem.delete()
        else:
            path = self.memory_path(session_id)
            if path is not None:
                path.unlink(missing_ok=True)
        return freed

    def expire_idle(self, now: float | None = None) -> list[Session]:
        """Close the sessions without a turn in flight unused for ``session_ttl_s`` seconds or more (none without a
        TTL); returns them (counted in :attr:`expired`).  ``now``: ``time.monotonic()`` unless given."""
        ttl = self.config.session_ttl_s
        if ttl is None:
            return []
        now = time.monotonic() if now is None else now
        gone = [s for s in list(self.sessions.values()) if s.turn is None and now - s.last_used >= ttl]
        for s in gone:
            self.close(s.id)
        self.expired += len(gone)
        return gone

    def _reopen_saved(self) -> None:
        """Register the disk tier's saved sessions as open sessions whose KV is on disk."""
        for saved in self.store.scan():
            if saved.session_id in self.sessions:
                log.warning("skipping the saved session in %s: session id %r is already open", saved.path,
                            saved.session_id)
                continue
            self._adopt(saved)
        if self.sessions:
            log.info("registered %d saved sessions from %s", len(self.sessions), self.store.sessions_dir)

    def _adopt(self, saved) -> Session:
        """Open a saved session (:class:`~kvkeeper.sessions.disk.SavedSession`) whose KV stays on disk until its next turn."""
        s = Session(self, saved.session_id, reuse=saved.reuse, context=self.default_context,
                    tenant=saved.tenant, name=saved.name)
        s.messages, s.text, s.turns = saved.messages, saved.text, saved.turns
        restore_context(s, saved.context)
        if saved.compression:
            try:
                s.compression = SessionCompression(**saved.compression)
            except (TypeError, InvalidRequestError) as e:
                log.warning("session %s: its saved compression policy is unreadable (%s); using the default", s.id, e)
        s.kv = Sequence(f"{saved.session_id}-saved", saved.token_ids, SamplingParams(), saved.namespace,
                        num_prompt_tokens=len(saved.token_ids), status=SeqStatus.FINISHED)
        self.sessions[s.id] = s
        self.store.adopt(saved, s)
        return s

    # ---- checkpoints: servers sharing a data directory --------------------------------------------
    def checkpoint_idle(self, min_idle_s: float = 0.0) -> int:
        """Copy to disk every idle session unused for ``min_idle_s`` seconds whose checkpoint is not current
        (see :meth:`SessionStore.checkpoint`); returns how many were written.  Failures are logged."""
        now, n = time.monotonic(), 0
        for s in list(self.sessions.values()):
            if now - s.last_used < min_idle_s:
                continue
            try:
                n += self.store.checkpoint(s)
            except KVKeeperError as e:
                log.warning("could not checkpoint session %s: %s", s.id, e)
        return n

    def refresh_from_disk(self, session_id: str) -> bool:
        """Before a turn of ``session_id`` (with checkpoints on): open the disk tier's copy when this manager
        does not hold the session, or replace its own copy when the disk one has more turns (another server
        continued the session).  Returns True when the disk copy was taken.  A turn in flight is left alone."""
        if self.config.checkpoint_every_s is None:
            return False
        s = self.sessions.get(session_id)
        if s is not None and s.turn is not None:
            return False
        saved = self.store.read_saved(session_id)
        if saved is None or (s is not None and len(saved.turns) <= len(s.turns)):
            return False
        if s is not None:  # stale: forget it without removing the newer files
            s.unpin()
            self.store.forget(session_id)
            s.kv, s.closed = None, True
            del self.sessions[session_id]
        self._adopt(saved)
        self.store.checkpointed[session_id] = (len(saved.turns), saved.num_computed)
        return True

    # ---- context policies: summaries and vector memory --------------------------------------------
    def memory_path(self, session_id: str):
        """Where a session's vector memory lives: ``DATA_DIR/memory/<session>.sqlite`` (None without a data dir)."""
        root = self.store.data_dir
        return None if root is None else root / "memory" / f"{session_dir_name(session_id)}.sqlite"

    def memory_of(self, session: Session):
        """The session's :class:`~kvkeeper.sessions.memory.SessionMemory` (opened on first use)."""
        mem = self._memories.get(session.id)
        if mem is None:
            from .memory import Embedder, SessionMemory

            if self._embedder is None:
                self._embedder = Embedder()
            mem = self._memories[session.id] = SessionMemory(self.memory_path(session.id), self._embedder)
        return mem

    @staticmethod
    def tenant_of(namespace) -> str:
        """The memory's tenant key of a cache namespace (its salt's sha256; "" unsalted)."""
        from .memory import tenant_key

        return tenant_key(getattr(namespace, "tenant_salt", None))

    def summarize(self, previous: str, turns: list[list[dict]], namespace, max_tokens: int = 96) -> str:
        """A new summary of ``previous`` plus ``turns``, written by the engine (greedy, at most
        ``max_tokens`` tokens) as a request in ``namespace`` (the session's own: its tenant salt).

        Runs the request to its end on the calling thread (the engine thread in the server); the input is
        cut to its last 1,536 tokens (fewer when the context window is short: at most half of it, less the reply).
        """
        eng = self.engine
        tok = eng.tokenizer
        text = "\n".join(turn_text(t) for t in turns)
        ids = tok.encode(text, add_special_tokens=False)
        keep = max(32, min(1536, eng.context_length // 2 - max_tokens))
        if len(ids) > keep:
            text = tok.decode(ids[-keep:])
        ask = (f"Summary so far:\n{previous}\n\n" if previous else "") + f"Conversation:\n{text}\n\n" \
            "Write a short summary of the conversation above, keeping names, numbers, dates and places."
        prompt = eng.encode_chat([{"role": "system", "content": "You write brief, factual summaries."},
                                  {"role": "user", "content": ask}])
        seq = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                              namespace=namespace)
        eng.run_until_done([seq])
        return seq.text if seq.finish_reason != "error" else previous

    # ---- offload -------------------------------------------------------------------------------
    def offload(self, session_id: str, tier: str = "host") -> int:
        """Offload one idle session (see :meth:`Session.offload`); returns the pool blocks released."""
        return self.get(session_id).offload(tier)

    def offload_idle(self, n_blocks: int, tier: str = "host") -> int:
        """Offload idle sessions, least recently used first, until ``n_blocks`` pool blocks are released.

        tier: "host" (host memory; over its budget the oldest move on to disk) or "disk".
        Returns the blocks released (may be fewer when not enough idle sessions pin KV).  Sessions
        with a turn in flight are skipped.  Raises :class:`InvalidRequestError`
        for an unknown or disabled tier.
        """
        self.store.check_tier(tier)
        freed = 0
        for s in sorted(self.sessions.values(), key=lambda s: s.last_used):
            if freed >= n_blocks:
                break
            if s.idle:
                try:
                    freed += self.store.offload(s, tier)
                except KVKeeperError as e:  # a failed disk write: that session keeps its KV in the pool
                    log.warning("could not offload session %s: %s", s.id, e)
        return freed

    def save_all(self) -> int:
        """Write every session holding KV to the disk tier (graceful shutdown); returns how many."""
        return self.store.save_all(self.sessions.values())

    # ---- the circuit breaker's levers (kvkeeper.sessions.breaker) ------------------------------------
    def lowest_priority_open(self) -> tuple[int | None, list[str]]:
        """(the lowest ``priority`` among the open sessions, the ids of the open sessions of that priority);
        ``(None, [])`` when none is open."""
        open_ = [s for s in self.sessions.values() if not s.closed]
        if not open_:
            return None, []
        low = min(s.priority for s in open_)
        return low, [s.id for s in open_ if s.priority == low]

    def trim_session(self, session_id: str, budget_tokens: int | None) -> int:
        """Set a session's prompt budget (``trim_budget``, tokens: its next prompts keep the newest turns that fit;
        None lifts it).  A session set a budget with no turn in flight is unpinned (its blocks released, the full
        ones staying in the prefix cache).  Returns the blocks released; 0 for a session no longer here."""
        s = self.sessions.get(session_id)
        if s is None:
            return 0
        s.trim_budget = budget_tokens
        return s.unpin() if budget_tokens is not None and s.turn is None else 0

    def offloaded_bytes(self) -> dict[str, int]:
        """Bytes of session KV held in each offload tier now (``{"host": n, "disk": n}``, tiers in use)."""
        return self.store.stats()["offloaded_bytes"]

    # ---- the engine's KV holder protocol --------------------------------------------------------
    def reclaim(self, n_blocks: int) -> int:
        """Release idle sessions' blocks, least recently used first, until ``n_blocks`` went back to the pool's
        free list (or no idle session is left); returns the blocks freed.  Forks share their full blocks, so
        releasing one frees only its own blocks: the count is of blocks freed, never of references dropped.

        A session's KV goes to the host offload tier when that tier has a budget (it comes back on
        the session's next turn); otherwise, or when that fails, the session is unpinned (its full
        blocks stay in the prefix cache until evicted).
        """
        freed = self.offload_idle(n_blocks, tier="host") if self.store.host_budget > 0 else 0
        for s in sorted(self.sessions.values(), key=lambda s: s.last_used):
            if freed >= n_blocks:
                break
            if s.turn is None:
                freed += s.unpin()  # what the host tier could not take (failed writes)
        return freed

    def kv_holdings(self) -> Iterator[tuple[str, Sequence]]:
        """(``session:<id>``, pinned state) for every session pinning blocks between turns."""
        for sid, s in self.sessions.items():
            if s.turn is None and s.kv is not None and s.kv.block_table:
                yield f"session:{sid}", s.kv

    def offloaded_blocks(self) -> int:
        return self.store.num_blocks()

    def stats(self) -> dict:
        """Open sessions, distinct blocks they pin (a shared prefix block once), sessions expired, and the offload
        tiers' counters."""
        pinned = {b for s in self.sessions.values() if s.kv is not None for b in s.kv.block_table}
        return {"sessions": len(self.sessions), "pinned_blocks": len(pinned), "offload": self.store.stats(),
                "sessions_expired": self.expired}


def restore_context(s: Session, saved: dict | None) -> None:
    """A reopened (or imported) session's context policy and state, from its manifest (kept as they were when unreadable)."""
    if not saved:
        return
    try:
        s.context = ContextSpec(**saved["spec"])
        s.context_state = ContextState(**saved["state"])
    except (KeyError, TypeError, InvalidRequestError) as e:
        log.warning("session %s: its saved context policy is unreadable (%s); using the default", s.id, e)
