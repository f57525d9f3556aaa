"""Cache namespaces: KV computed under one namespace is never reused under another.

A namespace keeps no client secret in plain text: its ``tenant_salt`` is a one-way hash
(:func:`salt_hash`) of the tenant name and the client's cache salt, so it can be written to a
manifest on disk, shown in a KV dump or a block hash, and never gives the salt back.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct

from dataclasses import dataclass

SALT_DOMAIN = b"kvkeeper/cache-namespace/v2\x00"  # domain prefix of every salt hash
DIGEST_DOMAIN = b"kvkeeper/namespace-digest/v1\x00"  # domain prefix of a namespace's digest
_HASHED = re.compile(r"^sha256:[0-9a-f]{64}$")


def _field(value: str | None) -> bytes:
    """One component of a salt, framed: ``00`` when absent (None or ""), else ``01``, its UTF-8 length (8 bytes,
    big-endian) and its UTF-8 bytes (lone surrogates kept), so that no value can spell another's framing."""
    if not value:
        return b"\x00"
    raw = value.encode("utf-8", "surrogatepass")
    return b"\x01" + struct.pack(">Q", len(raw)) + raw


def salt_hash(tenant: str | None, salt: str | None, cache_key: str | None = None) -> str:
    """The namespace salt of a tenant (an API key's tenant; None without keys), a client ``cache_salt`` and a
    ``prompt_cache_key`` (``cache_key``).

    "" when all are None or empty (the engine's own, unsalted namespace); else ``"sha256:" + hex`` of SHA-256
    over :data:`SALT_DOMAIN` and the three components, each framed by :func:`_field` (typed, length-prefixed),
    always in that order: distinct (tenant, salt, key) tuples never share a namespace, whatever characters a
    salt holds (a salt that reads like another tuple's encoding is just a salt).  A salt or key narrows the
    tenant's namespace and never widens it.  One-way as far as SHA-256 is: a guessable salt can be found by
    trying guesses, so clients should send random salts.
    """
    if not tenant and not salt and not cache_key:
        return ""
    return "sha256:" + hashlib.sha256(SALT_DOMAIN + _field(tenant) + _field(salt) + _field(cache_key)).hexdigest()


def is_salt_hash(value: str) -> bool:
    """Whether ``value`` has the form :func:`salt_hash` returns ("" included)."""
    return value == "" or bool(_HASHED.match(value))


@dataclass(frozen=True)
class Namespace:
    """What must match for two sequences to share KV: the weights, the adapter and the tenant.

    model_revision: a content id of the weights (``ModelConfig.revision``).
    adapter: a LoRA or other adapter id ("" for none).
    tenant_salt: the tenant's namespace salt, kept only as :func:`salt_hash`; a plain string given here
    (a library caller's own salt) is taken as the client salt of no tenant and hashed at construction,
    so ``Namespace(r, tenant_salt="x")`` is the namespace of an unkeyed server's ``cache_salt: "x"``.
    kv_dtype: the cache's storage dtype (KV in one dtype is not KV in another).
    """

    model_revision: str
    adapter: str = ""
    tenant_salt: str = ""
    kv_dtype: str = ""

    def __post_init__(self):
        if not is_salt_hash(self.tenant_salt):
            object.__setattr__(self, "tenant_salt", salt_hash(None, self.tenant_salt))

    @property
    def key(self) -> str:
        return json.dumps([self.model_revision, self.adapter, self.tenant_salt, self.kv_dtype])

    @property
    def digest(self) -> str:
        """The namespace's hashed identity: 16 hex digits (64 bits) of SHA-256 over :data:`DIGEST_DOMAIN` and
        :attr:`key`.  Block hashes are chained over it (:func:`kvkeeper.kvcache.block_pool.block_hash`), and it is
        all of a namespace that KV events carry off a replica (no tenant, salt or revision in clear)."""
        d = self.__dict__.get("_digest")
        if d is None:
            d = hashlib.sha256(DIGEST_DOMAIN + self.key.encode()).hexdigest()[:16]
            object.__setattr__(self, "_digest", d)
        return d


def tenant_namespace(base: Namespace, tenant: str | None, salt: str | None, cache_key: str | None = None) -> Namespace:
    """``base`` (the engine's namespace) for ``tenant``, the client ``salt`` and ``prompt_cache_key``
    (``cache_key``): ``base`` itself for none of them, else the same model, adapter and KV dtype under
    :func:`salt_hash` ``(tenant, salt, cache_key)``: the one encoding every path (chat, completions, responses,
    sessions, the cluster gateway) uses."""
    if not tenant and not salt and not cache_key:
        return base
    return Namespace(base.model_revision, adapter=base.adapter, tenant_salt=salt_hash(tenant, salt, cache_key),
                     kv_dtype=base.kv_dtype)
