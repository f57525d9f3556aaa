"""API keys and tenants: who is asking, as one FastAPI dependency (:func:`caller`).

A server started with ``--api-key KEY`` (or ``$KVKEEPER_API_KEY``, read by the CLI) or
``--api-keys-file FILE`` answers 401 to every request but ``/health``, ``/metrics`` and ``/openapi.json``
that lacks ``Authorization: Bearer <key>`` with a known key (vLLM's scheme).  Each key belongs to a *tenant*:

* the tenant owns the sessions its requests open (ids are scoped per tenant:
  :func:`kvkeeper.sessions.session.session_key`), and another tenant's request for the same id
  answers 404 and touches nothing;
* the tenant's requests run in its own cache namespace (a client ``cache_salt`` narrows it:
  :func:`kvkeeper.kvcache.namespace.salt_hash`), so prefix-cache hits never cross tenants;
* an optional :class:`~kvkeeper.sessions.manager.TenantQuota` (open sessions, pinned KV blocks) answers
  429 with ``Retry-After`` beyond it;
* ``/admin/*`` needs a key with ``admin`` set (403 for another key); a KV dump is also given to the
  session's own tenant.

``--api-key`` makes one admin key of tenant ``default``.  The keys file is JSON, or TOML when its name
ends in ``.toml``; its ``keys`` table maps each key to a tenant name or to an entry with ``tenant``
(1 to 64 characters of ``A-Z a-z 0-9 . _ -``), optional ``admin`` (bool), ``max_sessions`` and
``max_pinned_blocks`` (positive integers; one tenant's keys must agree on them)::

    {"keys": {"sk-alice-1": {"tenant": "alice", "max_sessions": 8, "max_pinned_blocks": 2048},
              "sk-bob-1": "bob",
              "sk-ops-1": {"tenant": "ops", "admin": true}}}

Without keys every request is the one caller of no tenant, with admin rights (a local server, as
before tenants); the server warns about it at start.  Keys are kept only as their SHA-256 digests
and looked up by digest.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from fastapi import Depends, Request

from ...sessions.manager import TenantQuota
from .errors import APIError

_TENANT_RE = re.compile(r"^[A-Za-z0-9._\-]{1,64}$")
_ENTRY_FIELDS = {"tenant", "admin", "max_sessions", "max_pinned_blocks"}
DEFAULT_TENANT = "default"  # the tenant of --api-key


class KeysFileError(ValueError):
    """A keys file that cannot be read or says something wrong (the message names the file and the entry)."""


@dataclass(frozen=True)
class Caller:
    """Who sent a request: ``tenant`` (None on a server without keys), ``admin`` rights and the tenant's
    ``quota`` (None: no limits)."""

    tenant: str | None
    admin: bool = False
    quota: TenantQuota | None = None


LOCAL = Caller(None, True, None)  # every request of a server without keys


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """The server's API keys, each with its :class:`Caller`; ``keys``: key -> caller.

    Raises :class:`KeysFileError` for an empty key, one with white space, or none at all.
    """

    def __init__(self, keys: dict[str, Caller]):
        if not keys:
            raise KeysFileError("no API keys given")
        for k in keys:
            if not isinstance(k, str) or not k or k != k.strip() or any(c.isspace() for c in k):
                raise KeysFileError("an API key must be a non-empty string without white space")
        self._by_digest = {_digest(k): c for k, c in keys.items()}
        self.tenants = sorted({c.tenant for c in keys.values()})

    def __len__(self) -> int:
        return len(self._by_digest)

    def lookup(self, key: str) -> Caller | None:
        """The caller of ``key``, or None for an unknown key (looked up by SHA-256 digest)."""
        return self._by_digest.get(_digest(key))

    @classmethod
    def single(cls, api_key: str) -> "KeyRing":
        """One admin key of tenant :data:`DEFAULT_TENANT` (``--api-key``)."""
        return cls({api_key: Caller(DEFAULT_TENANT, True, None)})

    @classmethod
    def from_file(cls, path: str | Path) -> "KeyRing":
        """The keys of a JSON or TOML keys file (format: this module's docstring); raises :class:`KeysFileError`."""
        return cls(load_keys_file(path))


def _parse_file(p: Path) -> dict:
    try:
        raw = p.read_text()
    except OSError as e:
        raise KeysFileError(f"cannot read the keys file {p}: {e.strerror or e}") from None
    try:
        if p.suffix.lower() == ".toml":
            import tomllib

            return tomllib.loads(raw)
        return json.loads(raw)
    except ValueError as e:  # json.JSONDecodeError and tomllib.TOMLDecodeError are ValueErrors
        kind = "TOML" if p.suffix.lower() == ".toml" else "JSON (name it *.toml for TOML)"
        raise KeysFileError(f"the keys file {p} is not valid {kind}: {e}") from None


def _positive(v, what: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise KeysFileError(f"{what} must be a positive integer, got {v!r}")
    return v


def _entry(p: Path, n: int, entry) -> Caller:
    where = f"{p}: key #{n}"
    if isinstance(entry, str):
        entry = {"tenant": entry}
    if not isinstance(entry, dict):
        raise KeysFileError(f"{where}: give a tenant name or a table with tenant, admin, max_sessions, "
                            f"max_pinned_blocks; got {entry!r}")
    extra = sorted(set(entry) - _ENTRY_FIELDS)
    if extra:
        raise KeysFileError(f"{where}: unknown field {extra[0]!r} (known: {', '.join(sorted(_ENTRY_FIELDS))})")
    tenant = entry.get("tenant")
    if not isinstance(tenant, str) or not _TENANT_RE.match(tenant):
        raise KeysFileError(f"{where}: tenant must be 1 to 64 characters of A-Z a-z 0-9 . _ -, got {tenant!r}")
    admin = entry.get("admin", False)
    if not isinstance(admin, bool):
        raise KeysFileError(f"{where}: admin must be true or false, got {admin!r}")
    ms = _positive(entry.get("max_sessions"), f"{where}: max_sessions")
    mb = _positive(entry.get("max_pinned_blocks"), f"{where}: max_pinned_blocks")
    quota = TenantQuota(ms, mb) if ms is not None or mb is not None else None
    return Caller(tenant, admin, quota)


def load_keys_file(path: str | Path) -> dict[str, Caller]:
    """key -> :class:`Caller` from a keys file (JSON, or TOML for ``*.toml``).  Raises :class:`KeysFileError`
    naming the file and the entry (never echoing a key) for anything malformed, and when two keys of one
    tenant give it different quotas."""
    p = Path(path)
    doc = _parse_file(p)
    keys = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(keys, dict) or not keys:
        raise KeysFileError(f"{p}: expected a non-empty 'keys' table mapping each API key to its tenant")
    out: dict[str, Caller] = {}
    quotas: dict[str, TenantQuota | None] = {}
    for n, (key, entry) in enumerate(keys.items(), 1):
        c = _entry(p, n, entry)
        if c.tenant in quotas and quotas[c.tenant] != c.quota:
            raise KeysFileError(f"{p}: key #{n} gives tenant {c.tenant!r} other limits than an earlier key; "
                                "give every key of a tenant the same max_sessions and max_pinned_blocks")
        quotas[c.tenant] = c.quota
        out[key] = c
    return out


def unauthorized(message: str) -> APIError:
    return APIError(401, message, type="authentication_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def caller(request: Request) -> Caller:
    """The FastAPI dependency naming who sent ``request``: :data:`LOCAL` on a server without keys, else the
    :class:`Caller` of its ``Authorization: Bearer`` key.  Raises :class:`APIError` 401 (OpenAI's
    ``authentication_error``) for a missing, malformed or unknown key."""
    ring: KeyRing | None = getattr(request.app.state, "keys", None)
    if ring is None:
        return LOCAL
    auth = request.headers.get("authorization")
    if not auth:
        raise unauthorized("this server needs an API key: send the header 'Authorization: Bearer <key>'")
    scheme, _, key = auth.strip().partition(" ")
    if scheme.lower() == "bearer" and not key.strip():  # e.g. a client whose key variable is unset
        raise unauthorized("the API key is missing: the Authorization header says 'Bearer' with no key after it; "
                            "send 'Authorization: Bearer <key>'")
    if scheme.lower() != "bearer" or not key.strip():
        raise unauthorized("the Authorization header must be 'Bearer <key>'")
    who = ring.lookup(key.strip())
    if who is None:
        raise unauthorized("the API key is not valid for this server")
    return who


def admin_caller(who: Caller = Depends(caller)) -> Caller:
    """The dependency of the admin routes: :func:`caller`, then 403 unless the key has admin rights."""
    if not who.admin:
        raise APIError(403, "this route needs an admin key (a key with \"admin\": true in --api-keys-file, or "
                            "--api-key)", type="permission_error", code="admin_key_required")
    return who
