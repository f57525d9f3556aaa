"""OpenAI's prompt-caching fields: ``prompt_cache_key`` scopes a request's prefix cache.

``prompt_cache_key`` names the cache entry a request's prefixes belong to: requests of one tenant with the same
key share their cached prefixes, requests with another key (or none) never hit them, and another tenant's
requests never do, whatever key they send (the key narrows the tenant's namespace like ``cache_salt``:
:func:`~kvkeeper.kvcache.namespace.tenant_namespace`).  With ``cache_salt`` as well, both narrow it.
"""

from __future__ import annotations

from ..kvcache.namespace import Namespace, tenant_namespace
from .errors import APIError


def cache_namespace(base: Namespace, tenant: str | None, salt: str | None,
                    prompt_cache_key: str | None) -> Namespace | None:
    """A request's cache namespace: ``base`` (the served one) under ``tenant``, ``salt`` (``cache_salt`` or
    ``X-Cache-Salt``) and ``prompt_cache_key``, each a component of its own
    (:func:`~kvkeeper.kvcache.namespace.tenant_namespace`: no salt can spell a key); None for none of them.
    Raises APIError (400) for a salt or key that is empty or longer than 256 characters."""
    for value, param in ((salt, "cache_salt"), (prompt_cache_key, "prompt_cache_key")):
        if value is not None and (not value or len(value) > 256):
            raise APIError(400, f"{param} must be 1 to 256 characters", param=param)
    if salt is None and prompt_cache_key is None and tenant is None:
        return None
    return tenant_namespace(base, tenant, salt, prompt_cache_key)
