"""Cache namespaces: KV computed under one namespace is never reused under another."""

from __future__ import annotations

import json

from dataclasses import dataclass


@dataclass(frozen=True)
class Namespace:
    """What must match for two sequences to share KV: the weights, the adapter and the tenant.

    model_revision: a content id of the weights (``ModelConfig.revision``).
    adapter: a LoRA or other adapter id ("" for none).
    tenant_salt: a client-chosen salt (``cache_salt``) that isolates a tenant's prefixes.
    kv_dtype: the cache's storage dtype (KV in one dtype is not KV in another).
    """

    model_revision: str
    adapter: str = ""
    tenant_salt: str = ""
    kv_dtype: str = ""

    @property
    def key(self) -> str:
        return json.dumps([self.model_revision, self.adapter, self.tenant_salt, self.kv_dtype])
