"""Session compression: a session's KV compressed at the end of each turn and continued by the next one.

Per-request compression (:mod:`kvkeeper.kvcache.compression`) drops prompt KV for one request and the session
throws the compressed KV away at its next turn.  A session compression policy (:class:`SessionCompression`,
set per session as the context policies are: the ``session_compression`` / ``session_compression_ratio`` body
fields or the ``X-Session-Compression`` / ``X-Session-Compression-Ratio`` headers) instead compresses the session's
whole KV when a turn ends and keeps it: the next turn appends its new tokens after the compressed KV.

Policies are query-agnostic (they do not know the next question); each layer and KV head keeps
``n_keep = max(1, int(T * (1 - ratio)))`` of the KV entries it holds, where ``T`` is the true number of tokens the
KV covers (the uncompressed length), so KV held between turns stays at about ``1 - ratio`` of the uncompressed
session's whatever the number of turns:

* ``streaming_llm`` -- StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention
  Sinks"): the first ``n_sink`` entries (attention sinks) and the most recent ones.
* ``knorm`` -- key-norm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
  Compression"): the entries whose keys have the lowest L2 norm (RoPE rotates pairs of channels, so the norm of a
  cached, rotated key is that of the unrotated one).
* ``kvzip`` -- context reconstruction (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context
  Reconstruction"): the model is asked to repeat the context (a prompt ``"\\n\\nRepeat the previous context:\\n"``
  followed by the session's token ids, prefilled over a copy-on-write view of the session's KV and thrown away);
  each KV entry's score is the largest attention any reconstruction query (over the group's query heads) gives it,
  and the top ``n_keep`` per KV head are kept.  Simplifications, stated: the whole history is repeated in one
  pass (chunked prefill of 256 tokens; KVzip scores 2k-token chunks of a long context separately), the entries
  are scored after the earlier turns' compression (the dropped ones are gone and are not re-scored), and there is
  no per-head budget reallocation (KVzip's non-uniform head budgets): every head keeps ``n_keep``.  The cost is a
  prefill of the whole history at the end of each turn.

**Reuse rule.**  The next turn continues from the compressed KV when its prompt extends the previous turn's full
token history (every token the KV covers, in order); its new tokens get their true positions (RoPE positions
continue from the uncompressed length; kept entries keep their original positions: ``Sequence.kv_offset``
records how many were dropped) and are appended after the kept entries.  A prompt that edits the history (any
token the KV covers differs) recomputes the whole prompt from scratch (compressed KV cannot be truncated to a
common prefix: its entries are no longer in token order across heads).  Compressed KV never enters the prefix
cache.

The per-turn report (:class:`CompressionReport`) says how many entries each layer kept.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

import torch

from ..errors import InvalidRequestError
from ..kvcache.compression import knorm_scores, n_keep, streaming_llm_keep, top_entries

log = logging.getLogger(__name__)

SESSION_COMPRESSION_POLICIES = ("none", "streaming_llm", "knorm", "kvzip")
REPEAT_PROMPT = "\n\nRepeat the previous context:\n"
_RECON_CHUNK = 256  # reconstruction tokens per forward pass (bounds activation memory)
_QUERY_CHUNK = 128  # queries per attention-probability block


@dataclass(frozen=True)
class SessionCompression:
    """A session's compression policy.

    policy: one of :data:`SESSION_COMPRESSION_POLICIES` ("none": keep everything).  ratio: the fraction of the KV
    entries dropped at the end of each turn, in [0, 1) (0.5 keeps half).  n_sink: streaming_llm's sink entries.
    Raises :class:`InvalidRequestError` naming ``session_compression`` (unknown policy) or
    ``session_compression_ratio`` (ratio outside [0, 1)).
    """

    policy: str = "none"
    ratio: float = 0.5
    n_sink: int = 4

    def __post_init__(self):
        if self.policy not in SESSION_COMPRESSION_POLICIES:
            raise InvalidRequestError(f"session_compression must be one of "
                                      f"{', '.join(SESSION_COMPRESSION_POLICIES)}, got {self.policy!r}",
                                      param="session_compression")
        if not isinstance(self.ratio, (int, float)) or not 0.0 <= float(self.ratio) < 1.0:
            raise InvalidRequestError(f"session_compression_ratio must be in [0, 1) (the fraction of the session's KV "
                                      f"dropped at the end of each turn), got {self.ratio!r}",
                                      param="session_compression_ratio")
        if self.n_sink < 0:
            raise InvalidRequestError(f"session compression n_sink must be >= 0, got {self.n_sink}",
                                      param="session_compression")

    @property
    def active(self) -> bool:
        return self.policy != "none" and self.ratio > 0

    def n_keep(self, length: int) -> int:
        """Entries kept per layer and KV head for KV covering ``length`` tokens
        (:func:`kvkeeper.kvcache.compression.n_keep`)."""
        return n_keep(length, self.ratio)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CompressionReport:
    """What a turn's end kept: ``tokens`` (true tokens the KV covers), ``kept_per_layer`` (KV entries each layer
    holds now, per KV head), ``before`` (entries held before compressing), ``ms`` (milliseconds compressing,
    the kvzip reconstruction pass included), ``applied`` (False: the KV was kept whole: nothing to drop, or no
    room in the pool for the copy)."""

    policy: str
    ratio: float
    tokens: int
    before: int
    kept_per_layer: list[int] = field(default_factory=list)
    ms: float = 0.0
    applied: bool = False

    @property
    def kept(self) -> int:
        return max(self.kept_per_layer, default=0)

    def to_dict(self) -> dict:
        return {**asdict(self), "kept": self.kept}

    def header(self) -> str:
        """The ``X-KVKeeper-Session-Compression`` value: ``policy=knorm; ratio=0.5; tokens=..; kept=..; ...``."""
        return (f"policy={self.policy}; ratio={self.ratio}; tokens={self.tokens}; kept={self.kept}; "
                f"before={self.before}; layers={len(self.kept_per_layer)}; applied={int(self.applied)}")


class ReconstructionObserver:
    """KVzip scores: ``acc[layer]`` (KVH, n_ctx) float32, the largest attention each of the first ``n_ctx`` KV
    entries receives from any reconstruction query (max over queries and the group's query heads)."""

    def __init__(self, n_ctx: int, num_layers: int, num_kv_heads: int):
        self.n_ctx = n_ctx
        self.acc = [torch.zeros(num_kv_heads, n_ctx) for _ in range(num_layers)]

    def observe(self, layer: int, q: torch.Tensor, k: torch.Tensor, offset: int, scale: float) -> None:
        """q (n, H, D): queries at KV indices offset..offset+n-1; k (ctx, KVH, D): every key so far."""
        n, H, D = q.shape
        ctx, kvh = k.shape[0], k.shape[1]
        g = H // kvh
        kk = k.float().permute(1, 2, 0)  # (KVH, D, ctx)
        acc = self.acc[layer]
        for a in range(0, n, _QUERY_CHUNK):
            b = min(n, a + _QUERY_CHUNK)
            qq = q[a:b].float().view(b - a, kvh, g, D).permute(1, 0, 2, 3).reshape(kvh, (b - a) * g, D)
            s = torch.bmm(qq, kk) * scale  # (KVH, rows * g, ctx)
            qpos = (torch.arange(a, b) + offset).repeat_interleave(g)
            s.masked_fill_(torch.arange(ctx)[None, :] > qpos[:, None], float("-inf"))
            p = torch.softmax(s, dim=-1)[:, :, : self.n_ctx]
            torch.maximum(acc, p.amax(dim=1), out=acc)


def _kvzip_scores(engine, seq, slots: int) -> list[torch.Tensor] | None:
    """Per layer (KVH, slots) reconstruction scores of ``seq``'s KV (see the module docstring); None when the pool
    has no room for the reconstruction's blocks."""
    from ..engine.sequence import Sequence, SeqStatus
    from ..sampling.params import SamplingParams

    bs, nc = engine.block_size, seq.num_computed
    history = list(seq.token_ids[:nc])
    recon = engine.tokenizer.encode(REPEAT_PROMPT, add_special_tokens=False) + history
    total = slots + len(recon)
    own = -(-slots // bs)
    extra = engine.kv.allocate_blocks(-(-total // bs) - own)
    if extra is None:
        return None
    mc = engine.model_config
    obs = ReconstructionObserver(slots, mc.num_layers, mc.num_kv_heads)
    tmp = Sequence(f"{seq.request_id}-kvzip", history + recon, SamplingParams(), seq.namespace,
                   num_prompt_tokens=nc + len(recon), status=SeqStatus.FINISHED)
    # the reconstruction writes after the session's entries: into the tail of its partial last block (unused slots,
    # owned by this sequence alone) and into fresh blocks; only entries < slots are read back, so nothing is harmed
    tmp.block_table, tmp.num_computed, tmp.kv_offset, tmp.observer = seq.block_table[:own] + extra, nc, \
        seq.kv_offset, obs
    try:
        with torch.inference_mode():
            while tmp.num_computed < len(tmp.token_ids):
                n = min(_RECON_CHUNK, len(tmp.token_ids) - tmp.num_computed)
                engine.kv.write_outside_scheduler(tmp, n)
                tmp.num_computed += n
    finally:
        engine.kv.free_blocks(extra)
    return obs.acc


def select_entries(spec: SessionCompression, keys: torch.Tensor, k: int, scores: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Indices (KVH, k) int64, ascending, of the KV entries each KV head keeps.

    keys: (S, KVH, D) float, the layer's S cached keys (RoPE applied) in entry order (the order of their true
    positions); scores: kvzip's (KVH, S) reconstruction scores.  ``k`` <= S.
    """
    S, kvh = keys.shape[0], keys.shape[1]
    if spec.policy == "streaming_llm":
        return streaming_llm_keep(S, k, spec.n_sink, kvh)
    if spec.policy == "knorm":
        s = knorm_scores(keys)
    elif spec.policy == "kvzip":
        s = scores
    else:
        raise ValueError(f"no selection for session compression policy {spec.policy!r}")
    return top_entries(s, k)


@torch.inference_mode()
def compress_session_kv(engine, seq, spec: SessionCompression) -> CompressionReport:
    """Compress a finished turn's KV in place (``seq``: its block table, ``num_computed``, ``kv_offset``) to
    ``spec.n_keep(seq.num_computed)`` entries per layer and KV head; returns the report.

    The kept K/V are copied raw (values and scales) into fresh blocks; the old blocks are released (full ones stay
    in the prefix cache, which keeps the uncompressed KV for other requests).  ``seq`` must not be reachable by
    the KV holders' reclaim while this runs (the session takes it over afterwards).  When the pool has no room
    (after reclaiming), the KV is kept whole and the report says ``applied=False`` (logged).
    Raises nothing for those cases; ValueError for a hybrid (sliding-window) KV cache.
    """
    t0 = time.perf_counter()
    nc = seq.num_computed
    slots = nc - seq.kv_offset
    nl = engine.model_config.num_layers
    rep = CompressionReport(spec.policy, spec.ratio, nc, slots, [slots] * nl)
    k = spec.n_keep(nc)
    if not spec.active or k >= slots or not seq.block_table:
        return rep
    if not engine.kv.store.uniform:
        raise ValueError("session compression needs a uniform KV cache (not a hybrid sliding-window one)")
    scores = None
    if spec.policy == "kvzip":
        scores = _kvzip_scores(engine, seq, slots)
        if scores is None:
            log.warning("no free blocks for the kvzip reconstruction of %s; its KV stays whole", seq.request_id)
            rep.ms = (time.perf_counter() - t0) * 1000.0
            return rep
    bs, store = engine.block_size, engine.kv.store
    new = engine.kv.allocate_blocks(-(-k // bs))
    if new is None:
        log.warning("no free blocks to compress %s into; its KV stays whole", seq.request_id)
        rep.ms = (time.perf_counter() - t0) * 1000.0
        return rep
    dev = store.device
    old = torch.tensor(seq.block_table[: -(-slots // bs)], dtype=torch.int64)
    j = torch.arange(k)
    dst = (torch.tensor(new, dtype=torch.int64)[j // bs] * bs + j % bs)
    for layer in range(store.num_layers):
        keys = store.gather_keys(layer, old.to(dev), slots, torch.float32).cpu()
        idx = select_entries(spec, keys, k, None if scores is None else scores[layer])  # (KVH, k)
        store.copy_tokens(layer, (old[idx // bs] * bs + idx % bs).to(dev), dst.to(dev))
    engine.kv.free_blocks(seq.block_table)
    seq.block_table, seq.block_hashes = new, []
    seq.kv_offset = nc - k
    seq.num_kv_dropped += slots - k
    rep.kept_per_layer, rep.applied = [k] * nl, True
    rep.ms = (time.perf_counter() - t0) * 1000.0
    return rep
