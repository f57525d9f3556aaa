"""The engine: model + paged KV cache + scheduler + sampler + output processor, stepped in one process.

Typical use::

    from kvkeeper import LLMEngine, SamplingParams, SessionManager
    eng = LLMEngine()                      # embedded SmolLM2-135M-Instruct, fp32, CPU
    out = eng.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0]
    s = SessionManager(eng).open()         # multi-turn with KV reuse across turns (kvkeeper.sessions)
    r = s.send("Hi!")                      # r.cached_tokens, r.ttft_s, r.decode_tok_per_s

The engine knows nothing of sessions, audits or servers.  What holds KV outside its requests
(a session manager) registers as a *KV holder* (:meth:`LLMEngine.add_kv_holder`): the engine asks
holders to release blocks under pressure and lists their blocks for the validators and telemetry.
Hooks run before each step (``step_hooks``, e.g. a circuit breaker) and at each request's first
token (``first_token_hooks``, e.g. the reuse audit).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import uuid
from typing import Callable, Iterable, Iterator, Protocol

import torch

from ..errors import ContextLengthError, InvalidRequestError
from ..kvcache.block_pool import BlockPool
from ..kvcache.compression import KVCompression, PrefillObserver
from ..kvcache.manager import KVCacheManager
from ..kvcache.namespace import Namespace
from ..kvcache.quant import parse_kv_format
from ..kvcache.surgery import compact, compress_prompt
from ..kvcache.telemetry import pool_stats
from ..kvcache.validate import assert_engine_ok
from ..weights.loader import load_weights
from ..weights.formats import may_map_gguf, weight_format_for
from ..weights.sources import resolve_model_path
from ..worker.runner import ModelRunner, parse_dtype
from ..sampling.processors import build_processors
from ..sampling.sampler import NO_TOKEN, make_generator, prompt_logprob_entries, sample
from ..sampling.structured import GrammarCompiler, GrammarMask
from ..text.tokenizer import load_tokenizer
from ..text.tool_format import prepare_messages, template_has_tools, template_reads_names
from .config import EngineConfig
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from ..sampling.params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence

log = logging.getLogger(__name__)

__all__ = ["LLMEngine", "EngineConfig", "KVHolder", "RequestOutput", "resolve_device"]


class KVHolder(Protocol):
    """Something that holds KV blocks between requests (``kvkeeper.sessions.SessionManager``)."""

    def kv_owners(self) -> Iterable[tuple[str, Sequence]]:
        """(owner name, sequence) for every block table it holds."""

    def reclaim(self, n_blocks: int) -> int:
        """Release about ``n_blocks`` pool blocks (offload or unpin idle state); returns how many it released."""

    def offloaded_blocks(self) -> int:
        """Blocks' worth of KV it keeps outside the pool (host memory, disk)."""


