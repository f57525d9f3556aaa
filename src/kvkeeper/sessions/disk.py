"""The disk tier's format: one folder per session, written atomically, verified when read back.

``DATA_DIR/sessions/<session id>/`` holds ``kv-<uuid>.safetensors`` (one tensor ``"<layer>.<part>"``
of shape ``(num_blocks, block_size, num_kv_heads, head_dim)`` per layer and part k / v, plus
k_scale / v_scale ``(num_blocks, block_size, num_kv_heads)`` float16 when quantized) and
``manifest.json`` (the session's token ids, namespace, owning tenant and id, turns, messages and text,
the model revision, KV dtype and block size, and the sha256 of the tensor file).

The manifest never holds a cache salt in plain text: the namespace's ``tenant_salt`` is already a one-way
hash of the tenant and the client's salt (:func:`kvkeeper.kvcache.namespace.salt_hash`), and a session
is reopened under its owning tenant only (``tenant`` and ``name`` make its key,
:func:`kvkeeper.sessions.session.session_key`).  Manifests of the first format
(``kvkeeper-session/1``, written before tenants, with the salt in plain text) are migrated by
:meth:`DiskTier.scan`: the salt is replaced by its hash (as the salt of no tenant, which is what those
servers had) and the manifest is rewritten atomically in the current format, with a warning.

Writes are atomic: each file is written to a temporary file in the same directory, flushed and
``os.fsync``-ed, then ``os.replace``-d into place, and the directory is fsync-ed.  The tensor
file gets a fresh name and the manifest, which names it, is replaced last; the old tensor file is
removed only afterwards.  So a crash at any point leaves either the previous whole session or the
new whole one; a directory without a manifest, and temporary files, are removed by :meth:`DiskTier.scan`.
A tensor file whose checksum, model, KV settings, namespace, sizes or token ids do not match
raises :class:`OffloadError`; a saved session of another model or KV settings is never overwritten.
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

from ..engine.outputs import TurnResult
from ..errors import KVKeeperError
from ..kvcache.namespace import Namespace, is_salt_hash, salt_hash
from .session import session_key

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "kvkeeper-session/2"
FORMAT_V1 = "kvkeeper-session/1"  # salt in plain text, no tenant: migrated by DiskTier.scan
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_:\-][A-Za-z0-9._:\-]{0,127}$")


class OffloadError(KVKeeperError):
    """Offloaded KV cannot be written or read back (I/O error, corrupt or foreign file)."""


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


def atomic_write(path: Path, data: bytes, delay_s: float = 0.0) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the new one, whole.

    temp file in the same directory -> flush + fsync -> os.replace -> fsync of the directory.
    delay_s: a test hook, seconds slept between writing the temporary file and renaming it.
    """
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if delay_s > 0:
            time.sleep(delay_s)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


@dataclass
class SavedSession:
    """A session found on disk: what it needs to be reopened (its KV stays in ``path`` until its next turn)."""

    session_id: str
    path: Path
    namespace: Namespace
    num_computed: int
    num_blocks: int
    nbytes: int
    token_ids: list[int]
    messages: list[dict] = field(default_factory=list)
    text: str = ""
    turns: list[TurnResult] = field(default_factory=list)
    reuse: bool = True
    context: dict | None = None  # the context policy's spec and state (kvkeeper.sessions.context)
    tenant: str | None = None  # the owning tenant (None: no tenant)
    name: str = ""  # the session's id as its client knows it (session_id is the manager's key)
    kv_offset: int = 0  # tokens session compression dropped (kvkeeper.sessions.compress): KV entries = nc - kv_offset
    compression: dict | None = None  # the session compression policy (SessionCompression's fields)


def identity_difference(saved: dict, identity: dict) -> str:
    """"" when ``saved`` (a manifest) matches every key of ``identity`` (an engine's), else the differences in
    words: ``"k=<saved> (this engine: <its>), ..."`` for every key that differs."""
    return ", ".join(f"{k}={saved.get(k)!r} (this engine: {v!r})" for k, v in identity.items() if saved.get(k) != v)


