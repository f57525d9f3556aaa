"""The gateway's view of a request's prompt: its token ids and its cache namespace, as a replica will compute them.

The token-exact router (:mod:`kvkeeper.cluster.exact_router`) needs, for each request, the chained hashes of the
KV blocks a replica would reuse.  Those are hashed over the token ids of the prompt and the digest of the request's
cache namespace, so the gateway computes both as a replica's server does, without the weights:

* **tokens** -- a chat request's messages rendered with the model's chat template and tokenized by a
  :class:`~kvkeeper.engine.input_processor.ChatRenderer` (the very code of a replica's input processor: the
  server's ``messages_of`` and ``tool_use_of`` convert the body first); a completion's text prompt tokenized as
  the replica does (``tokenizer.encode``), a token-id prompt taken as it is;
* **namespace** -- the replica's base namespace salted by the caller's tenant (its API key, looked up in the
  server's own key ring), the client's ``cache_salt`` / ``X-Cache-Salt`` and ``prompt_cache_key``: only
  :func:`salt_hash` of the three is kept (:func:`~kvkeeper.kvcache.namespace.tenant_namespace`); the digest is formed by the router once it
  knows the replicas' base namespace (their routing stats, inside the cluster).

A request the gateway cannot follow gets no tokens (None) and is routed by load: a body that is not a chat or
completion request, one the server would refuse (the replica answers its 400), a prompt list (several prompts),
a request naming a LoRA adapter (its namespace is the adapter's, known to the replica only).
"""

from __future__ import annotations

import json
import logging

from ..kvcache.namespace import salt_hash

log = logging.getLogger(__name__)

CHAT_PATHS = ("/v1/chat/completions",)
COMPLETION_PATHS = ("/v1/completions",)


def load_renderer(engine_cfg):
    """A :class:`~kvkeeper.engine.input_processor.ChatRenderer` over the tokenizer of ``engine_cfg``'s model
    (an :class:`~kvkeeper.engine.config.EngineConfig`), loaded as a replica loads it (the weights are not read).
    Raises what :func:`~kvkeeper.text.tokenizer.load_tokenizer` raises (ModelNotFoundError, ModelFormatError)."""
    from ..engine.input_processor import ChatRenderer
    from ..text.tokenizer import load_tokenizer
    from ..weights import dummy
    from ..weights.sources import resolve_model_path

    if engine_cfg.load_format == "dummy":
        cfg, path = dummy.load_config(engine_cfg.model)
        tok = dummy.load_dummy_tokenizer(path, cfg.vocab_size)
    else:
        tok = load_tokenizer(resolve_model_path(engine_cfg.model, engine_cfg.cache_dir), engine_cfg.cache_dir,
                             lazy=True)
    return ChatRenderer(tok, engine_cfg.control_tokens_in_content)


class GatewayTokenizer:
    """Token ids and namespace salt of requests (see the module docstring).

    renderer: a :class:`~kvkeeper.engine.input_processor.ChatRenderer` of the served model; served_model_name: the
    name requests give in ``model`` for the base model (others name an adapter); key_ring: the server's
    :class:`~kvkeeper.api.common.auth.KeyRing` (None: a server without keys, whose requests have no tenant).
    """

    def __init__(self, renderer, served_model_name: str | None, key_ring=None):
        self.renderer = renderer
        self.served_model_name = served_model_name
        self.key_ring = key_ring

    def tenant(self, headers: dict[bytes, bytes]) -> tuple[bool, str | None]:
        """(known, tenant) of a request's ``Authorization: Bearer`` key: (True, None) on a server without keys,
        (False, None) for a missing or unknown key (the replica answers 401)."""
        if self.key_ring is None:
            return True, None
        scheme, _, key = headers.get(b"authorization", b"").decode("latin-1").strip().partition(" ")
        who = self.key_ring.lookup(key.strip()) if scheme.lower() == "bearer" and key.strip() else None
        return (who is not None), (who.tenant if who is not None else None)

    def prompt(self, path: str, headers: dict[bytes, bytes], doc: dict) -> dict | None:
        """``{"tokens": [int], "salt": salt_hash}`` of a request (``path``: the HTTP path; ``headers``: lower-case
        names; ``doc``: the JSON body), or None when the gateway cannot follow it (module docstring).  Never
        raises for a bad request: the replica answers it."""
        try:
            return self._prompt(path, headers, doc)
        except Exception as e:  # noqa: BLE001  (the replica refuses the request with the reason; routing by load)
            log.debug("no routing tokens for a request on %s: %s", path, e)
            return None

    def _prompt(self, path: str, headers: dict[bytes, bytes], doc: dict) -> dict | None:
        model = doc.get("model")
        if model is not None and self.served_model_name is not None and model != self.served_model_name:
            return None  # a LoRA adapter's namespace (or an unknown model: a 404 from the replica)
        known, tenant = self.tenant(headers)
        if not known:
            return None
        salt = doc.get("cache_salt")
        if salt is None:
            raw = headers.get(b"x-cache-salt")
            salt = raw.decode("latin-1") if raw is not None else None
        key = doc.get("prompt_cache_key")
        if (salt is not None and not isinstance(salt, str)) or (key is not None and not isinstance(key, str)):
            return None
        if path in CHAT_PATHS:
            ids = self._chat(doc)
        elif path in COMPLETION_PATHS:
            ids = self._completion(doc)
        else:
            return None
        if not ids:
            return None
        return {"tokens": ids, "salt": salt_hash(tenant, salt, key)}

    def _chat(self, doc: dict) -> list[int] | None:
        from ..api.common.messages import messages_of
        from ..api.chat.protocol import ChatCompletionRequest
        from ..api.common.tools import tool_use_of

        body = ChatCompletionRequest.model_validate(doc)
        tools = tool_use_of(body)
        return self.renderer.encode_chat(messages_of(body.messages), add_generation_prompt=body.add_generation_prompt,
                                         continue_final_message=body.continue_final_message,
                                         tools=tools.tools if tools is not None else None)

    def _completion(self, doc: dict) -> list[int] | None:
        prompt = doc.get("prompt")
        if isinstance(prompt, str):
            return self.renderer.tokenizer.encode(prompt) if prompt else None
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return list(prompt)
        return None  # several prompts (a list of strings or of token lists): each may go elsewhere


def parse_body(body: bytes) -> dict:
    """A request's JSON body as a dict ({} when it is empty, not JSON or not an object)."""
    try:
        doc = json.loads(body) if body else {}
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}
