"""The framing of a cache namespace's salt (issue 44 item 3): tenant, client ``cache_salt`` and ``prompt_cache_key``
are each encoded typed and length-prefixed (:func:`kvkeeper.kvcache.namespace.salt_hash`), so no salt can spell
another tuple: a ``cache_salt`` that reads like a ``prompt_cache_key`` framing never lands in that key's cache."""

from __future__ import annotations

import json
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from kvkeeper.api.common.protocol import cache_namespace as namespace_of_request
from kvkeeper.kvcache.namespace import Namespace, salt_hash, tenant_namespace

BASE = Namespace("rev-1", kv_dtype="float32")
PART = st.one_of(st.none(), st.text(min_size=1, max_size=12), st.sampled_from(
    ['["prompt_cache_key", null, "K"]', "K", '["a", "b"]', "a", "b", "a\x00b", "\x00", '"', "\\", "null"]))


def cache_namespace(base: Namespace, tenant: str | None, salt: str | None, key: str | None):
    """The namespace the API gives a body with ``cache_salt`` / ``prompt_cache_key`` from ``tenant``'s caller."""
    body = SimpleNamespace(cache_salt=salt, prompt_cache_key=key)
    ctx = SimpleNamespace(cache_salt=None, tenant=tenant, served=SimpleNamespace(namespace=base))
    return namespace_of_request(body, ctx)


def test_a_salt_spelling_a_cache_key_framing_misses_that_keys_cache():
    probe = json.dumps(["prompt_cache_key", None, "K"])
    assert probe == '["prompt_cache_key", null, "K"]'
    keyed = cache_namespace(BASE, None, None, "K")
    salted = cache_namespace(BASE, None, probe, None)
    assert keyed.digest != salted.digest and keyed.tenant_salt != salted.tenant_salt
    for tenant in (None, "alice"):  # nor with a tenant, nor a key spelled as the tenant's salt
        assert cache_namespace(BASE, tenant, None, "K") != cache_namespace(BASE, tenant, probe, None)
        assert cache_namespace(BASE, tenant, "K", None) != cache_namespace(BASE, tenant, None, "K")
    assert cache_namespace(BASE, None, None, None) is None and cache_namespace(BASE, "t", None, None) is not None


@settings(max_examples=500, deadline=None)
@given(a=st.tuples(PART, PART, PART), b=st.tuples(PART, PART, PART))
def test_distinct_tenant_salt_key_tuples_never_share_a_namespace(a, b):
    if a == b:
        assert salt_hash(*a) == salt_hash(*b)
        return
    assert salt_hash(*a) != salt_hash(*b)
    assert tenant_namespace(BASE, *a) != tenant_namespace(BASE, *b)
    assert tenant_namespace(BASE, *a).digest != tenant_namespace(BASE, *b).digest


def test_the_unsalted_namespace_is_the_base_one():
    assert salt_hash(None, None) == salt_hash(None, None, None) == ""
    assert tenant_namespace(BASE, None, None, None) is BASE
    assert Namespace("rev-1", tenant_salt="x", kv_dtype="float32") == tenant_namespace(BASE, None, "x")