class DiskTier:
    """Session folders under ``root`` for one engine's model and KV settings.

    identity: the settings a saved session must match (:meth:`~kvkeeper.sessions.offload.SessionStore.identity`):
    model_revision, kv_dtype, block_size, num_layers, num_kv_heads, head_dim and the KV numerics.  write_delay_s: test hook (see :func:`atomic_write`).
    """

    def __init__(self, root: Path, identity: dict, write_delay_s: float = 0.0):
        self.root = root
        self.identity = identity
        self.write_delay_s = write_delay_s

    def path(self, session_id: str) -> Path:
        return self.root / session_dir_name(session_id)

    def check_manifest(self, man: dict, session_id: str | None = None) -> None:
        """Raise :class:`OffloadError` unless ``man`` is a manifest of this format, model and KV settings."""
        sid = session_id or man.get("session_id")
        if man.get("format") != FORMAT:
            raise OffloadError(f"session {sid}: unknown file format {man.get('format')!r} (want {FORMAT})")
        diff = identity_difference(man, self.identity)
        if diff:
            raise OffloadError(f"session {sid} was saved with {diff}; it can only be continued by an engine with the "
                               "same model, weight format, dtypes, KV and kernel settings (its next turn recomputes)")
        for k in ("session_id", "name", "kv_file", "sha256", "namespace", "num_computed", "num_blocks", "token_ids"):
            if k not in man:
                raise OffloadError(f"session {sid}: the manifest lacks {k!r}")

    def _previous_kv_file(self, d: Path, session_id: str) -> str | None:
        """The tensor file a folder's manifest names; refuses a folder of another model or KV settings."""
        if not (d / MANIFEST).exists():
            return None
        try:
            prev = json.loads((d / MANIFEST).read_text())
            if not isinstance(prev, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            raise OffloadError(f"{d} holds a saved session whose manifest cannot be read ({e}); it is left "
                               f"in place: move it away to offload session {session_id} to disk") from None
        try:
            self.check_manifest(prev)  # a session saved by another model or KV settings is never overwritten
        except OffloadError as e:
            raise OffloadError(f"{e}; its files in {d} are left in place, so this session cannot be "
                               "offloaded to disk (move them away, or use another session id)") from None
        return prev.get("kv_file")

    def write(self, tensors: dict[str, torch.Tensor], manifest: dict) -> Path:
        """Write a session's tensors and manifest (``manifest`` without ``kv_file``/``sha256``); returns its folder.

        Raises :class:`OffloadError` on an I/O error or when the folder holds a foreign session.
        """
        from safetensors.torch import save

        sid = manifest["session_id"]
        d = self.path(sid)
        try:
            d.mkdir(parents=True, exist_ok=True)
            _fsync_dir(self.root)
            old = self._previous_kv_file(d, sid)
            kv_file = f"kv-{uuid.uuid4().hex[:12]}.safetensors"
            blob = save({k: t.contiguous() for k, t in tensors.items()},
                        metadata={"session_id": sid, "model_revision": self.identity["model_revision"],
                                  "kv_dtype": self.identity["kv_dtype"]})
            atomic_write(d / kv_file, blob, self.write_delay_s)
            man = {"format": FORMAT, **self.identity, **manifest, "kv_file": kv_file,
                   "sha256": hashlib.sha256(blob).hexdigest(), "saved_at": time.time()}
            atomic_write(d / MANIFEST, json.dumps(man).encode(), self.write_delay_s)  # visible from here on
            if old and old != kv_file and "/" not in old:
                (d / old).unlink(missing_ok=True)
        except OSError as e:
            raise OffloadError(f"could not write session {sid} to {d}: {e}") from None
        return d

    def load(self, d: Path, session_id: str, namespace: Namespace, num_computed: int, num_blocks: int,
             token_ids: list[int] | None = None, kv_offset: int = 0) -> dict[str, torch.Tensor]:
        """Read and verify a session's tensors; raises :class:`OffloadError` on any mismatch
        (token_ids: the session's, whose first ``num_computed`` must be the file's; kv_offset: the tokens session
        compression dropped, which must be the file's)."""
        from safetensors.torch import load

        try:
            man = json.loads((d / MANIFEST).read_text())
            blob = (d / man["kv_file"]).read_bytes()
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise OffloadError(f"session {session_id}: cannot read its files in {d}: {e}") from None
        self.check_manifest(man, session_id)
        sha = hashlib.sha256(blob).hexdigest()
        if sha != man["sha256"]:
            raise OffloadError(f"session {session_id}: {d / man['kv_file']} is corrupt (sha256 {sha[:16]}..., "
                               f"the manifest says {man['sha256'][:16]}...)")
        try:
            same = Namespace(**man["namespace"]) == namespace
        except TypeError as e:  # not a dict of Namespace's fields
            raise OffloadError(f"session {session_id}: the manifest's namespace is malformed: {e}") from None
        if not same:
            raise OffloadError(f"session {session_id}: the file's KV namespace differs from the session's")
        if man["num_computed"] != num_computed or man["num_blocks"] != num_blocks:
            raise OffloadError(f"session {session_id}: the file holds {man['num_computed']} tokens, "
                               f"the session expects {num_computed}")
        if int(man.get("kv_offset", 0)) != kv_offset:
            raise OffloadError(f"session {session_id}: the file's compressed KV dropped {man.get('kv_offset', 0)} "
                               f"tokens, the session expects {kv_offset}")
        if token_ids is not None and list(man["token_ids"][:num_computed]) != list(token_ids[:num_computed]):
            raise OffloadError(f"session {session_id}: the file's token ids differ from the session's "
                               "(rewritten by another server on the same data directory?)")
        try:
            return load(blob)
        except Exception as e:  # safetensors raises its own error types on a malformed header
            raise OffloadError(f"session {session_id}: malformed safetensors file: {e}") from None

    def remove(self, d: Path | None) -> None:
        """Delete a session folder (manifest first, so a crash midway leaves no visible half session)."""
        if d is None:
            return
        try:
            (d / MANIFEST).unlink(missing_ok=True)
            shutil.rmtree(d, ignore_errors=True)
            _fsync_dir(d.parent)
        except OSError as e:
            log.warning("could not remove %s: %s", d, e)

    def scan(self) -> list[SavedSession]:
        """The saved sessions under ``root``, sorted by folder.

        Temporary files and folders without a manifest (writes cut short by a crash) are removed;
        sessions saved by another model or KV settings, or with an unreadable or malformed
        manifest, are skipped with a warning and left in place.
        """
        out = []
        for d in sorted(self.root.iterdir()):
            if not d.is_dir():
                continue
            for tmp in d.glob(".*.tmp-*"):
                tmp.unlink(missing_ok=True)
            if not (d / MANIFEST).exists():
                log.warning("removing %s: a session write that never completed", d)
                shutil.rmtree(d, ignore_errors=True)
                continue
            try:
                self._migrate_v1(d)
                out.append(self.read_saved(d))
            except (OSError, ValueError, TypeError, KeyError, OffloadError) as e:
                log.warning("skipping the saved session in %s: %s", d, e)
        return out

    def _migrate_v1(self, d: Path) -> None:
        """Rewrite a ``kvkeeper-session/1`` manifest in the current format: its plain cache salt replaced by the
        salt's hash (as no tenant's salt), owned by no tenant.  Other manifests, and those of another model or KV
        settings (never rewritten: :meth:`read_saved` skips them), are left alone."""
        man = json.loads((d / MANIFEST).read_text())
        if not isinstance(man, dict) or man.get("format") != FORMAT_V1 or \
                any(man.get(k) != v for k, v in self.identity.items()):
            return
        ns = man.get("namespace")
        if not isinstance(ns, dict) or not isinstance(ns.get("tenant_salt", ""), str):
            raise OffloadError("its manifest (format 1) has a malformed namespace")
        plain = ns.get("tenant_salt", "")
        hashed = plain if is_salt_hash(plain) else salt_hash(None, plain)
        man = {**man, "format": FORMAT, "namespace": {**ns, "tenant_salt": hashed}, "tenant": None,
               "name": man.get("session_id")}
        atomic_write(d / MANIFEST, json.dumps(man).encode())
        log.warning("migrated the saved session in %s to %s: its cache salt is now kept as a one-way hash; it "
                    "belongs to no tenant (a server without API keys reopens it)", d, FORMAT)

    def read_saved(self, d: Path) -> SavedSession:
        """The session saved in folder ``d``; raises :class:`OffloadError` (or OSError / ValueError) when unreadable."""
        man = json.loads((d / MANIFEST).read_text())
        if not isinstance(man, dict):
            raise ValueError("not a JSON object")
        self.check_manifest(man)
        if "/" in man["kv_file"] or not (d / man["kv_file"]).is_file():
            raise OffloadError(f"its tensor file {man['kv_file']!r} is missing")
        for f in d.glob("kv-*.safetensors"):
            if f.name != man["kv_file"]:
                f.unlink(missing_ok=True)  # left by a crash between the manifest and the cleanup
        sid, tenant, name = man["session_id"], man.get("tenant"), man["name"]
        if not isinstance(sid, str) or session_dir_name(sid) != d.name:
            raise OffloadError(f"its manifest names session {sid!r}, which does not live in {d.name!r}")
        if not (tenant is None or isinstance(tenant, str)) or not isinstance(name, str) or \
                sid != session_key(tenant, name):
            raise OffloadError(f"its owner (tenant {tenant!r}, id {name!r}) does not make its key {sid!r}")
        nc, nb, off = int(man["num_computed"]), int(man["num_blocks"]), int(man.get("kv_offset", 0))
        ids = [int(t) for t in man["token_ids"]]
        if not 0 <= off < nc <= len(ids) or nb != -(-(nc - off) // self.identity["block_size"]):
            raise OffloadError(f"inconsistent sizes: {nc} tokens, {nb} blocks, {len(ids)} token ids")
        messages, text, turns = man.get("messages") or [], man.get("text") or "", man.get("turns", [])
        if not isinstance(text, str) or not isinstance(messages, list) or not isinstance(turns, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise OffloadError("its messages, text or turns are malformed")
        return SavedSession(sid, d, Namespace(**man["namespace"]), nc, nb, int(man.get("nbytes", 0)), ids,
                            list(messages), text, [TurnResult(**t) for t in turns], bool(man.get("reuse", True)),
                            man.get("context") if isinstance(man.get("context"), dict) else None, tenant, name,
                            off, man.get("compression") if isinstance(man.get("compression"), dict) else None)


def session_manifest(session, st, nc: int, nb: int, nbytes: int, kv_offset: int | None = None) -> dict:
    """The per-session part of a manifest (see :meth:`DiskTier.write`): ids, namespace, conversation.

    The conversation's token ids are kept once; the turns keep their counts and texts, not their
    ``prompt_token_ids`` (a reopened session's turns have them empty).  kv_offset: the tokens session compression
    dropped (default: ``st.kv_offset``; given when ``st``'s blocks were already freed).
    """
    turns = []
    for t in session.turns:
        d = t.to_dict()
        d["prompt_token_ids"] = []  # the conversation's ids are kept once, below
        turns.append(d)
    return {"session_id": session.id, "tenant": session.tenant, "name": session.name, "nbytes": nbytes,
            "namespace": asdict(st.namespace), "num_computed": nc,
            "num_blocks": nb, "token_ids": list(st.token_ids), "messages": session.messages, "text": session.text,
            "turns": turns, "reuse": session.reuse,
            "context": {"spec": asdict(session.context), "state": session.context_state.to_dict()},
            "kv_offset": st.kv_offset if kv_offset is None else kv_offset,
            "compression": session.compression.to_dict()}
