"""Model runner: owns the weights and the KV store, turns a scheduled batch into logits.

Each step it packs the scheduled tokens of all sequences along one axis
(:meth:`ModelRunner.build_batch`: positions, slots, one :class:`AttentionMetadata`), then
:meth:`ModelRunner.forward` runs the model, the one place in the package it runs, and returns the
logits asked for: the last token of every sequence that needs a new one, every packed token (prompt
scoring), or none.
"""

from __future__ import annotations

import contextlib
import logging
from typing import NamedTuple

import torch

from ..kvcache.formats.base import KVFormat, parse_kv_format
from ..kvcache.store import KVStore
from ..kernels import cpu as cpu_kernels
from . import kernel_check
from ..attention.selector import resolve_attention_backend, triton_available  # noqa: F401  (re-exported)
from ..attention.metadata import AttentionMetadata, PrefillSpan
from ..model_config import ModelConfig
from .cuda_graphs import DecodeGraphs
from .fused_decode import FusedDecode
from ..models.registry import capabilities, causal_lm_class, family_options
from ..models.llama import skip_init
from ..layers.lora import LoRAHooks
from ..weights.formats import prepare_weights
from ..sampling.sampler import prompt_logprob_entries

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


class ModelRunner:
    """Weights plus KV cache on one device.

    kv_store: the :class:`~kvkeeper.kvcache.store.KVStore`, one ``PagedKV`` per layer: K and V (num_blocks,
    block_size, num_kv_heads, head_dim) in the KV format's storage dtype, plus per-token per-head scales when
    quantized.  An MLA (DeepSeek) model has one latent row per token instead: K only, (num_blocks, block_size, 1,
    kv_lora_rank + qk_rope_head_dim), one scale per row (``ModelConfig.kv_layout``).
    model: the ``nn.Module``; only :meth:`forward` runs it.
    """

    def __init__(self, cfg: ModelConfig, state: dict[str, torch.Tensor], num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 kv_dtype: str | torch.dtype | KVFormat | None = None, transposed_weights: bool | None = None,
                 attention_backend: str = "auto", quantization: str | None = None, fused_decode: bool = True,
                 invariant_kernels: bool = True, cache_dir=None, window_blocks: int | None = None, max_positions: int | None = None):
        """kv_dtype: KV storage format (fp32, bf16, fp16, int8, fp8; default: the model dtype).
        transposed_weights: keep W^T copies for fast few-row products (default: on for fp32 on CPU with
        unquantized weights).
        attention_backend: "torch" (kvkeeper.attention.reference, the reference), "cpu" (its prefill, the C++
        decode kernel), "triton" (kvkeeper.attention.triton_backend) or "auto" (see
        kvkeeper.attention.selector.resolve_attention_backend).
        quantization: weight format, None/"auto" for the model file's default (see
        kvkeeper.weights.formats); raises QuantizationError (a ValueError) for one the file cannot run.
        fused_decode: run a decode-only step as one C++ call when the weights are packed (False: layer by layer).
        invariant_kernels: the kernels' decode attention in invariant mode (see :attr:`invariant`; process-wide).
        cache_dir: where packed weights are cached (default: kvkeeper.text.tokenizer.cache_dir()).
        window_blocks: hybrid KV cache (a model with sliding-window layers): the sliding layers' caches hold
        this many blocks, addressed through ``window_of`` (block id -> window block id, set by the engine from
        its :class:`~kvkeeper.kvcache.block_pool.BlockPool`); None: every layer has ``num_blocks``.
        max_positions: RoPE tables for positions below this many tokens (the engine's context length: a 4,096-token
        context of a model made for 128k keeps 4 MB of tables, not 134 MB); a step past them grows the tables.
        None: the config's ``max_position_embeddings``."""
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_format = parse_kv_format(kv_dtype if kv_dtype is not None else dtype)
        self.kv_dtype = self.kv_format.storage
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.capabilities = capabilities(cfg)  # what the model's family supports (kvkeeper.models.capabilities)
        attention_backend, quantization = family_options(cfg, attention_backend, quantization)
        self.window_blocks = window_blocks if cfg.is_hybrid else None
        self.window_of = None  # block id -> window block id (hybrid KV cache), set by the engine
        with skip_init(), torch.device("meta"):
            model = causal_lm_class(cfg)(cfg)
        self.rope_positions = min(cfg.max_position_embeddings, max_positions or cfg.max_position_embeddings)
        model.build_rope(self.device, self.rope_positions)  # buffers computed, not loaded
        prepared = prepare_weights(state, cfg, quantization, self.device, dtype, cache=cache_dir)
        self.weight_format = prepared.format  # "none", "gguf", "int8" or "int4"
        self.weight_description = prepared.description
        model.load_weights(prepared.state, device=self.device, dtype=dtype)
        del prepared
        self.model = model.eval()
        if transposed_weights is None:
            transposed_weights = self.device.type == "cpu" and dtype == torch.float32 and self.weight_format == "none"
        if transposed_weights:
            self.model.add_transposed_copies()
        self.attention_backend = resolve_attention_backend(attention_backend, self.device)
        if (self.attention_backend == "triton" and self.kv_format.name == "fp8_e4m3" and self.device.type == "cuda"
                and torch.cuda.get_device_capability(self.device) < (8, 9)):
            # Triton has no e4m3 type before Ada/Hopper (sm_89): fp8 blocks go through the PyTorch path
            logging.getLogger(__name__).warning("fp8 KV cache on a GPU older than sm_89: PyTorch attention path")
            self.attention_backend = "torch"
        if self.attention_backend == "triton" and self.device.type == "cuda":
            self._check_kernels()
        if self.attention_backend == "cpu":
            mod = cpu_kernels.load()
            if mod is not None and hasattr(mod, "set_invariant_attention"):
                mod.set_invariant_attention(bool(invariant_kernels))
            self._check_cpu_kernels()
        self.graphs = None  # a cuda_graphs.DecodeGraphs once capture_cuda_graphs() ran
        self.kv_store = KVStore.allocate(cfg, num_blocks, block_size, self.kv_format, self.device, self.window_blocks)
        # one C++ call per decode step when the weights are packed (kvkeeper.worker.fused_decode); the
        # layer-by-layer path then uses the same C++ element-wise routines, also with fused_decode off, so that
        # --no-fused-decode computes every token bit for bit as the default does
        fusable = (FusedDecode.build(self.model, self.kv_store) if self.attention_backend == "cpu" and
                   self.weight_format != "none" and self.capabilities.fused_decode else None)
        if fusable is not None:
            self.model.use_cpu_kernels(fusable.kernels)
        self.fused_decode = fusable if fused_decode else None
        self._elementwise_kernels = fusable is not None
        self.lora: LoRAHooks | None = None  # installed by enable_lora() (kvkeeper.layers.lora)

    def enable_lora(self) -> LoRAHooks:
        """Install the LoRA forward hooks once (call between steps); raises InvalidRequestError for a model
        without the Llama projections."""
        if self.lora is None:
            self.lora = LoRAHooks(self.model, self.device)
        return self.lora

    def lora_scope(self, scheduled):
        """Context manager around a forward pass of ``scheduled``: applies each sequence's adapter
        (``seq.lora``); yields whether any sequence of the step has one."""
        return self.lora.batch(scheduled) if self.lora is not None else contextlib.nullcontext(False)

    def _check_kernels(self) -> None:
        """Compare the kernels with the PyTorch path on a small step of this model's shapes; on an error or a
        mismatch, log it and use the PyTorch path (a GPU or Triton version the kernels do not handle)."""
        cfg = self.cfg
        try:
            err = kernel_check.self_check(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.kv_format, self.dtype,
                                          self.device, self.block_size)
        except Exception as e:  # noqa: BLE001  (compile or launch failure)
            logging.getLogger(__name__).warning("Triton attention kernels failed (%s: %s); using the PyTorch path",
                                                type(e).__name__, e)
            self.attention_backend, self.kernel_check_error = "torch", None
            return
        self.kernel_check_error = err
        if not err <= kernel_check.SELF_CHECK_TOL.get(self.dtype, 5e-2):
            logging.getLogger(__name__).warning("Triton attention kernels differ from the PyTorch path by %.3g "
                                                "(relative); using the PyTorch path", err)
            self.attention_backend = "torch"

    def _check_cpu_kernels(self) -> None:
        """The C++ decode attention against the PyTorch path on a small random step of this model's shapes
        (a few milliseconds); on a mismatch, log it and use the PyTorch path."""
        cfg = self.cfg
        err = kernel_check.self_check(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.kv_format, self.dtype,
                                      self.device, self.block_size, backend="cpu")
        self.kernel_check_error = err
        if not err <= kernel_check.SELF_CHECK_TOL.get(self.dtype, 5e-2):
            logging.getLogger(__name__).warning("CPU attention kernel differs from the PyTorch path by %.3g "
                                                "(relative); using the PyTorch path", err)
            self.attention_backend = "torch"

    kernel_check_error: float | None = None  # relative error of the start-up kernel check (CUDA), None if not run

    @property
    def invariant(self) -> bool:
        """Whether a token's K/V and logits depend only on the token ids before it (bit for bit), not on how the
        engine split the work (prefill chunks, prefix-cache hits, session hand-overs, decode vs prefill, the batch,
        fused vs layer-by-layer step, thread count): the C++ kernels with invariant decode attention
        (csrc/cpu/attention.cpp), quantized weights through their block kernels (integer sums, row-independent
        activation codes), the kernels' element-wise routines on every path, and a 16- or 32-bit float KV cache.
        Not invariant: the float32 path (torch's GEMMs block their sums by the batch's shape), the PyTorch
        reference attention, CUDA, int8/fp8 KV (not verified), LoRA adapters (torch matmuls)."""
        mod = cpu_kernels.load() if self.attention_backend == "cpu" else None
        return (mod is not None and bool(getattr(mod, "invariant_attention", lambda: False)()) and self._elementwise_kernels
                and self.weight_format != "none" and not self.kv_format.quantized and self.lora is None)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV (values plus scales) per token across all layers (a hybrid cache: what a token costs
        while inside the window; past it, only the full layers' share, :attr:`kv_bytes_per_token_full_layers`)."""
        return self.kv_store.bytes_per_token

    @property
    def kv_bytes_per_token_full_layers(self) -> int:
        """Bytes of KV per token in the full-attention layers only (all layers without a hybrid cache)."""
        return self.kv_store.bytes_per_token_full_layers

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the KV tensors of all layers hold (values plus scales)."""
        return self.kv_store.nbytes

    def build_batch(self, scheduled) -> "StepBatch":
        """scheduled: list of (seq, num_new_tokens).  Returns a :class:`StepBatch` (a tuple: input_ids,
        positions, meta, logit_rows, seqs).

        A decode row carrying k draft tokens (speculative decoding: ``seq.spec_tokens``, scheduled with
        ``num_new_tokens`` = 1 + k) is packed as 1 + k decode rows of the sequence, the i-th attending to the cache
        through its own position (every row's K/V is written before attention reads any), each with a logits row:
        the rows a verification reads (:func:`kvkeeper.spec_decode.verify.verify`); its sequence is in ``seqs``
        once.  A decode-only step of such rows still runs as one fused decode call."""
        bs = self.block_size
        ids, pos, slots = [], [], []
        prefills = []
        dec_idx, dec_bt, dec_len = [], [], []
        logit_rows, sample_seqs = [], []
        start = 0
        for seq, n in scheduled:
            c = seq.num_computed  # token index of the first new token (its RoPE position)
            off = seq.kv_offset  # tokens dropped by KV compression: KV index = token index - off
            drafts = getattr(seq, "spec_tokens", None) if n > 1 else None
            drafts = drafts if drafts and n == 1 + len(drafts) else None
            ids.extend(seq.token_ids[c : c + n] if drafts is None else [seq.token_ids[c], *drafts])
            p = torch.arange(c, c + n)
            pos.append(p)
            bt = torch.tensor(seq.block_table, dtype=torch.int64)
            kv_i = p - off
            slots.append(bt[kv_i // bs] * bs + kv_i % bs)
            if (n == 1 and seq.observer is None) or drafts is not None:  # a verify row: n decode rows, causal
                dec_idx.extend(range(start, start + n))
                dec_bt.extend([bt] * n)
                dec_len.extend(range(c + 1 - off, c + n + 1 - off))
            else:
                prefills.append(PrefillSpan(start, n, c + n - off, bt.to(self.device), seq.observer))
            if drafts is not None:
                logit_rows.extend(range(start, start + n))
                sample_seqs.append(seq)
            elif c + n == len(seq.token_ids):
                logit_rows.append(start + n - 1)
                sample_seqs.append(seq)
            start += n
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.cat(slots).to(dev), prefills=prefills)
        if dec_idx:
            width = max(len(b) for b in dec_bt)
            table = torch.zeros(len(dec_bt), width, dtype=torch.int64)
            for i, b in enumerate(dec_bt):
                table[i, : len(b)] = b
            meta.decode_indices = torch.tensor(dec_idx, dtype=torch.int64, device=dev)
            meta.decode_block_tables = table.to(dev)
            meta.decode_context_lens = torch.tensor(dec_len, dtype=torch.int64, device=dev)
            meta.decode_max_len = max(dec_len)
        meta.backend = self.attention_backend
        if self.window_blocks:
            meta.sliding = self._sliding_meta(scheduled, meta)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        top = max((int(p[-1]) + 1 for p in pos if p.numel()), default=0)
        if top > self.rope_positions:  # past the tables (positions beyond the context after KV compression)
            self.rope_positions = max(top, 2 * self.rope_positions)
            self.model.build_rope(self.device, self.rope_positions)
        positions = torch.cat(pos).to(dev)
        return StepBatch(input_ids, positions, meta, logit_rows, sample_seqs)

    def _sliding_meta(self, scheduled, meta: AttentionMetadata) -> AttentionMetadata:
        """The sliding layers' metadata in a hybrid cache: slots and tables of window blocks, each table from
        the block holding the first new token's window start (KV indices shifted by that block's start)."""
        bs, window, dev = self.block_size, self.cfg.sliding_window, self.device
        slots, prefills, dec_bt, dec_len = [], [], [], []
        start = 0
        for seq, n in scheduled:
            c = seq.num_computed
            wins = [self.window_of(b) for b in seq.block_table]
            first = max(0, c - window + 1) // bs
            if seq.kv_offset or any(w is None for w in wins[first:]):
                raise RuntimeError(f"sequence {seq.request_id}: a block inside its window has no window block "
                                   "(a KV cache bookkeeping bug)")
            table = torch.tensor(wins[first:], dtype=torch.int64)
            p = torch.arange(c, c + n) - first * bs
            slots.append(table[p // bs] * bs + p % bs)
            if n == 1 and seq.observer is None:
                dec_bt.append(table)
                dec_len.append(c + 1 - first * bs)
            else:
                prefills.append(PrefillSpan(start, n, c + n - first * bs, table.to(dev), None))
            start += n
        out = AttentionMetadata(slot_mapping=torch.cat(slots).to(dev), prefills=prefills, window=window,
                                backend=meta.backend, decode_indices=meta.decode_indices)
        if dec_bt:
            padded = torch.zeros(len(dec_bt), max(len(b) for b in dec_bt), dtype=torch.int64)
            for i, b in enumerate(dec_bt):
                padded[i, : len(b)] = b
            out.decode_block_tables = padded.to(dev)
            out.decode_context_lens = torch.tensor(dec_len, dtype=torch.int64, device=dev)
            out.decode_max_len = max(dec_len)
        return out

    @torch.inference_mode()
    def execute(self, scheduled) -> tuple[torch.Tensor | None, list]:
        """Run one step of ``scheduled`` (list of (seq, num_new_tokens)); returns (float32 logits (N, vocab) on
        the model's device for the N sequences that need a token, those sequences; (None, []) when none does).

        When a sequence asked for prompt logprobs and this step computes some of its prompt, the logits of every
        packed token are computed in the same forward pass (``forward(batch, "prompt")``) and those of such prompt
        positions recorded in ``seq.prompt_logprobs`` (its prompt is computed whole: see
        ``Sequence.computes_whole_prompt``)."""
        with self.lora_scope(scheduled) as adapted:
            batch = self.build_batch(scheduled)
            if not any(s.prompt_logprobs is not None and s.num_computed < s.num_prompt_tokens - 1
                       for s, _ in scheduled):
                return self.forward(batch, "last", adapted=adapted), batch[4]
            logits = self.forward(batch, "prompt", adapted=adapted)  # (T, vocab): every packed token
        _record_prompt_logprobs(scheduled, logits)
        rows, seqs = batch[3], batch[4]
        if not rows:
            return None, []
        return logits.index_select(0, torch.tensor(rows, device=logits.device)), seqs

    @torch.inference_mode()
    def prefill_private(self, ids: torch.Tensor, positions: torch.Tensor, chunk: int = 512, logits: str = "none",
                        num_layers: int | None = None, lora=None) -> tuple[torch.Tensor | None, KVStore]:
        """Prefill ``ids`` (T,) int64 at ``positions`` (T,) int64 into a private cache of its own (the shared pool
        is untouched), ``chunk`` tokens per forward pass, with this runner's weights, kernels and KV format.

        logits: "last" (the float32 logits (1, vocab) of the last token, on the CPU) or "none" (None).
        num_layers: compute and keep the first ``num_layers`` layers only (default all).  lora: a
        :class:`~kvkeeper.layers.lora.LoRAAdapter` or None (the base model).  Returns (logits, the private
        :class:`KVStore` whose blocks ``0 .. ceil(T / block_size) - 1`` hold the T tokens in order)."""
        T, bs, dev = ids.numel(), self.block_size, self.device
        nb = -(-T // bs)
        store = KVStore.allocate(self.cfg, nb, bs, self.kv_format, dev, num_layers=num_layers)
        table = torch.arange(nb, dtype=torch.int64, device=dev)
        ids, positions, out = ids.to(dev), positions.to(dev), None
        for c in range(0, T, chunk):
            n = min(chunk, T - c)
            # the engine's own attention kernels (the C++ ones on CPU), so that an invariant path compares bit for bit
            meta = AttentionMetadata(slot_mapping=torch.arange(c, c + n, dtype=torch.int64, device=dev),
                                     prefills=[PrefillSpan(0, n, c + n, table)],
                                     backend=getattr(self, "attention_backend", "torch"))
            last = logits == "last" and c + n == T  # only the final chunk's last row needs logits
            batch = StepBatch(ids[c: c + n], positions[c: c + n], meta, [n - 1] if last else [], [])
            with self.lora_scope([(_Lora(lora), n)]) as adapted:
                got = self.forward(batch, "last" if last else "none", store=store, adapted=adapted)
            out = got.float().cpu() if last else out
        return out, store

    @torch.inference_mode()
    def forward(self, batch: "StepBatch", logits: str = "last", store: KVStore | None = None,
                adapted: bool = False) -> torch.Tensor | None:
        """Run the model on a packed batch (:meth:`build_batch`, or a StepBatch built by hand) and write its K/V.

        logits: "last": float32 logits (N, vocab) of the rows ``batch.logit_rows`` (the last token of each
        sequence that needs one; None when there is none); "prompt": logits (T, vocab) of every packed token,
        in batch order (prompt logprobs, perplexity; activation memory T x vocab x 4 bytes); "none": no logits,
        only the K/V written (returns None).  Logits stay on the model's device.
        store: the KV store to read and write (default: the runner's; a private one for a recompute such as
        the reuse audit).  adapted: some sequence runs a LoRA adapter (the caller holds :meth:`lora_scope`);
        the step then runs layer by layer in PyTorch modules, never as a CUDA graph or the fused C++ decode
        step, which know no adapters.  Raises ValueError for another ``logits``.
        """
        if logits not in ("last", "prompt", "none"):
            raise ValueError(f"logits must be 'last', 'prompt' or 'none', got {logits!r}")
        input_ids, positions, meta, rows, _ = batch
        own = store is None or store is self.kv_store
        fast = own and not adapted and logits == "last"
        if fast and self.graphs is not None and not meta.prefills and meta.decode_indices is not None:
            size = self.graphs.can_replay(len(rows), meta.decode_block_tables.shape[1])
            if size is not None and len(rows) == input_ids.numel():  # decode-only: row i is sequence i
                return self.graphs.replay(size, input_ids, positions, meta.slot_mapping,
                                          meta.decode_block_tables, meta.decode_context_lens)
            self.graphs.eager_steps += 1
        if fast and self.fused_decode is not None and meta.backend == "cpu" and meta.decode_only:
            hidden = self.fused_decode(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_store if own else store, meta)
        if logits == "none" or (logits == "last" and not rows):
            return None
        if logits == "last":
            hidden = hidden.index_select(0, torch.tensor(rows, dtype=torch.int64, device=hidden.device))
        return self.model.compute_logits(hidden)  # on the model's device: the sampler moves what it needs

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> bool:
        """Capture decode-step CUDA graphs for batches up to ``max_num_seqs`` (see kvkeeper.worker.cuda_graphs).

        Returns False (and keeps the eager path) on a CPU device, with the PyTorch attention backend or for a
        family without ``capabilities.cuda_graphs`` (sliding-window models: their windowed layers run the PyTorch path).
        """
        if self.device.type != "cuda" or self.attention_backend != "triton" or not self.capabilities.cuda_graphs:
            return False
        graphs = DecodeGraphs(self, max_model_len)
        graphs.capture(max_num_seqs)
        self.graphs = graphs if graphs.graphs else None
        return self.graphs is not None


class StepBatch(NamedTuple):
    """One step's packed batch (:meth:`ModelRunner.build_batch`).

    input_ids, positions: (T,) int64 on the device, the scheduled tokens of all sequences one after another;
    meta: their :class:`AttentionMetadata` (slots, prefill spans, decode tables); logit_rows: the packed rows
    (token indices) whose logits sample a token, one per sequence in ``seqs`` (those that reach their last
    token in this step), 1 + k consecutive rows for a sequence verifying k draft tokens (``seq.spec_tokens``).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: list[int]
    seqs: list


class _Lora(NamedTuple):
    """A scheduled entry's adapter for :meth:`ModelRunner.lora_scope` (a private prefill has no sequence)."""

    lora: object


def _record_prompt_logprobs(scheduled, logits: torch.Tensor) -> None:
    """Record the prompt logprobs of the prompt positions a step computed: logits (T, vocab), one row per packed
    token in ``scheduled`` order; position p's row predicts prompt token p + 1."""
    start = 0
    for seq, n in scheduled:
        c = seq.num_computed
        end = min(c + n, seq.num_prompt_tokens - 1)
        if seq.prompt_logprobs is not None and c < end:
            seq.prompt_logprobs[c + 1: end + 1] = prompt_logprob_entries(
                logits[start: start + end - c], seq.token_ids[c + 1: end + 1], seq.params.prompt_logprobs)
        start += n
