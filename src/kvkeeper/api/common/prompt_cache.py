"""OpenAI's prompt-caching fields: ``prompt_cache_key`` scopes a request's prefix cache.

``prompt_cache_key`` names the cache entry a request's prefixes belong to: requests of one tenant with the same
key share their cached prefixes, requests with another key (or none) never hit them, and another tenant's
requests never do, whatever key they send (the key narrows the tenant's namespace like ``cache_salt``:
:func:`~kvkeeper.kvcache.namespace.tenant_namespace`).  With ``cache_salt`` as well, both narrow it.
"""

from __future__ import annotations

import json

from .errors import APIError


def cache_salt_of(salt: str | None, prompt_cache_key: str | None) -> str | None:
    """The client salt of a request's cache namespace: ``salt`` (``cache_salt`` or ``X-Cache-Salt``) narrowed by
    ``prompt_cache_key`` (None: neither).  Raises APIError (400) for a salt or key that is empty or longer than
    256 characters."""
    for value, param in ((salt, "cache_salt"), (prompt_cache_key, "prompt_cache_key")):
        if value is not None and (not value or len(value) > 256):
            raise APIError(400, f"{param} must be 1 to 256 characters", param=param)
    if prompt_cache_key is None:
        return salt
    return json.dumps(["prompt_cache_key", salt, prompt_cache_key])
