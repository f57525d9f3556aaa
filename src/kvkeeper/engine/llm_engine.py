"""The engine: model + paged KV cache + scheduler + sampler + detokenizer, stepped in one process.

Typical use::

    from kvkeeper import LLMEngine, SamplingParams
    eng = LLMEngine()                      # embedded SmolLM2-135M-Instruct, fp32, CPU
    out = eng.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0]
    s = eng.new_session()                  # multi-turn with KV reuse across turns
    r = s.send("Hi!")                      # r.cached_tokens, r.ttft_s, r.decode_tok_per_s
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from ..diagnostics.audit import ReuseAuditor
from ..errors import ContextLengthError, InvalidRequestError, KVKeeperError
from ..kvcache.block_pool import BlockPool
from ..kvcache.manager import KVCacheManager
from ..kvcache.namespace import Namespace
from ..kvcache.compression import KVCompression, PrefillObserver, select
from ..kvcache.quant import parse_kv_format
from ..kvcache.validate import assert_engine_ok
from ..model.loader import load_weights
from ..model.registry import resolve_model_path
from ..model.runner import ModelRunner, parse_dtype
from ..sampling.sampler import make_generator, sample
from ..text.detokenizer import IncrementalDetokenizer
from ..text.tokenizer import load_tokenizer
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import SeqStatus, Sequence

log = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 1 << 30  # 1 GiB


@dataclass
class RequestOutput:
    """The result of one request.

    token_ids: generated ids (incl. a final EOS or the token that completed a stop string).
    text: generated text, stop string excluded.  Times are in seconds; decode speed in tokens/s.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cached_tokens: int
    ttft_s: float | None
    decode_tok_per_s: float | None
    num_preemptions: int = 0
    logprobs: list = field(default_factory=list)
    error: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def from_seq(cls, seq: Sequence) -> "RequestOutput":
        ttft = None if seq.t_first_token is None else seq.t_first_token - seq.t_arrival
        speed = None
        if seq.t_first_token is not None and seq.t_last_token and seq.num_output_tokens > 1:
            dt = seq.t_last_token - seq.t_first_token
            speed = (seq.num_output_tokens - 1) / dt if dt > 0 else None
        return cls(seq.request_id, seq.token_ids[: seq.num_prompt_tokens], list(seq.output_token_ids), seq.text,
                   seq.finish_reason, max(seq.num_cached_tokens, 0), ttft, speed, seq.num_preemptions,
                   list(seq.logprobs), seq.error)