class LLMEngine:
    """Paged-KV inference engine on one device.

    ``LLMEngine(model=None, **settings)`` or ``LLMEngine(EngineConfig(...), **overrides)``; the settings
    are the fields of :class:`~kvkeeper.engine.config.EngineConfig`.  Attributes: ``config`` (that
    EngineConfig), ``model_config`` (the model's shapes), ``tokenizer``, ``runner``, ``pool``, ``kv``,
    ``scheduler``, ``namespace`` (the default cache namespace), ``context_length`` (tokens).
    Raises ModelNotFoundError / ModelFormatError / UnsupportedArchitectureError while loading and
    InvalidRequestError for bad settings.
    """

    def __init__(self, model: str | EngineConfig | None = None, **settings):
        if isinstance(model, EngineConfig):
            cfg = dataclasses.replace(model, **settings)
        else:
            cfg = EngineConfig(**({"model": model} if model is not None else {}), **settings)
        self.config = cfg
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        device = resolve_device(cfg.device)
        torch_dtype = parse_dtype(cfg.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
        self.model_name = cfg.model
        mcfg, state = self._load(cfg, torch_dtype, device)
        self.model_config = mcfg
        try:
            weights = weight_format_for(state, cfg.quantization, device, torch_dtype)
            # quantized weights (the fast path) keep KV in bf16 by default, as llama.cpp keeps f16; the exact
            # float32 path keeps it in its dtype
            kv_format = parse_kv_format(cfg.kv_dtype if cfg.kv_dtype is not None else
                                        ("bf16" if weights != "none" else torch_dtype))
        except ValueError as e:  # an unknown KV dtype, or a weight format this file cannot run
            raise InvalidRequestError(str(e)) from None
        num_blocks, window_blocks = self._kv_blocks(kv_format, mcfg)
        self.block_size = cfg.block_size
        try:
            self.runner = ModelRunner(mcfg, state, num_blocks, cfg.block_size, dtype=torch_dtype, device=device,
                                      kv_dtype=kv_format, attention_backend=cfg.attention_backend,
                                      quantization=weights, fused_decode=cfg.fused_decode,
                                      cache_dir=cfg.cache_dir, window_blocks=window_blocks)
        except ValueError as e:  # unknown or unavailable attention backend
            raise InvalidRequestError(str(e)) from None
        del state
        self.pool = BlockPool(num_blocks, cfg.block_size, cfg.enable_prefix_caching, window_blocks)
        self.kv = KVCacheManager(self.pool, mcfg.sliding_window if window_blocks else None)
        self.runner.window_of = self.pool.window_id if window_blocks else None
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.enable_chunked_prefill,
                                   reclaim=self.reclaim)
        self.context_length = min(mcfg.context_length, cfg.max_model_len or mcfg.context_length)
        self.namespace = Namespace(mcfg.revision, kv_dtype=kv_format.name)
        eos = set(mcfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = eos
        self.processor = OutputProcessor(self.tokenizer, eos)
        eos_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else min(eos, default=None)
        self.grammars = GrammarCompiler(self.tokenizer, mcfg.vocab_size,  # structured outputs
                                        None if eos_id is None else int(eos_id))
        self._req_ids = itertools.count()
        self.loras: dict = {}  # name -> kvkeeper.layers.lora.LoRAAdapter (load_lora / unload_lora)
        self._seqs: dict[str, Sequence] = {}
        self.holders: list[KVHolder] = []
        self.num_steps = 0
        self.step_hooks: list[Callable[[], object]] = []  # before each step (a circuit breaker's evaluate)
        self.first_token_hooks: list[Callable[[Sequence, torch.Tensor], None]] = []  # (seq, (vocab,) logits)
        self.capture_first_logits = False  # tests: keep each request's first-token logits in seq.first_logits
        self.validate_every = cfg.validate_every  # KV integrity validators every N steps (0: never)
        if cfg.cuda_graphs:  # decode-step CUDA graphs (a no-op on CPU; see kvkeeper.worker.cuda_graphs)
            self.runner.capture_cuda_graphs(cfg.max_num_seqs, self.context_length)

    def _load(self, cfg: EngineConfig, dtype: torch.dtype, device: torch.device):
        """(model config, state dict); sets ``model_path`` and ``tokenizer``."""
        if cfg.load_format == "dummy":  # random weights of a config's shapes (kvkeeper.weights.dummy), made on the device
            from ..weights import dummy

            mcfg, self.model_path = dummy.load_config(cfg.model)
            self.tokenizer = dummy.load_dummy_tokenizer(self.model_path, mcfg.vocab_size)
            return mcfg, dummy.dummy_state(mcfg, dtype, device, seed=cfg.seed)
        self.model_path = resolve_model_path(cfg.model, cfg.cache_dir)
        mcfg, state = load_weights(self.model_path, cfg.cache_dir, in_place=may_map_gguf(cfg.quantization))
        self.tokenizer = load_tokenizer(self.model_path, cfg.cache_dir)
        return mcfg, state

    def _kv_blocks(self, kv_format, mcfg) -> tuple[int, int | None]:
        """(blocks, window blocks or None).  A hybrid cache (sliding-window layers, ``hybrid_kv_cache``) gives
        the sliding layers enough window blocks for every running sequence's window plus a prefill chunk, but
        at most half the byte budget (and no more than there are blocks); the full layers get the rest."""
        cfg = self.config
        if not (cfg.hybrid_kv_cache and mcfg.is_hybrid):
            return cfg.num_kv_blocks or self._blocks_for_budget(kv_format, mcfg), None
        bs = cfg.block_size
        parts, heads, dim = mcfg.kv_layout
        layer_block = kv_format.bytes_per_token(1, heads, dim, parts) * bs
        n_slide = sum(mcfg.is_sliding_layer(i) for i in range(mcfg.num_layers))
        n_full = mcfg.num_layers - n_slide
        want = cfg.max_num_seqs * (-(-(mcfg.sliding_window + cfg.max_num_batched_tokens) // bs) + 1)
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks, max(1, min(want, cfg.num_kv_blocks))
        budget = cfg.kv_budget_bytes
        window_blocks = max(1, min(want, budget // 2 // (n_slide * layer_block)))
        blocks = (budget - window_blocks * n_slide * layer_block) // (n_full * layer_block)
        if blocks < 1:
            raise InvalidRequestError(f"kv_cache_bytes={budget} is too small for a hybrid KV cache "
                                      f"({window_blocks} window blocks leave no room for one block)")
        return blocks, min(window_blocks, blocks)

    def require_uniform_kv(self, what: str) -> None:
        """Raise InvalidRequestError when ``what`` (an operation that reads or moves every layer's KV by block
        id) meets a hybrid KV cache, whose sliding layers keep their KV in window blocks."""
        if self.runner.window_blocks:
            raise InvalidRequestError(f"{what} is not supported with the hybrid KV cache of a sliding-window model "
                                      "(its sliding layers keep KV per window); start the engine with "
                                      "--no-hybrid-kv-cache (hybrid_kv_cache=False) to use it")

    def _blocks_for_budget(self, kv_format, mcfg) -> int:
        budget = self.config.kv_budget_bytes
        parts, heads, dim = mcfg.kv_layout
        per_block = kv_format.bytes_per_token(mcfg.num_layers, heads, dim, parts) * self.config.block_size
        if budget < per_block:
            raise InvalidRequestError(f"kv_cache_bytes={budget} is smaller than one block ({per_block} bytes)")
        return budget // per_block

    @property
    def kv_bytes_per_token(self) -> int:
        return self.runner.kv_bytes_per_token

    # ---- prompts -------------------------------------------------------------
    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **chat) -> list[int]:
        """Token ids of a conversation, exactly as the model's chat template renders it (``chat``: the
        other keyword arguments of :meth:`render_chat`)."""
        if not messages:
            raise InvalidRequestError("the conversation is empty: give at least one message")
        text = self.render_chat(messages, add_generation_prompt, **chat)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list[dict] | None = None) -> str:
        """The chat template's text of ``messages`` (dicts with ``role`` and ``content``; an assistant's
        may carry OpenAI ``tool_calls``, a ``tool`` message answers them).

        continue_final_message: end the text inside the last message (no end-of-turn marker after it),
        for the model to continue it (transformers' and vLLM's option; not with add_generation_prompt).
        tools: OpenAI tool definitions, rendered as the template does or, when it has no tool syntax,
        in the documented system-prompt format (:mod:`kvkeeper.text.tool_format`).
        Raises :class:`InvalidRequestError` for a malformed message or one the template rejects.
        """
        template = self.tokenizer.chat_template
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InvalidRequestError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
            if m.get("name") is not None and not template_reads_names(template):
                raise InvalidRequestError(f"messages[{i}].name: the model's chat template has no participant "
                                          "names; put the name in the content", param=f"messages.{i}.name")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message continues the last message: it needs "
                                      "add_generation_prompt=false", param="continue_final_message")
        msgs, extra = prepare_messages(messages, tools, template_has_tools(template))
        if continue_final_message:
            extra["continue_final_message"] = True
        try:
            return self.tokenizer.apply_chat_template(msgs, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **extra)
        except Exception as e:  # jinja2.TemplateError: the template rejects this conversation (raise_exception)
            if type(e).__module__.startswith("jinja2"):
                raise InvalidRequestError(f"the model's chat template rejected the conversation: {e}") from e
            if continue_final_message and isinstance(e, ValueError):  # no final message text to continue
                raise InvalidRequestError(f"continue_final_message: {e}", param="continue_final_message") from e
            raise

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty: give at least one token of text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("the prompt is empty: give at least one token", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary "
                                      f"(0..{self.model_config.vocab_size - 1})", param="prompt")
        return ids

    # ---- requests ----------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    namespace: Namespace | None = None, compression: KVCompression | None = None, *,
                    strict_max_tokens: bool = False, max_new_tokens: int | None = None,
                    lora: str | None = None) -> Sequence:
        """Queue a request; returns its :class:`Sequence` (until the next :meth:`step` a caller may give it
        KV it holds, as a session's turn does).

        compression: drop prompt tokens from the KV cache at the end of prefill
        (see :mod:`kvkeeper.kvcache.compression`); None keeps everything.
        lora: the name of a loaded LoRA adapter (:meth:`load_lora`) to run the request under; a namespace
        whose ``adapter`` is a loaded adapter's id selects it too (:meth:`lora_namespace`).
        ``max_tokens`` beyond the context window is cut to fit, unless ``strict_max_tokens`` (the
        server's rule: refuse).  max_new_tokens: an operator's cap on generated tokens.
        Raises :class:`InvalidRequestError` for an empty prompt, a token outside the vocabulary, a request
        id in use or an adapter that is not loaded, and :class:`ContextLengthError` when the prompt leaves
        no room for a token.
        """
        params = params or SamplingParams()
        ids = self._prompt_ids(prompt)
        ctx = self.context_length
        if len(ids) >= ctx:
            raise ContextLengthError(len(ids), ctx)
        if strict_max_tokens and params.max_tokens is not None and len(ids) + params.max_tokens > ctx:
            raise ContextLengthError(len(ids), ctx, params.max_tokens)
        request_id = request_id or f"req-{next(self._req_ids)}"
        if request_id in self._seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if compression is not None and self.model_config.layer_types:
            raise InvalidRequestError("KV compression is not supported for sliding-window models (Gemma 3): their "
                                      "layers keep different token ranges; send the request without compression")
        if compression is not None and self.model_config.is_mla:
            raise InvalidRequestError("KV compression is not supported for Multi-head Latent Attention (DeepSeek) "
                                      "models: their cache holds one shared latent row per token, not per-head keys")
        namespace, adapter = self._adapter_of(namespace or self.namespace, lora)
        seq = Sequence(request_id, ids, params, namespace)
        seq.lora = adapter
        seq.compression = compression
        new = min(x for x in (ctx - len(ids), params.max_tokens, max_new_tokens) if x is not None)
        seq.max_total_tokens = len(ids) + new
        seq.generator = make_generator(params)
        seq.processors = self._processors(params, ids)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * len(ids)
        self.processor.start(seq)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    # ---- LoRA adapters ----------------------------------------------------------
    def load_lora(self, name: str, path, replace: bool = False):
        """Load a PEFT LoRA adapter directory under ``name`` (see :mod:`kvkeeper.layers.lora`); returns its
        :class:`~kvkeeper.layers.lora.LoRAAdapter`.  Call between steps (the server runs it on the engine thread).

        replace: a loaded adapter of that name is replaced (requests running under it finish with the old
        weights; its KV is never reused under the new one: the namespace holds the content hash).  Raises
        :class:`InvalidRequestError` for a name already loaded (without ``replace``), the base model's own
        name, or an adapter that cannot be read or does not fit this model.
        """
        from ..layers.lora import load_adapter

        if name in self.loras and not replace:
            raise InvalidRequestError(f"the LoRA adapter {name!r} has already been loaded; unload it first",
                                      param="lora_name")
        if name == self.model_name:
            raise InvalidRequestError(f"{name!r} is the base model's name; give the adapter another name",
                                      param="lora_name")
        adapter = load_adapter(name, path, self.model_config, self.runner.device, self.runner.dtype)
        self.runner.enable_lora()
        self.loras[name] = adapter
        return adapter

    def unload_lora(self, name: str) -> None:
        """Forget the adapter ``name`` (requests running under it finish with it); its cached KV blocks stay
        in the prefix cache's LRU under their own namespace until evicted.  Raises InvalidRequestError
        when no adapter of that name is loaded."""
        if self.loras.pop(name, None) is None:
            raise InvalidRequestError(f"the LoRA adapter {name!r} cannot be found", param="lora_name")

    def lora_namespace(self, name: str, base: Namespace | None = None) -> Namespace:
        """``base`` (default: the engine's namespace) under the loaded adapter ``name``; raises
        InvalidRequestError naming it when it is not loaded."""
        if name not in self.loras:
            raise InvalidRequestError(f"the LoRA adapter {name!r} is not loaded (loaded: "
                                      f"{', '.join(sorted(self.loras)) or 'none'})", param="model")
        return dataclasses.replace(base or self.namespace, adapter=self.loras[name].id)

    def _adapter_of(self, namespace: Namespace, lora: str | None):
        """(namespace, adapter or None) of a request: ``lora`` names an adapter, or the namespace's
        ``adapter`` is a loaded adapter's id."""
        if lora is not None:
            wanted = self.lora_namespace(lora, namespace)
            if namespace.adapter and namespace.adapter != wanted.adapter:
                raise InvalidRequestError(f"lora={lora!r} conflicts with the namespace's adapter "
                                          f"{namespace.adapter!r}", param="lora")
            namespace = wanted
        if not namespace.adapter:
            return namespace, None
        for a in self.loras.values():
            if a.id == namespace.adapter:
                return namespace, a
        raise InvalidRequestError(f"the LoRA adapter {namespace.adapter!r} is not loaded (unloaded or replaced)",
                                  param="model")

    def _processors(self, params: SamplingParams, prompt_ids: list[int]):
        """The request's logits processors (None without any); checks token ids against the vocabulary.

        Raises :class:`InvalidRequestError` naming the field for a token id outside the vocabulary and
        for a grammar that cannot be compiled.
        """
        vocab = self.model_config.vocab_size
        for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"{name}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                                          param=name)
        words = [self._word_ids(w) for w in params.bad_words]
        grammar = None
        if params.structured is not None:
            matcher = self.grammars.matcher(params.structured)  # compiled now: errors reach the caller
            grammar = lambda: GrammarMask(matcher, self.grammars.eos_token_id)  # noqa: E731
        return build_processors(params, prompt_ids, vocab, [w for ws in words for w in ws], grammar)

    def _word_ids(self, word: str) -> list[list[int]]:
        """vLLM's spellings of a bad word: its tokens alone and after a space (when they differ)."""
        tok = self.tokenizer
        alone = tok.encode(word.strip(), add_special_tokens=False)
        spaced = tok.encode(" " + word.strip(), add_special_tokens=False)
        return [alone] if spaced == alone else [alone, spaced]

    def has_request(self, request_id: str) -> bool:
        """Whether a request of this id is queued or running."""
        return request_id in self._seqs

    def abort(self, request_id: str) -> None:
        """Finish a running or waiting request now (``finish_reason`` "abort"); unknown ids are ignored."""
        seq = self._seqs.get(request_id)
        if seq is not None and not seq.finished:
            seq.finish_reason = "abort"
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        seq.t_finished = time.perf_counter()
        self.scheduler.finish(seq)
        self._seqs.pop(seq.request_id, None)
        if seq.kv_keeper is not None:
            seq.kv_keeper(seq)  # a session takes the blocks over
        else:
            self.kv.free(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ----------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Schedule, run the model once, sample; returns the sequences that finished in this step."""
        for hook in self.step_hooks:
            hook()
        if self.validate_every and self.num_steps % self.validate_every == 0:
            assert_engine_ok(self)
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
                                               self.model_config.num_layers, self.model_config.num_kv_heads)
        logits, seqs = self._execute(out.scheduled)
        for seq, n in out.scheduled:
            seq.num_computed += n
            self.kv.commit(seq)
        if logits is not None:
            finished += self._take_samples(logits, seqs)
        for seq, _ in out.scheduled:
            obs = seq.observer
            if obs is not None and not seq.finished and seq.num_computed - seq.kv_offset >= obs.length:
                compress_prompt(seq, self.pool, self.runner.kv_caches, self.reclaim)
        return finished

    def _execute(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Run the model on a step's batch: (logits of the sequences that need a token, those sequences).

        When a sequence asked for prompt logprobs and this step computes some of its prompt, the
        logits of every such prompt position are computed as well and recorded (its prompt is computed
        whole: see ``Sequence.computes_whole_prompt``); otherwise this is ``runner.execute``.
        """
        if not any(s.prompt_logprobs is not None and s.num_computed < s.num_prompt_tokens - 1 for s, _ in scheduled):
            return self.runner.execute(scheduled)
        r = self.runner
        with torch.inference_mode(), r.lora_scope(scheduled):
            input_ids, positions, meta, rows, seqs = r.build_batch(scheduled)
            hidden = r.model(input_ids, positions, r.kv_caches, meta)
            start = 0
            for seq, n in scheduled:
                c = seq.num_computed
                end = min(c + n, seq.num_prompt_tokens - 1)  # position p predicts prompt token p + 1
                if seq.prompt_logprobs is not None and c < end:
                    logits = r.model.compute_logits(hidden[start: start + end - c])
                    entries = prompt_logprob_entries(logits, seq.token_ids[c + 1: end + 1], seq.params.prompt_logprobs)
                    seq.prompt_logprobs[c + 1: end + 1] = entries
                start += n
            if not rows:
                return None, []
            return r.model.compute_logits(hidden.index_select(0, torch.tensor(rows, device=hidden.device))), seqs

    def _take_samples(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[Sequence]:
        """Sample one token per sequence, run the first-token hooks, post-process; returns the finished ones."""
        ids, logps = sample(logits, [s.params for s in seqs], [s.generator for s in seqs],
                            [s.processors for s in seqs])
        for row, seq in enumerate(seqs):
            if seq.t_first_token is None:  # its prompt KV is complete: hooks see it before anything is freed
                if self.capture_first_logits:
                    seq.first_logits = logits[row].cpu().clone()
                for hook in self.first_token_hooks:
                    hook(seq, logits[row])
        blocked = [s for s, t in zip(seqs, ids) if t == NO_TOKEN]
        for seq in blocked:  # its constraints exclude every token: it ends with an error, the batch goes on
            seq.finish_reason = "error"
            seq.error = ("no token is allowed at this point: the output constraint (grammar), bad_words and "
                         "logit_bias together exclude every token; relax one of them")
            self._finish(seq)
        if blocked:
            kept = [(s, t, lp) for s, t, lp in zip(seqs, ids, logps) if t != NO_TOKEN]
            seqs, ids, logps = [k[0] for k in kept], [k[1] for k in kept], [k[2] for k in kept]
        done = self.processor.process(seqs, ids, logps)
        for seq in done:
            self._finish(seq)
        return blocked + done

    def run_until_done(self, seqs: list[Sequence]) -> None:
        while any(not s.finished for s in seqs):
            self.step()

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 namespace: Namespace | None = None, compression: KVCompression | None = None,
                 lora: str | list[str | None] | None = None) -> list[RequestOutput]:
        """Run prompts to completion (batched together); returns one :class:`RequestOutput` each, in order.

        compression: applied to every prompt's KV at the end of its prefill (None: keep everything).
        lora: a loaded adapter's name for every prompt, or one name (or None: the base model) per prompt.
        """
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        llist = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(llist) != len(prompts):
            raise InvalidRequestError(f"lora: {len(llist)} adapter names for {len(prompts)} prompts", param="lora")
        seqs = [self.add_request(p, sp, namespace=namespace, compression=compression, lora=a)
                for p, sp, a in zip(prompts, plist, llist)]
        self.run_until_done(seqs)
        return [RequestOutput.from_seq(s) for s in seqs]

    def isolated_namespace(self, tag: str = "", base: Namespace | None = None) -> Namespace:
        """A fresh namespace that shares no cached blocks with any other (recompute baselines, tests); it
        keeps ``base``'s adapter (None: no adapter)."""
        return Namespace(self.namespace.model_revision, adapter=base.adapter if base is not None else "",
                         tenant_salt=f"isolated-{tag}-{uuid.uuid4().hex}", kv_dtype=self.namespace.kv_dtype)

    # ---- KV held outside requests --------------------------------------------
    def add_kv_holder(self, holder: KVHolder) -> None:
        """Register something that holds KV between requests (a session manager)."""
        self.holders.append(holder)

    def reclaim(self, n_blocks: int) -> int:
        """Ask the KV holders to release about ``n_blocks`` pool blocks; returns how many they released."""
        freed = 0
        for h in self.holders:
            if freed >= n_blocks:
                break
            freed += h.reclaim(n_blocks - freed)
        return freed

    def kv_owners(self) -> Iterator[tuple[str, Sequence]]:
        """Yield (owner name, sequence) for everything that holds KV blocks: running and waiting
        requests (by request id), then each holder's (``session:<id>``)."""
        sched = self.scheduler
        for seq in list(sched.running) + list(sched.waiting):
            yield seq.request_id, seq
        for h in self.holders:
            yield from h.kv_owners()

    def offloaded_blocks(self) -> int:
        """Blocks' worth of KV the holders keep outside the pool (host memory and disk tiers)."""
        return sum(h.offloaded_blocks() for h in self.holders)

    def compact(self, evict_cache: bool = False) -> dict:
        """Defragment the pool, keeping the prefix cache (see :func:`kvkeeper.kvcache.surgery.compact`).

        evict_cache: drop the unreferenced cached blocks first.  Call between steps only.
        Returns ``{"evicted": cached blocks dropped, "moved": blocks whose id changed}``.
        """
        self.require_uniform_kv("defragmenting the KV pool (compact)")
        return compact(self.pool, (seq.block_table for _, seq in self.kv_owners()), self.runner.kv_caches,
                       self.runner.device, evict_cache)

    def pool_stats(self):
        """Block states and fragmentation figures now (a :class:`kvkeeper.kvcache.telemetry.PoolStats`)."""
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
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_cache_bytes": self.runner.kv_cache_bytes,
            "kv_window_blocks_total": self.pool.window_blocks or 0,
            "kv_window_blocks_free": self.pool.num_window_free,
            "weight_format": self.runner.weight_format,
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
