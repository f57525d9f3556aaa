"""EngineConfig: every setting of an :class:`~kvkeeper.engine.llm_engine.LLMEngine`, with its one default;
what the settings resolve to for a model (formats, KV sizing) and for a machine (:func:`resolve_device`).

The command line builds its engine options from these fields (:mod:`kvkeeper.options`), so a
default is written here and nowhere else.  The engine reads no environment variable; the CLI
(the edge) maps ``KVKEEPER_VALIDATE`` onto ``validate_every``.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

import torch

from ..argtypes import positive_int, size, validate_every_arg
from ..errors import InvalidRequestError
from ..kvcache.formats.base import KV_DTYPE_CHOICES, KVFormat, parse_kv_format
from ..kvcache.sizing import KVSizing, kv_blocks
from ..model_config import ModelConfig
from ..models.registry import capabilities, family_options
from ..weights.formats import QUANTIZATION_CHOICES, weight_format_for
from ..weights.sources import DEFAULT_MODEL
from ..options import option
from ..kvcache.kv_events.publisher import KVEventsConfig, parse_kv_events_config
from ..spec_decode.config import SpeculativeConfig, parse_speculative_config

DEFAULT_KV_CACHE_BYTES = 1 << 30  # 1 GiB


def kv_events_arg(raw: str) -> KVEventsConfig:
    """``--kv-events-config``'s value: argparse's type (ArgumentTypeError saying what was wrong)."""
    return _json_arg(parse_kv_events_config, raw, "--kv-events-config: ")


def speculative_arg(raw: str) -> SpeculativeConfig:
    """``--speculative-config``'s value: argparse's type (ArgumentTypeError saying what was wrong)."""
    return _json_arg(parse_speculative_config, raw, "--speculative-config: ")


def _json_arg(parse, raw: str, prefix: str):
    try:
        return parse(raw)
    except InvalidRequestError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(prefix)) from None


@dataclass
class EngineConfig:
    """Model, device, KV cache and scheduling settings (units: tokens, blocks, bytes).

    model: a known id (``kvkeeper.weights.sources``) or a path to a GGUF file / Hugging Face folder.
    dtype: weights and activations (None: float32 on CPU, bfloat16 on CUDA).
    device: "auto" (CUDA when available), "cpu", "cuda" or "cuda:N".
    load_format: "auto" (the model's files) or "dummy" (random weights of a shipped config, seeded by ``seed``).
    quantization: weight format "none", "gguf", "int8", "int4" or None/"auto" (the file's default, see
    ``kvkeeper.weights.formats``; ``runner.weight_format`` says which runs).
    attention_backend: "auto", "torch" (the reference), "cpu" (C++ kernels) or "triton" (CUDA).
    fused_decode: a decode-only step as one C++ call over packed weights (CPU, quantized weights).
    invariant_kernels: the C++ decode attention computes a token as the prefill kernel does (issue 26; False: the
    previous flash-decoding kernel, see ``ModelRunner.invariant``); a process-wide switch of the kernels.
    cuda_graphs: replay decode steps as CUDA graphs (CUDA only; a no-op on CPU).
    kv_dtype: KV cache storage "fp32", "bf16", "fp16", "int8", "fp8", "int4" or "int2" (int4 / int2: KIVI,
    :mod:`kvkeeper.kvcache.formats`; None: bf16 with quantized weights, else the ``dtype``).
    hybrid_kv_cache: a model with sliding-window layers keeps their KV only for the window (see
    ``kvkeeper.kvcache.block_pool``); False gives every layer every token's block.
    block_size: tokens per KV block (None: 16, or 32 for the KIVI dtypes int4 / int2).  KV budget: ``num_kv_blocks``, else ``kv_cache_bytes`` (default 1 GiB).
    kv_hold_share: the share of the KV blocks retention holds may keep from eviction (0..1; 0: off;
    :mod:`kvkeeper.kvcache.retention`).
    max_num_seqs: running sequences at most.  max_num_batched_tokens: tokens per step (the prefill chunk).
    max_model_len: cap on the context window (None: the model's own).  num_threads: torch CPU threads.
    validate_every: run the KV integrity validators before every N-th step (0: never).
    cache_dir: folder of the weight and tokenizer caches (None: ``~/.cache/kvkeeper``).
    kv_events_config: KV event publishing (:class:`~kvkeeper.kvcache.kv_events.publisher.KVEventsConfig`, a dict or its
    JSON text; None: off).
    memory_check: refuse a model whose estimated memory need exceeds the available memory before loading it
    (:mod:`kvkeeper.engine.memory_fit`; CPU only).
    speculative_config: n-gram or suffix speculation (:class:`~kvkeeper.spec_decode.config.SpeculativeConfig`, a dict
    or its JSON text, vLLM's fields; None: off, requests that send a prediction still draft from it).
    Raises :class:`InvalidRequestError` for a value out of range.
    """

    model: str = field(default=DEFAULT_MODEL, metadata=option(
        "--model", "known model id or path to a .gguf file / Hugging Face folder", metavar="ID_OR_PATH"))
    dtype: str | None = field(default=None, metadata=option(
        "--dtype", "weights and activations dtype (default: float32 on CPU, bfloat16 on CUDA)",
        choices=["float32", "bfloat16", "float16"]))
    device: str = field(default="auto", metadata=option(
        "--device", "where weights and the KV block pool live (auto = cuda when available)", metavar="{auto,cpu,cuda}"))
    load_format: str = field(default="auto", metadata=option(
        "--load-format", "dummy: random weights for --model = a shipped config name (llama-3.1-8b, llama-3-8b, "
        "qwen2.5-7b) or a config.json path, to measure speed without weight files", choices=["auto", "dummy"]))
    quantization: str | None = field(default=None, metadata=option(
        "--quantization", "weight format: none = float32 (exact), gguf = the GGUF file's Q4_0/Q4_1/Q8_0 blocks "
        "computed in place, int8 / int4 = round-to-nearest groups of 32 (default: $KVKEEPER_QUANTIZATION, else auto: "
        "the fastest format meeting the quality bar for the file, gguf for the embedded model)",
        metavar="{" + ",".join(["auto", *QUANTIZATION_CHOICES]) + "}"))
    attention_backend: str = field(default="auto", metadata=option(
        "--attention-backend", "attention kernels: auto (the C++ CPU kernels on CPU when built, Triton on CUDA), "
        "torch (the PyTorch reference), cpu or triton", choices=["auto", "torch", "cpu", "triton"]))
    fused_decode: bool = field(default=True, metadata=option(
        "--no-fused-decode", "run decode steps layer by layer instead of one C++ call over packed weights "
        "(default: fused, unless $KVKEEPER_FUSED_DECODE=0)", action="store_true", negate=True))
    invariant_kernels: bool = field(default=True, metadata=option(
        "--no-invariant-kernels", "CPU: decode attention by the previous flash-decoding kernel instead of the invariant "
        "one (default: invariant, a token's KV and logits the same bit for bit however the work was split; "
        "process-wide)", action="store_true", negate=True))
    cuda_graphs: bool = field(default=True, metadata=option(
        "--enforce-eager", "CUDA: no decode CUDA graphs", action="store_true", negate=True))
    kv_dtype: str | None = field(default=None, metadata=option(
        "--kv-dtype", "KV cache storage; int8 and fp8 (e4m3) are quantized per token and KV head, int4 and int2 "
        "as KIVI (keys per channel over a block, values per token, a 16-bit window of unfilled blocks) "
        "(default: bf16 with quantized weights, else the --dtype)", choices=list(KV_DTYPE_CHOICES)))
    block_size: int | None = field(default=None, metadata=option(
        "--block-size", "tokens per KV block (default 16; 32 with --kv-dtype int4 / int2, where a block is KIVI's "
        "key group: 0.297x the bf16 bytes instead of 0.328x on a 64-dim head)", type=positive_int, metavar="N"))
    kv_cache_bytes: int | None = field(default=None, metadata=option(
        "--kv-cache-bytes", "KV cache budget in bytes, suffixes K/M/G allowed (default: 1G)", type=size,
        metavar="N", exclusive="kv"))
    num_kv_blocks: int | None = field(default=None, metadata=option(
        "--kv-blocks", "KV cache size in blocks (instead of the byte budget)", type=positive_int, metavar="N",
        exclusive="kv"))
    max_num_seqs: int = field(default=64, metadata=option(
        "--max-num-seqs", "running sequences at most per step", type=positive_int, metavar="N"))
    max_num_batched_tokens: int = field(default=512, metadata=option(
        "--max-batched-tokens", "token budget per engine step, i.e. the prefill chunk size", type=positive_int,
        metavar="N"))
    enable_chunked_prefill: bool = True
    hybrid_kv_cache: bool = field(default=True, metadata=option(
        "--no-hybrid-kv-cache", "models with sliding-window layers (Gemma 3): give every layer a block for every "
        "token (all-full) instead of freeing the sliding layers' blocks that fall out of the window",
        action="store_true", negate=True))
    enable_prefix_caching: bool = field(default=True, metadata=option(
        "--no-prefix-caching", "never reuse cached blocks across requests", action="store_true", negate=True))
    kv_hold_share: float = field(default=0.25, metadata=option(
        "--kv-hold-share", "share of the KV blocks that prompt-cache retention holds (cache_control breakpoints, "
        "prompt_cache_retention 24h) may keep from LRU eviction until their TTL, the oldest hold giving way first; "
        "0 turns holds off", type=float, metavar="F"))
    max_model_len: int | None = field(default=None, metadata=option(
        "--max-model-len", "cap the context window at N tokens (default: the model's own)", type=positive_int,
        metavar="N"))
    num_threads: int | None = field(default=None, metadata=option(
        "--threads", "CPU threads for torch and the kernels (default: the CPUs this process may use, "
        "its affinity mask capped by the cgroup CPU quota)", type=positive_int, metavar="N"))
    cache_dir: str | None = field(default=None, metadata=option(
        "--cache-dir", "folder of kvkeeper's caches: dequantized and packed GGUF weights, converted tokenizers "
        "(default: $KVKEEPER_CACHE, else ~/.cache/kvkeeper)", metavar="DIR"))
    validate_every: int = field(default=0, metadata=option(
        "--validate-every", "run the KV integrity validators before every N-th step, 0 = never "
        "(default: $KVKEEPER_VALIDATE, else 0)", type=validate_every_arg, metavar="N"))
    memory_check: bool = field(default=True, metadata=option(
        "--no-memory-check", "load even when the estimated memory need (weights, KV pool, working buffers) exceeds "
        "the available memory (default: refuse such a model before loading it, kvkeeper.engine.memory_fit)",
        action="store_true", negate=True))
    control_tokens_in_content: bool = field(default=False, metadata=option(
        "--control-tokens-in-content", "let a chat message's text write the chat template's control tokens (a "
        "typed <|im_end|> then ends the turn, as transformers' apply_chat_template tokenizes it; any client can then "
        "forge a system or assistant turn).  Default: that text is tokenized as plain text, control tokens come only "
        "from the template", action="store_true"))
    kv_events_config: KVEventsConfig | None = field(default=None, metadata=option(
        "--kv-events-config", "publish the prefix cache's KV events (vLLM's schema, msgpack on ZMQ; needs "
        "kvkeeper[events]): a JSON object with vLLM's fields, e.g. '{\"enable_kv_cache_events\": true, "
        "\"publisher\": \"zmq\", \"endpoint\": \"tcp://127.0.0.1:5557\", \"replay_endpoint\": "
        "\"tcp://127.0.0.1:5558\"}' (default: off)", type=kv_events_arg, metavar="JSON"))
    speculative_config: SpeculativeConfig | None = field(default=None, metadata=option(
        "--speculative-config", "speculative decoding from the conversation's own tokens, lossless (vLLM's "
        "fields): a JSON object, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' (also disable_by_batch_size, default none; method "
        "\"suffix\" also drafts from the namespace's earlier requests, with suffix_decoding_max_cached_requests and "
        "suffix_decoding_min_token_prob; default: off, a request's prediction is still used)",
        type=speculative_arg, metavar="JSON"))
    seed: int = 0  # random weights of load_format "dummy"

    def __post_init__(self):
        if self.kv_events_config is not None:
            self.kv_events_config = parse_kv_events_config(self.kv_events_config)
        self.speculative_config = parse_speculative_config(self.speculative_config)
        if self.load_format not in ("auto", "dummy"):
            raise InvalidRequestError(f"unknown load format {self.load_format!r}; choose auto or dummy")
        if self.block_size is None:
            try:
                kivi = self.kv_dtype is not None and parse_kv_format(self.kv_dtype).kivi
            except ValueError:  # a bad --kv-dtype is refused where the KV format is chosen
                kivi = False
            self.block_size = 32 if kivi else 16
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if int(getattr(self, name)) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_kv_blocks", "kv_cache_bytes", "max_model_len", "num_threads"):
            v = getattr(self, name)
            if v is not None and int(v) < 1:
                raise InvalidRequestError(f"{name} must be >= 1 (or unset), got {v}")
        if not 0.0 <= self.kv_hold_share <= 1.0:
            raise InvalidRequestError(f"kv_hold_share is a share of the KV blocks, 0..1, got {self.kv_hold_share}")
        if self.validate_every < 0:
            raise InvalidRequestError(f"validate_every must be >= 0 (0 = never), got {self.validate_every}")

    @classmethod
    def of(cls, model: "str | EngineConfig | None" = None, **settings) -> "EngineConfig":
        """The settings of ``LLMEngine(model, **settings)``: an EngineConfig with ``settings`` replacing its
        fields, or a model id / path (None: the default model) with ``settings``."""
        if isinstance(model, EngineConfig):
            return dataclasses.replace(model, **settings)
        return cls(**({"model": model} if model is not None else {}), **settings)

    @property
    def kv_budget_bytes(self) -> int:
        return self.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES

    def kv_sizing(self) -> KVSizing:
        """What the KV pool is sized for (see :mod:`kvkeeper.kvcache.sizing`)."""
        return KVSizing(self.kv_budget_bytes, self.block_size, self.num_kv_blocks, self.max_num_seqs,
                        self.max_num_batched_tokens)

    def formats(self, mcfg: ModelConfig, state, device: torch.device,
                dtype: torch.dtype) -> tuple[str, str, KVFormat]:
        """(attention backend, weight format, KV format) these settings give for a model: both checked against
        the model's family (:func:`kvkeeper.models.registry.family_options`: "auto" becomes a family's only
        format), the weight format then resolved for the file (:func:`kvkeeper.weights.formats.weight_format_for`),
        and the KV format (default: bf16 with
        quantized weights, the fast path, as llama.cpp keeps f16; else the model dtype).  Raises
        :class:`InvalidRequestError` for a format or backend the file or family cannot run, or an unknown KV dtype.
        """
        try:
            attention, weights = family_options(mcfg, self.attention_backend, self.quantization)
            weights = weight_format_for(state, weights, device, dtype)  # (the runner checks it again)
            kv = self.kv_format_for(weights, dtype)
        except ValueError as e:  # QuantizationError, InvalidRequestError, an unknown KV dtype
            raise InvalidRequestError(str(e)) from None
        return attention, weights, kv

    def kv_format_for(self, weights: str, dtype: torch.dtype) -> KVFormat:
        """The KV format for a weight format: ``kv_dtype``, else bf16 with quantized weights (the fast path, as
        llama.cpp keeps f16), else the model dtype.  Raises ValueError for an unknown KV dtype."""
        return parse_kv_format(self.kv_dtype if self.kv_dtype is not None else ("bf16" if weights != "none" else dtype))

    def kv_pool_blocks(self, mcfg: ModelConfig, kv: KVFormat) -> tuple[int, int | None]:
        """(blocks, window blocks or None) of the KV pool for a model (:func:`kvkeeper.kvcache.sizing.kv_blocks`;
        window blocks for a family whose ``kv_layout`` is "hybrid", unless ``hybrid_kv_cache`` is off).
        Raises InvalidRequestError for a budget too small for one block."""
        hybrid = self.hybrid_kv_cache and capabilities(mcfg).kv_layout == "hybrid"
        return kv_blocks(kv, mcfg, self.kv_sizing(), hybrid)

    def runner_args(self, mcfg: ModelConfig, state, device: torch.device, dtype: torch.dtype) -> dict:
        """The :class:`~kvkeeper.worker.runner.ModelRunner` keyword arguments these settings give for a model:
        :meth:`formats`, and the pool's blocks (:func:`kvkeeper.kvcache.sizing.kv_blocks`; window blocks for a
        family whose ``kv_layout`` is "hybrid", unless ``hybrid_kv_cache`` is off).  Raises InvalidRequestError."""
        attention, weights, kv = self.formats(mcfg, state, device, dtype)
        num_blocks, window_blocks = self.kv_pool_blocks(mcfg, kv)
        return dict(num_blocks=num_blocks, block_size=self.block_size, dtype=dtype, device=device, kv_dtype=kv,
                    attention_backend=attention, quantization=weights, fused_decode=self.fused_decode,
                    invariant_kernels=self.invariant_kernels,
                    cache_dir=self.cache_dir, window_blocks=window_blocks,
                    # RoPE tables for the context served; CUDA graphs capture the tables: full size there
                    max_positions=None if device.type == "cuda" else min(mcfg.context_length,
                                                                         self.max_model_len or mcfg.context_length))


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
