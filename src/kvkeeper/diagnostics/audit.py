"""Reuse audit: recompute a sampled request's prompt without the cache and compare.

When a sampled request has produced its first token its prompt KV is complete
(positions ``0 .. P-1``), whether it was computed for this request, reused from
the prefix cache or handed over by a session.  The audit then

1. recomputes the prompt from scratch through the same model code, in a
   *private* :class:`~kvkeeper.kvcache.store.KVStore` sized for the prompt (in
   the engine's KV format, so int8/fp8 KV is compared with a recompute quantized
   the same way); the shared block pool is never touched;
2. compares the first generated token's logits (float32, ``(vocab,)``) with the
   recomputed last-row logits, and each layer's K and V, gathered from the
   request's own block table, with the recomputed ones (``(P, KVH, D)`` each,
   dequantized to float32);
3. reports the first divergent layer and, within it, the first divergent token
   position (K checked before V), logs it at WARNING and counts it.

A token of a layer diverges when ``max|a - b| > kv_atol + kv_rtol * max|b|``
over its heads and head dimension (a = stored, b = recomputed); the logits
diverge when ``max|a - b| > logits_atol``.

On an invariant path (``ModelRunner.invariant``: the default CPU engine, quantized
weights through the C++ kernels, a bf16/fp16/fp32 cache; issue 26) reuse equals
recompute bit for bit, so the audit is exact: every tolerance is 0 and a single
flipped bit of one cached value is reported with its layer and token.  The
tolerances below stay only for the paths that cannot be invariant: the float32
path (torch's GEMMs block their sums by the batch's shape), the PyTorch reference
attention, CUDA, int8/fp8 KV, LoRA adapters and ``--no-invariant-kernels``.  Default tolerances
(:func:`default_tolerance`) sit above the numerical noise between a chunked or
prefix-reusing prefill and a one-piece recompute (GEMMs of other shapes round
differently): for fp32 weights and KV, measured on SmolLM2-135M over MT-Bench
sessions, up to 7e-5 on K/V (7e-6 of the largest value) and 5e-5 on the logits;
in the soak (benchmarks/serving/soak.py, 652 audits over 5 runs with sessions, n=2,
hang-ups, offloads and a restart; 2026-12-01) up to 1.9e-4 on K/V (1.5e-5 of the
token's largest value: a turn whose prompt was cached but for its last token) and
7.6e-5 on the logits (see the README); bf16/fp16 storage and quantized formats
allow about one rounding or quantization step.

Compressed requests (``kv_offset > 0``) hold KV of a subset of their tokens and
are skipped (counted in ``skipped``).

Cost: one extra prefill of the prompt per audited request, on the engine thread.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field

import torch

from ..argtypes import fraction as fraction_arg
from ..kvcache.store import KVStore
from ..options import option
from ..engine.handle import EngineHandle

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AuditTolerance:
    """kv_atol, kv_rtol: per-token K/V tolerance (see the module docstring); logits_atol: absolute, logits."""

    kv_atol: float
    kv_rtol: float
    logits_atol: float


EXACT = AuditTolerance(kv_atol=0.0, kv_rtol=0.0, logits_atol=0.0)  # an invariant path: bit for bit


def default_tolerance(compute_dtype: torch.dtype, kv_format, weight_format: str = "none",
                      invariant: bool = False) -> AuditTolerance:
    """Tolerances for a compute dtype and a :class:`~kvkeeper.kvcache.formats.base.KVFormat`.

    invariant: the engine's path is invariant (``ModelRunner.invariant``): :data:`EXACT`, every tolerance 0.

    fp32 weights and fp32 KV: about ten times the largest fp32 noise measured (1.5e-5 of a token's largest
    value, 7.6e-5 on the logits; the module docstring), far below a wrong block.  An rtol of 1e-5 sat
    too close: CI's 2-minute soak flagged one clean prompt in 38.  bf16/fp16 compute or storage:
    a few units of the last place.  int8/fp8: rounding to a quantization step is discontinuous,
    so the fp32 noise between a reused and a recomputed prompt flips some roundings, and the
    flips compound over the layers; measured on SmolLM2-135M over 8 MT-Bench sessions (turn 2
    reusing the KV of decoded tokens): up to 0.029 (int8) and 0.086 (fp8) of a layer's largest
    value and 0.33 / 0.72 on the first-token logits.  The defaults sit above that noise
    (int8 10/127, fp8 0.3, logits 1.5) and far below a wrong block (differences of the order
    of the values themselves).
    Quantized weights (``weight_format`` gguf, int8, int4; kvkeeper.weights.formats) round the
    activations to 16-bit codes in every projection, with the same kind of flips: measured on SmolLM2-135M
    (gguf) over 40 MT-Bench sessions up to 2.9e-4 of a layer's largest value and 5.7e-3 on the logits with
    an fp32 cache (tolerance 3e-3 and 0.05), and within the int8 / fp8 tolerances above with those caches
    (0.055 and 0.15; logits 0.66 and 0.96).
    A 16-bit (bf16/fp16) cache: the default engine (gguf weights, bf16 KV) over 40 MT-Bench sessions (80 audits,
    48 tokens per reply; 2026-12-01) differed by up to 0.032 of a token's largest K/V value (a few bf16 steps
    compounded over the layers) and 0.11 on the logits, and in a 30-minute soak (763 audits) one prompt differed
    by 0.438 on a token whose largest V value is about 5 (0.086: a prefill resumed after a 16-token prefix hit
    against a one-piece recompute); tolerance 0.15 and 0.5 (a wrong block differs by the order of the values).
    KIVI int4 / int2 (kvkeeper.kvcache.formats) are not invariant across reuse: a query reads its block's recent
    tokens in 16 bits, a recompute in one piece reads them quantized.  Measured on SmolLM2-135M (fp32 weights,
    2 MT-Bench sessions, 16 tokens a reply, 4 audits, 2026-12-06, benchmarks/kv/kivi_audit_noise.py): int4 up
    to 0.19 of a layer's largest value and 1.28 on the logits: tolerance 0.4 and 2.5.  int2 up to 1.01 and 7.2 (its
    noise is of the order of the values): tolerance 2.0 and 15, which names only gross faults (with int2 the audit
    cannot tell a wrong block from quantization noise).
    """
    if invariant:
        return EXACT
    if getattr(kv_format, "kivi", False):
        rtol, logits = (0.4, 2.5) if kv_format.bits == 4 else (2.0, 15.0)
        return AuditTolerance(kv_atol=1e-2, kv_rtol=rtol, logits_atol=logits)
    if kv_format.quantized:
        rtol = 10.0 / kv_format.qmax if kv_format.storage == torch.int8 else 0.3
        return AuditTolerance(kv_atol=1e-3, kv_rtol=rtol, logits_atol=1.5)
    if compute_dtype != torch.float32 or kv_format.storage != torch.float32:  # a 16-bit step: one rounding flip
        return AuditTolerance(kv_atol=1e-2, kv_rtol=0.15, logits_atol=0.5)
    if weight_format != "none":
        return AuditTolerance(kv_atol=1e-3, kv_rtol=3e-3, logits_atol=0.05)
    return AuditTolerance(kv_atol=1e-4, kv_rtol=2e-4, logits_atol=1e-3)


@dataclass
class AuditReport:
    """The outcome of one audited request.

    ok: no layer and no logit diverged.  layer / token / tensor: the first divergent
    layer, the first divergent token position in it and which of "k", "v" diverged
    there ("logits" with layer None when only the logits did); None when ok.
    kv_max_abs_diff: max |stored - recomputed| over every layer, token, head and dim.
    kv_max_rel_diff: per layer and K or V, that max over the largest |recomputed| value; the max of those.
    layer_max_abs_diff: per layer, max over K and V.  logits_max_abs_diff: over the vocabulary.
    elapsed_ms: wall time of the recompute and comparison (ms).
    """

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    ok: bool
    layer: int | None = None
    token: int | None = None
    tensor: str | None = None
    kv_max_abs_diff: float = 0.0
    kv_max_rel_diff: float = 0.0
    logits_max_abs_diff: float | None = None
    layer_max_abs_diff: list[float] = field(default_factory=list)
    elapsed_ms: float = 0.0

    def summary(self) -> str:
        where = "no divergence" if self.ok else (
            "logits diverge (K/V agree)" if self.layer is None
            else f"first divergent layer {self.layer}, token {self.token} ({self.tensor.upper()})")
        lg = "n/a" if self.logits_max_abs_diff is None else f"{self.logits_max_abs_diff:.3g}"
        return (f"KV reuse audit of {self.request_id} ({self.prompt_tokens} prompt tokens, {self.cached_tokens} "
                f"cached): {where}; max |dKV| {self.kv_max_abs_diff:.3g}, max |dlogits| {lg}, "
                f"{self.elapsed_ms:.1f} ms")

    def to_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def recompute_prompt(engine: EngineHandle, token_ids: list[int], chunk: int = 512, lora=None) -> tuple[torch.Tensor, KVStore]:
    """Prefill ``token_ids`` from scratch into a private cache (the shared pool is untouched).

    engine: the engine (or its model runner): :meth:`~kvkeeper.worker.runner.ModelRunner.prefill_private`, its
    weights, kernels and KV format.  chunk: prefill chunk in tokens (bounds activation memory, as the scheduler's
    token budget does).  lora: the sequence's LoRA adapter (:class:`kvkeeper.layers.lora.LoRAAdapter`), None for
    the base model.  Returns (float32 logits of the last token (vocab,), a private KVStore whose blocks
    ``0 .. ceil(P / block_size) - 1`` hold positions ``0 .. P-1`` in order; MLA: one latent row per token).
    """
    ids = torch.tensor(token_ids, dtype=torch.int64)
    logits, store = engine.prefill_private(ids, torch.arange(len(token_ids)), chunk, "last", lora=lora)
    return logits[0], store


def _first_divergence(stored: torch.Tensor, ref: torch.Tensor,
                      tol: AuditTolerance) -> tuple[int | None, float, float]:
    """stored, ref (P, KVH, D) float32 -> (first token position over tolerance or None, max abs diff, max |ref|)."""
    err = (stored - ref).abs().flatten(1).amax(dim=1)  # (P,)
    scale = ref.abs().flatten(1).amax(dim=1)
    bad = torch.nonzero(~(err <= tol.kv_atol + tol.kv_rtol * scale))  # NaN counts as divergent
    return (int(bad[0, 0]) if bad.numel() else None), float(err.max()), float(scale.max())


@torch.inference_mode()
def audit_sequence(engine: EngineHandle, seq, logits: torch.Tensor | None = None, tolerance: AuditTolerance | None = None,
                   num_tokens: int | None = None) -> AuditReport:
    """Compare a sequence's cached K/V (and its first-token logits) with a recompute from scratch.

    seq: a :class:`~kvkeeper.engine.sequence.Sequence` (or a session's state) whose first
    ``num_tokens`` positions (default ``seq.num_computed``) have KV in its block table.
    logits: (vocab,) float32 logits the engine computed after those tokens (None: not compared).
    tolerance: default :func:`default_tolerance` for the engine's dtypes (exact on an invariant path).
    Raises ValueError for a compressed sequence (``kv_offset > 0``) or one with no KV.
    """
    t0 = time.perf_counter()
    if not engine.kv.store.uniform:
        raise ValueError(f"{seq.request_id}: the KV audit reads every layer by block id; a hybrid (sliding-window) "
                         "KV cache cannot be audited: start the engine with --no-hybrid-kv-cache")
    if seq.kv_offset:
        raise ValueError(f"{seq.request_id}: compressed KV (kv_offset {seq.kv_offset}) cannot be audited")
    P = seq.num_computed if num_tokens is None else num_tokens
    if P < 1 or P > seq.num_computed:
        raise ValueError(f"{seq.request_id}: {P} tokens to audit, {seq.num_computed} have KV")
    num = engine.numerics
    invariant = num["invariant"] and getattr(seq, "lora", None) is None
    tol = tolerance or default_tolerance(num["dtype"], num["kv_format"], num["weight_format"], invariant)
    chunk = num["max_num_batched_tokens"]
    ref_logits, ref_store = recompute_prompt(engine, list(seq.token_ids[:P]), chunk, getattr(seq, "lora", None))
    bs, dev = engine.block_size, engine.kv.store.device
    table = torch.tensor(seq.block_table[: -(-P // bs)], dtype=torch.int64, device=dev)
    ref_table = torch.arange(len(table), dtype=torch.int64, device=dev)
    layer = token = tensor = None
    per_layer, rel = [], 0.0
    for i in range(ref_store.num_layers):
        sk, sv = engine.kv.store.gather(i, table, P, torch.float32)
        rk, rv = ref_store.gather(i, ref_table, P, torch.float32)
        tk, dk, mk = _first_divergence(sk, rk, tol)
        tv, dv, mv = _first_divergence(sv, rv, tol) if sv is not None else (None, 0.0, 0.0)
        per_layer.append(max(dk, dv))
        rel = max(rel, dk / mk if mk else 0.0, dv / mv if mv else 0.0)
        if layer is None and (tk is not None or tv is not None):
            layer = i
            token, tensor = (tk, "k") if tv is None or (tk is not None and tk <= tv) else (tv, "v")
    dlog = None
    logits_bad = False
    if logits is not None:
        dlog = float((logits.float().cpu() - ref_logits).abs().max())
        logits_bad = not dlog <= tol.logits_atol  # NaN counts as divergent
    if layer is None and logits_bad:
        tensor = "logits"
    return AuditReport(seq.request_id, P, (getattr(seq, "num_cached_tokens", 0) or 0),
                       ok=layer is None and not logits_bad, layer=layer, token=token, tensor=tensor,
                       kv_max_abs_diff=max(per_layer) if per_layer else 0.0, kv_max_rel_diff=rel,
                       logits_max_abs_diff=dlog,
                       layer_max_abs_diff=per_layer, elapsed_ms=1000 * (time.perf_counter() - t0))


@dataclass
class AuditConfig:
    """The reuse audit's settings: share of requests audited (0..1, 0: off), sampling seed, tolerances."""

    audit_fraction: float = field(default=0.0, metadata=option(
        "--audit-fraction", "share of requests whose prompt is recomputed without the cache to check the reused KV "
        "and first-token logits (reuse audit, default 0: off)", type=fraction_arg, metavar="F"))
    audit_seed: int | None = 0
    audit_tolerance: AuditTolerance | None = None


class ReuseAuditor:
    """Samples requests for the audit and keeps its counters.

    :meth:`attach` hooks it onto an engine: each request is sampled at its first token and,
    when drawn, audited right then (before anything of it is freed).

    fraction: share of requests audited, in [0, 1] (0: none).  seed: of the sampling RNG
    (the same requests in the same order are sampled the same way).  tolerance: see
    :func:`default_tolerance`.  Counters: ``total`` (requests audited), ``mismatches``
    (of those, with a divergence), ``skipped`` (sampled but compressed).  The last 64
    reports are in ``reports``.
    Raises ValueError for a fraction outside [0, 1].
    """

    def __init__(self, fraction: float = 0.0, seed: int | None = 0, tolerance: AuditTolerance | None = None):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"audit fraction must be in [0, 1], got {fraction}")
        self.fraction = fraction
        self.tolerance = tolerance
        self._rng = random.Random(seed)
        self.total = 0
        self.mismatches = 0
        self.skipped = 0
        self.reports: deque[AuditReport] = deque(maxlen=64)
        self.engine = None

    @classmethod
    def from_config(cls, config: AuditConfig) -> "ReuseAuditor":
        return cls(config.audit_fraction, config.audit_seed, config.audit_tolerance)

    def attach(self, engine: EngineHandle) -> "ReuseAuditor":
        """Audit a sample of ``engine``'s requests from now on (a first-token hook); returns self."""
        self.engine = engine
        engine.first_token_hooks.append(self.on_first_token)
        return self

    def on_first_token(self, seq, logits: torch.Tensor) -> None:
        """The engine's first-token hook: draw, and audit when drawn; an audit never takes a request down."""
        if not self.sample():
            return
        try:
            self.audit(self.engine, seq, logits)
        except Exception:
            log.exception("KV reuse audit of %s failed", seq.request_id)
            self.skipped += 1

    def sample(self) -> bool:
        """Draw whether the next request is audited."""
        if self.fraction <= 0.0:
            return False
        return self.fraction >= 1.0 or self._rng.random() < self.fraction

    def audit(self, engine: EngineHandle, seq, logits: torch.Tensor | None) -> AuditReport | None:
        """Audit ``seq`` now (its prompt KV complete, ``logits`` its first-token logits); None if skipped."""
        if seq.kv_offset:
            self.skipped += 1
            return None
        rep = audit_sequence(engine, seq, logits, self.tolerance)
        self.total += 1
        self.reports.append(rep)
        if rep.ok:
            log.debug("%s", rep.summary())
        else:
            self.mismatches += 1
            log.warning("%s", rep.summary())
        return rep

    def stats(self) -> dict:
        return {"kv_audit_total": self.total, "kv_audit_mismatch_total": self.mismatches,
                "kv_audit_skipped_total": self.skipped}