class LLMEngine:
    """Paged-KV inference engine.

    model: a known id (see ``kvkeeper.model.registry``) or a path to a GGUF file / HF folder.
    dtype: weights and activations ("float32" default on CPU, "bfloat16" on CUDA; "float16" selectable).
    device: "cpu" (default), "cuda" or "auto" (CUDA when available); on CUDA the attention runs the Triton
    kernels of kvkeeper.model.triton_attention (``attention_backend`` "auto"; "torch" forces the reference)
    and decode steps replay CUDA graphs (``cuda_graphs=False``: eager).
    load_format: "auto" (weights from the model's files) or "dummy" (``model`` names a shipped config or a
    config.json; random weights seeded by ``seed``, see kvkeeper.model.dummy).
    kv_dtype: KV cache storage: "fp32", "bf16", "fp16", "int8" or "fp8" (default: ``dtype``); int8 and
    fp8 are quantized per token and KV head on write (see ``kvkeeper.kvcache.quant``).
    validate_every: run the KV integrity validators (kvkeeper.kvcache.validate) before every N-th step and
    raise IntegrityError on a violation (default: $KVKEEPER_VALIDATE, else 0 = never).
    audit_fraction: share of requests (0..1, default 0) whose prompt is recomputed without the cache once
    their first token is out, comparing first-token logits and each layer's K/V (reuse audit, see
    ``kvkeeper.diagnostics.audit``); audit_seed seeds the sampling, audit_tolerance overrides the defaults.
    block_size: tokens per KV block.  KV budget: ``num_kv_blocks`` or ``kv_cache_bytes``
    (default 1 GiB).  ``max_num_batched_tokens``: the per-step token budget (chunked prefill).
    Offload tiers of idle sessions (:mod:`kvkeeper.sessions.offload`): ``host_offload_bytes`` (host
    memory budget, default 1 GiB) and ``data_dir`` (disk tier under ``data_dir/sessions``; None: no disk
    tier); sessions saved there are registered as open sessions at start.
    quantization: weight format, "none", "gguf", "int8" or "int4" (default: the model file's, see
    kvkeeper.model.quant_weights; ``runner.weight_format`` says which runs); InvalidRequestError names the
    formats a file supports.
    Raises ModelNotFoundError / ModelFormatError / UnsupportedArchitectureError while loading.
    """

    def __init__(self, model: str | None = None, *, dtype: str | None = None, device: str = "cpu",
                 block_size: int = 16, num_kv_blocks: int | None = None, kv_cache_bytes: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512, enable_chunked_prefill: bool = True,
                 enable_prefix_caching: bool = True, max_model_len: int | None = None, num_threads: int | None = None,
                 kv_dtype: str | None = None, validate_every: int | None = None,
                 data_dir: str | os.PathLike | None = None, host_offload_bytes: int | None = None,
                 audit_fraction: float = 0.0, audit_seed: int | None = 0, audit_tolerance=None,
                 load_format: str = "auto", attention_backend: str = "auto", cuda_graphs: bool = True,
                 seed: int = 0, quantization: str | None = None):
        if num_threads:
            torch.set_num_threads(num_threads)
        device = resolve_device(device)
        dtype = dtype or ("bfloat16" if device.type == "cuda" else "float32")
        torch_dtype = parse_dtype(dtype)
        if load_format not in ("auto", "dummy"):
            raise InvalidRequestError(f"unknown load format {load_format!r}; choose auto or dummy")
        self.model_name = model or "smollm2-135m-instruct"
        if load_format == "dummy":  # random weights of a config's shapes (kvkeeper.model.dummy), made on the device
            from ..model import dummy

            cfg, self.model_path = dummy.load_config(self.model_name)
            state = dummy.dummy_state(cfg, torch_dtype, device, seed=seed)
            self.tokenizer = dummy.load_dummy_tokenizer(self.model_path, cfg.vocab_size)
        else:
            self.model_path = resolve_model_path(model)
            cfg, state = load_weights(self.model_path)
            self.tokenizer = load_tokenizer(self.model_path)
        self.config = cfg
        try:
            kv_format = parse_kv_format(kv_dtype if kv_dtype is not None else torch_dtype)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        bytes_per_token = kv_format.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        if num_kv_blocks is None:
            budget = kv_cache_bytes or DEFAULT_KV_CACHE_BYTES
            num_kv_blocks = budget // (bytes_per_token * block_size)
            if num_kv_blocks < 1:
                raise InvalidRequestError(f"kv_cache_bytes={budget} is smaller than one block ({bytes_per_token * block_size} bytes)")
        self.block_size = block_size
        try:
            self.runner = ModelRunner(cfg, state, num_kv_blocks, block_size, dtype=torch_dtype, device=device,
                                      kv_dtype=kv_format, attention_backend=attention_backend,
                                      quantization=quantization)
        except ValueError as e:  # unknown or unavailable attention backend
            raise InvalidRequestError(str(e)) from None
        del state
        self.pool = BlockPool(num_kv_blocks, block_size, enable_prefix_caching)
        self.kv = KVCacheManager(self.pool)
        self.scheduler = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill,
                                   reclaim=self._reclaim_from_sessions)
        self.context_length = min(cfg.context_length, max_model_len or cfg.context_length)
        self.namespace = Namespace(cfg.revision, kv_dtype=kv_format.name)
        eos = set(cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = eos
        self._req_ids = itertools.count()
        self._seqs: dict[str, Sequence] = {}
        self.sessions: dict[str, "Session"] = {}  # noqa: F821  (sessions register themselves)
        self.detached: dict[int, Sequence] = {}  # finished requests whose blocks a session has yet to take
        self.num_steps = 0
        self.step_hooks: list = []  # called before each step (the circuit breaker's evaluate)
        self.breaker = None  # a kvkeeper.sessions.breaker.CircuitBreaker once attached
        self.capture_first_logits = False  # tests and audits: keep each request's first-token logits
        if validate_every is None:
            validate_every = int(os.environ.get("KVKEEPER_VALIDATE", "0") or 0)
        self.validate_every = validate_every  # run the KV integrity validators every N steps (0: never)
        if cuda_graphs:  # decode-step CUDA graphs (a no-op on CPU; see kvkeeper.model.cuda_graphs)
            self.runner.capture_cuda_graphs(max_num_seqs, self.context_length)
        from ..sessions.offload import SessionStore

        self.offload_store = SessionStore(self, data_dir, host_offload_bytes)
        self.offload_store.load_sessions()
        try:
            self.auditor = ReuseAuditor(audit_fraction, audit_seed, audit_tolerance)  # reuse audit (0: off)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None

    # ---- requests ----------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        return self.runner.kv_bytes_per_token

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation, exactly as the model's chat template renders it."""
        if not messages:
            raise InvalidRequestError("the conversation is empty: give at least one message")
        text = self.render_chat(messages, add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InvalidRequestError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja2.TemplateError: the template rejects this conversation (raise_exception)
            if type(e).__module__.startswith("jinja2"):
                raise InvalidRequestError(f"the model's chat template rejected the conversation: {e}") from e
            raise

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    namespace: Namespace | None = None, compression: KVCompression | None = None) -> Sequence:
        """Queue a request; returns its :class:`Sequence`.

        compression: drop prompt tokens from the KV cache at the end of prefill
        (see :mod:`kvkeeper.kvcache.compression`); None keeps everything.

        Raises :class:`InvalidRequestError` for an empty prompt and
        :class:`ContextLengthError` when the prompt leaves no room for a token.
        """
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty: give at least one token of text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        if len(ids) >= self.context_length:
            raise ContextLengthError(len(ids), self.context_length)
        request_id = request_id or f"req-{next(self._req_ids)}"
        if request_id in self._seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, ids, params, namespace or self.namespace)
        seq.compression = compression
        seq.audit = self.auditor.sample()
        max_new = self.context_length - len(ids)
        seq.max_total_tokens = len(ids) + min(max_new, params.max_tokens or max_new)
        seq.generator = make_generator(params)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None and not seq.finished:
            seq.finish_reason = "abort"
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        seq.t_finished = time.perf_counter()
        self.scheduler.finish(seq)
        if not seq.keep_blocks:
            self.kv.free(seq)
        else:  # a session takes the blocks over (Session.keep); until then they are owned here
            self.detached[id(seq)] = seq
        self._seqs.pop(seq.request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ----------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Schedule, run the model once, sample; returns sequences that finished in this step."""
        for hook in self.step_hooks:
            hook()
        if self.validate_every and self.num_steps % self.validate_every == 0:
            assert_engine_ok(self)  # before scheduling: every finished request's blocks have their owner by now
        out = self.scheduler.schedule()
        finished: list[Sequence] = []
        for seq in out.rejected:
            seq.finish_reason = "error"
            self._finish(seq)
            finished.append(seq)
        if not out.scheduled:
            return finished
        self.num_steps += 1
        for seq, _ in out.scheduled:
            if seq.compression is not None and seq.observer is None and not seq.compressed:
                seq.observer = PrefillObserver(seq.compression, len(seq.token_ids) - seq.kv_offset,
                                               self.config.num_layers, self.config.num_kv_heads)
        logits, seqs = self.runner.execute(out.scheduled)
        for seq, n in out.scheduled:
            seq.num_computed += n
            self.kv.commit(seq)
        if logits is None:
            return finished
        ids, logps = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        now = time.perf_counter()
        for row, (seq, tok, lp) in enumerate(zip(seqs, ids, logps)):
            if self.capture_first_logits and seq.first_logits is None:
                seq.first_logits = logits[row].cpu().clone()
            if seq.audit:  # first token: the prompt's KV is complete; compare it with a recompute (before any free)
                seq.audit = False
                self._audit(seq, logits[row])
            seq.token_ids.append(tok)
            if seq.t_first_token is None:
                seq.t_first_token = now
            seq.t_last_token = now
            if lp is not None:
                k = seq.params.logprobs or 0
                top = torch.topk(lp, k) if k else None
                seq.logprobs.append({
                    "token_id": tok, "logprob": float(lp[tok]),
                    "top": [] if top is None else list(zip(top.indices.tolist(), top.values.tolist())),
                })
            delta = seq.detokenizer.add(tok)
            seq.text += delta
            reason = None
            if seq.detokenizer.stopped:
                reason, seq.stop_string = "stop", seq.detokenizer.stop_string
            elif (tok in self.eos_token_ids and not seq.params.ignore_eos) or tok in seq.params.stop_token_ids:
                reason = "stop"
            elif len(seq.token_ids) >= seq.max_total_tokens:
                reason = "length"
            if reason:
                if not seq.detokenizer.stopped:
                    seq.text += seq.detokenizer.flush()
                seq.finish_reason = reason
                self._finish(seq)
                finished.append(seq)
        for seq, _ in out.scheduled:
            obs = seq.observer
            if obs is not None and not seq.finished and seq.num_computed - seq.kv_offset >= obs.length:
                self._compress(seq)
        return finished

    def _audit(self, seq: Sequence, logits: torch.Tensor) -> None:
        try:
            self.auditor.audit(self, seq, logits)
        except Exception:  # the audit must never take a request down
            log.exception("KV reuse audit of %s failed", seq.request_id)
            self.auditor.skipped += 1

    @torch.inference_mode()
    def _compress(self, seq: Sequence) -> None:
        """Apply the sequence's KV compression now that its prefill is complete (see kvcache.compression)."""
        obs, comp = seq.observer, seq.compression
        seq.observer, seq.compressed = None, True
        L = obs.length
        k = comp.n_keep(L)
        if k >= L:
            return
        bs = self.block_size
        need = -(-k // bs)
        if need > self.pool.num_free and not (self._reclaim_from_sessions(need - self.pool.num_free) > 0
                                              and need <= self.pool.num_free):
            log.warning("no free blocks to compress %s into; its KV stays whole", seq.request_id)
            return
        new = self.pool.allocate(need)
        old = torch.tensor(seq.block_table[: -(-L // bs)], dtype=torch.int64)
        j = torch.arange(k)
        dst = torch.tensor(new, dtype=torch.int64)[j // bs] * bs + j % bs
        for layer, cache in enumerate(self.runner.kv_caches):
            keys = cache.gather_keys(old, L, torch.float32)
            idx = select(comp, obs, layer, keys)  # (KVH, k)
            cache.copy_tokens(old[idx // bs] * bs + idx % bs, dst)
        self.pool.free_all(seq.block_table)
        seq.block_table, seq.block_hashes = new, []
        seq.kv_offset = L - k
        seq.num_kv_dropped += L - k

    def run_until_done(self, seqs: list[Sequence]) -> None:
        while any(not s.finished for s in seqs):
            self.step()

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 namespace: Namespace | None = None, compression: KVCompression | None = None) -> list[RequestOutput]:
        """Run prompts to completion (batched together); returns one :class:`RequestOutput` each, in order.

        compression: applied to every prompt's KV at the end of its prefill (None: keep everything).
        """
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        seqs = [self.add_request(p, sp, namespace=namespace, compression=compression) for p, sp in zip(prompts, plist)]
        self.run_until_done(seqs)
        return [RequestOutput.from_seq(s) for s in seqs]

    # ---- sessions ------------------------------------------------------------
    def isolated_namespace(self, tag: str = "") -> Namespace:
        """A fresh namespace that shares no cached blocks with any other (recompute baselines, tests)."""
        import uuid

        return Namespace(self.namespace.model_revision, tenant_salt=f"isolated-{tag}-{uuid.uuid4().hex}",
                         kv_dtype=self.namespace.kv_dtype)

    def new_session(self, system: str | None = None, session_id: str | None = None, **kw):
        """Open a :class:`~kvkeeper.sessions.session.Session`; raises OverloadedError while a breaker is degraded."""
        from ..sessions.session import Session

        if self.breaker is not None:
            self.breaker.check_new_session(session_id or "")

        return Session(self, system=system, session_id=session_id, **kw)

    def list_sessions(self) -> list[dict]:
        return [s.info() for s in self.sessions.values()]

    def close_session(self, session_id: str) -> None:
        from ..errors import SessionNotFoundError

        s = self.sessions.get(session_id)
        if s is None:
            raise SessionNotFoundError(f"no open session {session_id!r}; open ones: {sorted(self.sessions)}")
        s.close()

    def _reclaim_from_sessions(self, n_blocks: int) -> int:
        """Release idle sessions' blocks, least recently used first; returns the block references dropped.

        A session's KV goes to the host offload tier when that tier has a budget (it comes back on
        the session's next turn); otherwise, or when that fails, the session is unpinned (its full
        blocks stay in the prefix cache until evicted).
        """
        freed = self.offload_idle_sessions(n_blocks, tier="host") if self.offload_store.host_budget > 0 else 0
        for s in sorted(self.sessions.values(), key=lambda s: s.last_used):
            if freed >= n_blocks:
                break
            freed += s.unpin()  # what the host tier could not take (busy, compressed or failed)
        return freed

    def kv_owners(self):
        """Yield (owner name, sequence) for everything that holds KV blocks.

        Running and waiting requests, finished requests whose blocks wait for their
        session (``detached``) and sessions' pinned states (``session:<id>``).
        """
        sched = self.scheduler
        live = list(sched.running) + list(sched.waiting)
        for seq in live:
            yield seq.request_id, seq
        for seq in list(self.detached.values()):
            yield f"detached:{seq.request_id}", seq
        for sid, s in self.sessions.items():
            st = getattr(s, "_state", None)
            if st is not None and st.block_table and not any(st is q for q in live):
                yield f"session:{sid}", st

    @torch.inference_mode()
    def compact(self) -> dict:
        """Evict unreferenced cached blocks and defragment the pool (the circuit breaker's first tier).

        Owned blocks are renumbered to ids ``0..k-1``, each owner's table contiguous in
        table order; their K/V move with them (raw copy, every layer) and every block
        table is rewritten.  Call between steps only.  Returns
        ``{"evicted": cached blocks dropped, "moved": blocks whose id changed}``.
        """
        evicted = self.pool.evict_cached()
        tables: list[list[int]] = []
        seen_tables: set[int] = set()
        order: list[int] = []
        seen: set[int] = set()
        for _, seq in self.kv_owners():
            if id(seq.block_table) in seen_tables:
                continue
            seen_tables.add(id(seq.block_table))
            tables.append(seq.block_table)
            for b in seq.block_table:
                if b not in seen:
                    seen.add(b)
                    order.append(b)
        mapping = self.pool.defragment(order)
        moved = [(o, n) for o, n in mapping.items() if o != n and n < len(order)]
        if moved:
            src = torch.tensor([o for o, _ in moved], dtype=torch.int64, device=self.runner.device)
            dst = torch.tensor([n for _, n in moved], dtype=torch.int64, device=self.runner.device)
            for cache in self.runner.kv_caches:
                cache.move_blocks(src, dst)
        for t in tables:
            t[:] = [mapping[b] for b in t]
        return {"evicted": evicted, "moved": len(moved)}

    def offloaded_blocks(self) -> int:
        """Blocks' worth of session KV held outside the pool (host memory and disk tiers)."""
        return self.offload_store.num_blocks()

    def offload_idle_sessions(self, n_blocks: int, tier: str = "host") -> int:
        """Offload idle sessions, least recently used first, until ``n_blocks`` pool blocks are released.

        tier: "host" (host memory; over its budget the oldest move on to disk) or "disk".
        Returns the blocks released (may be fewer when not enough idle sessions pin KV).  Sessions
        with a request in flight or compressed KV are skipped.  Raises :class:`InvalidRequestError`
        for an unknown or disabled tier.
        """
        store = self.offload_store
        store._check_tier(tier)
        freed = 0
        for s in sorted(self.sessions.values(), key=lambda s: s.last_used):
            if freed >= n_blocks:
                break
            if store.is_idle(s):
                try:
                    freed += store.offload(s, tier)
                except KVKeeperError as e:  # a failed disk write: that session keeps its KV in the pool
                    log.warning("could not offload session %s: %s", s.id, e)
        return freed

    def pool_stats(self):
        """Block states and fragmentation figures now (a :class:`kvkeeper.kvcache.telemetry.PoolStats`)."""
        from ..kvcache.telemetry import pool_stats

        return pool_stats(self.pool, self.kv_owners(), self.offloaded_blocks())

    def stats(self) -> dict:
        return {
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_used": self.pool.num_used,
            "kv_blocks_cached": self.pool.num_cached,
            "kv_usage": self.pool.usage(),
            "prefix_query_tokens": self.kv.query_tokens,
            "prefix_hit_tokens": self.kv.hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "sessions": len(self.sessions),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "weight_format": self.runner.weight_format,
            "offload": self.offload_store.stats(),
            **self.auditor.stats(),
        }


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N" -> a torch.device.

    Raises :class:`InvalidRequestError` for CUDA on a machine without a usable CUDA device.
    """
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidRequestError(f"unknown device {device!r}: {e}; choose auto, cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError(f"device {device!r} requested but torch sees no CUDA device "
                                  f"(torch {torch.__version__}); use --device cpu or a CUDA build of torch")
    if dev.type not in ("cpu", "cuda"):
        raise InvalidRequestError(f"device {device!r} is not supported; choose auto, cpu or cuda")
    return dev
