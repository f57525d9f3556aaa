"""KV dumps: a sequence's K and V per layer, from the paged cache to a safetensors file.

A dump holds, for each chosen layer ``l``, the tensors ``layers.{l}.k`` and
``layers.{l}.v`` of shape ``(tokens, num_kv_heads, head_dim)`` for the token
positions ``token_start .. token_end - 1`` (RoPE positions; keys are stored
rotated).  fp32/bf16/fp16 caches are dumped in their storage dtype, bit for bit;
int8/fp8 caches are dequantized to float32 (``q * scale`` is exact in float32).

Metadata (safetensors header, all strings): ``format`` (``kvkeeper.kv_dump.v1``),
``source`` (``session:<id>`` or ``prompt``), ``layers`` ("0,5,29"), ``token_start``,
``token_end``, ``kv_offset`` (tokens dropped by KV compression: position ``p`` sits in
slot ``p - kv_offset``), ``kv_dtype`` (the cache's storage format), ``tensor_dtype``,
``bytes_per_token`` (KV bytes per token of the cache, all layers, values plus scales),
``model``, ``model_revision``, ``namespace`` (the cache namespace key, JSON),
``num_layers``, ``num_kv_heads``, ``head_dim``, ``block_size``, ``cached_tokens``
(prompt dumps: tokens reused from the prefix cache) and ``token_ids`` (JSON list of
the dumped positions' token ids).

After KV compression (``kv_offset > 0``) only the tokens computed after it (positions
``>= num_prompt_tokens``) sit at their own slot; dumping compressed prompt positions is refused.
"""

from __future__ import annotations

import json

import torch

from ..sampling.params import SamplingParams
from ..errors import InvalidRequestError, SessionNotFoundError
from ..engine.handle import EngineHandle

FORMAT = "kvkeeper.kv_dump.v1"


def parse_layers(spec: str | list[int] | int | None, num_layers: int | None) -> list[int]:
    """Layer indices from "0,5,29", "0-3,7", "all", a list, one int, or None (all layers); sorted, unique.

    num_layers None checks the syntax only (and returns [] for "all").
    Raises :class:`InvalidRequestError` naming a bad entry or an index outside ``0 .. num_layers-1``.
    """
    have = "" if num_layers is None else f" (the model has layers 0..{num_layers - 1})"
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "all")):
        return list(range(num_layers or 0))
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = [spec]
    elif not isinstance(spec, (str, list, tuple)):
        raise InvalidRequestError(f"layers must be a string such as '0,5,29' or '0-3', a list of layer numbers "
                                  f"or one layer number, got {spec!r}")
    out: set[int] = set()
    items = list(spec) if isinstance(spec, (list, tuple)) else [x.strip() for x in spec.split(",")]
    for item in items:
        try:
            if isinstance(item, str) and "-" in item.strip("-"):
                a, b = item.split("-", 1)
                rng = range(int(a), int(b) + 1)
                if not rng:
                    raise ValueError
                if num_layers is None or rng.stop > num_layers:
                    out.update((rng.start, rng.stop - 1))  # never expand a range past the model (or unchecked)
                else:
                    out.update(rng)
            else:
                out.add(int(item))
        except ValueError:
            raise InvalidRequestError(f"bad layer {item!r} in {spec!r}: give layer numbers such as 0,5,29 "
                                      f"or ranges such as 0-3{have}", param="layers") from None
    bad = sorted(i for i in out if not 0 <= i < (num_layers if num_layers is not None else 1 << 62))
    if bad:
        raise InvalidRequestError(f"layer {bad[0]} does not exist: layers are numbered from 0{have}", param="layers")
    return sorted(out)


def _tensor_dtype(kv_format) -> torch.dtype:
    return torch.float32 if kv_format.quantized else kv_format.storage


