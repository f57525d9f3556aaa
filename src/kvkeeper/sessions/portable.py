"""A session as one portable, checksummed file: export it from one server, import it on another of the same model.

The file (format :data:`FORMAT`)::

    b"KVKSESS1" | manifest length (8 bytes, little-endian) | manifest (JSON) | KV (safetensors) | sha256 (32 bytes)

The manifest is the disk tier's (:func:`~kvkeeper.sessions.disk.session_manifest`: token ids, messages, text,
turns, namespace, context policy) plus the engine's identity (model revision, KV dtype, block size, KV shapes:
:meth:`~kvkeeper.sessions.offload.SessionStore.identity`); the KV is one tensor ``"<layer>.<part>"`` of shape
``(num_blocks, block_size, num_kv_heads, head_dim)`` per layer and part, as on disk; the trailing sha256 covers
every byte before it.  An import checks the checksum, the format and the identity before anything is allocated,
and refuses with :class:`~kvkeeper.errors.InvalidRequestError` saying what differs; nothing is imported then.
"""

from __future__ import annotations

import hashlib
import json
import struct

from ..engine.outputs import TurnResult
from ..engine.sequence import Sequence, SeqStatus
from ..errors import InvalidRequestError
from ..kvcache.namespace import Namespace, salt_hash
from ..sampling.params import SamplingParams
from .disk import identity_difference, session_manifest
from .manager import SessionManager, restore_context
from .session import Session
from ..engine.handle import EngineHandle

FORMAT = "kvkeeper-session-export/1"
MAGIC = b"KVKSESS1"


def export_session(manager: SessionManager, session: Session) -> bytes:
    """The file of an idle session holding KV (restored from an offload tier first).  Raises
    :class:`InvalidRequestError` while a turn runs, for a session without KV, and for compressed KV or a hybrid
    KV cache (neither is portable)."""
    from safetensors.torch import save

    if session.turn is not None:
        raise InvalidRequestError(f"session {session.name!r} has a turn in flight: export it once that has finished")
    eng, store = manager.engine, manager.store
    if store.tier_of(session.id):
        store.restore(session)
    st = session.kv
    if st is None or not st.block_table:
        raise InvalidRequestError(f"session {session.name!r} holds no KV (no turn yet, or it was reclaimed): "
                                  "nothing to export")
    if st.kv_offset:
        raise InvalidRequestError(f"session {session.name!r} holds compressed KV, which is not exported")
    eng.kv.require_uniform("exporting a session's KV")
    nc = st.num_computed
    nb = -(-nc // eng.block_size)
    blob = save({k: t.contiguous() for k, t in eng.kv.store.read_blocks(st.block_table[:nb]).items()})
    man = {"format": FORMAT, **store.identity(), **session_manifest(session, st, nc, nb, len(blob))}
    head = json.dumps(man).encode()
    body = MAGIC + struct.pack("<Q", len(head)) + head + blob
    return body + hashlib.sha256(body).digest()


def read_export(data: bytes, identity: dict) -> tuple[dict, bytes]:
    """(manifest, KV safetensors bytes) of an export file, checked: checksum, format, identity (this engine's).
    Raises :class:`InvalidRequestError` naming what is wrong."""
    if len(data) < len(MAGIC) + 8 + 32 or not data.startswith(MAGIC):
        raise InvalidRequestError("not a kvkeeper session export (it does not start with the format's marker)")
    body, sha = data[:-32], data[-32:]
    if hashlib.sha256(body).digest() != sha:
        raise InvalidRequestError("the session file is corrupt: its sha256 does not match its contents; export "
                                  "the session again")
    (n,) = struct.unpack("<Q", body[len(MAGIC):len(MAGIC) + 8])
    try:
        man = json.loads(body[len(MAGIC) + 8:len(MAGIC) + 8 + n])
    except ValueError:
        raise InvalidRequestError("the session file's manifest is not JSON") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise InvalidRequestError(f"unknown session file format {man.get('format') if isinstance(man, dict) else None!r}"
                                  f" (this server reads {FORMAT})")
    diff = identity_difference(man, identity)
    if diff:
        raise InvalidRequestError(f"the session was exported with {diff}: import it on a server of the same model "
                                  "revision, weight format, dtypes, KV and kernel settings")
    return man, body[len(MAGIC) + 8 + n:]


def import_session(manager: SessionManager, data: bytes, session_id: str | None = None,
                   tenant: str | None = None) -> Session:
    """Open the exported session ``data`` as ``tenant``'s session ``session_id`` (default: its exported id), its KV
    written into fresh pool blocks.  The KV keeps its cache namespace when ``tenant`` exported it, else it is
    re-keyed to ``tenant`` (a namespace never crosses tenants).  Raises :class:`InvalidRequestError` (see
    :func:`read_export`; an id already open; no room in the pool); nothing is imported then."""
    from safetensors.torch import load

    eng = manager.engine
    man, blob = read_export(data, manager.store.identity())
    try:
        ids, nc, nb = [int(t) for t in man["token_ids"]], int(man["num_computed"]), int(man["num_blocks"])
        ns = Namespace(**man["namespace"])
        turns = [TurnResult(**t) for t in man.get("turns", [])]
        tensors = load(blob)
    except Exception as e:  # a manifest of the right format but malformed fields, or a malformed safetensors part
        raise InvalidRequestError(f"the session file is malformed: {e}") from None
    if not 0 < nc <= len(ids) or nb != -(-nc // eng.block_size):
        raise InvalidRequestError(f"the session file is inconsistent: {nc} tokens, {nb} blocks, {len(ids)} ids")
    if man.get("tenant") != tenant:
        ns = Namespace(ns.model_revision, ns.adapter, salt_hash(tenant, None), ns.kv_dtype)
    s = manager.open(session_id=session_id or man.get("name"), reuse=bool(man.get("reuse", True)), tenant=tenant)
    try:
        _write_kv(eng, s, Sequence(f"{s.id}-import", ids, SamplingParams(), ns, num_prompt_tokens=len(ids),
                                   status=SeqStatus.FINISHED), tensors, nc, nb)
    except BaseException:
        manager.close(s.id)
        raise
    s.messages, s.text, s.turns = list(man.get("messages") or []), str(man.get("text") or ""), turns
    restore_context(s, man.get("context"))
    return s


def _write_kv(eng: EngineHandle, s: Session, st: Sequence, tensors: dict, nc: int, nb: int) -> None:
    bids = eng.kv.allocate_blocks(nb)
    if bids is None:
        raise InvalidRequestError(f"no room in the KV pool for the session's {nb} blocks, even after reclaiming idle "
                                  "sessions' blocks")
    try:
        eng.kv.store.write_blocks(bids, tensors)
    except (ValueError, RuntimeError, KeyError) as e:
        eng.kv.free_blocks(bids)
        raise InvalidRequestError(f"the session file's KV does not fit this cache: {e}") from None
    st.block_table, st.block_hashes, st.num_computed = bids, [], nc
    eng.kv.commit(st)  # its full blocks under their chained hashes (as a restore from the disk tier)
    s.kv, s.kv_source = st, "import"

