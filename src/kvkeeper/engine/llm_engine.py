"""The engine: requests in, one model step at a time over the paged KV cache, tokens out::

    eng = LLMEngine()                      # embedded SmolLM2-135M-Instruct, fp32, CPU
    out = eng.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0]

Its parts: ``inputs`` (:mod:`kvkeeper.engine.input_processor`: rendering and checks), ``adapters``
(:mod:`kvkeeper.engine.adapters`: LoRA), ``runner`` (:mod:`kvkeeper.worker.runner`), ``pool`` / ``kv`` (sized by
:mod:`kvkeeper.kvcache.sizing`), ``scheduler``, ``processor`` (:mod:`kvkeeper.engine.output_processor`).  It knows
nothing of sessions, audits or servers: what holds KV between requests registers as a *KV holder*
(:mod:`kvkeeper.engine.kv_holders`; the methods it calls are :mod:`kvkeeper.engine.kv_access`'s); ``step_hooks``
run before each step (a circuit breaker), ``first_token_hooks`` at each request's first token (the reuse audit).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from typing import Callable

import torch

from ..errors import InvalidRequestError
from ..kvcache.block_pool import BlockPool
from ..kvcache.compression import KVCompression, PrefillObserver
from ..kvcache.manager import KVCacheManager
from ..kvcache.namespace import Namespace
from ..kvcache.surgery import compress_prompt
from ..kvcache.validate import assert_engine_ok
from ..weights.formats import may_map_gguf
from ..weights.loader import load_model
from ..weights.sources import resolve_model_path
from ..worker.runner import ModelRunner, parse_dtype
from ..sampling.sampler import TokenMask, prompt_logprob_entries, sample
from ..text.multimodal import multimodal_token_ids
from .adapters import AdapterRegistry
from .config import EngineConfig, resolve_device
from .cpu_threads import choose_threads
from .input_processor import InputProcessor
from .kv_access import EngineKV
from .kv_events import start_kv_events
from .kv_holders import KVHolder, KVHolders
from .memory_fit import check_memory_fit
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from ..sampling.params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence
from .speculative import Drafter, verify

__all__ = ["LLMEngine", "EngineConfig", "KVHolder", "RequestOutput", "resolve_device"]


class LLMEngine(EngineKV):
    """Paged-KV inference engine on one device: ``LLMEngine(model=None, **settings)`` or
    ``LLMEngine(EngineConfig(...), **overrides)`` (the fields of :class:`~kvkeeper.engine.config.EngineConfig`).

    Attributes: ``config``, ``model_config`` (the model's shapes), ``tokenizer``, the parts above, ``loras``
    (name -> loaded adapter), ``namespace`` (the default cache namespace), ``context_length`` (tokens),
    ``kv_events`` (the KV event publisher of ``kv_events_config``, :mod:`kvkeeper.engine.kv_events`; None when off).
    Raises ModelNotFoundError / ModelFormatError / UnsupportedArchitectureError while loading and
    InvalidRequestError for bad settings.
    """

    def __init__(self, model: str | EngineConfig | None = None, **settings):
        cfg = self.config = EngineConfig.of(model, **settings)
        threads = choose_threads(cfg.num_threads, torch.get_num_threads())
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        device = resolve_device(cfg.device)
        torch_dtype = parse_dtype(cfg.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
        self.model_name = cfg.model
        path = None if cfg.load_format == "dummy" else resolve_model_path(cfg.model, cfg.cache_dir)
        self.memory_estimate = check_memory_fit(cfg, path, device, torch_dtype)  # before any large allocation
        mcfg, state, self.tokenizer, self.model_path = load_model(str(path or cfg.model), cfg.load_format, cfg.cache_dir,
                                                                  torch_dtype, device, cfg.seed,
                                                                  in_place=may_map_gguf(cfg.quantization))
        self.model_config = mcfg
        try:
            self.runner = ModelRunner(mcfg, state, **cfg.runner_args(mcfg, state, device, torch_dtype))
        except ValueError as e:  # a format or attention backend the model cannot run
            raise InvalidRequestError(str(e)) from None
        del state
        self.block_size = cfg.block_size
        self._make_parts(cfg, mcfg)
        # KV events (--kv-events-config): the pool reports to a recorder, a ZMQ publisher sends them; None when off
        self.kv_events = start_kv_events(self.pool, cfg.kv_events_config, "GPU" if device.type == "cuda" else "CPU")
        self._req_ids = itertools.count()
        self._seqs: dict[str, Sequence] = {}
        self.holders = KVHolders()  # what holds KV between requests (kvkeeper.engine.kv_holders)
        self.num_steps = 0
        self.step_hooks: list[Callable[[], object]] = []  # before each step (a circuit breaker's evaluate)
        self.first_token_hooks: list[Callable[[Sequence, torch.Tensor], None]] = []  # (seq, (vocab,) logits)
        self.capture_first_logits = False  # tests: keep each request's first-token logits in seq.first_logits
        self.validate_every = cfg.validate_every  # KV integrity validators every N steps (0: never)
        if cfg.cuda_graphs:  # decode-step CUDA graphs (a no-op on CPU; see kvkeeper.worker.cuda_graphs)
            self.runner.capture_cuda_graphs(cfg.max_num_seqs, self.context_length)

    def _make_parts(self, cfg: EngineConfig, mcfg) -> None:
        """Block pool, KV manager, scheduler, namespace, input and output processors, LoRA registry."""
        window_blocks = self.runner.window_blocks
        self.pool = BlockPool(self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching, window_blocks)
        self.kv = KVCacheManager(self.pool, mcfg.sliding_window if window_blocks else None)
        self.runner.window_of = self.pool.window_id if window_blocks else None
        # speculative decoding: n-gram drafts (cfg.speculative_config) and requests' predictions, verified in the step
        self.drafter = Drafter(cfg.speculative_config)
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.enable_chunked_prefill,
                                   reclaim=self.reclaim, drafter=self.drafter.propose)
        self.context_length = min(mcfg.context_length, cfg.max_model_len or mcfg.context_length)
        self.namespace = Namespace(mcfg.revision, kv_dtype=self.runner.kv_format.name)
        self.adapters = AdapterRegistry(self.model_name, self.runner)
        self.loras = self.adapters.loaded  # name -> kvkeeper.layers.lora.LoRAAdapter (load_lora / unload_lora)
        self.inputs = InputProcessor(self.tokenizer, mcfg, self.context_length, self.adapters,
                                     cfg.control_tokens_in_content)
        self.eos_token_ids, self.grammars = self.inputs.eos_token_ids, self.inputs.grammars  # (structured outputs)
        self.processor = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.text_mask = TokenMask(multimodal_token_ids(self.tokenizer, mcfg.vocab_size))  # never sampled for text

    # ---- prompts and requests ------------------------------------------------
    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **chat) -> list[int]:
        """Token ids of a conversation as the chat template renders it (:meth:`InputProcessor.encode_chat`)."""
        return self.inputs.encode_chat(messages, add_generation_prompt, **chat)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **chat) -> str:
        """The chat template's text of ``messages`` (:meth:`InputProcessor.render_chat`)."""
        return self.inputs.render_chat(messages, add_generation_prompt, **chat)

    def render_prompt(self, messages: list[dict], add_generation_prompt: bool = True, **chat):
        """The chat template's text of ``messages`` with its contents' spans (:meth:`InputProcessor.render_prompt`)."""
        return self.inputs.render_prompt(messages, add_generation_prompt, **chat)

    def encode_rendered(self, rendered, start: int = 0) -> list[int]:
        """Token ids of a rendered conversation from ``start`` (:meth:`InputProcessor.encode_rendered`)."""
        return self.inputs.encode_rendered(rendered, start)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    namespace: Namespace | None = None, compression: KVCompression | None = None, *,
                    strict_max_tokens: bool = False, max_new_tokens: int | None = None,
                    lora: str | None = None) -> Sequence:
        """Queue a request; returns its :class:`Sequence` (until the next :meth:`step` a caller may give it KV
        it holds, as a session's turn does).  ``max_tokens`` beyond the context window is cut to fit, unless
        ``strict_max_tokens`` (the server's rule: refuse); the other arguments and the errors: ``inputs``'
        :meth:`~InputProcessor.prompt_ids` and :meth:`~InputProcessor.sequence`, plus InvalidRequestError
        for a request id in use."""
        params = params or SamplingParams()
        ids = self.inputs.prompt_ids(prompt, params, strict_max_tokens)
        request_id = request_id or f"req-{next(self._req_ids)}"
        if request_id in self._seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        seq = self.inputs.sequence(request_id, ids, params, namespace or self.namespace, compression, lora,
                                   max_new_tokens)
        self.drafter.start(seq, self.inputs.prediction_ids(params), self.speculation_supported)
        self.processor.start(seq)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    # ---- LoRA adapters: kvkeeper.engine.adapters.AdapterRegistry (each raises InvalidRequestError) ----------
    def load_lora(self, name: str, path, replace: bool = False):
        """Load a PEFT LoRA adapter directory under ``name`` (between steps); returns its LoRAAdapter."""
        return self.adapters.load(name, path, replace)

    def unload_lora(self, name: str) -> None:
        """Forget the adapter ``name``; its cached KV blocks stay in the prefix cache's LRU until evicted."""
        self.adapters.unload(name)

    def lora_namespace(self, name: str, base: Namespace | None = None) -> Namespace:
        """``base`` (default: the engine's namespace) under the loaded adapter ``name``."""
        return self.adapters.namespace(name, base or self.namespace)

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
        self.drafter.finish(seq)  # method "suffix": its tokens join its namespace's suffix table
        self.scheduler.finish(seq)
        self._seqs.pop(seq.request_id, None)
        if seq.kv_holder is not None:
            seq.kv_holder(seq)  # a session takes the blocks over
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
        t0 = time.perf_counter()
        logits, seqs = self._execute(out.scheduled)
        if all(s.num_output_tokens and n == 1 + len(s.spec_tokens) for s, n in out.scheduled):  # decode rows only
            self.drafter.cost.observe(out.num_tokens, time.perf_counter() - t0)  # speculation's cost model
        for seq, n in out.scheduled:
            seq.num_computed += 1 if seq.spec_tokens else n  # drafts count once verified (_verify)
            self.kv.commit(seq)
        if logits is not None:
            finished += self._take_samples(logits, seqs)
        for seq, _ in out.scheduled:
            obs = seq.observer
            if obs is not None and not seq.finished and seq.num_computed - seq.kv_offset >= obs.length:
                compress_prompt(seq, self.pool, self.kv_store, self.reclaim)
        return finished

    def _execute(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Run the model on a step's batch: (logits of the sequences that need a token, those sequences).

        When a sequence asked for prompt logprobs and this step computes some of its prompt, the
        logits of every packed token are computed in the same forward pass (``runner.forward(batch, "prompt")``)
        and those of such prompt positions recorded (its prompt is computed whole: see
        ``Sequence.computes_whole_prompt``); otherwise this is ``runner.execute``.
        """
        if not any(s.prompt_logprobs is not None and s.num_computed < s.num_prompt_tokens - 1 for s, _ in scheduled):
            return self.runner.execute(scheduled)
        r = self.runner
        with torch.inference_mode(), r.lora_scope(scheduled) as adapted:
            batch = r.build_batch(scheduled)
            logits = r.forward(batch, "prompt", adapted=adapted)  # (T, vocab): every packed token
            start = 0
            for seq, n in scheduled:
                c = seq.num_computed
                end = min(c + n, seq.num_prompt_tokens - 1)  # position p predicts prompt token p + 1
                if seq.prompt_logprobs is not None and c < end:
                    entries = prompt_logprob_entries(logits[start: start + end - c], seq.token_ids[c + 1: end + 1],
                                                     seq.params.prompt_logprobs)
                    seq.prompt_logprobs[c + 1: end + 1] = entries
                start += n
            _, _, _, rows, seqs = batch
            if not rows:
                return None, []
            return logits.index_select(0, torch.tensor(rows, device=logits.device)), seqs

    def _take_samples(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[Sequence]:
        """Sample one token per sequence (a sequence verifying drafts: its verified run, :meth:`_verify`), run the
        first-token hooks, post-process; returns the finished ones.  logits: (rows, vocab), one row per sequence
        and 1 + k rows for one carrying k drafts, in ``seqs`` order."""
        if not any(s.spec_tokens for s in seqs):
            return self._sample_rows(logits, seqs)
        plain_rows, plain, finished, row = [], [], [], 0
        for seq in seqs:
            k = len(seq.spec_tokens)
            if k:
                finished += self._verify(seq, logits[row: row + k + 1])
            else:
                plain_rows.append(row)
                plain.append(seq)
            row += k + 1
        if plain:
            finished += self._sample_rows(logits[torch.tensor(plain_rows, device=logits.device)], plain)
        return finished

    def _sample_rows(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[Sequence]:
        """One token per sequence from its row of ``logits`` (B, vocab); returns the finished sequences."""
        ids, logps = sample(logits, [s.params for s in seqs], [s.generator for s in seqs],
                            [s.processors for s in seqs], self.text_mask)
        for row, seq in enumerate(seqs):
            if seq.t_first_token is None:  # its prompt KV is complete: hooks see it before anything is freed
                if self.capture_first_logits:
                    seq.first_logits = logits[row].cpu().clone()
                for hook in self.first_token_hooks:
                    hook(seq, logits[row])
        done = self.processor.process(seqs, ids, logps)  # (a sequence left no token ends with an error)
        for seq in done:
            self._finish(seq)
        return done

    def _verify(self, seq: Sequence, logits: torch.Tensor) -> list[Sequence]:
        """Take a verify row's tokens (:func:`~kvkeeper.engine.speculative.verify`), then count as computed the
        K/V of the tokens emitted but the last (the accepted drafts'), give back the blocks only the rejected drafts
        used and register the blocks that became full; returns ``[seq]`` when it finished."""
        drafts, c = seq.spec_tokens, seq.num_computed - 1
        seq.spec_tokens = []
        got = verify(seq, logits, drafts, self.processor)
        self.drafter.record(seq, len(drafts), got.accepted)
        seq.num_computed = c + max(1, got.emitted)
        self.kv.trim_to_computed(seq)
        self.kv.commit(seq)
        for s in got.finished:
            self._finish(s)
        return got.finished

    @property
    def speculation(self) -> str:
        """What speculative decoding runs, in words (the load line's)."""
        if not self.speculation_supported:
            return "no speculative decoding (hybrid KV cache)"
        cfg = self.config.speculative_config
        return cfg.describe() if cfg is not None else "speculative decoding from predictions only"

    @property
    def speculation_supported(self) -> bool:
        """Whether sequences may verify drafts here: not with a hybrid KV cache (sliding-window layers' window
        blocks are not trimmed after a rejection)."""
        return not self.pool.hybrid

    def write_kv_outside_scheduler(self, seq: Sequence, n: int) -> None:
        """One forward pass over ``seq``'s ``n`` tokens from ``seq.num_computed`` on, writing their KV into its
        block table's slots and keeping no logits; for a scratch sequence the scheduler does not hold (a session
        compression's reconstruction pass, :mod:`kvkeeper.sessions.compress`).  The caller owns the blocks and
        advances ``num_computed``.  Raises what the model runner raises."""
        self.runner.forward(self.runner.build_batch([(seq, n)]), "none")

    def run_until_done(self, seqs: list[Sequence]) -> None:
        while any(not s.finished for s in seqs):
            self.step()

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 namespace: Namespace | None = None, compression: KVCompression | None = None,
                 lora: str | list[str | None] | None = None) -> list[RequestOutput]:
        """Run prompts to completion (batched together); returns one :class:`RequestOutput` each, in order.
        compression: applied to every prompt's KV at the end of its prefill (None: keep everything).
        lora: a loaded adapter's name for every prompt, or one name (or None: the base model) per prompt."""
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

    def stats(self) -> dict:
        """Pool, prefix-cache and scheduler counters now (blocks, tokens, bytes)."""
        pool, sched, r = self.pool, self.scheduler, self.runner
        return {"kv_blocks_total": pool.num_blocks, "kv_blocks_used": pool.num_used, "kv_blocks_cached": pool.num_cached,
                "kv_usage": pool.usage(), "prefix_query_tokens": self.kv.query_tokens,
                "prefix_hit_tokens": self.kv.hit_tokens, "num_preemptions": sched.num_preemptions,
                "num_running": len(sched.running), "num_waiting": len(sched.waiting),
                "kv_bytes_per_token": self.kv_bytes_per_token, "kv_cache_bytes": r.kv_cache_bytes,
                "kv_window_blocks_total": pool.window_blocks or 0, "kv_window_blocks_free": pool.num_window_free,
                "weight_format": r.weight_format, "spec_decode": dataclasses.asdict(self.drafter.stats)}