@torch.inference_mode()
def dump_sequence(engine: EngineHandle, seq, layers=None, start: int | None = None, end: int | None = None,
                  source: str = "prompt", cached_tokens: int | None = None) -> tuple[dict, dict]:
    """K/V of ``seq`` (a Sequence or a session's state) for ``layers`` and positions ``start .. end-1``.

    start/end default to every position with KV (``num_computed``).  Returns (tensors, metadata)
    as described in the module docstring.  Raises :class:`InvalidRequestError` for a bad layer
    list or a range outside the positions that have KV.
    """
    store = engine.kv.store
    cfg = engine.model_config
    if not store.uniform:
        engine.kv.require_uniform("dumping KV tensors")
    layer_ids = parse_layers(layers, cfg.num_layers)
    n = seq.num_computed
    off = seq.kv_offset
    lo = seq.num_prompt_tokens if off else 0  # after compression, earlier slots hold per-head selections
    if n <= lo:
        raise InvalidRequestError(f"{source} has no KV to dump right now ({n} tokens computed"
                                  + (", a request may be running on it)" if n == 0 else ")"))
    start = lo if start is None else int(start)
    end = n if end is None else int(end)
    if not lo <= start < end <= n:
        why = f" (positions below {lo} were compressed, kv_offset {off})" if off else ""
        raise InvalidRequestError(f"token range {start}..{end} is outside the KV of {source}: give "
                                  f"{lo} <= start < end <= {n}{why}", param="start")
    bs = store.block_size
    slots = torch.arange(start - off, end - off, dtype=torch.int64)
    table = torch.tensor(seq.block_table, dtype=torch.int64)
    idx = table[slots // bs] * bs + slots % bs  # global slot ids
    dt = _tensor_dtype(store.format)
    tensors = {}
    for i in layer_ids:  # an MLA latent cache: "k" holds the latent rows, there is no "v"
        for name, x in store.read_slots(i, idx).items():
            tensors[f"layers.{i}.{name}"] = x.to(dt).contiguous()
    ns = seq.namespace
    meta = {
        "format": FORMAT, "source": source, "layers": ",".join(map(str, layer_ids)),
        "token_start": str(start), "token_end": str(end), "kv_offset": str(off),
        "kv_dtype": store.format.name, "tensor_dtype": str(dt).removeprefix("torch."),
        "bytes_per_token": str(engine.kv.bytes_per_token), "model": str(engine.model_name),
        "model_revision": ns.model_revision, "namespace": ns.key, "num_layers": str(cfg.num_layers),
        "num_kv_heads": str(store.num_kv_heads), "head_dim": str(store.head_dim),
        "block_size": str(bs), "kv_layout": "mla_latent" if cfg.is_mla else "kv",
        "cached_tokens": str((seq.num_cached_tokens or 0) if cached_tokens is None else cached_tokens),
        "token_ids": json.dumps(list(seq.token_ids[start:end])),
    }
    return tensors, meta


def dump_session(sessions, session_id: str, layers=None, start: int | None = None,
                 end: int | None = None) -> tuple[dict, dict]:
    """K/V a session keeps between turns (see :func:`dump_sequence`); sessions: a SessionManager.

    session_id: the manager's key (``SessionManager.sessions``).  Raises :class:`SessionNotFoundError` for an
    unknown id (naming no other session: they may be other tenants').
    """
    s = sessions.sessions.get(session_id)
    if s is None:
        raise SessionNotFoundError(f"no open session {session_id!r}")  # never lists the others (other tenants')
    st = s.kv
    tier = s.tier
    if tier != "pool":
        raise InvalidRequestError(f"session {session_id!r} is offloaded to the {tier} tier: its KV comes back "
                                  "into the pool on the session's next turn; dump it after that turn")
    if st is None or not st.block_table:
        raise InvalidRequestError(f"session {session_id!r} holds no KV right now (no finished turn yet, "
                                  "unpinned under memory pressure, or a request is running on it)")
    return dump_sequence(sessions.engine, st, layers, start, end, source=f"session:{session_id}")


def dump_prompt(engine: EngineHandle, prompt_ids: list[int], layers=None, start: int | None = None, end: int | None = None,
                warm_prefix: int = 0, namespace=None) -> tuple[dict, dict]:
    """Prefill ``prompt_ids`` on the engine and dump its K/V (positions ``0 .. P-1`` by default).

    warm_prefix: first prefill the prompt's first N tokens, so that the dumped prompt reuses
    their full blocks from the prefix cache (a reused dump; 0: computed whole, in chunks of
    the engine's token budget).  The request's blocks are released afterwards.
    Raises :class:`InvalidRequestError` for an empty prompt or a bad layer list / range.
    """
    parse_layers(layers, engine.model_config.num_layers)  # fail before computing anything
    ids = [int(t) for t in prompt_ids]
    if warm_prefix < 0 or warm_prefix > len(ids):
        raise InvalidRequestError(f"warm prefix {warm_prefix} is outside the prompt's {len(ids)} tokens")
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    if warm_prefix:
        engine.generate([ids[:warm_prefix]], greedy, namespace=namespace)
    seq = engine.add_request(ids, greedy, namespace=namespace)
    seq.kv_holder = lambda s: None  # keep the finished request's blocks for the dump (freed below)
    try:
        engine.run_until_done([seq])
        if seq.finish_reason == "error":
            raise InvalidRequestError(seq.error or "the prompt could not be computed")
        return dump_sequence(engine, seq, layers, start, end, source="prompt")
    finally:
        engine.kv.free(seq)


def to_bytes(tensors: dict, meta: dict) -> bytes:
    """A dump as safetensors bytes."""
    from safetensors.torch import save

    return save(tensors, metadata=meta)


def save_dump(path, tensors: dict, meta: dict) -> None:
    """Write a dump to ``path`` (safetensors)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=meta)
