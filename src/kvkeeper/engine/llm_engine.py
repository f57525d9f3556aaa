"""The engine: requests in, one model step at a time over the paged KV cache, tokens out::

    eng = LLMEngine()                      # embedded SmolLM2-135M-Instruct, fp32, CPU
    out = eng.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0]

Its parts: ``inputs``, ``adapters``, ``runner`` (:mod:`kvkeeper.worker.runner`), ``pool``, ``kv`` (the engine's KV:
:mod:`kvkeeper.engine.kv_access`), ``scheduler``, ``drafter`` (:mod:`kvkeeper.spec_decode`), ``processor``; KV holders,
step hooks and first-token hooks let the layers above attach (sessions, a circuit breaker, the reuse audit).  What
they may call: :mod:`kvkeeper.engine.handle`.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from typing import Callable

import torch

from ..errors import InvalidRequestError
from ..kvcache.compression import KVCompression
from ..kvcache.kv_events.publisher import start_kv_events
from ..kvcache.namespace import Namespace
from ..kvcache.surgery import compress_observed_prefills, observe_prefills
from ..kvcache.validate import assert_engine_ok
from ..sampling.params import SamplingParams
from ..sampling.sampler import TokenMask, sample
from ..spec_decode.drafter import Drafter
from ..spec_decode.verify import split_rows
from ..worker.cpu_threads import set_torch_threads
from ..worker.runner import parse_dtype
from ..text.multimodal import multimodal_token_ids
from .adapters import AdapterRegistry
from .config import EngineConfig, resolve_device
from .input_processor import InputProcessor
from .kv_access import KVAccess
from .handle import KVHolder
from .memory_fit import load_checked
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .scheduler import Scheduler
from .sequence import Sequence

__all__ = ["LLMEngine", "EngineConfig", "KVHolder", "RequestOutput", "resolve_device"]


class LLMEngine:
    """Paged-KV inference engine on one device: ``LLMEngine(model=None, **settings)`` or
    ``LLMEngine(EngineConfig(...), **overrides)`` (the fields of :class:`~kvkeeper.engine.config.EngineConfig`).

    Attributes: ``config``, ``model_config`` (the model's shapes), ``tokenizer``, the parts above (``kv``: a
    :class:`~kvkeeper.engine.kv_access.KVAccess`, the KV store, holders, blocks and pool figures), ``loras``
    (name -> loaded adapter), ``namespace`` (the default cache namespace), ``context_length`` (tokens),
    ``kv_events`` (the KV event publisher of ``kv_events_config``, :mod:`kvkeeper.kvcache.kv_events.publisher`;
    None when off).  Raises ModelNotFoundError / ModelFormatError / UnsupportedArchitectureError while loading
    and InvalidRequestError for bad settings.
    """

    def __init__(self, model: str | EngineConfig | None = None, **settings):
        cfg = self.config = EngineConfig.of(model, **settings)
        set_torch_threads(cfg.num_threads)
        device = resolve_device(cfg.device)
        torch_dtype = parse_dtype(cfg.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
        self.model_name = cfg.model
        self.runner, mcfg, self.tokenizer, self.model_path, self.memory_estimate = load_checked(cfg, device,
                                                                                               torch_dtype)
        self.model_config = mcfg
        self.block_size = cfg.block_size
        self._make_parts(cfg, mcfg)
        self.kv_events = start_kv_events(self.pool, cfg.kv_events_config, "GPU" if device.type == "cuda" else "CPU")
        self._req_ids = itertools.count()
        self._seqs: dict[str, Sequence] = {}
        self.num_steps = 0
        self.step_hooks: list[Callable[[], object]] = []  # before each step (a circuit breaker's evaluate)
        self.first_token_hooks: list[Callable[[Sequence, torch.Tensor], None]] = []  # (seq, (vocab,) logits)
        self.capture_first_logits = False  # tests: keep each request's first-token logits in seq.first_logits
        self.validate_every = cfg.validate_every  # KV integrity validators every N steps (0: never)
        if cfg.cuda_graphs:  # decode-step CUDA graphs (a no-op on CPU; see kvkeeper.worker.cuda_graphs)
            self.runner.capture_cuda_graphs(cfg.max_num_seqs, self.context_length)

    def _make_parts(self, cfg: EngineConfig, mcfg) -> None:
        """KV (pool, manager, holders), drafter, scheduler, namespace, input and output processors, LoRA registry."""
        self.kv = KVAccess(self.runner, cfg, mcfg)
        self.pool = self.kv.pool
        self.drafter = Drafter(cfg.speculative_config)  # n-gram / suffix drafts and requests' predictions
        self.scheduler = Scheduler(self.kv.manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.enable_chunked_prefill, reclaim=self.kv.reclaim, drafter=self.drafter.propose)
        self.kv.scheduler = self.scheduler  # its running and waiting requests hold KV
        self.context_length = min(mcfg.context_length, cfg.max_model_len or mcfg.context_length)
        self.namespace = Namespace(mcfg.revision, kv_dtype=self.runner.kv_format.name)
        self.adapters = AdapterRegistry(self.model_name, self.runner)
        self.loras = self.adapters.loaded  # name -> kvkeeper.layers.lora.LoRAAdapter (load_lora / unload_lora)
        self.inputs = InputProcessor(self.tokenizer, mcfg, self.context_length, self.adapters,
                                     cfg.control_tokens_in_content)
        self.eos_token_ids, self.grammars = self.inputs.eos_token_ids, self.inputs.grammars  # (structured outputs)
        self.processor = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.text_mask = TokenMask(multimodal_token_ids(self.tokenizer, mcfg.vocab_size))  # never sampled for text

    # ---- requests ----------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    namespace: Namespace | None = None, compression: KVCompression | None = None, *,
                    strict_max_tokens: bool = False, max_new_tokens: int | None = None,
                    lora: str | None = None) -> Sequence:
        """Queue a request; returns its :class:`Sequence` (until the next :meth:`step` a caller may give it KV
        it holds, as a session's turn does).  ``max_tokens`` beyond the context window is cut to fit, unless
        ``strict_max_tokens`` (the server's rule: refuse a ``max_tokens`` of the whole window or more); the other
        arguments and the errors: ``inputs``' :meth:`~InputProcessor.prompt_ids` and
        :meth:`~InputProcessor.sequence`, plus InvalidRequestError for a request id in use."""
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

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **chat) -> list[int]:
        """Token ids of a conversation as the chat template renders it (:meth:`InputProcessor.encode_chat`)."""
        return self.inputs.encode_chat(messages, add_generation_prompt, **chat)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **chat) -> str:
        """The chat template's text of ``messages`` (:meth:`InputProcessor.render_chat`)."""
        return self.inputs.render_chat(messages, add_generation_prompt, **chat)

    # LoRA adapters: kvkeeper.engine.adapters.AdapterRegistry (each raises InvalidRequestError)
    def load_lora(self, name: str, path, replace: bool = False):
        """Load a PEFT LoRA adapter directory under ``name`` (between steps); returns its LoRAAdapter."""
        return self.adapters.load(name, path, replace)

    def unload_lora(self, name: str) -> None:
        """Forget the adapter ``name``; its cached KV blocks stay in the prefix cache's LRU until evicted."""
        self.adapters.unload(name)

    def lora_namespace(self, name: str, base: Namespace | None = None) -> Namespace:
        """``base`` (default: the engine's namespace) under the loaded adapter ``name``."""
        return self.adapters.namespace(name, base or self.namespace)

    def isolated_namespace(self, tag: str = "", base: Namespace | None = None) -> Namespace:
        """A fresh namespace that shares no cached blocks with any other (recompute baselines, tests); it keeps
        ``base``'s adapter (None: no adapter)."""
        return Namespace(self.namespace.model_revision, adapter=base.adapter if base is not None else "",
                         tenant_salt=f"isolated-{tag}-{uuid.uuid4().hex}", kv_dtype=self.namespace.kv_dtype)

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
        self.kv.release(seq)  # to its KV holder (a session takes the blocks over) or freed

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ----------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Schedule -> run the model -> sample -> post-process; returns the sequences that finished in this step."""
        self._before_step()
        out = self.scheduler.schedule()
        finished = self._reject(out.rejected)
        if not out.scheduled:
            return finished
        self.num_steps += 1
        observe_prefills(out.scheduled, self.model_config.num_layers, self.model_config.num_kv_heads)
        t0 = time.perf_counter()
        logits, seqs = self.runner.execute(out.scheduled)  # (rows, vocab) of the sequences that need a token
        self.drafter.observe_step(out.scheduled, out.num_tokens, time.perf_counter() - t0)  # the cost model
        for seq, n in out.scheduled:
            seq.num_computed += 1 if seq.spec_tokens else n  # drafts count once verified (Drafter.verify)
            self.kv.commit(seq)
        if logits is not None:
            finished += self._sample(logits, seqs)
        compress_observed_prefills(out.scheduled, self.pool, self.kv.store, self.kv.reclaim)
        return finished

    def _before_step(self) -> None:
        """The step hooks (a circuit breaker), then the KV validators every ``validate_every`` steps."""
        for hook in self.step_hooks:
            hook()
        if self.validate_every and self.num_steps % self.validate_every == 0:
            assert_engine_ok(self)

    def _reject(self, rejected: list[Sequence]) -> list[Sequence]:
        """Finish the requests the scheduler cannot ever fit (``finish_reason`` "error"); returns them."""
        for seq in rejected:
            seq.finish_reason = "error"
            self._finish(seq)
        return list(rejected)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[Sequence]:
        """One token per plain row, a verified run per row carrying drafts (:meth:`Drafter.verify`); returns the
        finished sequences.  logits: (rows, vocab), one row per sequence and 1 + k for one carrying k drafts."""
        plain_logits, plain, verifying = split_rows(logits, seqs)
        finished = []
        for seq, rows in verifying:
            for done in self.drafter.verify(seq, rows, self.processor, self.kv.manager):
                self._finish(done)
                finished.append(done)
        return finished + (self._sample_rows(plain_logits, plain) if plain else [])

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

    @property
    def speculation_supported(self) -> bool:
        """Whether sequences may verify drafts here: not with a hybrid KV cache (sliding-window layers' window
        blocks are not trimmed after a rejection)."""
        return not self.pool.hybrid

    @property
    def numerics(self) -> dict:
        """The model's numerics: ``dtype`` (torch dtype), ``kv_format``, ``weight_format`` (str), ``invariant``
        (bool: batch-invariant kernels) and ``max_num_batched_tokens`` (a step's token budget)."""
        r = self.runner
        return {"dtype": r.dtype, "kv_format": r.kv_format, "weight_format": r.weight_format,
                "invariant": r.invariant, "max_num_batched_tokens": self.scheduler.max_num_batched_tokens}

    def prefill_private(self, ids: torch.Tensor, positions: torch.Tensor, chunk: int = 512, logits: str = "none",
                        num_layers: int | None = None, lora=None):
        """Prefill into a private KV store, the pool untouched (:meth:`ModelRunner.prefill_private`)."""
        return self.runner.prefill_private(ids, positions, chunk, logits, num_layers, lora)

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

    def stats(self) -> dict:
        """Pool, prefix-cache (:meth:`KVAccess.stats`), scheduler and speculation counters now (blocks, tokens,
        bytes)."""
        sched = self.scheduler
        return {**self.kv.stats(), "num_preemptions": sched.num_preemptions, "num_running": len(sched.running),
                "num_waiting": len(sched.waiting), "weight_format": self.runner.weight_format,
                "spec_decode": dataclasses.asdict(self.drafter.stats)}

    def describe(self) -> str:
        """The load line's description: dtype and device, weights, KV format and pool, context, speculation."""
        r = self.runner
        return (f"{str(r.dtype).removeprefix('torch.')} on {r.device}, weights {r.weight_description}, "
                f"{self.kv.describe()}, context {self.context_length}, "
                f"{self.drafter.describe(self.speculation_supported)}")
