"""Cache "hotfixes" for multi-turn drift, as KV-surgery policies on a finished span of a sequence (issue 26).

Articles on DeepSeek's multi-turn translation drift claim that three interventions on the KV cache improve
terminology consistency: resetting one decoder layer's KV at sentence boundaries (their "layer 3 hotfix"), a gated
refresh mixing the old KV with freshly computed KV, and a LayerNorm-aware reset.  None of them comes with a
primary source we could read (no paper, no code), so each is implemented here under the reading stated below and
measured by ``kvkeeper eval intervene`` (:mod:`kvkeeper.eval.intervene`; docs/evaluation.md).

**What "fresh" means.**  On kvkeeper's invariant default path the KV a session reuses *is* the KV a recompute of
the same tokens gives, bit for bit (tests/unit/engine/test_invariance.py), so refreshing a span from a recompute
of the whole history would change nothing.  What a reset can change is the context the span's KV was computed
with.  Here the fresh KV of a span ``[start, end)`` (a sentence: one turn of a session, or one sentence of a text)
is that of a recompute *with the context reset at the sentence boundary*: the tokens ``token_ids[:anchor]`` (the
anchor: a session's system message, a text's first sentence) followed directly by ``token_ids[start:end]``, at
their true positions (RoPE positions ``0 .. anchor-1`` and ``start .. end-1``), so every layer's K/V of the span
depends only on the anchor and the sentence itself, not on the sentences between them.  :func:`fresh_span_kv`
computes it in a private cache through the engine's own model code and kernels (the shared pool is untouched).

**Policies** (:data:`INTERVENTION_POLICIES`), each applied to the layers ``layers`` (default: layer 3) of the span's slots,
every other layer and every other token left as they are; values are computed in float32 and stored once in the
cache's format (one rounding to bf16 on the default path):

* ``layer_reset``: ``new = fresh`` (the "layer 3 hotfix");
* ``gated_refresh``: ``new = gate * old + (1 - gate) * fresh``, element-wise for K and V (``gate`` in [0, 1],
  default 0.5; 1 keeps the old KV, 0 is ``layer_reset``);
* ``ln_reset`` (the LayerNorm-aware reset): the fresh direction at the old scale, per token and KV head, K and V
  separately: ``new = fresh * ||old|| / ||fresh||`` (L2 norms over the head dimension; a zero fresh vector keeps
  the old one).  Our reading of "LayerNorm-aware": a reset that keeps the magnitudes the layer's normalised
  inputs produced (the attention logits' scale ``q . k`` and the values' scale), changing only their direction.

With ``start == anchor`` the fresh context *is* the original one, so on an invariant path every policy leaves the
first sentence's KV unchanged bit for bit (``gated_refresh`` up to the rounding of its mix).

Prefix cache.  The modified blocks keep their prefix-cache registration (their token hashes), so the sequence must
hold its KV in a namespace of its own (``LLMEngine.isolated_namespace``): no other request may ever be handed
that KV.  :func:`intervene` refuses a span in a block another owner also references.

Cost: one prefill of ``anchor + (end - start)`` tokens through the layers up to the deepest one rewritten (layer 3:
4 of SmolLM2's 30 layers) per intervention, plus a gather and a write of the chosen layers' K/V of the span.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..errors import InvalidRequestError
from ..kvcache.surgery import overwrite_slots
from ..engine.handle import EngineHandle

INTERVENTION_POLICIES = ("layer_reset", "gated_refresh", "ln_reset")


@dataclass(frozen=True)
class KVIntervention:
    """A cache hotfix: ``policy`` (one of :data:`INTERVENTION_POLICIES`), the decoder ``layers`` it rewrites (0-based) and,
    for ``gated_refresh``, the weight ``gate`` of the old KV in [0, 1].

    Raises InvalidRequestError for an unknown policy, no layers, a negative layer or a gate outside [0, 1].
    """

    policy: str
    layers: tuple[int, ...] = (3,)
    gate: float = 0.5

    def __post_init__(self):
        if self.policy not in INTERVENTION_POLICIES:
            raise InvalidRequestError(f"unknown intervention {self.policy!r}; choose from {', '.join(INTERVENTION_POLICIES)}")
        if not self.layers:
            raise InvalidRequestError("an intervention needs at least one layer (e.g. --layers 3)")
        if any(int(x) < 0 for x in self.layers):
            raise InvalidRequestError(f"layers are 0-based decoder layer indices, got {list(self.layers)}")
        if not 0.0 <= self.gate <= 1.0:
            raise InvalidRequestError(f"the gate (weight of the old KV) must be in [0, 1], got {self.gate}")
        object.__setattr__(self, "layers", tuple(sorted({int(x) for x in self.layers})))

    @property
    def name(self) -> str:
        """e.g. ``layer_reset@3``, ``gated_refresh(0.5)@3``."""
        g = f"({self.gate:g})" if self.policy == "gated_refresh" else ""
        return f"{self.policy}{g}@{','.join(map(str, self.layers))}"


def mix(policy: KVIntervention, old: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """The new K (or V) of a span under ``policy``: old, fresh (n, KVH, D) float32 -> (n, KVH, D) float32."""
    if policy.policy == "layer_reset":
        return fresh
    if policy.policy == "gated_refresh":
        return policy.gate * old + (1.0 - policy.gate) * fresh
    on = old.norm(dim=-1, keepdim=True)
    fn = fresh.norm(dim=-1, keepdim=True)
    return torch.where(fn > 0, fresh * (on / fn.clamp_min(torch.finfo(torch.float32).tiny)), old)


@torch.inference_mode()
def fresh_span_kv(engine: EngineHandle, token_ids: list[int], anchor: int, start: int, end: int, layers: list[int] | None = None,
                  chunk: int = 512) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """K/V of ``token_ids[start:end]`` computed with only ``token_ids[:anchor]`` before them, at their true
    positions (RoPE ``0..anchor-1`` then ``start..end-1``), in a private cache (the engine's pool is untouched).

    engine: the engine (:meth:`~kvkeeper.worker.runner.ModelRunner.prefill_private`: its weights, kernels and KV
    format: the values are rounded to the cache's storage as any cached KV).  layers: which layers to return
    (default all).  Returns ``{layer: (k, v)}``, each (end - start, KVH, D) float32 on the engine's device.
    Raises InvalidRequestError unless ``0 <= anchor <= start < end <= len(token_ids)``, and ValueError for an
    MLA (latent) cache, whose rows have no separate K and V.
    """
    if not 0 <= anchor <= start < end <= len(token_ids):
        raise InvalidRequestError(f"a span needs 0 <= anchor ({anchor}) <= start ({start}) < end ({end}) <= "
                                  f"{len(token_ids)} tokens")
    if engine.kv.store.latent:
        raise ValueError("an MLA latent cache has no separate K and V to intervene on")
    ids = torch.tensor(list(token_ids[:anchor]) + list(token_ids[start:end]), dtype=torch.int64)
    pos = torch.cat([torch.arange(anchor), torch.arange(start, end)])
    wanted = list(range(engine.kv.store.num_layers)) if layers is None else sorted(layers)
    # a cache for the layers up to the deepest one wanted: the model's forward runs one layer per cache it is
    # given (zip over the layers and the caches), so the layers past it are not computed at all
    _, store = engine.prefill_private(ids, pos, chunk, "none", num_layers=wanted[-1] + 1)
    table = torch.arange(store.num_blocks, dtype=torch.int64, device=store.device)
    out = {}
    for layer in wanted:
        k, v = store.gather(layer, table, ids.numel(), torch.float32)
        out[layer] = (k[anchor:], v[anchor:])
    return out


@torch.inference_mode()
def intervene(engine: EngineHandle, seq, start: int, end: int, anchor: int, policy: KVIntervention, chunk: int = 512) -> dict:
    """Apply ``policy`` to the KV of ``seq``'s tokens ``[start, end)`` (a finished sentence), in place.

    seq: a sequence (or a session's pinned state) holding KV for its first ``seq.num_computed`` tokens, in a
    namespace of its own (see the module docstring).  anchor: the tokens kept as the fresh recompute's context.
    Changes only the slots of positions ``start .. end-1`` in the layers ``policy.layers`` (K and V).
    Returns ``{"tokens": end - start, "recomputed": anchor + end - start, "max_abs_change": max |new - old|
    over the rewritten values (float32, before storage rounding), "ms": wall time}``.
    Raises InvalidRequestError for a span outside the computed tokens or a layer the model does not have,
    ValueError for compressed KV (``kv_offset``), a hybrid (sliding-window) cache (start the engine with
    ``--no-hybrid-kv-cache``) or a span in a block another owner references.
    """
    t0 = time.perf_counter()
    store, bs = engine.kv.store, engine.block_size
    if not store.uniform:
        raise ValueError("KV interventions address every layer by block id; a hybrid (sliding-window) KV cache "
                         "cannot be rewritten: start the engine with --no-hybrid-kv-cache")
    if seq.kv_offset:
        raise ValueError(f"{seq.request_id}: compressed KV (kv_offset {seq.kv_offset}) cannot be intervened on")
    if end > seq.num_computed:
        raise InvalidRequestError(f"span end {end} is past the {seq.num_computed} tokens with KV")
    bad = [x for x in policy.layers if x >= store.num_layers]
    if bad:
        raise InvalidRequestError(f"layer {bad[0]} does not exist: the model has layers 0..{store.num_layers - 1}")
    blocks = seq.block_table[start // bs: -(-end // bs)]
    shared = engine.kv.shared_blocks(blocks)
    if shared:
        raise ValueError(f"{seq.request_id}: block {shared[0]} is shared with another owner; hold the KV in a "
                         "namespace of its own (LLMEngine.isolated_namespace) before rewriting it")
    fresh = fresh_span_kv(engine, seq.token_ids, anchor, start, end, list(policy.layers), chunk)
    bt = torch.tensor(seq.block_table, dtype=torch.int64, device=store.device)
    p = torch.arange(start, end, device=store.device)
    slots = bt[p // bs] * bs + p % bs
    table = bt[: -(-end // bs)]
    change = 0.0
    for layer in policy.layers:
        ok, ov = store.gather(layer, table, end, torch.float32)
        fk, fv = fresh[layer]
        nk, nv = mix(policy, ok[start:], fk), mix(policy, ov[start:], fv)
        change = max(change, float((nk - ok[start:]).abs().max()), float((nv - ov[start:]).abs().max()))
        overwrite_slots(store, layer, nk, nv, slots)
    return {"tokens": end - start, "recomputed": anchor + end - start, "max_abs_change": change,
            "ms": 1000 * (time.perf_counter() - t0)}
